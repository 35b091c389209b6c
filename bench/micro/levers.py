"""The engine's levers, each measured against itself switched off, in one run.

Speculative decoding by n-gram prompt lookup (pdcluster/services/engine/spec_decode.py):
output tok/s and TPOT p50 with and without drafts, at concurrency 1 and 16,
on a repetitive workload (chat requests to repeat a piece of code, greedy:
the output copies the prompt) and a non-repetitive one (open questions,
sampled at temperature 1 with fixed seeds: greedy answers of a 135M model
loop on themselves, which drafts would love), and the acceptance rate.
Beside it, at concurrency 1, drafts by a draft model (spec_draft.py): the
default model's first ``--draft-layers`` layers (an early-exit draft over the
same weights), with its acceptance, tokens per verification and its cost per
drafted token in plain TPOTs (``pdcluster plan --spec-cost``).
Seeded draws do not depend on drafting (spec_decode.py), so every mode
produces the same tokens.  Engine-level (in-process engine, no Ray), the
default model in bf16; the engines share the weights and take turns
request by request (concurrency 1) or batch by batch, so load from anything
else on the machine falls on both alike.

8-bit KV cache (bench/micro/levers_kv.py): max concurrent 2k-token sequences and
KV bytes per hand-off with bf16 vs int8 KV, and greedy output with int8 KV
against bf16 KV on 16 chat prompts.

    flock /tmp/pdcluster-ray.lock python -m bench.micro.levers [--quick] [--threads N] [--skip-kv-greedy]
        [--draft-layers N]

Each lever is a function returning its rows and ratios; ``main`` prints
them and the target lines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from bench.fingerprint import print_fingerprint
from bench.micro.levers_kv import kv_capacity_and_transfer, print_kv_targets
from bench.targets import print_target
from pdcluster.services.engine.config import EngineConfig, SpeculativeConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.engine.model.loader import LoadedModel, load_model
from pdcluster.services.sampling_params import SamplingParams, greedy

SNIPPETS = [
    "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n\n"
    "def is_square(w, h):\n    return w == h\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "import json\n\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n"
    "def save(path, data):\n    with open(path, 'w') as f:\n        json.dump(data, f)\n",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
    "def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)\n",
]
DRAFT_LAYERS = 12  # not tuned yet: no depth sweep has finished on this machine (docs/engine.md, Levers)
QUESTIONS = [
    "Why do some birds migrate south for the winter while others stay?",
    "Give me three ideas for a birthday party for a seven year old.",
    "What are the main differences between a violin and a cello?",
    "Explain how a rainbow forms, as if to a curious child.",
]


@dataclass
class Run:
    """One mode's requests on one workload: timings per request."""
    tokens: int = 0
    seconds: float = 0.0
    tpots_s: list[float] | None = None

    def add(self, tokens: int, seconds: float, tpots: list[float]) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.tpots_s = (self.tpots_s or []) + tpots

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def tpot_p50_ms(self) -> float:
        return 1e3 * statistics.median(self.tpots_s) if self.tpots_s else float("nan")


def run_batch(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float, list[float]]:
    """All prompts at once; (output tokens, seconds, TPOT of each request)."""
    first: dict[str, float] = {}
    count: dict[str, int] = {}
    tpots: list[float] = []
    base = engine.num_steps
    for i, p in enumerate(prompts):
        engine.add_request(f"lever-{base}-{i}", p, params)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            rid = out.request_id
            first.setdefault(rid, now)
            count[rid] = count.get(rid, 0) + len(out.new_token_ids)
            if out.finished and count[rid] > 1:
                tpots.append((now - first[rid]) / (count[rid] - 1))
    return sum(count.values()), time.perf_counter() - t0, tpots


def spec_workloads(loaded: LoadedModel, max_tokens: int) -> dict[str, tuple[list[list[int]], SamplingParams]]:
    tok = loaded.tokenizer

    def chat(text: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": text}])
    return {"repetitive": ([chat("Repeat this code exactly, then stop:\n" + s) for s in SNIPPETS],
                           greedy(max_tokens)),
            "nonrepetitive": ([chat(q) for q in QUESTIONS],
                              SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=2026))}


def spec_engines(loaded: LoadedModel, draft_layers: int) -> dict[str, Engine]:
    """Plain, n-gram and draft-model (the default model's first ``draft_layers``
    layers: an early-exit draft over the same weights) engines, sharing the weights."""
    draft = SpeculativeConfig(method="draft", draft_model="default", draft_num_layers=draft_layers)
    specs = {"none": SpeculativeConfig(), "ngram": SpeculativeConfig(method="ngram"), "draft": draft}
    return {m: Engine(EngineConfig(num_kv_blocks=2048, speculative=s), loaded=loaded) for m, s in specs.items()}


def measure_spec(loaded: LoadedModel, concurrencies: tuple[int, ...], max_tokens: int, rounds: int,
                 draft_layers: int) -> dict:
    """TPOT and tok/s with and without drafts; the engines take turns.  The
    draft model runs at concurrency 1 only: it drafts request by request."""
    engines = spec_engines(loaded, draft_layers)
    for e in engines.values():  # warm-up: first-call costs out of the timings
        run_batch(e, [loaded.tokenizer.encode("Hello, world. Hello, world.")], greedy(8))
    results: dict = {}
    for name, (prompts, params) in spec_workloads(loaded, max_tokens).items():
        for conc in concurrencies:
            modes = [m for m in engines if m != "draft" or conc == 1]
            runs = {m: Run() for m in modes}
            before = {m: engines[m].stats() for m in modes}
            drafted = {m: _draft_time(engines[m]) for m in modes}
            batches = ([[p] for p in prompts] if conc == 1
                       else [[prompts[i % len(prompts)] for i in range(conc)]])
            for _ in range(rounds):
                for batch in batches:
                    for m in modes:
                        runs[m].add(*run_batch(engines[m], batch, params))
            spec = {}
            for m in modes[1:]:
                after = engines[m].stats()
                proposed = after.spec_proposed_tokens - before[m].spec_proposed_tokens
                accepted = after.spec_accepted_tokens - before[m].spec_accepted_tokens
                steps = after.spec_verify_steps - before[m].spec_verify_steps
                emitted = after.spec_emitted_tokens - before[m].spec_emitted_tokens
                seconds, tokens = (x1 - x0 for x1, x0 in zip(_draft_time(engines[m]), drafted[m]))
                spec[m] = {"acceptance": accepted / proposed if proposed else float("nan"),
                           "tokens_per_step": emitted / steps if steps else float("nan"),
                           "draft_s_per_token": seconds / tokens if tokens else float("nan")}
            results[(name, conc)] = {"runs": runs, "spec": spec}
    for e in engines.values():
        e.check_integrity()
        assert e.kv.num_free_blocks == e.kv.num_total_blocks, "a KV block leaked"
        assert getattr(e.speculator.proposer if e.speculator else None, "num_sequences", 0) == 0, "a draft cache leaked"
    return results


def _draft_time(engine: Engine) -> tuple[float, int]:
    """(seconds spent drafting, tokens drafted) by a draft-model engine; (0, 0) otherwise."""
    proposer = engine.speculator.proposer if engine.speculator else None
    return (proposer.draft_seconds, proposer.num_drafted_tokens) if hasattr(proposer, "draft_seconds") else (0.0, 0)


def print_spec(results: dict, draft_layers: int) -> dict[str, float]:
    """The table, and the TPOT ratios (with / without drafts) by workload and
    concurrency: n-gram's as ``{workload}_c{conc}``, the draft model's as
    ``draft_{workload}_c{conc}``.  The draft's cost per drafted token in
    plain TPOTs is c for `pdcluster plan --spec-cost` (docs/engine.md, Levers)."""
    print(f"# draft: the default model's first {draft_layers} layers + final norm + LM head (early exit)")
    print(f"{'workload':<14} {'conc':>4} {'spec':<6} {'out tok/s':>10} {'TPOT p50 ms':>12} "
          f"{'accept':>7} {'tok/verify-step':>15}")
    ratios: dict[str, float] = {}
    for (name, conc), r in results.items():
        for m, run in r["runs"].items():
            sp = r["spec"].get(m)
            acc = f"{sp['acceptance']:.2f}" if sp else "-"
            tps = f"{sp['tokens_per_step']:.2f}" if sp else "-"
            print(f"{name:<14} {conc:>4} {m:<6} {run.tok_per_s:>10.1f} {run.tpot_p50_ms:>12.1f} {acc:>7} {tps:>15}")
        plain = r["runs"]["none"]
        for m in r["spec"]:
            spec = r["runs"][m]
            ratio = spec.tpot_p50_ms / plain.tpot_p50_ms
            ratios[f"{name}_c{conc}" if m == "ngram" else f"{m}_{name}_c{conc}"] = ratio
            label = "ratio" if m == "ngram" else f"ratio({m})"
            print(f"{name:<14} {conc:>4} {label}  tok/s x{spec.tok_per_s / plain.tok_per_s:.2f}, TPOT p50 x{ratio:.2f}")
        if "draft" in r["spec"]:
            cost = 1e3 * r["spec"]["draft"]["draft_s_per_token"] / plain.tpot_p50_ms
            print(f"{name:<14} {conc:>4} draft cost per drafted token: {cost:.2f} plain TPOTs (--spec-cost)")
    return ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="concurrency 1 only, one round")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--skip-kv-greedy", action="store_true", help="8-bit KV: sizes and transfer bytes only")
    ap.add_argument("--draft-layers", type=int, default=DRAFT_LAYERS,
                    help="draft model: the default model's first N layers")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print_fingerprint()
    cmd = "flock /tmp/pdcluster-ray.lock python -m bench.micro.levers" + (" --quick" if args.quick else "") + (
        f" --threads {args.threads}" if args.threads else "") + (
        f" --max-tokens {args.max_tokens}" if args.max_tokens != 96 else "") + (
        " --skip-kv-greedy" if args.skip_kv_greedy else "") + (
        f" --draft-layers {args.draft_layers}" if args.draft_layers != DRAFT_LAYERS else "")
    print(f"# reproduce: {cmd}", flush=True)
    loaded = load_model(None, "bfloat16")
    concurrencies = (1,) if args.quick else (1, 16)
    ratios = print_spec(measure_spec(loaded, concurrencies, args.max_tokens, 1, args.draft_layers), args.draft_layers)
    kv = kv_capacity_and_transfer("int8", greedy=not args.skip_kv_greedy)
    ok = print_kv_targets(kv)
    ok &= print_target("spec_ngram_tpot_c1_ratio_repetitive", ratios["repetitive_c1"], "<=", 0.7)
    ok &= print_target("spec_ngram_tpot_c1_ratio_nonrepetitive", ratios["nonrepetitive_c1"], "<=", 1.05)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
