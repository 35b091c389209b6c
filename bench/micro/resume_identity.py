"""Identity across a failover hop, measured on the engine alone (no cluster).

Two questions, in the model's dtype (bf16 by default):

1. Batch invariance: does a request decode the same tokens alone as batched
   with 7 others (staggered arrivals, so batch sizes vary step to step)?
2. Resume identity: a request resumed from prompt + its first t tokens (what
   the gateway sends after a decode replica died) on a fresh engine (no
   prefix cache to lend it the original's K/V): does it continue with the
   tokens of the uninterrupted run?  Counted over prompts x hop points, with
   the engine's output replay on (``EngineConfig.exact_resume``: recomputed
   output positions go through the decode kernels) and off (one prefill
   pass, the old way), and the time each takes to recompute a hop after
   200 tokens (the ratio: what the identity costs).

    python -m bench.micro.resume_identity [--dtype bfloat16] [--tokens 64] [--threads 2] [--cost-only]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.fingerprint import print_fingerprint
from bench.targets import print_target
from pdcluster.services.engine.config import EngineConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.engine.model.loader import load_model
from pdcluster.services.sampling_params import SamplingParams

PROMPTS = [
    "The history of the printing press begins",
    "Write a short story about a lighthouse keeper who",
    "Explain why the sky is blue to a ten year old:",
    "List three reasons to learn a second language. 1.",
    "The river delta shelters migrating birds every spring, and",
    "In the year 2050, cities will",
    "A recipe for bread made from ancient grains: first,",
    "The committee postponed its decision about the library budget because",
]
HOPS = (1, 17, 40)
REPLAY_TOKENS = 200  # the acceptance test's streams: 200 tokens each


def _engine(loaded, exact_resume: bool) -> Engine:
    # No prefix caching: a resumed request must recompute its own K/V, as on a replica that never saw it.
    return Engine(EngineConfig(num_kv_blocks=256, enable_prefix_caching=False, exact_resume=exact_resume),
                  loaded=loaded)


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams, priors=None,
        every_steps: int = 0) -> tuple[list[list[int]], float]:
    """Each prompt's output tokens (after its prior ones) and the seconds of
    the first step (the hop's recompute, when one prompt is resumed alone)."""
    out: list[list[int]] = [[] for _ in prompts]
    pending = list(range(len(prompts)))
    step, first_step_s = 0, 0.0
    while pending or engine.has_unfinished():
        while pending and step >= pending[0] * every_steps:
            i = pending.pop(0)
            engine.add_request(f"p{i}", prompts[i], params, prior_output_token_ids=priors[i] if priors else ())
        t0 = time.perf_counter()
        for o in engine.step():
            out[int(o.request_id[1:])] += o.new_token_ids
        first_step_s = first_step_s or time.perf_counter() - t0
        step += 1
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    return out, first_step_s


def hop_recompute_s(loaded, prompt: list[int], prior: list[int], exact: bool, repeats: int = 3) -> float:
    """Median seconds of a resumed request's first step (prompt + ``prior``
    recomputed, one token sampled), alone on a fresh engine."""
    params = SamplingParams(max_tokens=len(prior) + 1, temperature=0, ignore_eos=True)
    return sorted(run(_engine(loaded, exact), [prompt], params, priors=[prior])[1] for _ in range(repeats))[repeats // 2]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cost-only", action="store_true", help="only the hop recompute cost, no identity runs")
    args = ap.parse_args(argv)
    if args.tokens <= max(HOPS):
        ap.error(f"--tokens must be > {max(HOPS)} (the last hop point), got {args.tokens}")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    print_fingerprint()
    loaded = load_model(None, args.dtype)
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    ok = True
    modes = [("greedy", SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)),
             ("seeded", SamplingParams(max_tokens=args.tokens, temperature=0.8, seed=1234, ignore_eos=True))]
    for name, params in [] if args.cost_only else modes:
        alone = [run(_engine(loaded, True), [p], params)[0][0] for p in prompts]
        batched, _ = run(_engine(loaded, True), prompts, params, every_steps=3)
        varied = [i for i in range(len(prompts)) if batched[i] != alone[i]]
        print(f"{name} {args.dtype}: batched with 7 others vs alone: {len(varied)}/{len(prompts)} differ {varied}")
        ok &= print_target(f"resume_{name}_batch_invariant_{args.dtype}", len(varied), "==", 0, "d")
        for exact in (False, True):
            differ, recompute_s = [], []
            for i, p in enumerate(prompts):
                for hop in HOPS:
                    rest, step_s = run(_engine(loaded, exact), [p], params, priors=[alone[i][:hop]])
                    recompute_s.append(step_s)
                    at = first_difference(alone[i][:hop] + rest[0], alone[i])
                    if at is not None:
                        differ.append(f"p{i}@{hop}:tok{at}")
            n = len(prompts) * len(HOPS)
            print(f"{name} {args.dtype} exact_resume={exact}: {len(differ)}/{n} resumed runs differ {differ}; "
                  f"hop recompute step p50 {sorted(recompute_s)[n // 2] * 1e3:.0f} ms, "
                  f"max {max(recompute_s) * 1e3:.0f} ms")
            if exact:
                ok &= print_target(f"resume_{name}_identical_{args.dtype}", n - len(differ), "==", n, "d")
    prior = [(7919 * i) % (loaded.config.vocab_size - 1000) + 500 for i in range(REPLAY_TOKENS)]
    exact_s, one_pass_s = (hop_recompute_s(loaded, prompts[0], prior, exact) for exact in (True, False))
    print(f"hop recompute of {len(prompts[0])} prompt + {REPLAY_TOKENS} prior tokens: decode-shaped "
          f"{exact_s * 1e3:.0f} ms, one prefill pass {one_pass_s * 1e3:.0f} ms (median of 3 each)")
    ok &= print_target("resume_replay_cost_ratio", exact_s / one_pass_s, "<=", 1.5)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
