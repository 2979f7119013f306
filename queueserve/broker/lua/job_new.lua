-- Record a job its client just enqueued (wire/jobs.py): where it waits, for cancel and status.
-- KEYS[1]  P:job:ID       the job's record (hash)
-- ARGV[1]  item count; ARGV[2] keep, ms; ARGV[3] serving; ARGV[4] stream; ARGV[5] entry id;
-- ARGV[6]  the TTL of a record still waiting (LIVE_TTL_MS)
-- A worker may have answered first (job.lua wrote the record): then only where it waited is
-- added, its status and TTL stay.
-- Returns 1 when the record is new, 0 when a worker had written it.
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'sv', ARGV[3], 'st', ARGV[4], 'e', ARGV[5])
  return 0
end
redis.call('HSET', KEYS[1], 's', 'queued', 'n', ARGV[1], 'k', ARGV[2], 'sv', ARGV[3],
  'st', ARGV[4], 'e', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
return 1
