-- Write the fields of jobs about to be enqueued into their record group (wire/job_record.py), before
-- their enqueue, so a worker's answer always finds them: on a Redis Cluster, where groups live
-- in other slots than the streams (elsewhere enqueue.lua writes them with the entries).
-- KEYS[1]  P:jobs:C:G    the group (hash)
-- ARGV[1]  the TTL of a group with a job still waiting (LIVE_TTL_MS)
-- ARGV[2]  '1' when the send was tried before (its reply lost): a job's field may be there,
--          waiting where that try put it or ended already, and is left as it is
-- ARGV[2i+1], ARGV[2i+2]  job i's request id and '<items>:<keep ms>:<serving>::' (not placed)
-- Returns the request ids whose fields it made (only those count as waiting, and only those
-- go again when their enqueue is refused: job_placed.lua). A key someone made another type
-- is left as it is.
local fields, made = {}, {}
for i = 3, #ARGV, 2 do
  local rid = ARGV[i]
  local old = false
  if ARGV[2] == '1' then  -- rare: worth a read of the field
    old = redis.pcall('HGET', KEYS[1], rid)
    if type(old) == 'table' then return {} end  -- another type
  end
  if not old then  -- (one there waits where the earlier try put it, or it ended)
    made[#made + 1] = rid
    fields[#fields + 1] = rid
    fields[#fields + 1] = ARGV[i + 1]
  end
end
if #fields == 0 then return made end
if type(redis.pcall('HSET', KEYS[1], unpack(fields))) ~= 'number' then return {} end
if #made > 0 and type(redis.pcall('HINCRBY', KEYS[1], 'live', #made)) ~= 'number' then
  redis.call('HSET', KEYS[1], 'live', #made)  -- a forged count starts again
end
-- a week at least, never less than the keep an ended job of it has left
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return made
