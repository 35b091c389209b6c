"""The pools a bare `pdcluster up` starts: the layout that measured best for
mixed traffic on a machine of this size.

With more than two cores: the config's own default, 1 prefill + 1 decode
replica (disaggregated), one core each.  With two cores or fewer: one
colocated replica on all of them.  Splitting two cores into 1-core pools
halves the cores each phase can use, and a 1,500-token prompt on one core of
the AMD EPYC (avx512_bf16) class takes 1.4-2.6 s, over the 2 s TTFT SLO;
the colocated replica prefills it on both cores and keeps its streams' TPOT
by prefilling at most `scheduler.decode_step_prefill_tokens` per step
beside them, short prompts ahead of long ones
(`scheduler.long_prefill_tokens`).  `python -m bench.load.mixed_goodput`,
Dec 4, that class: the mix (i) 97-100% good colocated against 88%
disaggregated, the bursts (ii) 81% both, every short chat good in both
(bench/README.md).  `--mode` or a config naming a layout (mode, prefill, decode, colocated)
always wins; a config that names none keeps this layout."""

from __future__ import annotations

import os

COLOCATED_UP_TO_CORES = 2


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_layout(cores: int) -> dict:
    """Config fields for a machine with ``cores`` usable cores ({}: the config's
    default, 1 prefill + 1 decode replica)."""
    if cores <= COLOCATED_UP_TO_CORES:
        n = max(cores, 1)
        # the KV memory of the two 1-core replicas it replaces
        return {"mode": "colocated", "colocated": {"num_replicas": 1, "num_cpus": n, "num_threads": n,
                                                   "kv_cache_mib": 1024}}
    return {}


def default_mode() -> str:
    """The mode a bare `pdcluster up` starts on this machine."""
    return default_layout(usable_cores()).get("mode", "disaggregated")
