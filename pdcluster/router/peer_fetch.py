"""peer_fetch: whether a replica pulls a prompt's cached prefix from a peer.

The whole rule (pure; pdcluster/services/pools/peer_fetch.py does the I/O):

    extra(h)    = matched_blocks(h) - local_blocks        blocks holder h can lend past this replica's
                                                          (its pool's and its tiers')
    pull_s(h)   = pull_overhead_s + extra(h) * pull_s_per_block
    compute_s(h)= extra(h) * block_size * recompute_s_per_token

    holder      = argmax over live h, not self, not avoided, of (extra(h), -lower_tier_blocks(h), name)
    pull        <=>  extra(holder) >= min_blocks  and  pull_s(holder) < compute_s(holder)

* ``local_blocks`` counts what this replica already holds in every tier
  (device pool, host, disk): those are loaded, never pulled.
* Only a prompt's *leading* blocks count (the index's match length), and
  never its last token's block: at least one token is computed, since its
  logits give the first output token.
* ``pull_overhead_s`` is one lease call to the holder plus the transfer's
  setup and the landing; a short prefix is cheaper to recompute than to ask
  for.  The puller measures it from its own recent fetches
  (pdcluster/services/pools/fetch_overhead.py; DEFAULT_PULL_OVERHEAD_S until
  it has): on a fast CPU with busy holders it costs more than recomputing.
* A failover's resume avoids the replicas its stream lost: the index may
  still list a dead one for a few seconds, and asking it costs the lend
  call's whole timeout.
* A holder lends the leading run of its pool (engine/peer_import.py
  ``lend_blocks``) after loading back what it holds only in its host or disk
  tier (services/pools/peer_fetch.py ``stage_then_lease``): in a chat whose
  turns move between replicas, the last replica's copy of the history has
  usually gone from its pool to its tiers by the next turn.  Those loads cost
  the holder a memory copy or a disk read a block, so of two holders with as
  many blocks the one with fewer in a lower tier ranks first.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.prefix_store.index_base import LookupResult

DEFAULT_PULL_OVERHEAD_S = 0.02           # one Serve call to the holder + the transfer's handshake
DEFAULT_PULL_S_PER_BLOCK = 0.001         # 360 KiB of bf16 KV per 16-token block at ~0.4 GB/s
DEFAULT_RECOMPUTE_S_PER_TOKEN = 0.0003   # this CPU's prefill, before any measurement
MIN_PULL_BLOCKS = 1


@dataclass(frozen=True)
class PeerFetchPlan:
    """Pull blocks ``start`` .. ``start + num_blocks`` of the prompt from ``holder``."""
    holder: str
    start: int
    num_blocks: int
    pull_s: float
    recompute_s: float


def should_pull(num_blocks: int, block_size: int, pull_s_per_block: float, recompute_s_per_token: float,
                pull_overhead_s: float = DEFAULT_PULL_OVERHEAD_S, min_blocks: int = MIN_PULL_BLOCKS) -> bool:
    """Whether pulling ``num_blocks`` is predicted cheaper than computing them."""
    if num_blocks < max(min_blocks, 1):
        return False
    return pull_s(num_blocks, pull_s_per_block, pull_overhead_s) < num_blocks * block_size * recompute_s_per_token


def pull_s(num_blocks: int, pull_s_per_block: float, pull_overhead_s: float = DEFAULT_PULL_OVERHEAD_S) -> float:
    return pull_overhead_s + num_blocks * pull_s_per_block


def plan_peer_fetch(lookup: LookupResult, self_name: str, local_blocks: int, num_prompt_tokens: int,
                    block_size: int, pull_s_per_block: float = DEFAULT_PULL_S_PER_BLOCK,
                    recompute_s_per_token: float = DEFAULT_RECOMPUTE_S_PER_TOKEN,
                    pull_overhead_s: float = DEFAULT_PULL_OVERHEAD_S,
                    min_blocks: int = MIN_PULL_BLOCKS, avoid: tuple[str, ...] = ()) -> PeerFetchPlan | None:
    """The holder to pull from and which blocks, or None (compute them here).
    ``avoid``: replicas never asked (a failover's lost ones: the index may not know yet)."""
    if lookup.degraded:
        return None
    usable = max(num_prompt_tokens - 1, 0) // block_size  # the last token is always computed

    def extra(name: str) -> int:
        return min(lookup.matched_blocks.get(name, 0), usable) - local_blocks

    def rank(name: str) -> tuple[int, int, str]:
        lower = sum(lookup.tier_blocks.get(name, {}).values())
        return extra(name), -lower, name

    holders = [n for n in lookup.matched_blocks if n != self_name and n not in avoid and extra(n) > 0]
    if not holders:
        return None
    holder = max(holders, key=rank)
    n = extra(holder)
    if not should_pull(n, block_size, pull_s_per_block, recompute_s_per_token, pull_overhead_s, min_blocks):
        return None
    return PeerFetchPlan(holder, local_blocks, n, pull_s(n, pull_s_per_block, pull_overhead_s),
                         n * block_size * recompute_s_per_token)


def role_of(worker_name: str) -> str | None:
    """The pool (Serve deployment) a worker name belongs to: ``<role>-<replica id>``."""
    role, sep, _ = worker_name.partition("-")
    return role if sep and role in ("prefill", "decode", "colocated") else None
