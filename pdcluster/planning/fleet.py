"""Instances from facts measured on one running instance: the max-of-three
rule, each requirement rounded up, then the redundancy factor.

    by throughput = ceil(output tok/s demand / instance tok/s)                  --instance-tok-s
    by active     = ceil(active requests (rps x dwell) / active per instance)   --active-per-instance
    by KV         = ceil(concurrency / KV-safe concurrency per instance)        --kv-safe-per-instance
                    (else the memory section's safe concurrency)
                    concurrency = --concurrency, else the active requests
    instances     = ceil(max(the requirements) x redundancy)

Each requirement comes from its own measurement, so unlike the
workload-driven pools (where Little's law makes concurrency equal
throughput) any of the three can bind.  A requirement whose input was not
given is left out, not guessed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdcluster.planning.figures import Figure, g, need
from pdcluster.planning.inputs import Deployment, PerInstance


@dataclass(frozen=True)
class FleetSize:
    needs: dict[str, int]  # "throughput" / "active" / "KV" -> instances, those given
    final: int

    @property
    def binding(self) -> str:
        return max(self.needs, key=self.needs.get)


def fleet_needs(per: PerInstance, output_tok_s: Figure, active: Figure, concurrency: int | None,
                safe_concurrency: Figure) -> list[Figure]:
    needs = []
    if per.tok_s is not None:
        needs.append(need("fleet_by_throughput", "instances by throughput", output_tok_s.value / per.tok_s,
                          f"{g(output_tok_s.value)} tok/s / {g(per.tok_s)} tok/s per instance",
                          "demand tok/s / instance tok/s"))
    if per.active is not None:
        needs.append(need("fleet_by_active", "instances by active requests", active.value / per.active,
                          f"{g(active.value)} active / {g(per.active)} per instance",
                          "rps x dwell / active per instance"))
    n, n_source = (concurrency, "--concurrency") if concurrency is not None else (active.value, "active requests")
    kv_safe, kv_source = ((per.kv_safe, "--kv-safe-per-instance") if per.kv_safe is not None
                          else (safe_concurrency.value, "safe concurrency"))
    needs.append(need("fleet_by_kv", "instances by KV-safe concurrency", n / kv_safe,
                      f"{g(n)} ({n_source}) / {g(kv_safe)} ({kv_source})",
                      "concurrency / KV-safe per instance"))
    return needs


_CONSTRAINT = {"fleet_by_throughput": "throughput", "fleet_by_active": "active", "fleet_by_kv": "KV"}


def fleet_instances(needs: list[Figure], d: Deployment) -> tuple[FleetSize, Figure]:
    largest = max(f.value for f in needs)
    final = math.ceil(largest * d.redundancy - 1e-9)
    fig = Figure("fleet_instances", "instances (max of the above x redundancy)", final, "instances",
                 f"ceil(max({', '.join(g(f.value) for f in needs)}) x redundancy {g(d.redundancy)})",
                 "ceil(max(by throughput, by active, by KV) x redundancy)")
    return FleetSize({_CONSTRAINT[f.key]: int(f.value) for f in needs}, final), fig
