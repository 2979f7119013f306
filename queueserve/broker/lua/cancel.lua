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
-- KEYS[6]  (optional, with KEYS[5]) P:{S}:withdrawn: the requests of packs no worker read yet
--          that their callers cancelled (below)
-- ARGV[6]  the request id, ARGV[7] the inbox of the client that sent it (P:inbox:C): the entry
--          is withdrawn only when its own header says so (its id, its item count, and a reply
--          address of that client), as the reply path checks addresses: an id read from a
--          record anyone may write (a job's) never withdraws another caller's entry
-- Returns 1 when the request was withdrawn before any delivery (it will never run), 0 when a
-- worker holds it already (it is dropped unless its batch is running; a step or generator
-- request stops at its next step), it is gone, or it is not the request named. The admission
-- counter never goes below 0.
-- No consumer group yet (NOGROUP) means no worker has read anything from this stream.
-- A pack (an entry holding several requests, enqueue.lua): its other requests must run, so
-- the entry stays. Its request is found by the same check of its own header (a pack holds at
-- most MAX_PACK_REQUESTS). A worker holds the pack: the message names the request
-- ("stream\nentry id/request id", wire/cancel.py). No worker read it: the request id joins the
-- pack's field of KEYS[6] ("stream\nentry id" -> "rid,rid,..."), which read.lua takes with the
-- pack in the same script that delivers it, so no read comes between; the worker answers
-- none of them and acks the pack, releasing its items then (none are released here). A full
-- KEYS[6] (MAX_WITHDRAWN fields, anyone may write them) is pruned of fields that name no
-- queued pack of this serving; still full, nothing is recorded and it returns 0.
local MAX_PACK_REQUESTS = 1024  -- protocol.MAX_PACK_REQUESTS
local MAX_WITHDRAWN = 10000  -- keys.MAX_WITHDRAWN (wire/keys.py)
local function owned(header)  -- the request's header (msgpack, written by anyone) names it
  local ok, h = pcall(cmsgpack.unpack, header)
  if not ok or type(h) ~= 'table' then return false end
  local reply, inbox = h[4], ARGV[7]
  return h[2] == tonumber(ARGV[6]) and h[3] == tonumber(ARGV[3]) and type(reply) == 'string'
    and (reply == inbox or string.sub(reply, 1, #inbox + 1) == inbox .. '.')
end
local function held(stream, id)  -- delivered to a consumer and not acked (NOGROUP: never read)
  local pending = redis.pcall('XPENDING', stream, ARGV[1], id, id, 1)
  return type(pending) == 'table' and pending.err == nil and #pending > 0
end
-- Whether a field of KEYS[6] names a pack of this serving's shard still waiting unread
local function queued_pack(field)
  local stream, id = string.match(field, '^(.*)\n(%d+%-%d+)$')
  local tag = string.sub(KEYS[6], 1, -10)  -- 'P:{S}:' (KEYS[6] ends in 'withdrawn')
  if not stream or string.sub(stream, 1, #tag) ~= tag then return false end
  local entry = redis.pcall('XRANGE', stream, id, id)
  return type(entry) == 'table' and entry.err == nil and entry[1] ~= nil and not held(stream, id)
end
local function room(field)
  if redis.call('HEXISTS', KEYS[6], field) == 1 then return true end
  if redis.call('HLEN', KEYS[6]) < MAX_WITHDRAWN then return true end
  local sample = redis.call('HRANDFIELD', KEYS[6], 16)
  local stale = {}
  for _, f in ipairs(sample) do
    if not queued_pack(f) then stale[#stale + 1] = f end
  end
  if #stale > 0 then redis.call('HDEL', KEYS[6], unpack(stale)) end
  return redis.call('HLEN', KEYS[6]) < MAX_WITHDRAWN
end
local function withdraw_packed(packed)
  local ok, members = pcall(cmsgpack.unpack, packed)
  if not ok or type(members) ~= 'table' or #members > MAX_PACK_REQUESTS then return 0 end
  local found = false
  for _, m in ipairs(members) do
    if type(m) == 'table' and type(m[1]) == 'string' and owned(m[1]) then
      found = true
      break
    end
  end
  if not found or not string.find(ARGV[6], '^%d+$') then return 0 end
  if held(KEYS[1], ARGV[2]) then
    redis.call('PUBLISH', KEYS[3], KEYS[1] .. '\n' .. ARGV[2] .. '/' .. ARGV[6])
    return 0
  end
  if not KEYS[6] then return 0 end  -- a caller written before packed withdrawals
  -- A key of another type (anyone may write one) is left as it is: nothing recorded
  local kind = redis.call('TYPE', KEYS[6]).ok
  if kind ~= 'hash' and kind ~= 'none' then return 0 end
  local field = KEYS[1] .. '\n' .. ARGV[2]
  if not room(field) then return 0 end
  local rids = redis.call('HGET', KEYS[6], field)
  if not rids or not string.find(rids, '^[%d,]+$') or #rids > 21 * MAX_PACK_REQUESTS then
    rids = ARGV[6]  -- none yet, or one nobody can read (forged): this request's alone
  elseif not string.find(',' .. rids .. ',', ',' .. ARGV[6] .. ',', 1, true) then
    rids = rids .. ',' .. ARGV[6]
  end
  redis.call('HSET', KEYS[6], field, rids)
  return 1
end
local entry = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
if not entry[1] then return 0 end  -- gone: acked and deleted, or withdrawn already
local fields, header = entry[1][2], nil
for j = 1, #fields, 2 do
  if fields[j] == 'k' then return withdraw_packed(fields[j + 1]) end
  if fields[j] == 'h' then header = fields[j + 1] end
end
if not header or not owned(header) then return 0 end
if held(KEYS[1], ARGV[2]) then
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
