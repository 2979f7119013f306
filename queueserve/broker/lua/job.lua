-- Keep a job's answer (wire/jobs.py): the worker's write, sent before the ack of its entry in
-- the same round trip, so a job's record holds its answer whenever its entry was acked.
-- KEYS[1]  P:job:ID       the job's record (hash)
-- ARGV[1]  keep, ms: the record's TTL once the job ended
-- ARGV[2]  '1' when these messages end the job (its last item is answered), else '0'
-- ARGV[3]  '1' when one of these items was answered with an error
-- ARGV[4]  item count
-- ARGV[5]  the most bytes of answers one job keeps (MAX_JOB_BYTES)
-- ARGV[6]  the TTL of a record still waiting (LIVE_TTL_MS)
-- ARGV[7..] reply messages (wire/reply.py), as an inbox would get them
-- A job that ended already (done, failed, cancelled) takes nothing more: a run repeated after
-- its worker died, or a job cancelled while its pack ran, leaves its record as it was.
-- Everything in a record may have been written by anyone: counts that are no count are 0.
-- Returns 1 when written, 0 when the job had ended.
local s = redis.call('HGET', KEYS[1], 's')
if s == 'done' or s == 'failed' or s == 'cancelled' then return 0 end
local function count(field)
  local n = tonumber(redis.call('HGET', KEYS[1], field) or '0')
  if not n or n < 0 or n > 1048576 * 1048576 then return 0 end
  return math.floor(n)
end
local bytes, m = count('b'), math.min(count('m'), 1048576)
local added = 0
for i = 7, #ARGV do added = added + #ARGV[i] end
if bytes + added > tonumber(ARGV[5]) then
  redis.call('DEL', KEYS[1])  -- its answers so far go too: one command, whatever it held
  redis.call('HSET', KEYS[1], 's', 'failed', 'x',
    'its answer is over ' .. ARGV[5] .. ' bytes, the most one job keeps in Redis: return '
    .. 'smaller results, or send fewer items per job')
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  return 1
end
for i = 7, #ARGV do
  m = m + 1
  redis.call('HSET', KEYS[1], 'r' .. m, ARGV[i])
end
redis.call('HSET', KEYS[1], 'm', m, 'b', bytes + added, 'n', ARGV[4])
if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 'f', 1) end
if ARGV[2] == '1' then
  local failed = ARGV[3] == '1' or redis.call('HEXISTS', KEYS[1], 'f') == 1
  redis.call('HSET', KEYS[1], 's', failed and 'failed' or 'done')
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
else
  redis.call('HSETNX', KEYS[1], 's', 'queued')
  redis.call('PEXPIRE', KEYS[1], ARGV[6])
end
return 1
