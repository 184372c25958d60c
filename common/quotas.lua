-- Tenant quotas, atomically, in one tenant's Cluster slot (see common/quotas.py).
--
-- KEYS[1] rate log   ZSET admission id -> admit time (ms)         (requests per window)
-- KEYS[2] leases     ZSET admission id -> lease expiry (ms)        (concurrent requests)
-- KEYS[3] token log  ZSET admission id -> admit time (ms)         (tokens per window)
-- KEYS[4] amounts    HASH admission id -> tokens charged ("r" prefix once released)
-- KEYS[5] token sum  STRING sum of the amounts of the entries in the token log
--
-- ARGV[1] op: "admit" | "release" | "renew"
-- admit:   ARGV[2] id, [3] rate limit, [4] rate window ms, [5] concurrency limit,
--          [6] lease ms, [7] token limit, [8] token window ms, [9] tokens to charge
--          -> {1, now_ms, lease_expiry_ms} or {0, failed limit (1 rate, 2 concurrency,
--             3 tokens), retry after ms}
-- release: ARGV[2] id, [3] actual tokens (-1: keep the whole charge) -> tokens refunded
-- renew:   ARGV[2] id, [3] lease ms -> new lease expiry ms, or 0 if the lease was lost
--
-- Time is the Redis server's clock, so gateways with skewed clocks agree on windows.
-- A limit <= 0 means unlimited; nothing is recorded for it.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local op = ARGV[1]
local id = ARGV[2]

-- An amount is "<n>" while refundable and "r<n>" after release, so a retried release
-- (e.g. after a client timeout) cannot refund twice.
local function amount(v)
  if not v then return 0, true end
  if string.sub(v, 1, 1) == 'r' then return tonumber(string.sub(v, 2)), true end
  return tonumber(v), false
end

local function keep_ttl(key, ms)
  -- Never shorten: another gateway may hold a longer lease in the same key.
  if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, ms) end
end

if op == 'admit' then
  local rate_limit, rate_win = tonumber(ARGV[3]), tonumber(ARGV[4])
  local conc_limit, lease = tonumber(ARGV[5]), tonumber(ARGV[6])
  local tok_limit, tok_win, cost = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
  local failed, retry = 0, -1

  if rate_limit > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - rate_win)
    local n = redis.call('ZCARD', KEYS[1])
    if n >= rate_limit then
      -- Admission needs the (n - limit + 1) oldest entries to leave the window.
      local e = redis.call('ZRANGE', KEYS[1], n - rate_limit, n - rate_limit, 'WITHSCORES')
      local r = tonumber(e[2]) + rate_win - now
      if r > retry then failed, retry = 1, r end
    end
  end

  if conc_limit > 0 then
    -- Expired leases are slots of crashed gateways: reclaim them here.
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
    if redis.call('ZCARD', KEYS[2]) >= conc_limit then
      -- Nobody knows when a request ends; suggest a short retry, capped by the first lease.
      local e = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
      local r = math.min(1000, tonumber(e[2]) - now)
      if r > retry then failed, retry = 2, r end
    end
  end

  local sum = 0
  if tok_limit > 0 then
    local sum_raw = redis.call('GET', KEYS[5])
    sum = tonumber(sum_raw) or 0
    local old = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now - tok_win)
    for _, member in ipairs(old) do
      sum = sum - amount(redis.call('HGET', KEYS[4], member))
      redis.call('HDEL', KEYS[4], member)
    end
    if #old > 0 then
      redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - tok_win)
      redis.call('SET', KEYS[5], sum, 'KEEPTTL')
    end
    if sum + cost > tok_limit then
      local need, freed = sum + cost - tok_limit, 0
      local all = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
      local r = tok_win
      for i = 1, #all, 2 do
        freed = freed + amount(redis.call('HGET', KEYS[4], all[i]))
        if freed >= need then r = tonumber(all[i + 1]) + tok_win - now; break end
      end
      if r > retry then failed, retry = 3, r end
    end
  end

  if failed > 0 then return {0, failed, math.max(1, retry)} end

  local expiry = 0
  if rate_limit > 0 then
    redis.call('ZADD', KEYS[1], now, id)
    redis.call('PEXPIRE', KEYS[1], rate_win)
  end
  if conc_limit > 0 then
    expiry = now + lease
    redis.call('ZADD', KEYS[2], expiry, id)
    keep_ttl(KEYS[2], lease)
  end
  if tok_limit > 0 then
    redis.call('ZADD', KEYS[3], now, id)
    redis.call('HSET', KEYS[4], id, cost)
    redis.call('SET', KEYS[5], sum + cost)
    redis.call('PEXPIRE', KEYS[3], tok_win)
    redis.call('PEXPIRE', KEYS[4], tok_win)
    redis.call('PEXPIRE', KEYS[5], tok_win)
  end
  return {1, now, expiry}

elseif op == 'release' then
  local actual = tonumber(ARGV[3])
  redis.call('ZREM', KEYS[2], id)
  local charged, released = amount(redis.call('HGET', KEYS[4], id))
  if released then return 0 end
  local keep = charged
  if actual >= 0 and actual < charged then keep = actual end
  redis.call('HSET', KEYS[4], id, 'r' .. keep)
  local refund = charged - keep
  if refund > 0 then redis.call('DECRBY', KEYS[5], refund) end
  return refund

elseif op == 'renew' then
  local lease = tonumber(ARGV[3])
  -- A lease that already expired may have been handed to someone else: don't resurrect it.
  local score = redis.call('ZSCORE', KEYS[2], id)
  if not score or tonumber(score) <= now then return 0 end
  redis.call('ZADD', KEYS[2], now + lease, id)
  keep_ttl(KEYS[2], lease)
  return now + lease
end

return redis.error_reply('unknown op ' .. tostring(op))
