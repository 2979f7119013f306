-- Cancel a job (wire/jobs.py) by its record: it ends 'cancelled' unless it ended already, and
-- job.lua writes nothing into an ended record, so a run that goes on (a pack's, or a batch
-- already running) never makes it 'done'. The caller withdraws its entry after (cancel.lua).
-- KEYS[1]  P:job:ID       the job's record (hash)
-- ARGV[1]  keep, ms, when the record has none (or a forged one); ARGV[2] the most keep may be
-- Returns 1 when cancelled now, 0 when it had ended, -1 when there is no record.
local s = redis.call('HGET', KEYS[1], 's')
if not s then return -1 end
if s ~= 'queued' then return 0 end
local keep = tonumber(redis.call('HGET', KEYS[1], 'k') or '')
if not keep or keep < 1 or keep > tonumber(ARGV[2]) then keep = tonumber(ARGV[1]) end
redis.call('HSET', KEYS[1], 's', 'cancelled')
redis.call('PEXPIRE', KEYS[1], math.floor(keep))
return 1
