"""How much of a prompt the replicas of each place already hold, for
admission's prediction (placement.py counts a place's work less it).

A chat's next turn resends its whole history, which the replica that served
the last turn still caches: counted whole, a 2,000-token history predicted
0.8 s of prefill where the turn computes its new message in tens of
milliseconds, and three such turns at once were refused on an idle replica.

One prefix-index lookup per request (bounded by ``router.lookup_timeout_s``),
left for the cache-aware router that places the request next, which takes it
instead of asking again (pdcluster/prefix_store/recent_lookups.py).  The place
whose router follows the cache counts its best replica's match: the prefill
pool in a disaggregated cluster, the colocated pool in a colocated one (both
routed cache-aware).  A decode replica is chosen by free KV, not by prefix,
so a decode-side prefill counts what every live decode replica holds (the
least of their matches: in a 1 prefill + 1 decode cluster, the history the
decode replica got with the last turn's hand-off and then generated itself;
the engine there computes only the rest).  An index that cannot answer
predicts every prompt whole, as before.  The first token reports what was
really cached, and calibration uses that (admission.py)."""

from __future__ import annotations

import logging

from pdcluster.prefix_store.index import LookupResult, PrefixIndex
from pdcluster.prefix_store.recent_lookups import RECENT_LOOKUPS
from pdcluster.router.peer_fetch import role_of
from pdcluster.services.gateway.placement import DECODE, PREFILL

log = logging.getLogger(__name__)


def cache_routed_place(mode: str, prefill_policy: str) -> tuple[str, str] | None:
    """(worker-name role, admission place) whose match the router follows, or None (pure)."""
    if prefill_policy != "cache_aware":
        return None
    return ("colocated", DECODE) if mode == "colocated" else ("prefill", PREFILL)


def _matches(lookup: LookupResult, role: str) -> list[int]:
    return [n for name, n in lookup.matched_blocks.items() if role_of(name) == role]


def cached_by_place(lookup: LookupResult, block_size: int, routed: tuple[str, str] | None,
                    decode_live: int | None = None) -> dict[str, int]:
    """Per place, the leading prompt tokens it holds (pure; any tier: a block loads from host memory
    or disk in well under a millisecond, against recomputing it): the cache-routed place's
    best-matching live replica; in a disaggregated cluster the decode place's least match over its
    ``decode_live`` live replicas (none where some live decode replica holds none of it)."""
    if routed is None or lookup.degraded:
        return {}
    role, place = routed
    out = {place: max(_matches(lookup, role), default=0) * block_size}
    if place == PREFILL and decode_live:
        held = _matches(lookup, "decode")
        out[DECODE] = min(held) * block_size if len(held) >= decode_live else 0
    return {p: tokens for p, tokens in out.items() if tokens > 0}


async def cached_tokens(index: PrefixIndex | None, block_hashes: tuple[int, ...], block_size: int,
                        routed: tuple[str, str] | None, decode_live: int | None = None) -> dict[str, int]:
    """The index's answer for a prompt's full blocks ({} without an index, hashes or an answer)."""
    if index is None or routed is None or not block_hashes:
        return {}
    try:
        lookup = await index.lookup(block_hashes)
        RECENT_LOOKUPS.put(getattr(index, "shared_scope", None), block_hashes, lookup)  # the router's too
        return cached_by_place(lookup, block_size, routed, decode_live)
    except Exception as exc:  # noqa: BLE001 - a prediction input, never a reason to fail the request
        log.warning("prefix lookup for admission failed (%s); predicting the prompt whole", exc)
        return {}
