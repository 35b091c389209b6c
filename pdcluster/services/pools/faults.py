"""Fault injection for the tests of the serving layer's failure paths.

Off unless the cluster's config says ``fault_injection: true`` (or the
gateway's environment has ``PDCLUSTER_FAULTS=1``): then a
request's ``x-pdcluster-fault`` header (comma-separated kinds, some with
``:seconds``) travels with it to the replicas, which act on it at the
named point.  Per request, so a test hits exactly the replica serving its
request, whatever the pool sizes.

    short_lease            prefill: the hand-off's lease runs out 0.5 s after it is pinned
    reuse_leased_block     prefill: the hand-off's partial last block changes after its checksum was
                           taken (as a block released early and reused would): the pull must refuse it
    delay_pull:S           decode: wait S seconds before pulling the blocks
    wait_for_kv:S          decode: the hand-off's reservation waits S seconds, as in line for a full pool
    fail_pull              decode: the pull fails as if the connection broke
    die_before_pull        decode: the replica process exits before pulling
    reject_decode          decode: answer 429 as a full decode replica would
    stall_decode:S         decode: the engine loop stalls S seconds after the first decoded token
    kill_prefill_engine    prefill: the engine loop dies (as if a bug fired in a step)
    kill_decode_engine     decode: the engine loop dies after the first decoded token (mid-stream)
    drop_stream            any replica streaming it: the stream breaks after its first token, on every
                           attempt (a request that loses its replica again and again: failover's bound)
    drop_stream_once       the same on the first attempt only: one failover, and no replica to respawn
"""

from __future__ import annotations

import os

ENV = "PDCLUSTER_FAULTS"
HEADER = "x-pdcluster-fault"
KINDS = frozenset({"short_lease", "reuse_leased_block", "delay_pull", "wait_for_kv", "fail_pull", "die_before_pull",
                   "reject_decode", "stall_decode", "kill_prefill_engine", "kill_decode_engine", "drop_stream",
                   "drop_stream_once"})


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def parse(header_value: str | None, on: bool | None = None) -> tuple[str, ...]:
    """The faults a request asks for; () when injection is off or none is named.
    ``on``: the config's switch (None: the environment decides).  Unknown
    kinds are ignored (the header is a test hook, not an API)."""
    if not header_value or not (enabled() if on is None else on):
        return ()
    return tuple(f.strip() for f in header_value.split(",")[:8]
                 if f.strip().partition(":")[0] in KINDS)


def has(faults: tuple[str, ...], kind: str) -> bool:
    return any(f.partition(":")[0] == kind for f in faults)


def seconds(faults: tuple[str, ...], kind: str, default: float = 1.0) -> float:
    for f in faults:
        name, _, value = f.partition(":")
        if name == kind:
            try:
                return min(max(float(value), 0.0), 600.0) if value else default
            except ValueError:
                return default
    return default


def drop_stream(faults_: tuple[str, ...], num_deltas_sent: int, resumed: bool = False) -> None:
    """Raises as a broken stream would, once a delta went out (fault
    drop_stream; drop_stream_once unless the request is a resumed one)."""
    if num_deltas_sent and (has(faults_, "drop_stream") or (has(faults_, "drop_stream_once") and not resumed)):
        raise RuntimeError("the stream broke (injected fault drop_stream)")
