-- Housekeeping of batch keys: a bounded slice of the known keys per call, so that what a call
-- costs never grows with the number of keys (an idle key costs a look once per pass).
-- KEYS[1]  P:{S}:seen     zset batch key -> last enqueue (unix ms)
-- KEYS[2]  P:{S}:ready    zset "<priority><batch key>" of streams with unread entries
-- KEYS[3]  P:{S}:active   zset streams that may hold pending entries (reclaim watches them)
-- KEYS[4]  P:{S}:depth    hash batch key -> items admitted and not acked
-- KEYS[5]  P:{S}:wake     stream that wakes idle workers
-- ARGV[1]  consumer group
-- ARGV[2]  ms of waiting one priority level is worth
-- ARGV[3]  forget a key idle (no enqueue) for this many ms and holding nothing; 0 = never
-- ARGV[4]  name prefix of priority-0 streams, P:{S}:in:
-- ARGV[5]  name prefix of priority-N streams, P:{S}:p
-- ARGV[6]  rank in KEYS[1] (by last enqueue) of the first key to look at (the caller's cursor)
-- ARGV[7]  how many keys of KEYS[1] to look at
-- ARGV[8]  how many streams of KEYS[3] to look at
-- ARGV[9..] more batch keys to look at (the worker's declared keys; never forgotten here)
-- Per key looked at:
--  * a stream with entries no consumer read is marked ready: entries written by anyone
--    (XADD, an older client) or whose ready mark a Redis restart lost are still served;
--  * a stream with pending entries joins KEYS[3], so reclaim watches it however they came;
--  * a key idle past ARGV[3] whose streams are all empty (nothing queued, nothing pending)
--    is forgotten: its streams (and their groups), ready marks and depth go; its next
--    request brings it back through enqueue.lua.
-- Then up to ARGV[8] streams of KEYS[3], least recently looked at first: one with nothing
-- pending leaves it (ack.lua removes most as they empty; these are the rest: cancels, dead
-- letters, a Redis restart), one still holding entries goes to the back of the line.
-- Returns {keys looked at in KEYS[1], keys forgotten, streams marked ready}; fewer keys looked
-- at than ARGV[7] means the pass over KEYS[1] is complete (start the next one at rank 0).
local group = ARGV[1]
local step = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local chunk = tonumber(ARGV[7])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local function stream_of(key, priority)
  if priority == 0 then return ARGV[4] .. key end
  return ARGV[5] .. priority .. ':' .. key
end

local function last_delivered(stream)
  local groups = redis.pcall('XINFO', 'GROUPS', stream)
  if type(groups) == 'table' and not groups.err then
    for _, g in ipairs(groups) do
      for j = 1, #g, 2 do
        if g[j] == 'name' and g[j + 1] ~= group then break end
        if g[j] == 'last-delivered-id' then return g[j + 1] end
      end
    end
  end
  redis.pcall('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
  return '0-0'
end

local marked = 0
-- true when the key holds anything (queued or pending)
local function look(key)
  local holds = false
  for priority = 0, 9 do
    local stream = stream_of(key, priority)
    if redis.call('XLEN', stream) > 0 then
      holds = true
      local after = '(' .. last_delivered(stream)
      local summary = redis.pcall('XPENDING', stream, group)
      if type(summary) == 'table' and not summary.err and summary[1] > 0 then
        redis.call('ZADD', KEYS[3], 'NX', now, stream)
      end
      if #redis.call('XRANGE', stream, after, '+', 'COUNT', 1) > 0 then
        local member = priority .. key
        if redis.call('ZADD', KEYS[2], 'NX', now - priority * step, member) == 1 then
          redis.call('XADD', KEYS[5], 'MAXLEN', '~', 100, '*', 'k', member)
          marked = marked + 1
        end
      end
    end
  end
  return holds
end

local start = tonumber(ARGV[6])
local seen = redis.call('ZRANGE', KEYS[1], start, start + chunk - 1, 'WITHSCORES')
local forgotten = {}
for i = 1, #seen, 2 do
  local key, last = seen[i], tonumber(seen[i + 1])
  if not look(key) and ttl > 0 and last < now - ttl then
    forgotten[#forgotten + 1] = key
  end
end
for i = 9, #ARGV do look(ARGV[i]) end
for _, key in ipairs(forgotten) do
  redis.call('ZREM', KEYS[1], key)
  redis.call('HDEL', KEYS[4], key)
  for priority = 0, 9 do
    local stream = stream_of(key, priority)
    redis.call('DEL', stream)
    redis.call('ZREM', KEYS[2], priority .. key)
    redis.call('ZREM', KEYS[3], stream)
  end
end
for _, stream in ipairs(redis.call('ZRANGE', KEYS[3], 0, tonumber(ARGV[8]) - 1)) do
  local summary = redis.pcall('XPENDING', stream, group)
  if type(summary) ~= 'table' or summary.err or summary[1] == 0 then
    redis.call('ZREM', KEYS[3], stream)
  else
    redis.call('ZADD', KEYS[3], 'XX', now, stream)
  end
end
return {#seen / 2, #forgotten, marked}
