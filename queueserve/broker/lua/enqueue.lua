-- Admit and enqueue one or more requests of one serving, atomically, and mark the streams
-- that now hold unread work as ready, so workers read only those.
-- KEYS[1]  P:{S}:queued   items admitted and not yet acked
-- KEYS[2]  P:{S}:seen     zset batch key -> last enqueue (unix ms)
-- KEYS[3]  P:{S}:meta     serving options declared by workers (field max_queue)
-- KEYS[4]  P:{S}:ready    zset "<priority><batch key>" of streams with unread entries
-- KEYS[5]  P:{S}:wake     stream: one entry per stream that became ready (wakes idle workers)
-- KEYS[6]  P:{S}:depth    hash batch key -> items admitted and not yet acked
-- KEYS[7..] P:{S}:in:K / P:{S}:pN:K   request streams named by the requests below
-- ARGV[1]  max_queue to use when KEYS[3] has none (no worker has declared the serving yet);
--          0 = unlimited
-- ARGV[2]  consumer group
-- ARGV[3]  ms of waiting one priority level is worth (ready score = now - priority * this,
--          and LEAD_MS - 0.5 less for a quiet key that becomes ready: read.lua)
-- ARGV[4]  S, the number of streams: KEYS[7..6+S]; or 'S:O' with O idempotency records (below)
-- ARGV[5..4+2S]  per stream, in KEYS order: batch key, priority
-- ARGV[5+2S..] per request, four values: stream number (1 = KEYS[7]), item count, header,
--           payload. An item count 'N:R' (N items, R > 1) starts R requests of one call (a
--           call cut into requests of a batch, or spread over batch keys): the R are
--           admitted together or all refused, never in part
-- Jobs (optional; wire/job_record.py): KEYS[7+S..6+S+G] are the record groups P:jobs:C:G of the
-- jobs among these requests, and the last ARGV is msgpack [serving name, TTL of a group with
-- a job still waiting (ms), whether the send was tried before, then per group in KEYS order a
-- flat list of (request number (1 = the first request), request id (a string), keep (ms))
-- per job]. Each admitted job's field is written here, where its entry is, in the same
-- atomic step (a refused one gets none), with one HSET per group. A send tried again (its
-- reply lost) may find a job's field written, or ended already: an ended one is left as it
-- is (the rerun of its entry then takes nothing), and only fields made count as waiting. On a Redis Cluster the groups live in other slots:
-- clients there write them around the enqueue instead (job_new.lua, job_placed.lua).
-- Idempotency keys (optional; wire/once.py): with ARGV[4] 'S:O', the O KEYS after the job
-- groups are the records P:{S}:once:I of keyed requests, and the last ARGV is msgpack [TTL
-- (ms) when the meta hash declares no idempotency_ttl, then per keyed request, in KEYS order:
-- request number, digest, job id]. A keyed request whose record exists is not enqueued: it
-- is answered '=<job id>' (the same digest: the key's request), '!<job id>' (another digest)
-- or '?' (a value no client writes, or another type: left as it is). One enqueued writes its
-- record here, after its XADD, so no second sender of the key can come between; its job
-- keeps its answer as long as the record lives at least.
-- Result cache (optional; wire/cache.py): with ARGV[4] 'S:O:C', the C KEYS after the records
-- are the cache entries P:{S}:cached:D of cached requests (one item each), then P:{S}:cachestats,
-- and the last ARGV is msgpack [per cached request, in KEYS order: request number, digest (16
-- bytes)]. A cached request whose entry holds a value that starts with its digest is not
-- enqueued: it is answered '*' .. the value after the digest (the cached result); any other
-- value, or another type, is a miss. hits and misses are counted in the stats hash, which
-- gets a TTL of a week when it has none (workers renew it as they count).
-- Per priority (optional): the last of all KEYS may be P:{S}:pdepth (hash priority -> items
-- admitted and not yet acked), known by its name: KEYS[6]'s with 'pdepth' for 'depth'. The
-- admitted items are counted there per stream's priority; a caller that leaves it out (one
-- written before it) still enqueues, and its items are missing from that count only.
-- Returns {limit, queued, r1, r2, ...}: ri is the stream entry id, or 0 when request i was
-- rejected because admitting it would pass max_queue items.
-- When the workers declared pack_items (KEYS[3]), the admitted requests of one stream go in
-- packs: one entry holding several requests (fields a = their items, k = msgpack of
-- [[header, payload, items], ...]), up to pack_items items each, so Redis and the workers
-- handle one entry for them all. Requests of one pack share its entry id. A pack holds at
-- most MAX_PACK_REQUESTS requests (protocol.py; workers dead-letter a bigger one unread).
-- Anyone may write the meta hash: a count is taken only as workers write one (str of an int:
-- decimal digits alone, at most 10^12, the bound of qs.Serving), and anything else counts as
-- not declared. Lua's tonumber alone takes far more: '0x10' and ' 16 ' are 16 to it, '16.0',
-- '1.6e1' too, 'inf' and 'nan' are numbers (a forged '0x10' made callers get QueueFull).
local function declared_count(field)
  local raw = redis.call('HGET', KEYS[3], field)
  if not raw or #raw > 13 or not string.find(raw, '^%d+$') then return nil end
  local n = tonumber(raw)
  if n > 1e12 then return nil end
  return n
end
local limit = declared_count('max_queue') or tonumber(ARGV[1])
local pack_items = declared_count('pack_items') or 0
-- A serving no worker ever declared (no meta hash; its callers passed wait_for_worker, or
-- misspelled it): what they send lives at most the default key_idle_ttl past the last send,
-- so a misspelled name costs nothing for long. Once declared, a send takes those TTLs off.
local UNDECLARED_TTL_MS = 3600000  -- options/serving_options.py's default key_idle_ttl
local declared = redis.call('EXISTS', KEYS[3]) == 1
local MAX_PACK_REQUESTS = 1024  -- protocol.MAX_PACK_REQUESTS (tests/faults/test_pack_limits.py)
-- The counter is a key anyone may write: one that holds no count, or a key of another type,
-- counts as 0 and is replaced below, never an error after the XADDs (its caller would be
-- told the requests were not queued, and send them again: they would run twice)
local raw_queued = redis.pcall('GET', KEYS[1])
local queued = raw_queued == false and 0 or nil
if type(raw_queued) == 'string' and #raw_queued <= 13 and string.find(raw_queued, '^%d+$') then
  queued = tonumber(raw_queued)
end
local junk_queued = queued == nil
queued = queued or 0
local step = tonumber(ARGV[3])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local admitted = 0
local per_key = {}
local per_priority = {}
local registered = {}
local out = {limit, 0}
local streams = tonumber(ARGV[4])
local onces, caches = 0, 0
if not streams then  -- 'S:O(:C)': keyed or cached requests among these
  local s, o, c = string.match(ARGV[4], '^(%d+):(%d+):?(%d*)$')
  streams, onces, caches = tonumber(s), tonumber(o), tonumber(c) or 0
end
local cache_keys = caches > 0 and caches + 1 or 0
local pdepth = KEYS[#KEYS]
if #KEYS <= 6 + streams or string.sub(KEYS[6], -5) ~= 'depth'
    or pdepth ~= string.sub(KEYS[6], 1, -6) .. 'pdepth' then
  pdepth = nil
end
local jobs = #KEYS - 6 - streams - onces - cache_keys - (pdepth and 1 or 0)
-- the last per-request value
local job_args = #ARGV - (jobs > 0 and 1 or 0) - (onces > 0 and 1 or 0) - (caches > 0 and 1 or 0)
local keyed, once_ttl  -- request number -> {record key, digest, job id}
if onces > 0 then
  local spec = cmsgpack.unpack(ARGV[#ARGV - (caches > 0 and 1 or 0)])
  keyed = {}
  for k = 1, onces do
    local at = 3 * k - 1
    keyed[spec[at]] = {KEYS[6 + streams + jobs + k], spec[at + 1], spec[at + 2]}
  end
  -- The option as workers declared it (str of a float, seconds; config set writes it too)
  local raw = redis.call('HGET', KEYS[3], 'idempotency_ttl')
  local seconds = raw and #raw <= 24 and string.find(raw, '^%d+%.?%d*$') and tonumber(raw)
  if seconds and seconds <= 2592000 then  -- options/serving_options.py MAX_IDEMPOTENCY_TTL_S
    once_ttl = math.max(math.floor(seconds * 1000), 1)
  else
    once_ttl = math.max(tonumber(spec[1]) or 86400000, 1)
  end
end
-- What a keyed request's record says: nil when there is none (the request goes), else the
-- answer in its entry id's place (wire/once.py)
local function held_by(once)
  local value = redis.pcall('GET', once[1])
  if value == false then return nil end
  if type(value) ~= 'string' or #value > 116 then return '?' end  -- once.RECORD_MAX_BYTES
  local digest, job = string.match(value, '^(%x+):([%w_.%-]+%-%d+)$')
  if not digest or #digest ~= 32 then return '?' end
  return (digest == once[2] and '=' or '!') .. job
end
local cached_of, cache_stats  -- request number -> {entry key, digest}
local hits, misses = 0, 0
if caches > 0 then
  local spec = cmsgpack.unpack(ARGV[#ARGV])
  local first = 6 + streams + jobs + onces
  cached_of = {}
  for k = 1, caches do cached_of[spec[2 * k - 1]] = {KEYS[first + k], spec[2 * k]} end
  cache_stats = KEYS[first + caches + 1]
end
-- A cached request's answer from its entry, or nil (a miss): a value counts only when it
-- starts with the digest looked up (one copied under another item's name is a miss)
local function cached(entry)
  local value = redis.pcall('GET', entry[1])
  if type(value) == 'string' and #value > 16 and string.sub(value, 1, 16) == entry[2] then
    hits = hits + 1
    return '*' .. string.sub(value, 17)
  end
  misses = misses + 1
  return nil
end
local filling = {}  -- stream number -> its pack being filled: {items, members, at}
-- A quiet key's lead (read.lua): it ranks as if it had waited this much longer, and its score
-- ends in .5, which no other rank does, so that read.lua knows it had no turn yet
local LEAD_MS, QUIET_MS = 60000, 1000
-- Whether a key that becomes ready at 'priority' takes the lead: when it had no request for
-- QUIET_MS (so a client that sends a batch at a time, each after the last was answered, is not
-- quiet each time and does not take half the worker from keys that wait their turn; nor does
-- an urgent flood that keeps draining, which priority ageing bounds) and no more urgent work
-- is queued or running (pdepth, and this call's own requests so far)
local function leads(key, priority)
  local last = tonumber(redis.pcall('ZSCORE', KEYS[2], key))
  if last and last > now - QUIET_MS then return false end
  if priority >= 9 then return true end
  local above = {}
  for level = priority + 1, 9 do above[#above + 1] = level end
  local counts = pdepth and redis.pcall('HMGET', pdepth, unpack(above))
  for i, level in ipairs(above) do
    local queued_now = type(counts) == 'table' and tonumber(counts[i]) or 0
    if queued_now + (per_priority[level] or 0) > 0 then return false end
  end
  return true
end

local function write(s)
  local pack = filling[s]
  if not pack then return end
  filling[s] = nil
  local id
  if #pack.members == 1 then
    local m = pack.members[1]
    id = redis.call('XADD', KEYS[6 + s], '*', 'h', m[1], 'p', m[2], 'a', m[3])
  else
    id = redis.call('XADD', KEYS[6 + s], '*', 'a', pack.items, 'k', cmsgpack.pack(pack.members))
  end
  for _, at in ipairs(pack.at) do out[at] = id end  -- its requests share the id
end
local together_to, together_fits = 0, true  -- the requests of one call admitted as one
local first_request = 5 + 2 * streams
for i = first_request, job_args, 4 do
  local count, together = string.match(ARGV[i + 1], '^(%d+):(%d+)$')
  count = count or ARGV[i + 1]
  local n = tonumber(count)
  if together then  -- the first of `together` requests of one call: all of them, or none
    local total = n
    together_to = math.min(i + 4 * (tonumber(together) - 1), job_args)
    for j = i + 4, together_to, 4 do
      total = total + tonumber(string.match(ARGV[j + 1], '^%d+'))
    end
    together_fits = not (limit > 0 and queued + admitted + total > limit)
  end
  local refused
  if i <= together_to then
    refused = not together_fits
  else
    refused = limit > 0 and queued + admitted + n > limit
  end
  local once = keyed and keyed[(i - first_request) / 4 + 1]
  local held = once and held_by(once)
  if not held and cached_of then
    local entry = cached_of[(i - first_request) / 4 + 1]
    held = entry and cached(entry)
  end
  if held then
    out[#out + 1] = held
  elseif refused then
    out[#out + 1] = 0
  else
    local s = tonumber(ARGV[i])
    local stream = KEYS[6 + s]
    local key = ARGV[3 + 2 * s]
    if not registered[s] then
      registered[s] = true
      local priority = tonumber(ARGV[4 + 2 * s])
      local rank, member = now - priority * step, priority .. key
      if redis.call('ZADD', KEYS[4], 'NX', rank, member) == 1 then
        -- It had nothing unread: it may be quiet, it may be new (no group yet; BUSYGROUP is
        -- fine), and idle workers wait on the wake stream, not on this one.
        if leads(key, priority) then
          redis.call('ZADD', KEYS[4], 'XX', rank - LEAD_MS + 0.5, member)
        end
        redis.pcall('XGROUP', 'CREATE', stream, ARGV[2], '0', 'MKSTREAM')
        redis.call('XADD', KEYS[5], 'MAXLEN', '~', 100, '*', 'k', priority .. key)
      end
    end
    -- 'a' records the items admitted, which only the ack of this entry may release
    if pack_items > 1 and n < pack_items then
      if filling[s] and (filling[s].items + n > pack_items
                         or #filling[s].members >= MAX_PACK_REQUESTS) then
        write(s)
      end
      local pack = filling[s]
      if not pack then
        pack = {items = 0, members = {}, at = {}}
        filling[s] = pack
      end
      pack.items = pack.items + n
      pack.members[#pack.members + 1] = {ARGV[i + 2], ARGV[i + 3], count}
      out[#out + 1] = 0
      pack.at[#pack.at + 1] = #out
    else
      write(s)  -- what came before it, first
      out[#out + 1] = redis.call('XADD', stream, '*', 'h', ARGV[i + 2], 'p', ARGV[i + 3], 'a', n)
    end
    if once then redis.call('SET', once[1], once[2] .. ':' .. once[3], 'PX', once_ttl) end
    admitted = admitted + n
    per_key[key] = (per_key[key] or 0) + n
    local priority = tonumber(ARGV[4 + 2 * s])
    per_priority[priority] = (per_priority[priority] or 0) + n
  end
end
for s = 1, streams do write(s) end
if jobs > 0 then
  local spec = cmsgpack.unpack(ARGV[job_args + 1])
  local serving, live, again = spec[1], spec[2], spec[3]
  for g = 1, jobs do
    local key, list, fields, added = KEYS[6 + streams + g], spec[3 + g], {}, 0
    local ended = {}
    if again then  -- rare: worth a read of the fields
      local names = {}
      for j = 2, #list, 3 do names[#names + 1] = list[j] end
      local old = redis.pcall('HMGET', key, unpack(names))
      if type(old) == 'table' and not old.err then
        for j, value in ipairs(old) do
          if value and not string.match(value, '^%d') then ended[names[j]] = true end
        end
      end
    end
    for j = 1, #list, 3 do
      local r = list[j]
      local id = out[2 + r]
      -- admitted (an entry id, not a keyed request's answer), not ended
      if type(id) == 'string' and string.find(id, '^%d') and not ended[list[j + 1]] then
        local request = first_request + 4 * (r - 1)
        local keep = list[j + 2]
        if keyed and keyed[r] then keep = math.max(tonumber(keep), once_ttl) end
        fields[#fields + 1] = list[j + 1]
        fields[#fields + 1] = string.match(ARGV[request + 1], '^%d+') .. ':' .. keep
          .. ':' .. serving .. ':' .. id .. ':' .. KEYS[6 + tonumber(ARGV[request])]
        added = added + 1
      end
    end
    -- A key someone made another type is left as it is (pcall), and the others are written.
    -- HSET counts the fields it made: a request sent again (a retried send) is one job still.
    local made = added > 0 and redis.pcall('HSET', key, unpack(fields))
    if type(made) == 'number' then
      if type(redis.pcall('HINCRBY', key, 'live', made)) ~= 'number' then
        redis.call('HSET', key, 'live', made)  -- a forged count starts again
      end
      -- a week at least, never less than the keep an ended job of it has left
      if redis.call('PTTL', key) < live then redis.call('PEXPIRE', key, live) end
    end
  end
end
if admitted > 0 then
  if junk_queued then
    redis.call('SET', KEYS[1], string.format('%d', admitted))  -- (SET replaces any type)
  else
    redis.call('INCRBY', KEYS[1], admitted)
  end
  for key, n in pairs(per_key) do
    redis.call('ZADD', KEYS[2], now, key)
    -- A field anyone may overwrite: one that holds no count is reset (after the XADDs above
    -- an error would leave the entries written and the caller told they were not)
    if type(redis.pcall('HINCRBY', KEYS[6], key, n)) ~= 'number' then
      redis.pcall('HSET', KEYS[6], key, n)
    end
  end
  if pdepth then
    -- Nothing was admitted and unacked before these: whatever the hash held was drift (acks
    -- by workers that predate it, a forged field), of any type; it goes.
    if queued == 0 then redis.call('DEL', pdepth) end
    for priority, n in pairs(per_priority) do
      if type(redis.pcall('HINCRBY', pdepth, priority, n)) ~= 'number' then
        redis.pcall('HSET', pdepth, priority, n)
      end
    end
  end
end
if cache_stats then
  for field, n in pairs({hits = hits, misses = misses}) do
    if n > 0 and type(redis.pcall('HINCRBY', cache_stats, field, n)) ~= 'number' then
      redis.pcall('HSET', cache_stats, field, n)  -- a forged count starts again
    end
  end
  -- counts live a week past the last one (wire/cache.py STATS_TTL_MS)
  if redis.call('PTTL', cache_stats) == -1 then redis.pcall('PEXPIRE', cache_stats, 604800000) end
end
local function each_key(command, ...)
  for k = 1, 6 do
    if k ~= 3 then redis.call(command, KEYS[k], ...) end
  end
  for s = 1, streams do redis.call(command, KEYS[6 + s], ...) end
  if pdepth then redis.call(command, pdepth, ...) end
end
if not declared then
  each_key('PEXPIRE', UNDECLARED_TTL_MS)
elseif redis.call('PTTL', KEYS[2]) > 0 then  -- sent to while undeclared: its keys now stay
  each_key('PERSIST')
end
out[2] = queued + admitted
return out
