-- Claim a consumer's pending entries for another consumer, atomically (worker/pipeline/
-- reclaim.py): only entries that are pending for that owner at this moment, idle at least the
-- given time. Looking (XPENDING) and claiming (XCLAIM) in two round trips left a gap: XCLAIM
-- checks how long an entry was idle, not whose it is, so a partition that looked while a dead
-- (or forged) consumer held an entry, and claimed more than the idle floor later (descheduled
-- in between), took it from the live partition that had reclaimed it first, and both ran it.
-- KEYS[1]  a request stream
-- ARGV[1]  consumer group
-- ARGV[2]  the owner whose entries to claim
-- ARGV[3]  the claimer
-- ARGV[4]  the idle floor, ms
-- ARGV[5]  at most this many entries are looked at
-- ARGV[6..] entry ids to leave where they are (the claimer holds them)
-- Returns {{entry id, {field, value, ...}, times delivered so far}, ...}. The claim is not a
-- delivery (JUSTID): only running the entry counts one. An entry deleted meanwhile (cancelled)
-- leaves the pending list and is not returned.
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[4], '-', '+', ARGV[5],
  ARGV[2])
if #pending == 0 then return {} end
local skip = {}
for i = 6, #ARGV do skip[ARGV[i]] = true end
local ids, delivered = {}, {}
for _, p in ipairs(pending) do
  if not skip[p[1]] then
    ids[#ids + 1] = p[1]
    delivered[p[1]] = p[4]
  end
end
if #ids == 0 then return {} end
local out = {}
for first = 1, #ids, 1000 do  -- unpack passes a bounded number of values
  local args = {unpack(ids, first, math.min(first + 999, #ids))}
  args[#args + 1] = 'JUSTID'
  local claimed = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], ARGV[4], unpack(args))
  for _, id in ipairs(claimed) do
    local entry = redis.call('XRANGE', KEYS[1], id, id)[1]
    if entry then out[#out + 1] = {id, entry[2], delivered[id]} end
  end
end
return out
