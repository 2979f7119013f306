-- Say where jobs just enqueued wait (wire/job_record.py), for cancel and status: on a Redis Cluster,
-- after their enqueue; job_new.lua wrote their fields before it.
-- KEYS[1]  P:jobs:C:G    the group (hash)
-- ARGV[3i-2], ARGV[3i-1], ARGV[3i]  job i's request id, stream and entry id; an entry id of
--          "" means the enqueue refused it (max_queue): its field goes, and the group counts
--          one live job less
-- A field that is gone (forgotten, or its group expired) is not made again, and one that is
-- no job's (forged) is left alone. Returns how many jobs were placed.
local placed, refused = 0, 0
for i = 1, #ARGV, 3 do
  local rid, stream, entry = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local value = redis.pcall('HGET', KEYS[1], rid)
  local head = type(value) == 'string' and string.match(value, '^(%d+:%d+:[^:]*):')
  if head and entry == '' then
    redis.call('HDEL', KEYS[1], rid)
    refused = refused + 1
  elseif head then
    redis.call('HSET', KEYS[1], rid, head .. ':' .. entry .. ':' .. stream)
    placed = placed + 1
  end
end
if refused > 0 then
  local live = redis.pcall('HINCRBY', KEYS[1], 'live', -refused)
  if type(live) == 'number' and live <= 0 then  -- none waits: keep what ended, if any
    local last = tonumber(redis.call('HGET', KEYS[1], 'until') or '')
    if last and last > 0 and last < 1e13 then
      redis.call('PEXPIREAT', KEYS[1], string.format('%d', last))
    else
      redis.call('DEL', KEYS[1])
    end
  end
end
return placed
