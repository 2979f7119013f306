-- Split a reclaimed pack (an entry holding several requests, enqueue.lua) into one new entry
-- per request, atomically, so each runs, fails and counts its deliveries on its own: a
-- request that kills the workers running it is dead-lettered alone, never with the requests
-- that shared its pack.
-- KEYS[1]  P:{S}:in:K     request stream holding the pack
-- KEYS[2]  P:{S}:ready    zset of streams with unread entries
-- KEYS[3]  P:{S}:wake     stream that wakes idle workers
-- ARGV[1]  consumer group
-- ARGV[2]  the pack's entry id
-- ARGV[3]  the stream's ready member ("<priority><batch key>"), ARGV[4] its ready score
-- ARGV[5]  the most requests a pack may hold (protocol.MAX_PACK_REQUESTS)
-- The new entries carry each request's own admitted items ('a'), so the admission counters,
-- which count the pack's items, stay right; the pack is acked and deleted without releasing.
-- They carry 'r' too: each request already ran once, in the pack, so it runs again as a replay
-- (a streamed one restarts its caller's stream).
-- Returns the number of entries written; 0 when the entry is gone or is not a pack; -1 when
-- its 'k' field is not a pack as enqueue.lua writes one, or holds more requests than ARGV[5]
-- (the caller dead-letters it whole).
local entry = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])[1]
if not entry then return 0 end
local packed
local fields = entry[2]
for j = 1, #fields, 2 do
  if fields[j] == 'k' then packed = fields[j + 1] end
end
if not packed then return 0 end
local ok, members = pcall(cmsgpack.unpack, packed)
if not ok or type(members) ~= 'table' or #members == 0 or #members > tonumber(ARGV[5]) then
  return -1
end
for _, m in ipairs(members) do
  if type(m) ~= 'table' or #m ~= 3 or type(m[1]) ~= 'string' or type(m[2]) ~= 'string'
      or type(m[3]) ~= 'string' then
    return -1
  end
end
for _, m in ipairs(members) do
  redis.call('XADD', KEYS[1], '*', 'h', m[1], 'p', m[2], 'a', m[3], 'r', '1')
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if redis.call('ZADD', KEYS[2], 'NX', ARGV[4], ARGV[3]) == 1 then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', 100, '*', 'k', ARGV[3])
end
return #members
