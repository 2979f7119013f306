-- Keep jobs' answers (wire/jobs.py): the worker's write, sent before the ack of their entries
-- in the same round trip, so a job's record holds its answer whenever its entry was acked.
-- KEYS[1..N]  P:job:ID    the records of N jobs (hashes; one per call on a cluster)
-- ARGV[1]  the most bytes of answers one job keeps (MAX_JOB_BYTES)
-- ARGV[2]  the TTL of a record still waiting (LIVE_TTL_MS)
-- ARGV[3]  msgpack: per job, in KEYS order, [keep (ms: the record's TTL once the job ended),
--          whether these messages end it (its last item is answered), whether one of these
--          items was answered with an error, its item count, the last hook event of its
--          batches ('' for none: the codec tag and its encoding), [the reply messages
--          (wire/reply.py) as an inbox would get them], whether the record holds none of
--          its answers yet (a first run's first answers: their count need not be read)].
--          One argument for all: per job values as arguments of their own cost the worker
--          and Redis more than the writes.
-- A job that ended already (done, failed, cancelled) takes nothing more: a run repeated after
-- its worker died, or a job cancelled while its pack ran, leaves its record as it was.
-- Everything in a record may have been written by anyone: counts that are no count are 0, and
-- a key of another type is left alone (its job's answer goes to its caller's inbox only).
-- Redis's work per job is most of what keeping a job costs (issue 26), and each command and
-- field read or written counts: a fresh job's write reads its status alone, and it writes
-- what readers will need: 'b' and 'f' only while more answers may come (an ended job takes
-- none), 'n' only into a record that had no status (gone before its answer: forgotten, or
-- expired), and the TTL only when it changes.
-- Returns how many jobs were written.
local limit, live = tonumber(ARGV[1]), ARGV[2]
local jobs = cmsgpack.unpack(ARGV[3])
if type(jobs) ~= 'table' or #jobs ~= #KEYS then
  return redis.error_reply('job.lua: ARGV[3] must hold one write per key')
end
local function count(value)
  local n = tonumber(value or '0')
  if not n or n < 0 or n > 1048576 * 1048576 then return 0 end
  return math.floor(n)
end
local written = 0
for k = 1, #KEYS do
  local key = KEYS[k]
  local keep, final, errored, n, hook, messages, fresh = unpack(jobs[k])
  -- pcall: a key someone made another type fails alone, not the other jobs of this reply
  local s = redis.pcall('HGET', key, 's')
  local readable = type(s) ~= 'table' or s.err == nil
  if readable and not (s == 'done' or s == 'failed' or s == 'cancelled') then
    written = written + 1
    local m, bytes, failed = 0, 0, errored
    if not fresh then  -- earlier writes may have kept answers: how many, their size, an error
      local earlier = redis.call('HMGET', key, 'm', 'b', 'f')
      m, bytes = math.min(count(earlier[1]), 1048576), count(earlier[2])
      failed = failed or earlier[3] ~= false
    end
    local added = 0
    for _, message in ipairs(messages) do added = added + #message end
    if bytes + added > limit then
      redis.call('DEL', key)  -- its answers so far go too: one command, whatever it held
      redis.call('HSET', key, 's', 'failed', 'x',
        'its answer is over ' .. limit .. ' bytes, the most one job keeps in Redis: return '
        .. 'smaller results, or send fewer items per job')
      redis.call('PEXPIRE', key, keep)
    else
      local fields = {'m', m + #messages}
      for i, message in ipairs(messages) do
        fields[#fields + 1] = 'r' .. (m + i)
        fields[#fields + 1] = message
      end
      if final then
        fields[#fields + 1] = 's'
        fields[#fields + 1] = failed and 'failed' or 'done'
      else
        fields[#fields + 1] = 'b'
        fields[#fields + 1] = bytes + added
        if failed then
          fields[#fields + 1] = 'f'
          fields[#fields + 1] = 1
        end
      end
      if not s then  -- what reading it needs, for a record that was gone (or forged)
        fields[#fields + 1] = 'n'
        fields[#fields + 1] = n
        if not final then
          fields[#fields + 1] = 's'
          fields[#fields + 1] = 'queued'
        end
      end
      if hook ~= '' then
        fields[#fields + 1] = 'h'
        fields[#fields + 1] = hook
      end
      redis.call('HSET', key, unpack(fields))
      if final then
        redis.call('PEXPIRE', key, keep)
      elseif not s then
        redis.call('PEXPIRE', key, live)
      end
    end
  end
end
return written
