-- Cancel a job (wire/jobs.py) by its record: it ends 'cancelled' unless it ended already (its
-- field then starts with how, not with its item count), and job.lua writes nothing into an
-- ended job, so a run that goes on (a pack's, or a batch
-- already running) never makes it 'done'. The caller withdraws its entry after (cancel.lua).
-- KEYS[1]  P:jobs:C:G     the job's group (hash)
-- ARGV[1]  its request id; ARGV[2] keep, ms, when its field has none readable (or one over
--          ARGV[3], the most keep may be)
-- Returns 1 when cancelled now, 0 when it had ended, -1 when there is no record.
-- Counts and times in a group may have been written by anyone: what is no count is nil.
local function count(value)
  local n = tonumber(value or '')
  if n and n >= 0 and n < 1e13 then return math.floor(n) end
end
local rid = ARGV[1]
local got = redis.call('HMGET', KEYS[1], rid, 'live', 'until')
if not got[1] then return -1 end
local n, keep = string.match(got[1], '^(%d+):(%d+):')
if not n then return 0 end  -- it ended (its field starts with how)
keep = count(keep)
if not keep or keep < 1 or keep > tonumber(ARGV[3]) then keep = tonumber(ARGV[2]) end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local ends = now + keep
local live = (count(got[2]) or 1) - 1
local last = math.max(count(got[3]) or 0, ends)
redis.call('HSET', KEYS[1], rid, string.format('cancelled:%d:%d:0:', ends, count(n) or 0),
  'live', live, 'until', string.format('%d', last))
redis.call('HDEL', KEYS[1], rid .. '.a')  -- its answers so far are not kept
if live <= 0 then  -- none waits: it goes with the last keep
  redis.call('PEXPIREAT', KEYS[1], string.format('%d', last))
else  -- it stays for that keep at least
  redis.call('PEXPIREAT', KEYS[1], string.format('%d', last), 'GT')
end
return 1
