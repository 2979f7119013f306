-- Move one dead letter back onto its request stream: one new entry per request it held (a
-- pack's requests each go alone, as a split pack's do), admitted and marked ready as
-- enqueue.lua would, so the ack of each entry releases exactly what this script counted.
-- KEYS[1]  P:{S}:dead     dead-letter stream
-- KEYS[2]  P:{S}:in:K / P:{S}:pN:K   the request stream it came from (checked by the caller:
--          a request stream of this shard, the record's own 'stream' field)
-- KEYS[3]  P:{S}:queued   admission counter (the replayed items count as queued again)
-- KEYS[4]  P:{S}:seen     zset batch key -> last enqueue (unix ms)
-- KEYS[5]  P:{S}:ready    zset "<priority><batch key>" of streams with unread entries
-- KEYS[6]  P:{S}:wake     stream that wakes idle workers
-- KEYS[7]  P:{S}:depth    hash batch key -> items admitted and not yet acked
-- KEYS[8]  P:{S}:pdepth   hash priority -> items admitted and not yet acked
-- ARGV[1]  dead-letter entry id
-- ARGV[2]  consumer group
-- ARGV[3]  batch key of KEYS[2], ARGV[4] its priority, ARGV[5] ms one priority level is worth
-- ARGV[6..] per request: header (deadline cleared by the caller), payload, item count (an
--          integer from 1 to the payload's length, checked by the caller)
-- Returns the new entry ids; false when the dead letter is gone (replayed or dropped already)
-- or no longer names KEYS[2] (the record was not the one the caller checked).
local record = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])[1]
if not record then return false end
local named
for j = 1, #record[2], 2 do
  if record[2][j] == 'stream' then named = record[2][j + 1] end
end
if named ~= KEYS[2] then return false end
local items = 0
for i = 6, #ARGV, 3 do
  local n = tonumber(ARGV[i + 2])
  if not n or n < 1 or n ~= math.floor(n) or n > #ARGV[i + 1] then
    return redis.error_reply('ERR replay: item count ' .. tostring(ARGV[i + 2]) ..
                             ' is not an integer from 1 to its payload length')
  end
  items = items + n
end
redis.call('XDEL', KEYS[1], ARGV[1])
local key, priority = ARGV[3], tonumber(ARGV[4])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.pcall('XGROUP', 'CREATE', KEYS[2], ARGV[2], '0', 'MKSTREAM')  -- BUSYGROUP is fine
local ids = {}
for i = 6, #ARGV, 3 do
  ids[#ids + 1] = redis.call('XADD', KEYS[2], '*', 'h', ARGV[i], 'p', ARGV[i + 1],
                             'a', ARGV[i + 2])
end
local queued = redis.call('INCRBY', KEYS[3], items)
-- A depth field that holds no count (anyone may write one) is reset, as enqueue.lua does
if type(redis.pcall('HINCRBY', KEYS[7], key, items)) ~= 'number' then
  redis.pcall('HSET', KEYS[7], key, items)
end
if queued == items then redis.call('DEL', KEYS[8]) end  -- nothing else admitted: drift goes
if type(redis.pcall('HINCRBY', KEYS[8], priority, items)) ~= 'number' then
  redis.pcall('HSET', KEYS[8], priority, items)
end
redis.call('ZADD', KEYS[4], now, key)
if redis.call('ZADD', KEYS[5], 'NX', now - priority * tonumber(ARGV[5]), priority .. key) == 1 then
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', 100, '*', 'k', priority .. key)
end
return ids
