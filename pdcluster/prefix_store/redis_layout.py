"""Redis key layout and Lua scripts of the prefix index (shared by every client).

All keys of one (cluster, model) share the hash tag ``{cluster/model}``, so a
Lua call touches one slot even on Redis Cluster:

    pdc:{c/m}:b:<hash hex16>     SET   members holding the block: "name@epoch" in its device pool,
                                       "name@epoch#host" / "#disk" in a lower tier (index_base.tier_member)
    pdc:{c/m}:w:<name@epoch>     SET   that worker's block hashes (hex16, "hex16#host", ...), for cleanup
    pdc:{c/m}:hb:<name>          STR   live epoch of <name>, expires after the TTL
    pdc:{c/m}:workers            SET   worker keys registered, live or with entries left
    pdc:{c/m}:info:<name@epoch>  STR   msgpack {name, epoch, ttl_s, ...} for operators

A worker key counts only while ``hb:<name>`` equals its epoch: a lapsed
heartbeat or a newer epoch retires it in the same instant, with no sweep.
Sweeps (``purge``) only reclaim memory.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdcluster.prefix_store.worker_id import WorkerId


def _tag_part(text: str) -> str:
    if not text or any(c in text for c in "{}"):
        raise ValueError(f"cluster/model name {text!r} must be non-empty without braces")
    return text


@dataclass(frozen=True)
class RedisKeys:
    cluster: str
    model: str
    namespace: str = field(init=False)

    def __post_init__(self) -> None:
        ns = f"pdc:{{{_tag_part(self.cluster)}/{_tag_part(self.model)}}}"
        object.__setattr__(self, "namespace", ns)

    @property
    def block_prefix(self) -> str:
        return f"{self.namespace}:b:"

    @property
    def heartbeat_prefix(self) -> str:
        return f"{self.namespace}:hb:"

    @property
    def workers(self) -> str:
        return f"{self.namespace}:workers"

    def block(self, block_hash: int) -> str:
        return f"{self.block_prefix}{block_hash:016x}"

    def worker_blocks(self, worker: WorkerId) -> str:
        return f"{self.namespace}:w:{worker.key}"

    def heartbeat(self, worker: WorkerId) -> str:
        return f"{self.heartbeat_prefix}{worker.name}"

    def info(self, worker: WorkerId) -> str:
        return f"{self.namespace}:info:{worker.key}"


def hex16(block_hash: int) -> str:
    return f"{block_hash:016x}"


def packed_hex(block_hashes: Sequence[int]) -> str:
    """All hashes as one string of 16-hex-digit words (what LOOKUP_LUA slices)."""
    return struct.pack(f">{len(block_hashes)}Q", *block_hashes).hex()


# KEYS[1]: the first block's key (declares the slot).  ARGV[1]: block key
# prefix, ARGV[2]: heartbeat key prefix, ARGV[3]: the prompt's hashes as
# 16-hex-digit words (packed_hex) -- one argument instead of one per block
# keeps the client's encoding cost flat.  All keys share one hash-tag slot.
# A block counts for a worker held in any tier: its device pool first, then
# host, then disk.  Returns a flat list name1, len1, host1, disk1, ... for
# live workers holding block 0 (host/disk: leading blocks held only there).
# One round trip; cost ~ blocks x candidate workers SISMEMBERs (up to three
# for a block that is not on the device).
LOOKUP_LUA = """
local block_prefix, hb_prefix, hexes = ARGV[1], ARGV[2], ARGV[3]
local live_epoch = {}
local function is_live(wkey)
  local at = string.find(wkey, '@', 1, true)
  if not at then return false end
  local name = string.sub(wkey, 1, at - 1)
  local epoch = live_epoch[name]
  if epoch == nil then
    epoch = redis.call('GET', hb_prefix .. name) or false
    live_epoch[name] = epoch
  end
  return epoch == string.sub(wkey, at + 1), name
end
local function worker_of(member)
  local at = string.find(member, '@', 1, true) or 1
  local cut = string.find(member, '#', at, true)
  if cut then return string.sub(member, 1, cut - 1) end
  return member
end
local function block_key(i)
  return block_prefix .. string.sub(hexes, (i - 1) * 16 + 1, i * 16)
end
local n = string.len(hexes) / 16
local active, names, host, disk, left = {}, {}, {}, {}, 0
for _, member in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local wkey = worker_of(member)
  if not active[wkey] then
    local ok, name = is_live(wkey)
    if ok then active[wkey] = true; names[wkey] = name; host[wkey] = 0; disk[wkey] = 0; left = left + 1 end
  end
end
local out = {}
local function done(wkey, len)
  out[#out + 1] = names[wkey]; out[#out + 1] = len; out[#out + 1] = host[wkey]; out[#out + 1] = disk[wkey]
end
local i = 1
while left > 0 and i <= n do
  local key = block_key(i)
  for wkey in pairs(active) do
    if redis.call('SISMEMBER', key, wkey) == 0 then
      if redis.call('SISMEMBER', key, wkey .. '#host') == 1 then host[wkey] = host[wkey] + 1
      elseif redis.call('SISMEMBER', key, wkey .. '#disk') == 1 then disk[wkey] = disk[wkey] + 1
      else active[wkey] = nil; left = left - 1; done(wkey, i - 1) end
    end
  end
  i = i + 1
end
for wkey in pairs(active) do done(wkey, n) end
return out
"""

# KEYS[1]=hb:<name> KEYS[2]=workers KEYS[3]=info:<wkey>
# ARGV[1]=epoch ARGV[2]=ttl_ms ARGV[3]=wkey ARGV[4]=info blob ('' = keep)
# Returns 0 registered, 1 renewed, 2 took over an older epoch, 3 superseded.
HEARTBEAT_LUA = """
local cur = redis.call('GET', KEYS[1])
local epoch = tonumber(ARGV[1])
if cur and tonumber(cur) > epoch then return 3 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
if ARGV[4] ~= '' then redis.call('SET', KEYS[3], ARGV[4]) end
if not cur then return 0 end
if tonumber(cur) == epoch then return 1 end
return 2
"""

# KEYS[1]=w:<wkey> KEYS[2]=workers KEYS[3]=info:<wkey> KEYS[4]=hb:<name>
# ARGV[1]=wkey ARGV[2]=block key prefix ARGV[3]=max blocks this call
# ARGV[4]=epoch ARGV[5]='1' to refuse while the worker is live at its epoch
# Returns {blocks removed, blocks still left}; left = -1: refused, the worker
# is live.  Bounded work per call keeps Redis responsive; the client loops.
# A live worker stays in the workers set (it is how live_workers finds it).
PURGE_LUA = """
local live = redis.call('GET', KEYS[4]) == ARGV[4]
if ARGV[5] == '1' and live then return {0, -1} end
local hs = redis.call('SPOP', KEYS[1], tonumber(ARGV[3]))
for _, h in ipairs(hs) do
  redis.call('SREM', ARGV[2] .. string.sub(h, 1, 16), ARGV[1] .. string.sub(h, 17))  -- "hex16#tier": key#tier
end
local left = redis.call('SCARD', KEYS[1])
if left == 0 and not live then
  redis.call('SREM', KEYS[2], ARGV[1])
  redis.call('DEL', KEYS[3])
end
return {#hs, left}
"""

# KEYS[1]=hb:<name>  ARGV[1]=epoch.  Drops liveness only if it is ours.
DEREGISTER_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def parse_lookup_reply(reply: list) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """(leading blocks per worker name, {name: {"host": n, "disk": m}} for those with lower-tier blocks)."""
    matched: dict[str, int] = {}
    tiers: dict[str, dict[str, int]] = {}
    for i in range(0, len(reply), 4):
        name = reply[i].decode() if isinstance(reply[i], bytes) else str(reply[i])
        matched[name] = int(reply[i + 1])
        lower = {t: int(n) for t, n in (("host", reply[i + 2]), ("disk", reply[i + 3])) if int(n)}
        if lower:
            tiers[name] = lower
    return matched, tiers
