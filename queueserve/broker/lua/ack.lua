-- Acknowledge finished requests of one stream: XACK, XDEL, and release their admitted items.
-- KEYS[1]  P:{S}:in:K     request stream
-- KEYS[2]  P:{S}:queued   admission counter
-- KEYS[3]  P:{S}:depth    per batch key admission counter
-- KEYS[4]  P:{S}:active   streams that may hold pending entries: KEYS[1] leaves it once
--          nothing is pending there, so reclaim looks only at streams with work
-- KEYS[5]  P:{S}:pdepth   per priority admission counter
-- ARGV[1]  consumer group
-- ARGV[2]  batch key of the stream
-- ARGV[3]  priority of the stream
-- ARGV[4..] runs of entries admitted with the same item count (their 'a' field; 0 for entries
--           written without enqueue.lua, which never counted): count, number of ids, the ids
-- An entry already acked (by a worker that reclaimed it, which also deleted it) releases
-- nothing, so the counter never drops twice for one request; it never drops below zero.
-- Returns the number of entries this call acked.
local ids = {}
local counts = {}
local total = 0
local i = 4
while i <= #ARGV do
  local n, k = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  for j = i + 2, i + 1 + k do
    ids[#ids + 1] = ARGV[j]
    counts[#counts + 1] = n
  end
  total = total + n * k
  i = i + 2 + k
end
local acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
local released = total
if acked < #ids then
  -- Rare (a duplicate run): entries acked elsewhere were deleted there too, so the ones still
  -- in the stream are the ones this call acked.
  released = 0
  for j = 1, #ids do
    if #redis.call('XRANGE', KEYS[1], ids[j], ids[j]) > 0 then
      released = released + counts[j]
    end
  end
end
redis.call('XDEL', KEYS[1], unpack(ids))
local summary = redis.pcall('XPENDING', KEYS[1], ARGV[1])
if type(summary) == 'table' and not summary.err and summary[1] == 0 then
  redis.pcall('ZREM', KEYS[4], KEYS[1])
end
-- The counters are keys anyone may write. One that holds no count, or a key of another type,
-- is reset, never a failed ack: the entries are acked and deleted above already, and a
-- script that failed here made the replier send its replies again, for every ack of the key.
if released > 0 then
  local left = redis.pcall('DECRBY', KEYS[2], released)
  if type(left) ~= 'number' or left < 0 then
    redis.call('SET', KEYS[2], 0)
    left = 0
  end
  local depth = redis.pcall('HINCRBY', KEYS[3], ARGV[2], -released)
  if type(depth) ~= 'number' or depth <= 0 then redis.pcall('HDEL', KEYS[3], ARGV[2]) end
  if left == 0 then
    -- Nothing admitted is left unacked: what the hash still holds is drift (enqueues by
    -- callers that predate it count nothing there, acks by workers that predate it release
    -- nothing there), so it goes whole, of whatever type
    redis.call('DEL', KEYS[5])
  else
    local n = redis.pcall('HINCRBY', KEYS[5], ARGV[3], -released)
    if type(n) ~= 'number' or n <= 0 then redis.pcall('HDEL', KEYS[5], ARGV[3]) end
  end
end
return acked
