-- Forget a job (wire/jobs.py): its fields go now; the group's messages that hold its answers
-- may hold other jobs' too, so they go with the group (its TTL). A job not ended yet counts
-- as live no more.
-- KEYS[1]  P:jobs:C:G     the job's group (hash)
-- ARGV[1]  its request id
-- Returns 1 when it had a record, else 0.
-- Counts and times in a group may have been written by anyone: what is no count is nil.
local function count(value)
  local n = tonumber(value or '')
  if n and n >= 0 and n < 1e13 then return math.floor(n) end
end
local rid = ARGV[1]
local got = redis.call('HMGET', KEYS[1], rid, 'live', 'until')
if not got[1] then return 0 end
redis.call('HDEL', KEYS[1], rid, rid .. '.a', rid .. '.h')
if string.match(got[1], '^%d') then  -- not ended: one live job less
  local live = (count(got[2]) or 1) - 1
  redis.call('HSET', KEYS[1], 'live', live)
  local last = count(got[3])
  if live <= 0 and last then
    redis.call('PEXPIREAT', KEYS[1], string.format('%d', last))
  elseif live <= 0 then  -- no job of it ended, and none is waiting: nothing to keep
    redis.call('DEL', KEYS[1])
  end
end
return 1
