-- End a job by a caller's hand (wire/job_record.py): cancel it, or forget it.
-- KEYS[1]  P:jobs:C:G     the job's group (hash)
-- ARGV[1]  'cancel' or 'forget'; ARGV[2] its request id
-- ARGV[3]  keep, ms, when its field has none readable (or one over ARGV[4], the most keep
--          may be): how long a cancelled job is kept
-- cancel: it ends 'cancelled' unless it ended already (its field then starts with how, not
-- with its item count), and job.lua writes nothing into an ended job, so a run that goes on
-- (a pack's, or a batch already running) never makes it 'done'. The caller withdraws its
-- entry after (cancel.lua). Returns 1 when cancelled now, 0 when it had ended, -1 when there
-- is no record.
-- forget: its fields go now; the group's messages that hold its answers may hold other
-- jobs' too, so they go with the group (its TTL). Returns 1 when it had a record, else 0.
-- Either way a job that was waiting counts as live no more, and when none of the group
-- waits, the group goes with the last keep of its ended jobs (or at once, with none).
-- Counts and times in a group may have been written by anyone: what is no count is nil.
local function count(value)
  local n = tonumber(value or '')
  if n and n >= 0 and n < 1e13 then return math.floor(n) end
end
local action, rid = ARGV[1], ARGV[2]
local got = redis.call('HMGET', KEYS[1], rid, 'live', 'until')
if not got[1] then return action == 'cancel' and -1 or 0 end
local n, keep = string.match(got[1], '^(%d+):(%d+):')
if action == 'cancel' and not n then return 0 end  -- it ended
local last = count(got[3])
if action == 'cancel' then
  keep = count(keep)
  if not keep or keep < 1 or keep > tonumber(ARGV[4]) then keep = tonumber(ARGV[3]) end
  local time = redis.call('TIME')
  local ends = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000) + keep
  last = math.max(last or 0, ends)
  redis.call('HSET', KEYS[1], rid, string.format('cancelled:%d:%d:0:', ends, count(n) or 0),
    'until', string.format('%d', last))
  redis.call('HDEL', KEYS[1], rid .. '.a')  -- its answers so far are not kept
else
  redis.call('HDEL', KEYS[1], rid, rid .. '.a', rid .. '.h')
end
if not n then return 1 end  -- (forgotten after it ended: the group is as it was)
-- An unreadable count (forged) frees nothing early: the TTL is only raised
local live = count(got[2])
if live then
  live = math.max(live - 1, 0)
  redis.call('HSET', KEYS[1], 'live', live)
end
if live == 0 and last then  -- none waits: it goes with the last keep
  redis.call('PEXPIREAT', KEYS[1], string.format('%d', last))
elseif live == 0 then  -- no job of it ended, and none waits: nothing to keep
  redis.call('DEL', KEYS[1])
elseif last then  -- it stays for that keep at least
  redis.call('PEXPIREAT', KEYS[1], string.format('%d', last), 'GT')
end
return 1
