"""Autoscaling vs a static deployment sized for the peak, on one load ramp:
low, 3x low, low (60 s each by default), poisson arrivals of short chats.

    the probe   the autoscaled deployment's opening size (the rule's need at
                no load: 0 prefill + 1 decode) serves PROBE_RPS of these chats
                for PROBE_S; their mean TPOT over the rule's step model at the
                batch they ran (Little: rps x decode seconds) is the machine's
                decode slowdown now -- the figure the controller calibrates
                itself with.  The same machine measured 3.7 to 6.2 GB/s of copy
                bandwidth within one day, and decode is bandwidth-bound, so a
                fixed ramp is a different test on every run
    the ramp    the peak is the lowest rate (in 0.05 req/s) at which the
                autoscaler's rule, calibrated by the probe, needs one replica
                more than at a third of it: a peak the deployment must grow
                for, and no bigger, because on a 2-core machine every replica
                is a thread on the same two cores (a replica added beyond them
                adds no compute).  --low-rps overrides it (and skips the probe)

    autoscaled  starts as the rule sizes the opening phase (at low load: no prefill replica,
                the decode replica prefills; pdcluster/services/autoscale/policy.py); the
                controller (pdcluster/services/autoscale/controller.py) sizes both pools from
                the gateway's /metrics while the ramp runs
    static      sized for the peak, held for the whole ramp: the deployment the
                autoscaled run held at its largest (the rule on live, calibrated
                figures), or what the same rule (pdcluster/services/autoscale/policy.py)
                needs at the peak's nominal load if that has more replicas.  Whole
                deployments, not a per-pool maximum: with a prefill pool that may
                be at zero, 0 + 2 and 1 + 1 are two answers to one peak, and
                1 + 2 would be a deployment neither asked for

Replicas are 1 torch thread each on logical Ray CPUs, so replicas can be
added on a small machine.  Prints goodput (TTFT <= 2 s and TPOT <= 100 ms;
a failed or refused request is not good), replica-seconds (pool replicas
held, from the moment the controller asks for them, sampled every second),
every scale decision, the direction changes per phase, the cores other
processes used meanwhile (a shared machine's noise), the best ratio the
ramp allows (low replicas for two phases, peak replicas for one: (2 L + P) /
3 P, before any lag), and the targets.

    python -m bench.load.autoscale [--low-rps R] [--phase-s 60]
"""

from __future__ import annotations

import argparse
import math
import asyncio
import collections
import shlex
import os
import sys
import time
from dataclasses import dataclass

from bench.fingerprint import print_fingerprint
from bench.load.loadgen import run_workload
from bench.machine_load import OtherLoad
from bench.stats import percentile
from bench.targets import print_target
from bench.tokenizer import load_tokenizer
from bench.workload import Bucket, Poisson, RequestOptions, Stop, Uniform, Workload

TTFT_SLO_S, TPOT_SLO_S = 2.0, 0.100
PHASE_S = [60.0]  # the --phase-s of this run
PEAK_FACTOR = 3.0
INPUT = (24, 40)  # prompt tokens, uniform
OUTPUT = (24, 40)  # output tokens, uniform


@dataclass(frozen=True)
class Phase:
    name: str
    start_s: float
    duration_s: float
    rps: float


def phases(low_rps: float, phase_s: float) -> list[Phase]:
    return [Phase("low", 0.0, phase_s, low_rps), Phase("peak", phase_s, phase_s, low_rps * PEAK_FACTOR),
            Phase("low again", 2 * phase_s, phase_s, low_rps)]


def phase_workload(p: Phase, index: int, seed: int) -> Workload:
    return Workload(
        name=f"autoscale_{p.name.replace(' ', '_')}", seed=seed + index,  # fresh prompts: no prefix-cache hits
        buckets=[Bucket(name="chat", share=1.0, input_tokens=Uniform(dist="uniform", min=INPUT[0], max=INPUT[1]),
                        output_tokens=Uniform(dist="uniform", min=OUTPUT[0], max=OUTPUT[1]))],
        arrival=Poisson(kind="poisson", rate_rps=p.rps), stop=Stop(duration_s=p.duration_s),
        request=RequestOptions(ignore_eos=True, timeout_s=120))


def good(r) -> bool:
    return r.ok and r.ttft_s is not None and r.ttft_s <= TTFT_SLO_S and (r.tpot_s is None or r.tpot_s <= TPOT_SLO_S)


async def run_ramp(url: str, ramp: list[Phase], tokenizer, seed: int, replicas) -> tuple[list, list]:
    """Every phase's records (start_s on the ramp's clock) and (t, prefill, decode) samples every second."""
    samples: list[tuple[float, int, int]] = []
    t0 = time.monotonic()

    async def sample() -> None:
        while True:
            samples.append((time.monotonic() - t0, *replicas()))
            await asyncio.sleep(1.0)

    async def phase(i: int, p: Phase) -> list:
        await asyncio.sleep(max(0.0, t0 + p.start_s - time.monotonic()))
        result = await run_workload(url, phase_workload(p, i, seed), tokenizer, show_progress=False, label=p.name)
        return [(p.name, r) for r in result.records]

    sampler = asyncio.create_task(sample())
    try:
        per_phase = await asyncio.gather(*(phase(i, p) for i, p in enumerate(ramp)))
    finally:
        sampler.cancel()
    return [rec for records in per_phase for rec in records], samples


def replica_seconds(samples: list[tuple[float, int, int]]) -> float:
    return sum((b[0] - a[0]) * (a[1] + a[2]) for a, b in zip(samples, samples[1:]))


def direction_changes(moves: list[tuple[float, str, str]], ramp: list[Phase]) -> dict[tuple[str, str], int]:
    """Per (phase, pool): moves whose direction reverses the pool's previous move."""
    out = {(p.name, pool): 0 for p in ramp for pool in ("prefill", "decode")}
    last: dict[str, str] = {}
    for t, pool, direction in moves:
        phase = next((p.name for p in reversed(ramp) if t >= p.start_s), ramp[0].name)
        if pool in last and last[pool] != direction:
            out[(phase, pool)] += 1
        last[pool] = direction
    return out


def start_cluster(prefill: int, decode: int, autoscaling: bool):
    from bench.load.serve_modes import pool
    from pdcluster.prefix_store.redis_server import free_service_port
    from pdcluster.services.cli.cluster_runtime import LocalCluster
    from pdcluster.services.config import AutoscalingSettings, ClusterConfig

    config = ClusterConfig(mode="disaggregated", prefill=pool(num_replicas=prefill), decode=pool(num_replicas=decode),
                           port=free_service_port(), autoscaling=AutoscalingSettings(enabled=autoscaling))
    return LocalCluster(config, num_cpus=8, dashboard=False).start(progress=lambda m: None)


def warm_up(url: str, tokenizer) -> None:
    warm = phase_workload(Phase("warm", 0, 5.0, 0.5), 99, 0)
    asyncio.run(run_workload(url, warm, tokenizer, show_progress=False))


PROBE_RPS, PROBE_S = 0.4, 40.0


def rule_models(slowdown: float = 1.0):
    """The autoscaler's rules and speed models (the config's defaults), its
    decode steps x ``slowdown`` as a probe measured them."""
    from pdcluster.services.autoscale.controller import scaling_rules, speed_models
    from pdcluster.services.autoscale.policy import Calibrated
    from pdcluster.services.config import AutoscalingSettings, ClusterConfig

    settings = AutoscalingSettings()
    prefill, step = speed_models(settings)
    return scaling_rules(settings, ClusterConfig().scheduler.max_num_seqs), prefill, Calibrated(step, slowdown)


def rule_need(rps: float, slowdown: float = 1.0) -> tuple[int, int]:
    """What the autoscaler's rule needs at ``rps`` of this bench's chats in steady state (no queue)."""
    from pdcluster.services.autoscale.policy import Measurements, PoolMeasurement, decode_batch, steady_need

    rules, prefill, step = rule_models(slowdown)
    prompt, out = sum(INPUT) / 2, sum(OUTPUT) / 2
    sequences = rps * out * step.step_s(decode_batch(step, rules))  # Little at B*
    m = Measurements(0.0, rps, prompt, rps * out, PoolMeasurement(), PoolMeasurement(sequences=sequences),
                     output_tokens_mean=out)
    return steady_need(m, prefill, step, rules)


def static_size(ramp: list[Phase], slowdown: float = 1.0) -> tuple[int, int]:
    """What the autoscaler's rule needs at the peak's nominal load (steady state, no queue)."""
    return rule_need(max(p.rps for p in ramp), slowdown)


def default_low_rps(slowdown: float = 1.0, limit_rps: float = 20.0) -> float:
    """A third of the lowest peak (in 0.05 req/s) at which the rule needs more replicas than at a third of it."""
    peak = 0.05
    while peak < limit_rps and sum(rule_need(peak, slowdown)) <= sum(rule_need(peak / PEAK_FACTOR, slowdown)):
        peak = round(peak + 0.05, 2)
    return round(peak / PEAK_FACTOR, 3)


def probe_slowdown(url: str, tokenizer, seed: int) -> tuple[float, str]:
    """The decode slowdown the rule would calibrate (measured mean TPOT over
    step(batch)) from PROBE_S of PROBE_RPS on the cluster at ``url``, and how."""
    probe = phase_workload(Phase("probe", 0, PROBE_S, PROBE_RPS), 98, seed)
    records = asyncio.run(run_workload(url, probe, tokenizer, show_progress=False)).records
    ok = [r for r in records if r.tpot_s is not None]
    if len(ok) < 3:
        raise SystemExit(f"the probe got {len(ok)} answers with a TPOT out of {len(records)}: is the cluster up?")
    tpot = sum(r.tpot_s for r in ok) / len(ok)
    decode_s = sum(r.tpot_s * (r.output_tokens - 1) for r in ok) / len(ok)
    batch = max(1.0, PROBE_RPS * decode_s)  # Little: sequences decoding at once
    rules, _, step = rule_models()
    slowdown = tpot / step.step_s(batch)
    return slowdown, (f"{len(ok)} requests at {PROBE_RPS:g} req/s: mean TPOT {tpot * 1e3:.0f} ms at batch "
                      f"{batch:.2f}, the model's step {step.step_s(batch) * 1e3:.0f} ms: x{slowdown:.2f}")


def static_for_peak(nominal: tuple[int, int], samples: list[tuple[float, int, int]]) -> tuple[int, int]:
    """The largest deployment (most replicas in all) the autoscaled run held;
    ``nominal`` when it held none larger (ties go to what it held)."""
    held = max(((p, d) for _, p, d in samples), key=sum, default=nominal)
    return held if sum(held) >= sum(nominal) else nominal


def best_ratio(ramp: list[Phase], slowdown: float = 1.0) -> float:
    """Replica-seconds autoscaled / static if every phase ran at the rule's need with no lag."""
    held = sum(sum(rule_need(p.rps, slowdown)) * p.duration_s for p in ramp)
    return held / (sum(static_size(ramp, slowdown)) * sum(p.duration_s for p in ramp))


def run_mode(name: str, ramp: list[Phase] | None, tokenizer, seed: int, prefill: int, decode: int,
             autoscale: bool, low_rps: float | None = None) -> dict:
    """``ramp`` None: probe first, and ramp from ``low_rps`` or the probe's calibrated rule."""
    print(f"... {name}: starting {prefill} prefill + {decode} decode", file=sys.stderr, flush=True)
    cluster = start_cluster(prefill, decode, autoscale)
    scaler = None
    probed = None
    try:
        url = f"http://127.0.0.1:{cluster.config.port}"
        warm_up(url, tokenizer)
        if autoscale:  # before the probe: it sees that traffic as a long-running controller sees earlier traffic
            from pdcluster.services.autoscale.controller import Autoscaler
            scaler = Autoscaler(cluster).start()
            replicas = lambda: tuple(scaler.replicas().values())  # noqa: E731
        else:
            replicas = lambda: (prefill, decode)  # noqa: E731
        if ramp is None:
            if low_rps is None:
                print(f"... probing: {PROBE_S:g} s at {PROBE_RPS:g} req/s", file=sys.stderr, flush=True)
                probed = probe_slowdown(url, tokenizer, seed)
                low_rps = default_low_rps(probed[0])
            ramp = phases(low_rps, PHASE_S[0])
        t0 = time.monotonic()
        other = OtherLoad().start()
        records, samples = asyncio.run(run_ramp(url, ramp, tokenizer, seed, replicas))
        other_cores, load = other.cores(), os.getloadavg()[0]
    finally:
        if scaler is not None:
            scaler.stop()
        cluster.stop()
    moves = [(t - t0, d.pool, d.direction, d) for t, ds in (scaler.history if scaler else []) for d in ds
             if d.direction != "hold"]
    return {"name": name, "records": records, "samples": samples, "moves": moves, "other_cores": other_cores,
            "load": load, "ramp": ramp, "probe": probed}


def report(run: dict, ramp: list[Phase]) -> tuple[float, float]:
    recs = [r for _, r in run["records"]]
    n_good = sum(good(r) for r in recs)
    goodput = n_good / len(recs) if recs else float("nan")
    rs = replica_seconds(run["samples"])
    print(f"\n## {run['name']}: {len(recs)} requests, {sum(not r.ok for r in recs)} failed, goodput {goodput:.3f} "
          f"({n_good}/{len(recs)}), replica-seconds {rs:.0f}; other processes used {run['other_cores']:.2f} cores "
          f"meanwhile (load average {run['load']:.1f} at the end, {os.cpu_count()} cores)")
    for p in ramp:
        mine = [r for name, r in run["records"] if name == p.name]
        if mine:
            ok = [r for r in mine if r.ok and r.ttft_s is not None]
            tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
            print(f"   {p.name:<10} {p.rps:.2f} req/s: {len(mine):>3} requests, goodput "
                  f"{sum(good(r) for r in mine) / len(mine):.3f}, {len(mine) - len(ok)} failed; TTFT p90 "
                  f"{percentile([r.ttft_s for r in ok], 90):.2f} s, TPOT p90 {percentile(tpots, 90) * 1e3:.0f} ms")
    failed = collections.Counter(f"{r.error} {r.error_detail[:80]}".strip() for r in recs if not r.ok)
    for what, n in failed.most_common(3):
        print(f"   failed: {n} x {what}")
    for t, pool, direction, d in run["moves"]:
        print(f"   t={t:6.1f}s {pool:<8} {direction:<4} {d.current} -> {d.target}: {d.reason}")
    return goodput, rs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--low-rps", type=float, default=None,
                    help="the low phases' arrival rate; the peak is 3x (default: the rule's, see above)")
    ap.add_argument("--phase-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for flag, value in (("--low-rps", args.low_rps), ("--phase-s", args.phase_s)):
        if value is not None and not (math.isfinite(value) and value > 0):
            ap.error(f"{flag} must be a finite number > 0, got {value}")
    PHASE_S[0] = args.phase_s
    print(f"# autoscaling vs static for the peak: low, {PEAK_FACTOR:g}x, low, {args.phase_s:g} s each; prompts "
          f"{INPUT[0]}-{INPUT[1]}, outputs {OUTPUT[0]}-{OUTPUT[1]} tokens")
    print_fingerprint()
    tokenizer = load_tokenizer(None)
    opening = rule_need(0.0)  # the rule's need at no load: where the autoscaled deployment starts
    auto_run = run_mode("autoscaled", None, tokenizer, args.seed, *opening, True, low_rps=args.low_rps)
    ramp, slowdown = auto_run["ramp"], auto_run["probe"][0] if auto_run["probe"] else 1.0
    if auto_run["probe"]:
        print(f"# probe on {opening[0]} + {opening[1]}: {auto_run['probe'][1]}; the rule so calibrated first "
              f"needs more replicas at {ramp[1].rps:g} req/s than at a third of it")
    print(f"# ramp: {' -> '.join(f'{p.name} {p.rps:g} req/s' for p in ramp)}")
    print(f"# reproduce: {shlex.join(['python', '-m', 'bench.load.autoscale', '--phase-s', str(args.phase_s), '--seed', str(args.seed)])}"
          f"  (this ramp without the probe: --low-rps {ramp[0].rps:g})", flush=True)
    nominal = static_size(ramp, slowdown)
    static = static_for_peak(nominal, auto_run["samples"])
    print(f"# static: {static[0]} prefill + {static[1]} decode (the autoscaled run's largest deployment, or the "
          f"rule at the peak's nominal load, {nominal[0]} + {nominal[1]}, if larger)", flush=True)
    static_run = run_mode("static", ramp, tokenizer, args.seed, *static, False)
    auto_good, auto_rs = report(auto_run, ramp)
    static_good, static_rs = report(static_run, ramp)
    changes = direction_changes([(t, pool, direction) for t, pool, direction, _ in auto_run["moves"]], ramp)
    print("\n# scale direction changes per phase (autoscaled): "
          + ", ".join(f"{phase}/{pool} {n}" for (phase, pool), n in changes.items()))
    ratio = auto_rs / static_rs if static_rs else float("nan")
    print(f"# replica-seconds autoscaled / static: {auto_rs:.0f} / {static_rs:.0f} = {ratio:.2f} (the ramp allows "
          f"{best_ratio(ramp, slowdown):.2f} at best: the rule's need per phase, no lag); goodput static {static_good:.3f}\n")
    print_target("goodput_autoscaled", auto_good, ">=", 0.95)
    print_target("replica_seconds_autoscaled_vs_static", ratio, "<=", 0.7)
    print_target("direction_changes_per_phase_max", float(max(changes.values())), "<=", 1.0, fmt=".0f")
    return 0


if __name__ == "__main__":
    sys.exit(main())
