-- Write the fields of jobs about to be enqueued into their record group (wire/jobs.py), before
-- their enqueue, so a worker's answer always finds them: on a Redis Cluster, where groups live
-- in other slots than the streams (elsewhere enqueue.lua writes them with the entries).
-- KEYS[1]  P:jobs:C:G    the group (hash)
-- ARGV[1]  the TTL of a group with a job still waiting (LIVE_TTL_MS)
-- ARGV[2i], ARGV[2i+1]  job i's request id and '<items>:<keep ms>:<serving>::' (not placed)
-- Returns how many were made; a key someone made another type is left as it is.
local fields = {}
for i = 2, #ARGV do fields[#fields + 1] = ARGV[i] end
-- HSET counts the fields it made: a job sent again (a retried send) is one job still
local added = redis.pcall('HSET', KEYS[1], unpack(fields))
if type(added) ~= 'number' then return 0 end
if type(redis.pcall('HINCRBY', KEYS[1], 'live', added)) ~= 'number' then
  redis.call('HSET', KEYS[1], 'live', added)  -- a forged count starts again
end
-- a week at least, never less than the keep an ended job of it has left
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return added
