-- Keep jobs' answers (wire/jobs.py): the worker's write, sent before the ack of their entries
-- in the same round trip, so a job's record holds its answer whenever its entry was acked.
-- KEYS[1..N]  P:job:ID    the records of N jobs (hashes; one per call on a cluster)
-- ARGV[1]  the most bytes of answers one job keeps (MAX_JOB_BYTES)
-- ARGV[2]  the TTL of a record still waiting (LIVE_TTL_MS)
-- then per job, in KEYS order: keep (ms: the record's TTL once the job ended), '1' when these
--          messages end it (its last item is answered) else '0', '1' when one of these items
--          was answered with an error, its item count, the last hook event of its batches
--          ('' for none: the codec tag and its encoding), how many messages follow, the reply
--          messages (wire/reply.py) as an inbox would get them
-- A job that ended already (done, failed, cancelled) takes nothing more: a run repeated after
-- its worker died, or a job cancelled while its pack ran, leaves its record as it was.
-- Everything in a record may have been written by anyone: counts that are no count are 0, and
-- a key of another type is left alone (its job's answer goes to its caller's inbox only).
-- Returns how many jobs were written.
local limit, live = tonumber(ARGV[1]), ARGV[2]
local function count(value)
  local n = tonumber(value or '0')
  if not n or n < 0 or n > 1048576 * 1048576 then return 0 end
  return math.floor(n)
end
local written, a = 0, 3
for k = 1, #KEYS do
  local key = KEYS[k]
  local keep, final, errored, n, hook = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3],
    ARGV[a + 4]
  local messages = tonumber(ARGV[a + 5])
  local first = a + 6
  a = first + messages
  -- pcall: a key someone made another type fails alone, not the other jobs of this reply
  local state = redis.pcall('HMGET', key, 's', 'b', 'm', 'f')
  local s = state.err == nil and state[1]
  if state.err == nil and not (s == 'done' or s == 'failed' or s == 'cancelled') then
    written = written + 1
    local bytes, m = count(state[2]), math.min(count(state[3]), 1048576)
    local added = 0
    for i = first, a - 1 do added = added + #ARGV[i] end
    if bytes + added > limit then
      redis.call('DEL', key)  -- its answers so far go too: one command, whatever it held
      redis.call('HSET', key, 's', 'failed', 'x',
        'its answer is over ' .. limit .. ' bytes, the most one job keeps in Redis: return '
        .. 'smaller results, or send fewer items per job')
      redis.call('PEXPIRE', key, keep)
    else
      local fields = {}
      for i = first, a - 1 do
        m = m + 1
        fields[#fields + 1] = 'r' .. m
        fields[#fields + 1] = ARGV[i]
      end
      local failed = errored == '1' or state[4] ~= false
      local status = s or 'queued'
      if final == '1' then status = failed and 'failed' or 'done' end
      redis.call('HSET', key, 's', status, 'm', m, 'b', bytes + added, 'n', n, unpack(fields))
      if errored == '1' then redis.call('HSET', key, 'f', 1) end
      if hook ~= '' then redis.call('HSET', key, 'h', hook) end
      redis.call('PEXPIRE', key, final == '1' and keep or live)
    end
  end
end
return written
