-- Move one dead letter back onto its request stream, as a new entry.
-- KEYS[1]  P:{S}:dead     dead-letter stream
-- KEYS[2]  P:{S}:in:K     the request stream it came from
-- KEYS[3]  P:{S}:queued   admission counter (the replayed items count as queued again)
-- ARGV[1]  dead-letter entry id
-- ARGV[2]  header (deadline cleared by the caller), ARGV[3] payload, ARGV[4] item count
-- Returns the new entry id, or false when the dead letter is gone (replayed or dropped already).
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then
  return false
end
local id = redis.call('XADD', KEYS[2], '*', 'h', ARGV[2], 'p', ARGV[3], 'a', ARGV[4])
redis.call('INCRBY', KEYS[3], tonumber(ARGV[4]))
return id
