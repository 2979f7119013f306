-- Admit and enqueue one or more requests of one serving, atomically.
-- KEYS[1]  P:{S}:queued   items admitted and not yet acked
-- KEYS[2]  P:{S}:keys     set of batch keys
-- KEYS[3]  P:{S}:meta     serving options declared by workers (field max_queue)
-- KEYS[4..] P:{S}:in:K    request streams named by the requests below
-- ARGV[1]  max_queue to use when KEYS[3] has none (no worker has declared the serving yet);
--          0 = unlimited
-- ARGV[2..] per request, five values: stream index into KEYS (1 = KEYS[4]), batch key,
--           item count, header, payload
-- Returns {limit, queued, r1, r2, ...}: ri is the stream entry id, or 0 when request i was
-- rejected because admitting it would pass max_queue items.
local limit = tonumber(redis.call('HGET', KEYS[3], 'max_queue') or ARGV[1])
local queued = tonumber(redis.call('GET', KEYS[1]) or '0')
local admitted = 0
local registered = {}
local out = {limit, 0}
for i = 2, #ARGV, 5 do
  local n = tonumber(ARGV[i + 2])
  if limit > 0 and queued + admitted + n > limit then
    out[#out + 1] = 0
  else
    local stream = KEYS[3 + tonumber(ARGV[i])]
    if not registered[stream] then
      redis.call('SADD', KEYS[2], ARGV[i + 1])
      registered[stream] = true
    end
    -- 'a' records the items admitted, which only the ack of this entry may release
    out[#out + 1] = redis.call('XADD', stream, '*', 'h', ARGV[i + 3], 'p', ARGV[i + 4], 'a', n)
    admitted = admitted + n
  end
end
if admitted > 0 then
  redis.call('INCRBY', KEYS[1], admitted)
end
out[2] = queued + admitted
return out
