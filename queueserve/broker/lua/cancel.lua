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
-- Returns 1 when the entry was removed before any delivery (it will never run), 0 when a worker
-- holds it already (it is dropped unless its batch is running) or it is gone.
-- No consumer group yet (NOGROUP) means no worker has read anything from this stream.
-- A pack (an entry holding several requests, enqueue.lua) is neither removed nor dropped:
-- its other requests must run, so the cancelled one runs too and its answer is dropped by
-- the client; 0.
local entry = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
if entry[1] then
  local fields = entry[1][2]
  for j = 1, #fields, 2 do
    if fields[j] == 'k' then return 0 end
  end
end
local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if type(pending) == 'table' and pending.err == nil and #pending > 0 then
  redis.call('PUBLISH', KEYS[3], KEYS[1] .. '\n' .. ARGV[2])  -- ids are unique per stream only
  return 0
end
if redis.call('XDEL', KEYS[1], ARGV[2]) == 1 then
  local left = redis.call('DECRBY', KEYS[2], tonumber(ARGV[3]))
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
