-- Read new entries for one consumer from the streams that have unread work, most urgent first.
-- KEYS[1]  P:{S}:ready    zset "<priority><batch key>" -> rank (lower is read first)
-- KEYS[2]  P:{S}:active   zset stream -> last read (unix ms): streams reclaim must watch
-- KEYS[3]  P:{S}:wake     stream a worker blocks on when nothing is ready for it
-- KEYS[4]  (optional) P:{S}:withdrawn  hash "stream\nentry id" -> request ids of a pack that
--          their callers cancelled before any worker read it (cancel.lua): a pack read here
--          takes its field along, as its field 'w' ("rid,rid,...": the worker answers none of
--          them), and the field goes, in this same script, so no cancel falls between the two
-- ARGV[1]  consumer group
-- ARGV[2]  consumer
-- ARGV[3]  ms of waiting one priority level is worth
-- ARGV[4]  items to read in all (the worker's room)
-- ARGV[5]  items to read per batch key at most (one batch)
-- Items are counted by each entry's 'a' field (1 for an entry without one), so one read takes
-- about a batch whatever the size of the requests.
-- ARGV[6]  name prefix of priority-0 streams, P:{S}:in:
-- ARGV[7]  name prefix of priority-N streams, P:{S}:p (the stream is P:{S}:pN:K)
-- ARGV[8..] '<priority><batch key>': streams of that key at that priority or below are not to
--           be read: the worker holds a whole batch of it already, as urgent or more;
--           '-<batch key>': the worker holds some of that key's work (less than a batch);
--           '+': read leading keys only, among the first 64 (the worker's look-ahead is full:
--           their batch goes in first, read while the others wait);
--           '=<batch key>=<weight>': the key's weight (batch_key_weights; 1 when not named);
--           '~<tenant>=<weight>': a tenant's weight (P:tenants): a tenant's lane of a key
--           ('<batch key>\31<tenant>', wire/tenants.py) has its key's weight times its tenant's
--           '!<ms>': the lean (a serving with load_key, worker/pipeline/affinity.py): keys this
--           worker holds the state of ('@<batch key>') and quiet keys' leads are read as
--           ranked; every other key costs a load and is deferred: one no worker holds is
--           ranked that many ms later, one another worker holds ('^<batch key>') is left to
--           it until it waited two leans past its rank, then ranked two leans later. One
--           deferred key is read, after the others, the first by leaned rank, and only with
--           '*' (the worker may load a key now): once that rank is past, or at once if it is
--           the only one, this read took nothing else and the worker holds no work ('-' or
--           full marks)
-- Keys the worker holds work of are read after the others, whatever their rank: what it holds
-- of them runs in their turn anyway, and reading more of them first would spend the room on
-- work that only waits, while a key that became ready later (a quiet one) waits a read more.
-- Streams are named from the ready set's members: all share the serving's hash tag, so they
-- live in the slot of KEYS[1].
-- A stream that gave fewer entries than asked is drained and leaves the ready set (enqueue.lua
-- adds it back on its next request, atomically, so no request is missed); one that gave all
-- it was asked is ranked again as if it became ready now: ready keys take turns. A key of weight
-- w is ranked again only 1/w of the way from its rank to now, so it comes round w times as often
-- as a key of weight 1 while both have work (stride scheduling; the worker's assembler ranks
-- the batches it holds the same way).
-- Quiet keys first (FQ-CoDel's new flows): enqueue.lua ranks a key that becomes ready after a
-- second without requests, while no more urgent work is queued, LEAD_MS ahead, its score ending
-- in .5, so it is read before the keys taking turns, and a quiet key waits for no round of busy
-- ones. The lead lasts one read: a key read so is ranked again as any other. Nor does it pass
-- more urgent work that came after it: a leading key of a priority below that of the first key
-- without a lead (among the first 16 members) is ranked as any other instead.
-- Returns {wake id, skipped, more, left, leads, stream, entries, stream, entries, ...}: the
-- newest wake entry id (block on the wake stream after it, so a request that comes after this
-- read is not missed), how many ready streams were skipped (their keys' batches are full), 1
-- when the room ran out before every ready stream was looked at (else 0), how many streams it
-- read from still hold unread entries, the streams it read with a lead (the worker gives their
-- batch the same lead), and what XREADGROUP returns per stream. With nothing skipped,
-- no more and none left, the worker may block on the wake stream at once.
local LEAD_MS = 60000  -- enqueue.lua's lead
local group, consumer = ARGV[1], ARGV[2]
local step = tonumber(ARGV[3])
local budget = tonumber(ARGV[4])
local per_key = tonumber(ARGV[5])
local full, held, new_only, weights, tenant_weights = {}, {}, false, {}, {}
local here, elsewhere, lean, may_load = {}, {}, 0, false
for i = 8, #ARGV do
  local mark, key = string.sub(ARGV[i], 1, 1), string.sub(ARGV[i], 2)
  if mark == '-' then held[key] = true elseif mark == '+' then new_only = true
  elseif mark == '=' then
    local name, weight = string.match(key, '^(.*)=([^=]+)$')
    weight = tonumber(weight)
    if name and weight and weight > 0 then weights[name] = weight end
  elseif mark == '~' then
    local name, weight = string.match(key, '^(.*)=([^=]+)$')
    weight = tonumber(weight)
    if name and weight and weight > 0 then tenant_weights[name] = weight end
  elseif mark == '@' then here[key] = true
  elseif mark == '^' then elsewhere[key] = true
  elseif mark == '!' then lean = math.max(0, tonumber(key) or 0)
  elseif mark == '*' and key == '' then may_load = true
  else full[key] = tonumber(mark) end
end
local weighted = next(weights) ~= nil or next(tenant_weights) ~= nil
local LANE = '^(.*)\31([A-Za-z0-9][A-Za-z0-9_.%-]*)$'
local lanes, spread = {}, false  -- tenant -> its lanes ready on the page being read
local function count_lanes(members)
  local seen = {}
  lanes, spread = {}, false
  for i = 1, #members, 2 do
    if string.find(members[i], '\31', 2, true) then  -- a lane (a plain find: most keys are not)
      local key = string.sub(members[i], 2)
      local _, tenant = string.match(key, LANE)
      if tenant and #tenant <= 64 and not seen[key] then
        seen[key] = true
        lanes[tenant] = (lanes[tenant] or 0) + 1
        if lanes[tenant] > 1 then spread = true end
      end
    end
  end
end
local function weight_of(key)  -- nil for weight 1
  local w = weights[key]
  if w then return w end
  local base, tenant = string.match(key, LANE)
  if not tenant or #tenant > 64 then return nil end
  w = (weights[base] or 1) * (tenant_weights[tenant] or 1) / (lanes[tenant] or 1)
  if w == 1 then return nil end
  return w
end
local function items_of(entry)  -- and whether it is a pack
  local fields, items, pack = entry[2], 1, false
  for j = 1, #fields, 2 do
    local name = fields[j]
    if name == 'a' then items = math.max(1, tonumber(fields[j + 1]) or 1)
    elseif name == 'k' then pack = true end
  end
  return items, pack
end
-- Whether KEYS[4] holds withdrawals: looked up at the first pack read (a key of another type,
-- which anyone may write, holds none), so a read of no pack costs nothing more
local withdrawals
if not KEYS[4] then withdrawals = false end
local function take_withdrawn(stream, entry)
  if withdrawals == nil then withdrawals = redis.call('TYPE', KEYS[4]).ok == 'hash' end
  if not withdrawals then return end
  local field = stream .. '\n' .. entry[1]
  local rids = redis.call('HGET', KEYS[4], field)
  if rids then
    redis.call('HDEL', KEYS[4], field)
    local fields = entry[2]
    fields[#fields + 1] = 'w'
    fields[#fields + 1] = rids
  end
end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local last = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
local leads = {}
local out = {last[1] and last[1][1] or '0-0', 0, 0, 0, leads}
local taken = {}
local drained = {}
local again = {}
-- The rank of a stream that gave all it was asked, 'head' the id of its first unread entry:
-- now, less its levels' worth, when no more urgent level of its key is ready. Else the head
-- keeps its own clock, as the worker's assembler ranks a key's levels: each request of a level
-- that wins only by ageing is read within that bound, not one batch of them per bound; but
-- never ranked before the most urgent ready level would be, read now (a head that waited
-- more than the levels between): a level that fell behind (a slow batch, a burst) takes turns
-- with that level until it catches up, rather than wait a whole bound per read, which would
-- leave it further behind with every read.
local function rank_again(priority, key, head)
  local ms = tonumber(string.match(head, '^(%d+)%-'))
  if priority >= 9 or not ms or ms >= now then return now - priority * step end
  for level = 9, priority + 1, -1 do
    if redis.call('ZSCORE', KEYS[1], level .. key) then
      return math.max(ms, now - (level - priority) * step) - priority * step
    end
  end
  return now - priority * step
end
-- A less urgent level of the key that ranks before 'stream' would, ranked again now, when
-- 'stream' was ranked again at its last read (read all along: its score is a read old, and
-- the worker's assembler ranks it from its last batch): read first, so aged work waits no read
-- more for it. Its member, priority and score; nil if none (or the worker holds it full).
local function aged_below(priority, key, stream, score)
  if priority == 0 or step <= 0 then return nil end
  local last = tonumber(redis.call('ZSCORE', KEYS[2], stream))
  if not last or last - priority * step ~= score then return nil end
  local best, best_level, best_score
  for level = (full[key] or -1) + 1, priority - 1 do
    local member = level .. key
    local s = tonumber(redis.call('ZSCORE', KEYS[1], member))
    if s and s % 1 ~= 0.5 and s < now - priority * step and (not best or s < best_score) then
      best, best_level, best_score = member, level, s
    end
  end
  return best, best_level, best_score
end
local function take(member, priority, key, new, score)
  local want = math.min(per_key - (taken[key] or 0), budget)
  if want <= 0 then return end
  local stream
  if priority == 0 then stream = ARGV[6] .. key else stream = ARGV[7] .. priority .. ':' .. key end
  if not new then
    local below, level, below_score = aged_below(priority, key, stream, score)
    if below then
      take(below, level, key, false, below_score)
      want = math.min(per_key - (taken[key] or 0), budget)
      if want <= 0 then return end
    end
  end
  local entries, items, count, drained_now = {}, 0, 1, false
  while items < want do
    local got = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', count,
                            'STREAMS', stream, '>')
    if type(got) == 'table' and got.err then  -- the group is gone: make it again
      redis.pcall('XGROUP', 'CREATE', stream, group, '0')
      got = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', count,
                        'STREAMS', stream, '>')
    end
    -- No such stream, or a key of another type under its name: nothing to read there,
    -- and its mark goes (one bad key must not stop the reads of every other)
    if type(got) == 'table' and got.err then got = nil end
    local batch = got and got[1] and got[1][2] or {}
    for _, entry in ipairs(batch) do
      entries[#entries + 1] = entry
      local n, pack = items_of(entry)
      items = items + n
      if pack and withdrawals ~= false then take_withdrawn(stream, entry) end
    end
    if #batch < count then drained_now = true break end
    -- as many more entries as the ones read so far say fill the rest
    count = math.max(1, math.ceil((want - items) * #entries / items))
  end
  local n, head = #entries, nil
  if not drained_now and n > 0 then  -- read enough: is anything left after the last one?
    local next_entry = redis.call('XRANGE', stream, '(' .. entries[n][1], '+', 'COUNT', 1)
    drained_now = #next_entry == 0
    head = next_entry[1] and next_entry[1][1]
  end
  if drained_now then
    drained[#drained + 1] = member
  else
    local rank = head and rank_again(priority, key, head) or now - priority * step
    local weight = (weighted or spread) and weight_of(key)
    if weight and not new and score < rank then
      rank = math.floor(score + (rank - score) / weight)
    end
    again[#again + 1] = rank
    again[#again + 1] = member
  end
  if n > 0 then
    if new then leads[#leads + 1] = stream end
    taken[key] = (taken[key] or 0) + items
    budget = budget - items
    out[#out + 1] = stream
    out[#out + 1] = entries
    redis.call('ZADD', KEYS[2], now, stream)
  end
end
local later = {}  -- {member, priority, key, new, score} of keys the worker holds work of, in order
local function leading(score) return score % 1 == 0.5 end
local urgent_level  -- the priority of the first key without a lead (looked up once needed)
local function passes_urgent_work(priority)
  if not urgent_level then
    urgent_level = -1
    local head = redis.call('ZRANGE', KEYS[1], 0, 15, 'WITHSCORES')
    for i = 1, #head, 2 do
      local level = tonumber(string.sub(head[i], 1, 1))
      if level and not leading(tonumber(head[i + 1]) or 0) then urgent_level = level break end
    end
  end
  return priority < urgent_level
end
local ranked = {}  -- score, member of leading keys whose lead would pass more urgent work
-- Keys the lean defers (no state here: 1, held elsewhere: 2), each list in rank order, as
-- {member, priority, key, new, score, score + lean}: one of them is read after the others
local deferred, next_of = {{}, {}}, {1, 1}
local function lean_of(key)
  local base = string.match(key, '^(.*)\31[A-Za-z0-9][A-Za-z0-9_.%-]*$') or key
  if here[base] then return 0 elseif elsewhere[base] then return 2 end
  return 1
end
local start = 0
while budget > 0 do
  local members = redis.call('ZRANGE', KEYS[1], start, start + 63, 'WITHSCORES')
  if #members == 0 then break end
  count_lanes(members)
  start = start + 64
  for i = 1, #members, 2 do
    local member = members[i]
    local priority = tonumber(string.sub(member, 1, 1))
    local key = string.sub(member, 2)
    local score = tonumber(members[i + 1]) or 0
    local new = leading(score)
    if new and priority and passes_urgent_work(priority) then
      ranked[#ranked + 1] = score - 0.5 + LEAD_MS
      ranked[#ranked + 1] = member
    elseif not priority then  -- not a mark enqueue.lua or sweep.lua wrote (anyone may ZADD)
      drained[#drained + 1] = member
    elseif full[key] and priority <= full[key] then
      out[2] = out[2] + 1
    elseif new or not new_only then  -- (the watch reads leading keys alone)
      local class = lean > 0 and not new and lean_of(key) or 0
      if held[key] then
        later[#later + 1] = {member, priority, key, new, score}
      elseif class == 2 and score + 2 * lean > now then
        out[2] = out[2] + 1  -- left to the worker that holds it, for two leans at most
      elseif class > 0 then
        local list = deferred[class]
        list[#list + 1] = {member, priority, key, new, score, score + class * lean}
      elseif budget > 0 then
        take(member, priority, key, new, score)
      end
    end
  end
  if new_only then break end
end
-- Of the keys the lean defers, one is read, and only when the worker may load a key ('*':
-- fewer keys than it loads at once wait for a load there): the one whose leaned rank is first,
-- once that rank is past; or at once if it is the only one, this read took nothing else and
-- the worker holds no work (a lone key on an idle worker gathers nothing by waiting). The
-- others wait in Redis, gathering items (counted as skipped: the worker reads again soon).
local function first_deferred()
  local a, b = deferred[1][next_of[1]], deferred[2][next_of[2]]
  if a and (not b or a[6] <= b[6]) then return a, 1 end
  return b, 2
end
local m, from = first_deferred()
local deferred_n = #deferred[1] + #deferred[2]
local idle = deferred_n == 1 and #out == 5 and next(held) == nil and next(full) == nil
if may_load and m and budget > 0 and (m[6] <= now or idle) then
  next_of[from] = next_of[from] + 1
  take(m[1], m[2], m[3], m[4], m[5])
end
out[2] = out[2] + deferred_n - next_of[1] - next_of[2] + 2
for _, m in ipairs(later) do
  if budget <= 0 then break end
  take(m[1], m[2], m[3], m[4], m[5])
end
if #drained > 0 then redis.call('ZREM', KEYS[1], unpack(drained)) end
if #again > 0 then redis.call('ZADD', KEYS[1], 'XX', unpack(again)) end
if #ranked > 0 then redis.call('ZADD', KEYS[1], 'XX', unpack(ranked)) end
if budget <= 0 then out[3] = 1 end
out[4] = (#again + #ranked) / 2  -- a key ranked anew waits unread: read again, do not block
return out
