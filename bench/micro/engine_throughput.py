"""Engine throughput vs Hugging Face transformers on the same prompts, in one run.

Compares output tokens/s of our engine (continuous batching, paged KV) with
transformers' ``generate`` (static batches of the same prompts, greedy) at
concurrency 1, 16 and 64; and our batch-1 decode step time with the roofline
(bf16 weight bytes / memory read bandwidth measured in this run).

    python -m bench.micro.engine_throughput [--threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from bench.fingerprint import print_fingerprint
from pdcluster.services.engine.config import EngineConfig, SchedulerConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.default_model import default_model_path
from pdcluster.services.engine.model.loader import load_model
from pdcluster.services.sampling_params import greedy

PROMPT_TOKENS = 256


def make_workload(n: int, vocab_lo: int, vocab_hi: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(vocab_lo, vocab_hi) for _ in range(PROMPT_TOKENS)], rng.randint(16, 256))
            for _ in range(n)]


def run_ours(engine: Engine, work: list[tuple[list[int], int]], concurrency: int) -> tuple[float, int]:
    """Closed loop: keeps ``concurrency`` requests in flight until all are done."""
    pending = list(enumerate(work))
    in_flight, produced = 0, 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            i, (prompt, n_out) = pending.pop(0)
            engine.add_request(f"c{concurrency}-{i}", prompt, greedy(n_out, ignore_eos=True))
            in_flight += 1
        for out in engine.step():
            produced += len(out.new_token_ids)
            in_flight -= out.finished
    return time.perf_counter() - t0, produced


def run_hf(hf, work: list[tuple[list[int], int]], concurrency: int) -> tuple[float, int]:
    """Static batches of ``concurrency`` prompts; each batch runs to its longest
    output; only the requested tokens count."""
    t0, produced = time.perf_counter(), 0
    for s in range(0, len(work), concurrency):
        chunk = work[s:s + concurrency]
        ids = torch.tensor([p for p, _ in chunk])
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=max(n for _, n in chunk), min_new_tokens=max(n for _, n in chunk),
                        pad_token_id=0)
        produced += sum(n for _, n in chunk)
    return time.perf_counter() - t0, produced


def batch1_step_ms(engine: Engine, prompt: list[int], steps: int = 48) -> float:
    engine.add_request("step-probe", prompt, greedy(steps + 8, ignore_eos=True))
    engine.step()  # prefill
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort("step-probe")
    times.sort()
    return 1e3 * times[len(times) // 2]


def read_bandwidth_gbs(nbytes: int = 1024 * 2**20) -> float:
    """Streaming read bandwidth: a vectorised fp32 sum over 1 GiB (far beyond
    the caches), best of 5, with the engine's thread count."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print_fingerprint()
    torch.set_num_threads(args.threads)
    print(f"# engine vs transformers, bf16, {args.threads} threads, prompts {PROMPT_TOKENS} tokens, "
          "outputs 16-256 tokens")
    print(f"# reproduce: python -m bench.micro.engine_throughput --threads {args.threads}" + (" --quick" if args.quick else ""))
    loaded = load_model(None, "bfloat16")
    engine = Engine(EngineConfig(kv_cache_bytes=1536 * 2**20, num_threads=args.threads,
                                 scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)), loaded=loaded)
    from transformers import AutoModelForCausalLM, GgufConfig

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16,
                                              quantization_config=GgufConfig(gguf_file=path.name, dequantize=True)).eval()
    rows = []
    for conc in (1, 16, 64):
        n = (2 if args.quick else 4) if conc == 1 else conc * (1 if args.quick else 2)
        work = make_workload(n, 100, 40000, args.seed + conc)
        print(f"... concurrency {conc}: {n} requests, ours", file=sys.stderr, flush=True)
        ours_s, ours_tok = run_ours(engine, work, conc)
        print(f"... concurrency {conc}: transformers", file=sys.stderr, flush=True)
        hf_s, hf_tok = run_hf(hf, work, conc)
        rows.append((conc, ours_tok / ours_s, hf_tok / hf_s))
    engine.check_integrity()
    step_ms = batch1_step_ms(engine, make_workload(1, 100, 40000, 99)[0][0])
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    bw = read_bandwidth_gbs()
    roofline_ms = weight_bytes / (bw * 1e9) * 1e3

    print(f"\n{'concurrency':>11} | {'ours tok/s':>10} | {'transformers tok/s':>18} | {'ratio':>6}")
    for conc, ours, theirs in rows:
        print(f"{conc:>11} | {ours:>10.1f} | {theirs:>18.1f} | {ours / theirs:>5.2f}x")
    print(f"\nbatch-1 decode step: {step_ms:.1f} ms; roofline {roofline_ms:.1f} ms "
          f"= {weight_bytes / 1e6:.0f} MB weights / {bw:.1f} GB/s read bandwidth (measured); ratio {step_ms / roofline_ms:.2f}")
    c16 = next(r for r in rows if r[0] == 16)
    ratio16, step_ratio = c16[1] / c16[2], step_ms / roofline_ms
    print(f"target engine_vs_transformers_c16: {ratio16:.2f} (goal >= 2.0) {'met' if ratio16 >= 2.0 else 'missed'}")
    print(f"target batch1_step_vs_roofline: {step_ratio:.2f} (goal <= 2.0) {'met' if step_ratio <= 2.0 else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
