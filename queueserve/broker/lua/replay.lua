-- Move one dead letter back onto its request stream: one new entry per request it held (a
-- pack's requests each go alone, as a split pack's do).
-- KEYS[1]  P:{S}:dead     dead-letter stream
-- KEYS[2]  P:{S}:in:K     the request stream it came from
-- KEYS[3]  P:{S}:queued   admission counter (the replayed items count as queued again)
-- ARGV[1]  dead-letter entry id
-- ARGV[2..] per request: header (deadline cleared by the caller), payload, item count
-- Returns the new entry ids, or false when the dead letter is gone (replayed or dropped already).
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then
  return false
end
local ids = {}
local items = 0
for i = 2, #ARGV, 3 do
  ids[#ids + 1] = redis.call('XADD', KEYS[2], '*', 'h', ARGV[i], 'p', ARGV[i + 1],
                             'a', ARGV[i + 2])
  items = items + tonumber(ARGV[i + 2])
end
redis.call('INCRBY', KEYS[3], items)
return ids
