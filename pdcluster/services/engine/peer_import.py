"""Prefix blocks pulled from a peer replica: the engine-side bookkeeping.

A replica about to prefill a prompt whose leading blocks another live
replica holds may pull them instead of computing them (pdcluster/services/pools/
peer_fetch.py drives it; pdcluster/router/peer_fetch.py decides).  Here, on the engine
thread, the pulled blocks' life::

    reserve(key, n)      n fresh pool blocks (ref 1, uncached), held under ``key``
        |                the transfer thread writes into them (nobody else can see them)
        +-- land(key, hashes, tokens, start) --> each block verified (its hash
        |       recomputed from its parent's and the token ids it covers), then
        |       committed to the prefix cache; the first that fails stops the prefix
        |       there and it and the rest go back uncached.  The references are then
        |       dropped: the blocks sit in the prefix cache, evictable, most recently
        |       released, where the request's admission finds them.
        +-- drop(key)        the pull failed: the blocks go back, uncached
        +-- take(key)        the pull is in doubt (bytes may still land): the
                             caller quarantines the blocks until it settles

    prompt blocks  [ local hit (device/tiers) | pulled: start .. start+n | computed ]

A pulled block enters the prefix cache only after its pull completed, its
checksums matched the holder's (transfer layer) and its hash verified here;
until then it is held by ``key`` and nobody reads it.  Only the engine
thread calls this class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdcluster.prefix_store.hashing import hash_prompt_blocks
from pdcluster.services.engine.kv_cache import KVCache
from pdcluster.services.engine.lease import LeaseTable


@dataclass(frozen=True)
class LandedImport:
    """What ``land`` did: ``num_committed`` leading blocks entered the prefix
    cache; ``failure`` says why the one after them did not (None: all did)."""
    num_committed: int
    num_blocks: int
    failure: str | None = None


class PeerImports:
    def __init__(self, kv: KVCache, hash_seed: int):
        self.kv, self.seed = kv, hash_seed
        self._held: dict[str, list[int]] = {}  # key -> fresh blocks being filled, prompt order
        self.num_committed_blocks = 0
        self.num_refused_blocks = 0  # landed but failed verification

    def reserve(self, key: str, num_blocks: int, tenant: str, keep_free: int = 0) -> list[int] | None:
        """``num_blocks`` fresh blocks held under ``key``; None when the pool
        cannot spare them and still keep ``keep_free`` blocks free."""
        if key in self._held:
            raise KeyError(f"peer import {key!r} already holds blocks")
        if num_blocks < 1 or num_blocks + keep_free > self.kv.num_free_blocks:
            return None
        blocks = self.kv.allocate(num_blocks, tenant)
        if blocks is None:
            return None
        self._held[key] = blocks
        return list(blocks)

    def land(self, key: str, block_hashes: Sequence[int], token_ids: Sequence[int], start: int) -> LandedImport:
        """The pull into ``key``'s blocks (blocks ``start``... of the prompt)
        completed: verifies and commits them, then lets go of them."""
        blocks = self._held.pop(key)
        bs, n = self.kv.spec.block_size, len(blocks)
        hashes = list(block_hashes[start:start + n])
        tokens = list(token_ids[start * bs:(start + n) * bs])
        ok, failure = _verified_prefix(self.seed, hashes, tokens, bs, block_hashes[start - 1] if start else None)
        if len(hashes) < n or len(tokens) < n * bs:
            ok, failure = min(ok, len(hashes), len(tokens) // bs), failure or "fewer hashes or tokens than blocks"
        self.kv.commit(blocks[:ok], hashes[:ok], tokens)
        self.num_committed_blocks += ok
        self.num_refused_blocks += n - ok
        self.kv.free(blocks)  # committed ones stay cached (evictable); the rest go back to the free list
        return LandedImport(ok, n, failure)

    def drop(self, key: str) -> int:
        """The pull failed: the blocks go back uncached.  Returns how many."""
        blocks = self._held.pop(key, [])
        if blocks:
            self.kv.free(blocks)
        return len(blocks)

    def take(self, key: str) -> list[int]:
        """Hands ``key``'s blocks (still referenced) to the caller, who now owns them."""
        return self._held.pop(key, [])

    def __contains__(self, key: str) -> bool:
        return key in self._held

    def held_block_ids(self) -> list[int]:
        return [b for blocks in self._held.values() for b in blocks]


def lend_blocks(kv: KVCache, leases: LeaseTable, lease_id: str, block_hashes: Sequence[int],
                token_ids: Sequence[int], start: int) -> tuple[tuple[int, ...], float] | None:
    """The holder's side: pins the cached blocks ``start``... of the prompt's
    leading match in ``kv`` (hash and tokens equal) under a lease, as a prefill
    hand-off's are: one reference each, dropped when the lease is released or
    expires.  (block ids, lease deadline unix), or None when the pool holds no
    block past ``start``."""
    lent = kv.match_prefix(block_hashes, token_ids).block_ids[start:]
    if not lent:
        return None
    kv.acquire(lent)
    try:
        lease = leases.pin(lease_id, list(lent))
    except Exception:
        kv.free(lent)
        raise
    return lent, lease.deadline_unix


def _verified_prefix(seed: int, hashes: list[int], tokens: list[int], block_size: int,
                     parent: int | None) -> tuple[int, str | None]:
    """How many leading blocks' hashes equal the chain recomputed from
    ``parent`` over ``tokens``; and why the next one failed (None: none did)."""
    recomputed = hash_prompt_blocks(seed, tokens, block_size, parent=parent)
    for i, (want, got) in enumerate(zip(hashes, recomputed)):
        if want != got:
            return i, f"block {i} is not the hash of the tokens it should cover"
    return min(len(hashes), len(recomputed)), None
