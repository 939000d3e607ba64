"""The lease ledger's Lua scripts: every change that touches several keys runs as one script,
so concurrent schedulers or coroutines can never hand one device to two jobs. Key layout:
lease_ledger.py's docstring."""

ACQUIRE = """
local prefix, worker_id, job_id = ARGV[1], ARGV[2], ARGV[3]
local n, lease_id, ttl_ms, now = tonumber(ARGV[4]), ARGV[5], ARGV[6], ARGV[7]
-- Run again with the same lease id (the client retried after the reply of a run that took
-- the devices was lost): the same answer, not a refusal that leaves that lease held for good
local taken = redis.call('HGET', prefix .. ':lease:' .. lease_id, 'devices')
if taken then
  local out = {}
  for d in string.gmatch(taken, '[^\\n]+') do table.insert(out, d) end
  return out
end
local devices = redis.call('LRANGE', prefix .. ':worker:' .. worker_id .. ':devices', 0, -1)
local free = {}
for _, d in ipairs(devices) do
  if #free < n and redis.call('EXISTS', prefix .. ':device:' .. d) == 0 then
    table.insert(free, d)
  end
end
if #free < n then return false end
for _, d in ipairs(free) do
  redis.call('SET', prefix .. ':device:' .. d, lease_id, 'PX', ttl_ms)
end
redis.call('HSET', prefix .. ':lease:' .. lease_id, 'worker_id', worker_id, 'job_id', job_id,
           'devices', table.concat(free, '\\n'), 'created', now)
redis.call('SADD', prefix .. ':worker:' .. worker_id .. ':leases', lease_id)
redis.call('SADD', prefix .. ':leases', lease_id)
redis.call('XADD', prefix .. ':history', 'MAXLEN', '~', ARGV[8], '*', 'event', 'acquire',
           'lease_id', lease_id, 'job_id', job_id, 'worker_id', worker_id,
           'devices', table.concat(free, '\\n'))
return free
"""

# Shared by the scripts below: is every device of the lease still held by it?
LIVE_FN = """
local function lease_devices(prefix, lease_id)
  local joined = redis.call('HGET', prefix .. ':lease:' .. lease_id, 'devices')
  local out = {}
  if not joined then return nil end
  for d in string.gmatch(joined, '[^\\n]+') do table.insert(out, d) end
  return out
end
-- A share of a shared LoRA host (ACQUIRE_SHARE) is live while its host holds the devices
local function holder_of(prefix, lease_id)
  return redis.call('HGET', prefix .. ':lease:' .. lease_id, 'host') or lease_id
end
local function is_live(prefix, lease_id, devices)
  local holder = holder_of(prefix, lease_id)
  for _, d in ipairs(devices) do
    if redis.call('GET', prefix .. ':device:' .. d) ~= holder then return false end
  end
  return true
end
"""

RENEW = (
    LIVE_FN
    + """
local prefix, worker_id, ttl_ms = ARGV[1], ARGV[2], ARGV[3]
local renewed = 0
for _, lease_id in ipairs(redis.call('SMEMBERS', prefix .. ':worker:' .. worker_id .. ':leases')) do
  local devices = lease_devices(prefix, lease_id)
  if devices and is_live(prefix, lease_id, devices) then
    for _, d in ipairs(devices) do redis.call('PEXPIRE', prefix .. ':device:' .. d, ttl_ms) end
    renewed = renewed + 1
  end
end
return renewed
"""
)

RELEASE = (
    LIVE_FN
    + """
local prefix, lease_id, call_id = ARGV[1], ARGV[2], ARGV[4]
local released = prefix .. ':released:' .. lease_id
local worker_id = redis.call('HGET', prefix .. ':lease:' .. lease_id, 'worker_id')
if not worker_id then
  redis.call('SREM', prefix .. ':leases', lease_id)
  redis.call('SREM', prefix .. ':draining', lease_id)
  -- Run again by the same call (the client retried after the reply was lost): its answer
  if call_id and call_id ~= '' and redis.call('GET', released) == call_id then return 1 end
  return 0
end
if call_id and call_id ~= '' then redis.call('SET', released, call_id, 'PX', 600000) end
redis.call('XADD', prefix .. ':history', 'MAXLEN', '~', ARGV[3], '*', 'event', 'release',
           'lease_id', lease_id, 'worker_id', worker_id,
           'job_id', redis.call('HGET', prefix .. ':lease:' .. lease_id, 'job_id'))
local holder = lease_id
local host = redis.call('HGET', prefix .. ':lease:' .. lease_id, 'host')
if host then  -- a share: the host's devices are freed with its last share
  redis.call('SREM', prefix .. ':host:' .. host .. ':leases', lease_id)
  if redis.call('SCARD', prefix .. ':host:' .. host .. ':leases') == 0 then
    holder = host
    redis.call('DEL', prefix .. ':host:' .. host)
  end
end
for _, d in ipairs(lease_devices(prefix, lease_id)) do
  if redis.call('GET', prefix .. ':device:' .. d) == holder then
    redis.call('DEL', prefix .. ':device:' .. d)
  end
end
local port = redis.call('HGET', prefix .. ':lease:' .. lease_id, 'port')
if port then redis.call('SREM', prefix .. ':worker:' .. worker_id .. ':ports', port) end
redis.call('DEL', prefix .. ':lease:' .. lease_id)
redis.call('SREM', prefix .. ':worker:' .. worker_id .. ':leases', lease_id)
redis.call('SREM', prefix .. ':leases', lease_id)
redis.call('SREM', prefix .. ':draining', lease_id)
return 1
"""
)

IS_LIVE = (
    LIVE_FN
    + """
local devices = lease_devices(ARGV[1], ARGV[2])
if devices and is_live(ARGV[1], ARGV[2], devices) then return 1 end
return 0
"""
)

LAPSED = (
    LIVE_FN
    + """
local prefix = ARGV[1]
local out = {}
for _, lease_id in ipairs(redis.call('SMEMBERS', prefix .. ':leases')) do
  local devices = lease_devices(prefix, lease_id)
  if devices == nil or not is_live(prefix, lease_id, devices) then table.insert(out, lease_id) end
end
return out
"""
)


REVIVE = (
    LIVE_FN
    + """
local prefix, lease_id, worker_id, job_id, ttl_ms = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local key = prefix .. ':lease:' .. lease_id
if redis.call('HGET', key, 'worker_id') ~= worker_id then return 0 end
if redis.call('HGET', key, 'job_id') ~= job_id then return 0 end
local devices = lease_devices(prefix, lease_id)
local own = holder_of(prefix, lease_id)
for _, d in ipairs(devices) do
  local holder = redis.call('GET', prefix .. ':device:' .. d)
  if holder and holder ~= own then return 0 end
end
for _, d in ipairs(devices) do
  redis.call('SET', prefix .. ':device:' .. d, own, 'PX', ttl_ms)
end
redis.call('XADD', prefix .. ':history', 'MAXLEN', '~', ARGV[6], '*', 'event', 'revive',
           'lease_id', lease_id, 'job_id', job_id, 'worker_id', worker_id)
return 1
"""
)


# Hold a lease for its stopped attempt (draining.py). ARGV: prefix, lease_id, attempt, now,
# reason, ttl_ms, history max, rehold ("1"/"0"). With rehold, a device no lease holds (the lease
# lapsed) is held again; one another lease took stays that lease's. A second drain keeps the
# first's time and reason.
DRAIN = (
    LIVE_FN
    + """
local prefix, lease_id, ttl_ms = ARGV[1], ARGV[2], ARGV[6]
local key = prefix .. ':lease:' .. lease_id
local devices = lease_devices(prefix, lease_id)
if not devices then return 0 end
local own = holder_of(prefix, lease_id)
for _, d in ipairs(devices) do
  if ARGV[8] == '1' and redis.call('EXISTS', prefix .. ':device:' .. d) == 0 then
    redis.call('SET', prefix .. ':device:' .. d, own, 'PX', ttl_ms)
  end
end
if redis.call('HEXISTS', key, 'drain_since') == 1 then return 1 end
redis.call('HSET', key, 'drain_attempt', ARGV[3], 'drain_since', ARGV[4], 'drain_reason', ARGV[5])
redis.call('SADD', prefix .. ':draining', lease_id)
redis.call('XADD', prefix .. ':history', 'MAXLEN', '~', ARGV[7], '*', 'event', 'drain',
           'lease_id', lease_id, 'job_id', redis.call('HGET', key, 'job_id'),
           'worker_id', redis.call('HGET', key, 'worker_id'))
return 1
"""
)


# Devices on several workers for one job, all or none (multi-worker jobs). ARGV: prefix, job_id,
# ttl_ms, now, history max, port_base, port_count, then (worker_id, n, lease_id) per part; the
# first part is rank 0's, whose lease also takes the first free port of its rendezvous range.
ACQUIRE_GROUP = """
local prefix, job_id, ttl_ms, now, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local port_base, port_count = tonumber(ARGV[6]), tonumber(ARGV[7])
-- Run again with the same lease ids (a retry after a lost reply): the same answer
local first = prefix .. ':lease:' .. ARGV[10]
if redis.call('EXISTS', first) == 1 then
  local again = {redis.call('HGET', first, 'port')}
  for i = 8, #ARGV, 3 do
    table.insert(again, redis.call('HGET', prefix .. ':lease:' .. ARGV[i + 2], 'devices'))
  end
  return again
end
local parts, ids = {}, {}
for i = 8, #ARGV, 3 do
  local worker_id, n, lease_id = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local free = {}
  local offered = redis.call('LRANGE', prefix .. ':worker:' .. worker_id .. ':devices', 0, -1)
  for _, d in ipairs(offered) do
    if #free < n and redis.call('EXISTS', prefix .. ':device:' .. d) == 0 then
      table.insert(free, d)
    end
  end
  if #free < n then return false end
  table.insert(parts, {worker_id, lease_id, free})
  table.insert(ids, lease_id)
end
local ports_key = prefix .. ':worker:' .. parts[1][1] .. ':ports'
local port = nil
for p = port_base, port_base + port_count - 1 do
  if redis.call('SISMEMBER', ports_key, p) == 0 then port = p; break end
end
if port == nil then return false end
redis.call('SADD', ports_key, port)
local out = {tostring(port)}
for i, part in ipairs(parts) do
  local worker_id, lease_id, free = part[1], part[2], part[3]
  for _, d in ipairs(free) do
    redis.call('SET', prefix .. ':device:' .. d, lease_id, 'PX', ttl_ms)
  end
  local key = prefix .. ':lease:' .. lease_id
  redis.call('HSET', key, 'worker_id', worker_id, 'job_id', job_id, 'created', now,
             'devices', table.concat(free, '\\n'), 'group', table.concat(ids, '\\n'))
  if i == 1 then redis.call('HSET', key, 'port', port) end
  redis.call('SADD', prefix .. ':worker:' .. worker_id .. ':leases', lease_id)
  redis.call('SADD', prefix .. ':leases', lease_id)
  redis.call('XADD', prefix .. ':history', 'MAXLEN', '~', maxlen, '*', 'event', 'acquire',
             'lease_id', lease_id, 'job_id', job_id, 'worker_id', worker_id,
             'devices', table.concat(free, '\\n'), 'group', table.concat(ids, '\\n'))
  table.insert(out, table.concat(free, '\\n'))
end
return out
"""


# A share of a shared LoRA host: one of the ``slots`` sessions of host ``host_id`` on one device
# of the worker. The host's device key holds the host id (not a lease id); each share is a lease
# of its own (its job's, released as any) whose ``host`` field names it, live while the host
# holds the device. The first share takes a free device for the host; the last share's release
# frees it (RELEASE). ARGV: prefix, worker_id, job_id, host_id, slots, lease_id, ttl_ms, now,
# history max. Returns the devices, or false (no free device for a new host; the host full, on
# another worker, or its device lapsed).
ACQUIRE_SHARE = (
    LIVE_FN
    + """
local prefix, worker_id, job_id, host_id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local slots, lease_id, ttl_ms, now = tonumber(ARGV[5]), ARGV[6], ARGV[7], ARGV[8]
local taken = redis.call('HGET', prefix .. ':lease:' .. lease_id, 'devices')
if taken then return {taken} end  -- a retry after a lost reply: the same answer
local host_key = prefix .. ':host:' .. host_id
local members = host_key .. ':leases'
local device = redis.call('HGET', host_key, 'devices')
if device then
  if redis.call('HGET', host_key, 'worker_id') ~= worker_id then return false end
  if redis.call('GET', prefix .. ':device:' .. device) ~= host_id then return false end
  if redis.call('SCARD', members) >= tonumber(redis.call('HGET', host_key, 'slots')) then
    return false
  end
else
  local offered = redis.call('LRANGE', prefix .. ':worker:' .. worker_id .. ':devices', 0, -1)
  for _, d in ipairs(offered) do
    if not device and redis.call('EXISTS', prefix .. ':device:' .. d) == 0 then device = d end
  end
  if not device then return false end
  redis.call('SET', prefix .. ':device:' .. device, host_id, 'PX', ttl_ms)
  redis.call('HSET', host_key, 'worker_id', worker_id, 'devices', device, 'slots', slots)
end
redis.call('SADD', members, lease_id)
redis.call('HSET', prefix .. ':lease:' .. lease_id, 'worker_id', worker_id, 'job_id', job_id,
           'devices', device, 'created', now, 'host', host_id,
           'slots', redis.call('HGET', host_key, 'slots'))
redis.call('SADD', prefix .. ':worker:' .. worker_id .. ':leases', lease_id)
redis.call('SADD', prefix .. ':leases', lease_id)
redis.call('XADD', prefix .. ':history', 'MAXLEN', '~', ARGV[9], '*', 'event', 'acquire',
           'lease_id', lease_id, 'job_id', job_id, 'worker_id', worker_id, 'devices', device,
           'host', host_id)
return {device}
"""
)
