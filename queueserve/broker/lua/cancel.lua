-- Withdraw a request: remove it if no worker has read it yet, else tell the workers.
-- KEYS[1]  P:{S}:in:K     request stream
-- KEYS[2]  P:{S}:queued   admission counter
-- KEYS[3]  P:{S}:cancel   channel the workers listen on (they drop the entry if not yet run)
-- ARGV[1]  consumer group
-- ARGV[2]  entry id
-- ARGV[3]  item count
-- KEYS[4], ARGV[4]  (optional) P:{S}:depth and the stream's batch key: released there too
-- KEYS[5], ARGV[5]  (optional, with KEYS[4]) P:{S}:pdepth and the stream's priority: released
--          there too (the whole hash goes when nothing admitted is left, as ack.lua does)
-- ARGV[6]  the request id, ARGV[7] the inbox of the client that sent it (P:inbox:C): the entry
--          is withdrawn only when its own header says so (its id, its item count, and a reply
--          address of that client), as the reply path checks addresses: an id read from a
--          record anyone may write (a job's) never withdraws another caller's entry
-- Returns 1 when the entry was removed before any delivery (it will never run), 0 when a worker
-- holds it already (it is dropped unless its batch is running), it is gone, or it is not the
-- request named. The admission counter never goes below 0.
-- No consumer group yet (NOGROUP) means no worker has read anything from this stream.
-- A pack (an entry holding several requests, enqueue.lua) is neither removed nor dropped:
-- its other requests must run, so the cancelled one runs too and its answer is dropped by
-- the client; 0.
local function owned(header)  -- the request's header (msgpack, written by anyone) names it
  local ok, h = pcall(cmsgpack.unpack, header)
  if not ok or type(h) ~= 'table' then return false end
  local reply, inbox = h[4], ARGV[7]
  return h[2] == tonumber(ARGV[6]) and h[3] == tonumber(ARGV[3]) and type(reply) == 'string'
    and (reply == inbox or string.sub(reply, 1, #inbox + 1) == inbox .. '.')
end
local entry = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
if not entry[1] then return 0 end  -- gone: acked and deleted, or withdrawn already
local fields, mine = entry[1][2], false
for j = 1, #fields, 2 do
  if fields[j] == 'k' then return 0 end
  if fields[j] == 'h' then mine = owned(fields[j + 1]) end
end
if not mine then return 0 end
local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if type(pending) == 'table' and pending.err == nil and #pending > 0 then
  redis.call('PUBLISH', KEYS[3], KEYS[1] .. '\n' .. ARGV[2])  -- ids are unique per stream only
  return 0
end
if redis.call('XDEL', KEYS[1], ARGV[2]) == 1 then
  local left = redis.pcall('DECRBY', KEYS[2], tonumber(ARGV[3]))
  if type(left) ~= 'number' or left < 0 then  -- a count anyone wrote: none is below 0
    redis.call('SET', KEYS[2], 0)
    left = 0
  end
  if KEYS[4] and redis.call('HINCRBY', KEYS[4], ARGV[4], -tonumber(ARGV[3])) <= 0 then
    redis.call('HDEL', KEYS[4], ARGV[4])
  end
  if KEYS[5] then  -- a field holding no count (anyone may write one) is reset, as ack.lua does
    if left <= 0 then
      redis.call('DEL', KEYS[5])
    else
      local n = redis.pcall('HINCRBY', KEYS[5], ARGV[5], -tonumber(ARGV[3]))
      if type(n) ~= 'number' or n <= 0 then redis.pcall('HDEL', KEYS[5], ARGV[5]) end
    end
  end
  return 1
end
return 0
