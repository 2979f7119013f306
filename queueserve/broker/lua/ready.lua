-- Which of the given servings have work waiting to be read: the idle servings whose wake
-- streams one worker watches together (broker/wakes.py). Work becomes ready with an entry on
-- its serving's wake stream, which wakes the watch; this finds what became ready otherwise
-- (a member of the ready set anyone may write, a key another worker left unread), as each
-- serving's own read.lua after a blocking read found it before.
-- KEYS[1..n]  P:{S}:ready   zset of each serving's ready streams (several hash tags: a plain
--                           server or a Sentinel master only, never a cluster)
-- Returns the positions (1-based) in KEYS of the sets that hold a member; a key of another type
-- holds none.
local found = {}
for i, key in ipairs(KEYS) do
  local members = redis.pcall('ZCARD', key)
  if type(members) == 'number' and members > 0 then found[#found + 1] = i end
end
return found
