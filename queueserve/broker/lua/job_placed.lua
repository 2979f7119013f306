-- Say where jobs just enqueued wait (wire/jobs.py), for cancel and status; their records
-- were written before the enqueue (so a worker's answer always finds one).
-- KEYS[1..N]  P:job:ID       the records (one per call on a cluster)
-- ARGV[2i-1], ARGV[2i]       job i's stream and entry id; an entry id of "" means the enqueue
--                            refused it (max_queue): its record goes
-- A record that is gone (forgotten, or its keep passed already) is not made again.
-- Returns how many records were updated.
local updated = 0
for i = 1, #KEYS do
  local stream, entry = ARGV[2 * i - 1], ARGV[2 * i]
  if entry == '' then
    redis.call('DEL', KEYS[i])
  elseif redis.call('EXISTS', KEYS[i]) == 1
      and type(redis.pcall('HSET', KEYS[i], 'st', stream, 'e', entry)) == 'number' then
    updated = updated + 1  -- (a key of another type is left alone)
  end
end
return updated
