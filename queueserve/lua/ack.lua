-- Acknowledge finished requests of one stream: XACK, XDEL, and release their admitted items.
-- KEYS[1]  P:{S}:in:K     request stream
-- KEYS[2]  P:{S}:queued   admission counter
-- ARGV[1]  consumer group
-- ARGV[2..] pairs: entry id, items it was admitted with (its 'a' field; 0 for entries written
--           without enqueue.lua, which never counted)
-- An entry already acked (by a worker that reclaimed it, which also deleted it) releases
-- nothing, so the counter never drops twice for one request; it never drops below zero.
-- Returns the number of entries this call acked.
local ids = {}
local total = 0
for i = 2, #ARGV, 2 do
  ids[#ids + 1] = ARGV[i]
  total = total + tonumber(ARGV[i + 1])
end
local acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
local released = total
if acked < #ids then
  -- Rare (a duplicate run): entries acked elsewhere were deleted there too, so the ones still
  -- in the stream are the ones this call acked.
  released = 0
  for i = 2, #ARGV, 2 do
    if #redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i]) > 0 then
      released = released + tonumber(ARGV[i + 1])
    end
  end
end
redis.call('XDEL', KEYS[1], unpack(ids))
if released > 0 and redis.call('DECRBY', KEYS[2], released) < 0 then
  redis.call('SET', KEYS[2], 0)
end
return acked
