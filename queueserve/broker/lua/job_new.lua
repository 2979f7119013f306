-- Write the records of jobs about to be enqueued (wire/jobs.py), before their enqueue, so a
-- worker's answer always finds one.
-- KEYS[1..N]  P:job:ID       the records (one per call on a cluster)
-- ARGV[1]  the TTL of a record still waiting (LIVE_TTL_MS)
-- ARGV[3i-1], ARGV[3i], ARGV[3i+1]  job i's item count, keep (ms) and serving
-- Returns how many were written.
-- A key someone made another type is left as it is (pcall), and the others are written.
local written = 0
for i = 1, #KEYS do
  local ok = redis.pcall('HSET', KEYS[i], 's', 'queued', 'n', ARGV[3 * i - 1], 'k', ARGV[3 * i],
    'sv', ARGV[3 * i + 1])
  if type(ok) == 'number' then
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
    written = written + 1
  end
end
return written
