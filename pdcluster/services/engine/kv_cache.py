"""Paged KV pool, block manager with ref counts, and the local prefix cache.

Pool layout (block-major, one contiguous region per block, see pdcluster/kernels/)::

    kv_pool[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

An 8-bit pool (int8, float8_e4m3fn) widens each row by its bf16 scale,
``head_dim + 2`` bytes (pdcluster/kernels/kv_quant.py): a block stays one region.

Every block is in exactly one of three states::

    in use      ref_count > 0 (held by requests or leases; may be cached)
    evictable   ref_count == 0, holds a cached full block (hash -> block)
    free        ref_count == 0, holds nothing worth keeping

A hash names a block for routing and lookup; it is not trusted alone.  A
cached block keeps the token ids it was computed from, and a prefix hit is
taken only while those equal the request's own (nano-vllm's
``block_manager.allocate``): a 64-bit hash collision, or a gateway's
``block_hashes`` that do not describe the prompt, cost a recompute, never
another prompt's K/V::

    request tokens  [ t0..t3 | t4..t7 | t8..t11 ]      hashes [ h0 | h1 | h2 ]
    cache           h0 -> blk 5 (t0..t3) ok, h1 -> blk 2 (u4..u7) != t4..t7: stop
    match           (5,)                                   one block reused

Allocation takes free blocks first, then evicts the least recently released
evictable block (its hash leaves the cache: an ``evicted`` event).  Blocks
released by one request go to the evictable list tail-first, so a
sequence's last blocks (least likely shared) are evicted before its first.

Each block in use or cached is charged to the tenant that allocated it
(``charged``); with per-tenant quotas (kv_quota.py), eviction keeps a
tenant's guaranteed share and takes a tenant over its maximum's own first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdcluster.kernels.kv_quant import row_width
from pdcluster.services.engine.kv_quota import KVQuota, pick_victims
from pdcluster.services.sampling_params import DEFAULT_TENANT

KVEventCallback = Callable[[str, list[int]], None]  # ("stored" | "evicted", block hashes)
# (block id, its hash, its tokens): called before an evicted block is reused (kv_tiers.py keeps its bytes)
EvictCallback = Callable[[int, int, tuple[int, ...]], None]


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}: raise kv_cache_bytes")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def block_bytes(self) -> int:
        """One block's bytes: all layers, K and V, and (8-bit pools) their scales."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.row_width * self.dtype.itemsize

    @property
    def row_width(self) -> int:
        """Elements of one (token, kv head) row: head_dim, plus the scale's bytes in 8-bit pools."""
        return row_width(self.head_dim, self.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.row_width)


@dataclass(frozen=True)
class PrefixMatch:
    """Leading cached blocks of a prompt (not yet referenced)."""
    block_ids: tuple[int, ...]
    num_evictable: int  # how many of them currently sit in the evictable list

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class KVCache:
    def __init__(self, spec: KVCacheSpec, device: str | torch.device = "cpu",
                 on_event: KVEventCallback | None = None, enable_prefix_caching: bool = True,
                 quota: KVQuota | None = None):
        self.spec = spec
        self.kv_pool = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
        self.enable_prefix_caching = enable_prefix_caching
        self.on_event = on_event
        self._ref = [0] * spec.num_blocks
        self._hash_of: list[int | None] = [None] * spec.num_blocks
        self._tokens_of: list[tuple[int, ...] | None] = [None] * spec.num_blocks  # what a cached block holds
        self.num_hash_mismatches = 0  # hash hits refused because the tokens differ
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._free: deque[int] = deque(range(spec.num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.quota = quota if quota is not None and quota.active else None
        self._owner: list[str | None] = [None] * spec.num_blocks  # the tenant a block is charged to
        self.charged: dict[str, int] = {}  # tenant -> blocks in use or cached
        self.num_guaranteed_evictions = 0  # every evictable block was within a guarantee: one was taken anyway
        self.on_evict: EvictCallback | None = None  # the tiers under the pool, when there are any

    # ---- sizes -------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.spec.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether the block holds a prefix-cache entry (a hash and its tokens)."""
        return self._hash_of[block_id] is not None

    # ---- prefix cache ------------------------------------------------
    def _block_tokens(self, token_ids: Sequence[int], i: int) -> tuple[int, ...]:
        bs = self.spec.block_size
        return tuple(token_ids[i * bs:(i + 1) * bs])

    def _check_covered(self, block_hashes: Sequence[int], token_ids: Sequence[int]) -> None:
        if len(token_ids) < len(block_hashes) * self.spec.block_size:
            raise ValueError(f"{len(block_hashes)} block hashes need {len(block_hashes) * self.spec.block_size} "
                             f"token ids, got {len(token_ids)}: pass the tokens the hashes were computed from")

    def match_prefix(self, block_hashes: Sequence[int], token_ids: Sequence[int]) -> PrefixMatch:
        """Leading blocks cached under ``block_hashes`` whose stored tokens
        equal ``token_ids`` block by block; stops at the first miss or the
        first block whose tokens differ (counted in ``num_hash_mismatches``)."""
        self._check_covered(block_hashes, token_ids)
        ids: list[int] = []
        if self.enable_prefix_caching:
            for i, h in enumerate(block_hashes):
                b = self._cached.get(h)
                if b is None:
                    break
                if self._tokens_of[b] != self._block_tokens(token_ids, i):
                    self.num_hash_mismatches += 1
                    break
                ids.append(b)
        return PrefixMatch(tuple(ids), sum(1 for b in ids if self._ref[b] == 0))

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Takes a reference on already-cached blocks (a prefix hit)."""
        for b in block_ids:
            if self._ref[b] == 0:
                if self._hash_of[b] is None:
                    raise ValueError(f"block {b} is free and holds nothing; allocate() it instead")
                del self._evictable[b]
            self._ref[b] += 1

    def commit(self, block_ids: Sequence[int], block_hashes: Sequence[int], token_ids: Sequence[int]) -> None:
        """Registers full, computed blocks under their hashes (``stored``),
        each with its tokens (``token_ids`` from the first block on).  A hash
        that is already cached in another block stays with that one."""
        if not self.enable_prefix_caching:
            return
        self._check_covered(block_hashes[:len(block_ids)], token_ids)
        stored = []
        for i, (b, h) in enumerate(zip(block_ids, block_hashes)):
            if self._hash_of[b] is not None or h in self._cached:
                continue
            self._hash_of[b] = h
            self._tokens_of[b] = self._block_tokens(token_ids, i)
            self._cached[h] = b
            stored.append(h)
        if stored and self.on_event:
            self.on_event("stored", stored)

    # ---- allocation --------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def allocate(self, n: int, tenant: str = DEFAULT_TENANT) -> list[int] | None:
        """``n`` fresh blocks (ref 1) charged to ``tenant``, or None (and no change) if not enough."""
        if n > self.num_free_blocks:
            return None
        out = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        evict = n - len(out)
        if evict and self.quota is not None:
            lru = [(b, self._owner[b]) for b in self._evictable]
            victims = pick_victims(lru, evict, self.charged, self.quota, tenant, requester_new=len(out))
            self.num_guaranteed_evictions += victims.num_guaranteed
            for b in victims.block_ids:
                del self._evictable[b]
            out += victims.block_ids
        else:
            out += [self._evictable.popitem(last=False)[0] for _ in range(evict)]
        evicted = [self._evict(b) for b in out[n - evict:]]
        for b in out:
            self._ref[b] = 1
            self._charge(b, tenant)
        if evicted and self.on_event:
            self.on_event("evicted", evicted)
        return out

    def _evict(self, b: int) -> int:
        """Block ``b`` leaves the prefix cache for reuse: the tiers (if any) keep a copy first."""
        if self.on_evict is not None:
            self.on_evict(b, self._hash_of[b], self._tokens_of[b])
        return self._forget(b)

    def _forget(self, b: int) -> int:
        """Takes block ``b``'s entry out of the prefix cache; returns its hash."""
        h = self._hash_of[b]
        del self._cached[h]
        self._hash_of[b] = None
        self._tokens_of[b] = None
        return h

    def _charge(self, b: int, tenant: str | None) -> None:
        old = self._owner[b]
        if old is not None:
            left = self.charged[old] - 1
            if left:
                self.charged[old] = left
            else:
                del self.charged[old]
        self._owner[b] = tenant
        if tenant is not None:
            self.charged[tenant] = self.charged.get(tenant, 0) + 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drops one reference on each block, last block first."""
        for b in reversed(block_ids):
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} freed more often than it was taken")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash_of[b] is not None:
                    self._evictable[b] = None
                else:
                    self._charge(b, None)
                    self._free.append(b)

    def reset_prefix_cache(self) -> int:
        """Forgets every unreferenced cached block; returns how many."""
        dropped = [self._hash_of[b] for b in self._evictable]
        for b in list(self._evictable):
            self._forget(b)
            self._charge(b, None)
            self._free.append(b)
        self._evictable.clear()
        if dropped and self.on_event:
            self.on_event("evicted", dropped)
        return len(dropped)

    # ---- checks ------------------------------------------------------
    def check_integrity(self) -> None:
        """Asserts the three block states partition the pool consistently."""
        n = self.num_total_blocks
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "duplicate block in the free list"
        assert not free & evictable, "block both free and evictable"
        for b in range(n):
            ref, h = self._ref[b], self._hash_of[b]
            assert ref >= 0, f"block {b} has ref {ref}"
            if ref > 0:
                assert b not in free and b not in evictable, f"in-use block {b} is listed free"
            elif h is None:
                assert b in free, f"block {b} (ref 0, uncached) is lost"
            else:
                assert b in evictable, f"block {b} (ref 0, cached) is not evictable"
            if h is not None:
                assert self._cached.get(h) == b, f"block {b} hash {h} not in the cache map"
                assert len(self._tokens_of[b] or ()) == self.spec.block_size, f"cached block {b} lacks its tokens"
            else:
                assert self._tokens_of[b] is None, f"uncached block {b} still holds tokens"
        assert len(self._cached) == sum(h is not None for h in self._hash_of)
        owners: dict[str, int] = {}
        for b in range(n):
            owner = self._owner[b]
            assert (owner is None) == (b in free), f"block {b}: charged to {owner!r} but free, or uncharged in use"
            if owner is not None:
                owners[owner] = owners.get(owner, 0) + 1
        assert owners == self.charged, f"tenant charges {self.charged} != the blocks' owners {owners}"
