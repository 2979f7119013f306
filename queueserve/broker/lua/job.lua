-- Keep jobs' answers (wire/job_record.py): the worker's write for the jobs of one record group, sent
-- before the ack of their entries in the same round trip, so a job's record holds its answer
-- whenever its entry was acked.
-- KEYS[1]  P:jobs:C:G     the group (hash)
-- ARGV[1]  the most bytes of answers one job keeps (MAX_JOB_BYTES)
-- ARGV[2]  msgpack [messages, jobs]: the reply messages (wire/reply.py) holding these jobs'
--          rows of this round trip, as an inbox would get them, and per job that is not
--          plain (below) [request id (a string), whether these rows end it (its last item is
--          answered), whether one of them is an error, the numbers of the messages that hold
--          its rows (1 = the first), the bytes of answers it is counted for, its last hook
--          event ('' for none: the codec tag and its encoding)].
-- ARGV[3]  the plain jobs' request ids, space separated: a first run's answer of all its
--          items, none an error, in message 1, no hook event: most jobs. Their item count and
--          keep are read from their own field, so each costs a name and nothing more.
-- ARGV[4]  the bytes of message 1 a plain job is counted for per item
-- A job's field says whether it waits (it starts with its item count, a digit) or ended
-- (with its status): one field read per job, as a field that is not there costs a hash in
-- Redis's compact encoding a scan of all of it. A job that ended already (done, failed,
-- cancelled) takes nothing more: a run repeated after its worker died, or a job cancelled
-- while its pack ran, leaves its record as it was; a job with no field (forgotten, its
-- group expired, or never enqueued) is not made again.
-- Everything in a group may have been written by anyone: counts that are no count are 0, and
-- a key of another type is left alone (its jobs' answers go to their caller's inbox only).
-- Redis's work per job is most of what keeping a job costs (issue 26): a group takes one
-- read, one write and at most one TTL whatever its number of jobs, and Lua's own work per
-- job (each string made) costs as much as Redis's.
-- Returns how many jobs were written.
local limit = tonumber(ARGV[1])
local data = cmsgpack.unpack(ARGV[2])
local messages, jobs = data[1], data[2]
if type(messages) ~= 'table' or type(jobs) ~= 'table' then
  return redis.error_reply('job.lua: ARGV[2] must be [messages, jobs]')
end
local function count(value)
  local n = tonumber(value or '')
  if n and n >= 0 and n < 1e13 then return math.floor(n) end
  return 0
end
local wanted = {'#', 'live', 'until'}
for _, job in ipairs(jobs) do
  wanted[#wanted + 1] = job[1]
  wanted[#wanted + 1] = job[1] .. '.a'
end
local complex = #wanted
local plain = {}
for rid in string.gmatch(ARGV[3], '%d+') do
  plain[#plain + 1] = rid
  wanted[#wanted + 1] = rid
end
local got = redis.pcall('HMGET', KEYS[1], unpack(wanted))
if got.err then return 0 end  -- a key of another type
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local base, last = count(got[1]), count(got[3])
-- how many of its jobs wait; nil when unreadable (forged): then the group is never freed
-- early, its TTL only raised
local live = tonumber(got[2] or '')
if not live or live ~= math.floor(live) or live < 0 or live > 1e13 then live = nil end
local fields, answered, written, ended, used, seen = {}, {}, 0, 0, {}, {}
local over = ':its answer is over ' .. string.format('%d', limit) .. ' bytes, the most one '
  .. 'job keeps in Redis: return smaller results, or send fewer items per job'
-- The field of a job that ends now: '<status>:<ends (unix ms)>:<items>:<bytes>:<messages>',
-- then ':<why>' for one that failed without an answer.
local function finish(rid, status, keep, n, bytes, numbers, why)
  local ends = now + keep
  fields[#fields + 1] = rid
  fields[#fields + 1] = status .. string.format(':%d:%d:%d:', ends, n, bytes) .. numbers .. why
  last = math.max(last, ends)
  ended = ended + 1
end
for j, job in ipairs(jobs) do
  local rid, final, errored, refs, bytes, hook = unpack(job)
  local waiting, progress = got[2 * j + 2], got[2 * j + 3]
  local n, keep = string.match(waiting or '', '^(%d+):(%d+):')
  if n and not seen[rid] then  -- (a request id twice in one call: a forged entry's)
    seen[rid] = true
    n, keep = count(n), math.max(count(keep), 1)
    written = written + 1
    local earlier, failed, numbers = 0, errored, {}
    if progress then  -- earlier round trips' answers
      local b, f, list = string.match(progress, '^(%d+):([01]):([%d ]*)$')
      earlier, failed = count(b), failed or f == '1'
      if list and list ~= '' then numbers[1] = list end
    end
    for _, r in ipairs(refs) do numbers[#numbers + 1] = string.format('%d', base + r) end
    bytes = earlier + bytes
    if bytes > limit then
      finish(rid, 'failed', keep, n, bytes, '', over)
      answered[#answered + 1] = rid .. '.a'
    else
      for _, r in ipairs(refs) do used[r] = true end
      numbers = table.concat(numbers, ' ')
      if final then
        finish(rid, failed and 'failed' or 'done', keep, n, bytes, numbers, '')
        if progress then answered[#answered + 1] = rid .. '.a' end
      else
        fields[#fields + 1] = rid .. '.a'
        fields[#fields + 1] = string.format('%d:', bytes) .. (failed and '1:' or '0:') .. numbers
      end
    end
    if hook ~= '' then
      fields[#fields + 1] = rid .. '.h'
      fields[#fields + 1] = hook
    end
  end
end
local per_item = tonumber(ARGV[4]) or 0
local ref = string.format('%d', base + 1)
for j, rid in ipairs(plain) do
  local n, keep = string.match(got[complex + j] or '', '^(%d+):(%d+):')
  if n and not seen[rid] then
    seen[rid] = true
    n, keep = count(n), math.max(count(keep), 1)
    local bytes = math.floor(n * per_item) + 1
    if bytes > limit then
      finish(rid, 'failed', keep, n, bytes, '', over)
    else
      used[1] = true
      finish(rid, 'done', keep, n, bytes, ref, '')
    end
    written = written + 1
  end
end
if written == 0 then return 0 end
-- Only the messages a job written now takes: not those of a job that ended already, went
-- over the limit, or has no field (their numbers are left unused)
for i, message in ipairs(messages) do
  if used[i] then
    fields[#fields + 1] = 'm' .. string.format('%d', base + i)
    fields[#fields + 1] = message
  end
end
fields[#fields + 1] = '#'
fields[#fields + 1] = string.format('%d', base + #messages)
if ended > 0 then
  if live then
    live = math.max(live - ended, 0)
    fields[#fields + 1] = 'live'
    fields[#fields + 1] = string.format('%d', live)
  end
  fields[#fields + 1] = 'until'
  fields[#fields + 1] = string.format('%d', last)
end
redis.call('HSET', KEYS[1], unpack(fields))
if #answered > 0 then redis.call('HDEL', KEYS[1], unpack(answered)) end
if ended > 0 and live == 0 then  -- none waits: it goes with the last keep
  redis.call('PEXPIREAT', KEYS[1], string.format('%d', last))
elseif ended > 0 then  -- it stays for that keep at least
  redis.call('PEXPIREAT', KEYS[1], string.format('%d', last), 'GT')
end
return written
