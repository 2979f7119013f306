-- Acknowledge finished requests of one stream: XACK, XDEL, and release their admitted items.
-- KEYS[1]  P:{S}:in:K     request stream
-- KEYS[2]  P:{S}:queued   admission counter
-- ARGV[1]  consumer group
-- ARGV[2..] pairs: entry id, items it was admitted with (its 'a' field; 0 for entries written
--           without enqueue.lua, which never counted)
-- An entry already acked (by a worker that reclaimed it) releases nothing, so the counter never
-- drops twice for one request; it never drops below zero. Returns the number of entries acked.
local released = 0
local acked = 0
for i = 2, #ARGV, 2 do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    redis.call('XDEL', KEYS[1], ARGV[i])
    released = released + tonumber(ARGV[i + 1])
    acked = acked + 1
  end
end
if released > 0 and redis.call('DECRBY', KEYS[2], released) < 0 then
  redis.call('SET', KEYS[2], 0)
end
return acked
