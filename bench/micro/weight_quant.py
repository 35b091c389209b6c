"""Weights in 8 bits (issue 35): int8 weights (codes in groups of 32 with fp16
scale and offset: the GGUF's own Q4_1/Q8_0 blocks; bf16 activations) against
bf16 in one run.

Speed (the engine, both models loaded side by side, sides alternated every
round, the median of the per-round ratios):
    batch-1 decode step   median step time of one request at ~256 tokens of context
    c16 output tok/s      16 requests (128-token prompts, 64 output tokens), closed loop, prefill included
    prefill tok/s         4 prompts x 512 tokens to their first tokens
    (c16 and prefill: both engines get the same requests and step in turn, each step timed, so a burst of
    the machine's other load lands on both sides alike)
Quality (no timing):
    perplexity            bench/workloads/perplexity_text.txt (our own text, ~3k tokens), 512-token windows
    greedy departures     16 chat prompts x 64 tokens, greedy with each model; at the first token where int8
                          departs from bf16, bf16's own top-2 gap (nats) there: a departure is a near tie
                          when that gap is small (the gap from bf16's final hidden state through the LM head
                          in fp32: its bf16 logits are 0.125 apart near 20; both are printed)
Kernels (--kernels): the 120 projections of SmolLM2-135M streamed from memory, per build that runs here
(AVX-512 BF16 and AMX where present, AVX2): bf16 packed linear vs int8 in groups of 32; then the LM head
(49152 x 576) alone at batch 1, bf16 vs int8.

    python -m bench.micro.weight_quant [--threads 2] [--rounds 5] [--kernels] [--quick]
    PDCLUSTER_CPU_KERNELS=avx2 python -m bench.micro.weight_quant     # the engine on the AVX2 build
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.fingerprint import print_fingerprint
from bench.targets import print_target
from pdcluster.services.engine.config import EngineConfig, SchedulerConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.engine.forward_batch import ForwardBatch
from pdcluster.services.sampling_params import greedy

TEXT = Path(__file__).resolve().parents[1] / "workloads" / "perplexity_text.txt"
WINDOW = 512
CHAT_PROMPTS = [
    "What is the capital of France?", "Give me three tips for sleeping better.", "Explain photosynthesis briefly.",
    "Write a haiku about the sea.", "What is a prime number?", "How do I boil an egg?",
    "Why is the sky blue?", "Name three planets in our solar system.", "What does a CPU do?",
    "Summarize the story of Cinderella in two sentences.", "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.", "What is the difference between weather and climate?",
    "Suggest a name for a black cat.", "What is 12 times 7?", "Describe a rainbow to a child.",
]


# ---- forwards outside the scheduler (quality) --------------------------------

def forward_logits(model, ids: list[int], all_positions: bool) -> torch.Tensor:
    """fp32 logits of ``ids`` prefilled in one pass over a scratch pool: every position's, or the last one's."""
    cfg, bs, n = model.cfg, 16, len(ids)
    blocks = (n + bs - 1) // bs
    pool = torch.zeros(blocks, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
    empty = torch.zeros(0, 1, dtype=torch.int32)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(n), slot_mapping=torch.arange(n),
        num_decode_tokens=0, decode_block_tables=empty, decode_context_lens=torch.zeros(0, dtype=torch.int32),
        prefill_block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        prefill_context_lens=torch.tensor([n], dtype=torch.int32),
        logits_indices=torch.arange(n) if all_positions else torch.tensor([n - 1]),
        prefill_fresh_kv=torch.ones(1, dtype=torch.int32))
    return model(batch, pool)


def perplexity(model, ids: list[int]) -> float:
    nll, count = 0.0, 0
    for s in range(0, len(ids) - 1, WINDOW):
        window = ids[s:s + WINDOW]
        if len(window) < 2:
            break
        logp = torch.log_softmax(forward_logits(model, window, True)[:-1], dim=-1)
        nll -= logp.gather(1, torch.tensor(window[1:])[:, None]).sum().item()
        count += len(window) - 1
    return float(torch.exp(torch.tensor(nll / count)))


def greedy_answers(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return [o.new_token_ids for o in engine.generate(prompts, greedy(max_tokens))]


def fp32_head_logits(model, ids: list[int], all_positions: bool = False) -> torch.Tensor:
    """The last position's logits (every position's: ``all_positions``) with the LM head's product in fp32
    (the bf16 model's own final hidden state): bf16 logits near 20 are 0.125 apart, too coarse to tell a
    0.3-nat gap from a 0.4 one."""
    from pdcluster.kernels import ops
    from pdcluster.services.engine.model import llama

    head, real = model.lm_head_weight, llama.ops.linear

    def linear(x, weight, bias=None, w_scales=None):
        if weight is head:
            return x.float() @ ops.unpack_linear_weight(weight).float().T
        return real(x, weight, bias, w_scales)

    llama.ops.linear = linear
    try:
        logits = forward_logits(model, ids, all_positions)
        return logits if all_positions else logits[0]
    finally:
        llama.ops.linear = real


def departures(bf16_model, prompts, ours, theirs) -> list[tuple[int, int, float, float]]:
    """(prompt index, position, bf16's top-2 gap there in nats: its bf16 logits, its fp32-head logits)
    at each answer's first departure."""
    found = []
    for i, (prompt, a, b) in enumerate(zip(prompts, theirs, ours)):
        at = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), None)
        if at is None and len(a) != len(b):
            at = min(len(a), len(b))  # one stopped (EOS) where the other went on
        if at is None:
            continue
        top2 = torch.topk(forward_logits(bf16_model, prompt + a[:at], False)[0], 2).values
        fine = torch.topk(fp32_head_logits(bf16_model, prompt + a[:at]), 2).values
        found.append((i, at, float(top2[0] - top2[1]), float(fine[0] - fine[1])))
    return found


# ---- engine speed ------------------------------------------------------------

def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def batch1_steps_ms(engines: dict[str, Engine], rng: random.Random, blocks: int, per_block: int = 4
                    ) -> dict[str, float]:
    """Median step time of one decoding request per engine, the engines taking turns every
    ``per_block`` steps (so both sample the machine's load alike)."""
    prompt = random_prompt(rng, 256)
    times: dict[str, list[float]] = {wd: [] for wd in engines}
    for e in engines.values():
        e.add_request("step-probe", prompt, greedy(blocks * per_block + 8, ignore_eos=True))
        e.step()
    for b in range(blocks):
        for wd in (list(engines) if b % 2 == 0 else list(engines)[::-1]):
            for _ in range(per_block):
                t = time.perf_counter()
                engines[wd].step()
                times[wd].append(time.perf_counter() - t)
    for e in engines.values():
        e.abort("step-probe")
        while e.has_unfinished():
            e.step()
    return {wd: 1e3 * statistics.median(ts) for wd, ts in times.items()}


def taking_turns(engines: dict[str, Engine], add: Callable[[Engine], None]) -> dict[str, tuple[int, float]]:
    """Each engine gets the same requests (``add``), then the engines step in turn (who goes first flips every
    step) until all are done: per engine, (output tokens, seconds of its own steps).  Turn by turn, both
    sides meet the machine's load alike (a shared machine's bursts otherwise land on one side's run)."""
    for e in engines.values():
        add(e)
    produced, seconds = {wd: 0 for wd in engines}, {wd: 0.0 for wd in engines}
    turn = 0
    while any(e.has_unfinished() for e in engines.values()):
        for wd in (list(engines) if turn % 2 == 0 else list(engines)[::-1]):
            if engines[wd].has_unfinished():
                t = time.perf_counter()
                outs = engines[wd].step()
                seconds[wd] += time.perf_counter() - t
                produced[wd] += sum(len(o.new_token_ids) for o in outs)
        turn += 1
    return {wd: (produced[wd], seconds[wd]) for wd in engines}


def c16_tok_s(engines: dict[str, Engine], seed: int, out_tokens: int) -> dict[str, float]:
    """16 requests (128-token prompts, ``out_tokens`` each), prefill included: output tokens per second."""
    prompts = [random_prompt(random.Random(seed * 100 + i), 128) for i in range(16)]

    def add(e: Engine) -> None:
        for i, prompt in enumerate(prompts):
            e.add_request(f"c16-{i}", prompt, greedy(out_tokens, ignore_eos=True))

    return {wd: n / s for wd, (n, s) in taking_turns(engines, add).items()}


def prefill_tok_s(engines: dict[str, Engine], seed: int) -> dict[str, float]:
    """4 prompts x 512 tokens to their first tokens: prompt tokens per second."""
    prompts = [random_prompt(random.Random(seed * 100 + 50 + i), 512) for i in range(4)]

    def add(e: Engine) -> None:
        for i, prompt in enumerate(prompts):
            e.add_request(f"prefill-{i}", prompt, greedy(1))

    return {wd: 4 * 512 / s for wd, (_, s) in taking_turns(engines, add).items()}


# ---- kernels -----------------------------------------------------------------

def _timed(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def kernel_table(threads: int, rows: tuple[int, ...]) -> None:
    """ms for the 120 projections of SmolLM2-135M (weights far larger than the caches), per build; then the
    LM head alone at batch 1."""
    from pdcluster.kernels import cpu_native
    from pdcluster.kernels import int8_linear as il

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
    gen = torch.Generator().manual_seed(0)
    plain = [torch.randn(n, k, generator=gen).bfloat16() for n, k in shapes]
    int8 = [il.pack_int8_weight(*il.quantize_groups(w)) for w in plain]
    # Q4_1's codes (0..15) as the default model's projections hold them: packed 4 bits a code
    nibbles = [il.pack_int8_weight(torch.randint(0, 16, w.shape, generator=gen, dtype=torch.int8),
                                   il.quantize_groups(w)[1]) for w in plain]
    head = torch.randn(49152, 576, generator=gen).bfloat16()
    head8 = il.pack_int8_weight(*il.quantize_groups(head))
    p = cpu_native._p
    print(f"\n# kernels: 120 SmolLM2-135M projections, {threads} threads, ms (median of 5); ratio vs bf16")
    print(f"{'build':>12} {'M':>5} | {'bf16':>8} | {'int8 g32, 8-bit codes':>21} | {'4-bit codes (Q4_1)':>18}")
    for variant in cpu_native.supported_variants():
        lib = ctypes.CDLL(str(cpu_native.build(which=variant)))
        for name, argtypes in cpu_native._SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes

        def packed_bf16(w: torch.Tensor) -> torch.Tensor:
            out = torch.empty(w.shape[0] // 32, w.shape[1] // 2, 32, 2, dtype=torch.bfloat16)
            lib.pd_pack_weight_bf16(p(w), p(out), *w.shape)
            return out

        bf16 = [packed_bf16(w) for w in plain]
        for m in rows:
            xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in (576, 1536)}
            ys = {n: torch.empty(m, n, dtype=torch.bfloat16) for n in (960, 576, 3072)}

            def run_bf16() -> None:
                for (n, k), w in zip(shapes, bf16):
                    lib.pd_linear_packed_bf16(p(xs[k]), p(w), None, p(ys[n]), m, n, k, threads)

            def run_int8(weights: list[torch.Tensor], bits: int):
                def run() -> None:
                    for (n, k), w in zip(shapes, weights):
                        lib.pd_linear_int8(p(xs[k]), p(w), None, p(ys[n]), None, m, n, k, bits, threads)
                return run

            b, q, h = _timed(run_bf16), _timed(run_int8(int8, 8)), _timed(run_int8(nibbles, 4))
            b, q, h = min(b, _timed(run_bf16)), min(q, _timed(run_int8(int8, 8))), min(h, _timed(run_int8(nibbles, 4)))
            print(f"{variant.name:>12} {m:>5} | {b:8.2f} | {q:12.2f} ({q / b:.2f}x) | {h:9.2f} ({h / b:.2f}x)",
                  flush=True)
        hb, x1, y1 = packed_bf16(head), torch.randn(1, 576, generator=gen).bfloat16(), torch.empty(1, 49152).bfloat16()

        def head_bf16() -> None:
            lib.pd_linear_packed_bf16(p(x1), p(hb), None, p(y1), 1, 49152, 576, threads)

        def head_int8() -> None:
            lib.pd_linear_int8(p(x1), p(head8), None, p(y1), None, 1, 49152, 576, 8, threads)

        b = min(_timed(head_bf16) for _ in range(2))
        q = min(_timed(head_int8) for _ in range(2))
        print(f"{variant.name:>12} LM head 49152x576, M=1: bf16 {b:.2f} ms, int8 {q:.2f} ms ({q / b:.2f}x)", flush=True)


# ---- main --------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="alternations of the speed probes")
    ap.add_argument("--kernels", action="store_true", help="also the per-build kernel table")
    ap.add_argument("--quick", action="store_true", help="fewer steps and tokens (smoke run)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print_fingerprint()
    from pdcluster.kernels import ops
    print(f"# int8 weights (projections and LM head as int8 codes in groups of 32 with fp16 scale and offset: the "
          f"GGUF's Q4_1/Q8_0 blocks exactly; activations bf16 on AVX-512 BF16, int16 per group of 32 on AVX2; "
          f"embedding rows and norms bf16) vs bf16, "
          f"{args.threads} threads, native build {ops.native_variant()}")
    forced = os.environ.get("PDCLUSTER_CPU_KERNELS")
    print("# reproduce: " + (f"PDCLUSTER_CPU_KERNELS={forced} " if forced else "") + "python -m bench.micro.weight_quant"
          + (f" --threads {args.threads}" if args.threads != 2 else "") + (" --kernels" if args.kernels else "")
          + (f" --rounds {args.rounds}" if args.rounds != 5 else "") + (" --quick" if args.quick else ""))
    engines = {}
    for wd in ("auto", "int8"):
        print(f"... loading the {wd} engine", file=sys.stderr, flush=True)
        engines[wd] = Engine(EngineConfig(weight_dtype=wd, num_threads=args.threads, kv_cache_bytes=256 * 2**20,
                                          scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024)))
    if args.kernels:
        kernel_table(args.threads, (1, 16, 256))

    blocks, out_tokens = (4, 16) if args.quick else (24, 64)
    ratios = {"step": [], "c16": [], "prefill": []}
    for r in range(args.rounds):
        print(f"... round {r + 1}/{args.rounds}: batch-1 steps, both engines taking turns", file=sys.stderr, flush=True)
        step = batch1_steps_ms(engines, random.Random(r), blocks)
        print(f"... round {r + 1}/{args.rounds}: c16 and prefill, the engines taking turns", file=sys.stderr,
              flush=True)
        c16, pre = c16_tok_s(engines, r, out_tokens), prefill_tok_s(engines, r)
        got = {wd: (step[wd], c16[wd], pre[wd]) for wd in engines}
        print(f"round {r + 1}: batch-1 step bf16 {got['auto'][0]:.2f} ms, int8 {got['int8'][0]:.2f} ms; "
              f"c16 bf16 {got['auto'][1]:.1f} tok/s, int8 {got['int8'][1]:.1f}; "
              f"prefill bf16 {got['auto'][2]:.0f} tok/s, int8 {got['int8'][2]:.0f}", flush=True)
        ratios["step"].append(got["int8"][0] / got["auto"][0])
        ratios["c16"].append(got["int8"][1] / got["auto"][1])
        ratios["prefill"].append(got["int8"][2] / got["auto"][2])
    for e in engines.values():
        e.check_integrity()

    print("... quality: perplexity", file=sys.stderr, flush=True)
    tok = engines["auto"].tokenizer
    text_ids = tok.encode(TEXT.read_text())
    ppl = {wd: perplexity(e.loaded.model, text_ids) for wd, e in engines.items()}
    print("... quality: greedy answers", file=sys.stderr, flush=True)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_PROMPTS]
    answers = {wd: greedy_answers(e, prompts, out_tokens) for wd, e in engines.items()}
    deps = departures(engines["auto"].loaded.model, prompts, answers["int8"], answers["auto"])
    same = sum(a == b for a, b in zip(answers["auto"], answers["int8"]))

    step, c16, pre = (statistics.median(ratios[k]) for k in ("step", "c16", "prefill"))
    print(f"\nbatch-1 decode step int8/bf16: {step:.3f} (rounds {', '.join(f'{x:.3f}' for x in ratios['step'])})")
    print(f"c16 output tok/s int8/bf16: {c16:.3f} (rounds {', '.join(f'{x:.3f}' for x in ratios['c16'])})")
    print(f"prefill tok/s int8/bf16: {pre:.3f} (rounds {', '.join(f'{x:.3f}' for x in ratios['prefill'])})")
    increase = 100 * (ppl["int8"] / ppl["auto"] - 1)
    print(f"perplexity on {TEXT.name} ({len(text_ids)} tokens, {WINDOW}-token windows): bf16 {ppl['auto']:.3f}, "
          f"int8 {ppl['int8']:.3f} ({increase:+.2f}%)")
    print(f"greedy, {len(prompts)} chat prompts x {out_tokens} tokens: {same} identical, {len(deps)} departed")
    for i, at, gap, fine in deps:
        print(f"  prompt {i:2d} ({CHAT_PROMPTS[i][:40]!r}): departs at token {at:2d}, bf16's top-2 gap there "
              f"{fine:.3f} nats (fp32 head; {gap:.3f} in its bf16 logits)")
    worst = max((fine for *_, fine in deps), default=0.0)
    print_target("batch1_decode_step_int8_vs_bf16", step, "<=", 0.6, ".3f")
    print_target("c16_output_tok_s_int8_vs_bf16", c16, ">=", 1.3, ".3f")
    print_target("prefill_tok_s_int8_vs_bf16", pre, ">=", 0.9, ".3f")
    print_target("perplexity_increase_pct", increase, "<=", 2.0)
    print_target("greedy_departure_max_top2_gap_nats", worst, "<", 0.3, ".3f")
    return 0


if __name__ == "__main__":
    sys.exit(main())
