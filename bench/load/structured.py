"""Structured-output overhead: engine output tokens/s with a JSON schema vs
without, at concurrency 16, in one run.

Same prompts, same token counts: a schema run (each request ends when its
JSON is complete, or at max_tokens), then a free run asking each request for
exactly as many tokens as its schema twin produced (ignore_eos), so both do
the same prefill and decode work and the ratio is the grammar's cost alone
(mask fill, bitmask apply, matcher advance).  The pair repeats ``--rounds``
times, alternating, and the ratio is of the summed times: on a shared
machine the load drifts between runs, and alternating spreads the drift
over both sides.

    python -m bench.load.structured [--requests 16] [--concurrency 16] [--rounds 3] [--threads N]

Ends with ``target json_schema_overhead: free tok/s / schema tok/s (goal <= 1.15)``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.fingerprint import print_fingerprint
from bench.targets import print_target
from pdcluster.services.engine.config import EngineConfig, SchedulerConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.guided_spec import GuidedSpec
from pdcluster.services.sampling_params import SamplingParams, greedy

GOAL = 1.15
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "maxLength": 32},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "country": {"enum": ["FR", "DE", "US", "JP"]}},
                "required": ["city", "country"]},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "email", "tags", "address", "active"]}
SUBJECTS = ["a chef", "a pilot", "a student", "a farmer", "a nurse", "a painter", "a coder", "a judge"]


def prompts(engine: Engine, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": f"Invent {SUBJECTS[i % len(SUBJECTS)]} "
                                                                   f"number {i} as a JSON profile."}])
            for i in range(n)]


def run(engine: Engine, work: list[tuple[list[int], SamplingParams]], concurrency: int, tag: str
        ) -> tuple[float, list[int], list[str]]:
    """Closed loop at ``concurrency``: seconds, tokens per request, texts."""
    pending = list(enumerate(work))
    tokens: dict[int, list[int]] = {i: [] for i in range(len(work))}
    in_flight = 0
    started = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            i, (prompt, params) = pending.pop(0)
            engine.add_request(f"{tag}-{i}", prompt, params)
            in_flight += 1
        for out in engine.step():
            tokens[int(out.request_id.rsplit("-", 1)[1])] += out.new_token_ids
            in_flight -= out.finished
    seconds = time.perf_counter() - started
    return seconds, [len(tokens[i]) for i in range(len(work))], [engine.tokenizer.decode(tokens[i])
                                                                  for i in range(len(work))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="schema/free pairs, alternating")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print("compares: engine output tok/s with a JSON schema (response_format json_schema) vs the same requests "
          f"free, equal token counts, concurrency {args.concurrency}, {args.requests} requests x {args.rounds} "
          "alternating rounds, greedy")
    print(f"reproduce: python -m bench.load.structured --requests {args.requests} --concurrency {args.concurrency} "
          f"--rounds {args.rounds} --max-tokens {args.max_tokens}" + (f" --threads {args.threads}" if args.threads else ""))
    print_fingerprint()
    engine = Engine(EngineConfig(num_kv_blocks=2048, scheduler=SchedulerConfig(max_num_seqs=args.concurrency)))
    spec = GuidedSpec("json_schema", json.dumps(SCHEMA))
    work = prompts(engine, args.requests)
    # Warm-up: first-step costs out of both runs, and every prompt prefilled once into the prefix
    # cache -- else round 0's schema run (always first) computes the prompts and its free run reuses them.
    engine.generate(work, greedy(1))
    compile_s = time.perf_counter()
    engine.grammars.compile(spec)                    # what admission does once per distinct schema
    compile_s = time.perf_counter() - compile_s

    guide = engine.runner.sampler.grammar
    schema_s = free_s = 0.0
    total = valid = 0
    for r in range(args.rounds):
        round_schema_s, counts, texts = run(engine, [(p, greedy(args.max_tokens, guided=spec)) for p in work],
                                            args.concurrency, f"schema{r}")
        valid += sum(_parses(t) for t in texts)
        round_free_s, free_counts, _ = run(engine, [(p, greedy(n, ignore_eos=True)) for p, n in zip(work, counts)],
                                           args.concurrency, f"free{r}")
        assert free_counts == counts, "the free run must produce the schema run's token counts"
        schema_s, free_s, total = schema_s + round_schema_s, free_s + round_free_s, total + sum(counts)
        print(f"round {r}: {sum(counts)} tokens each; schema {round_schema_s:.2f} s, free {round_free_s:.2f} s "
              f"(ratio {round_schema_s / round_free_s:.3f})")
    schema_tps, free_tps = total / schema_s, total / free_s
    ratio = free_tps / schema_tps
    per_token_us = 1e6 * guide.mask_seconds / max(guide.num_masked_rows, 1)
    print(f"schema compile: {compile_s * 1e3:.1f} ms (once per distinct schema, at admission; the first one also "
          "builds the tokenizer info, once per replica)")
    print(f"schema run: {total} tokens in {schema_s:.2f} s = {schema_tps:.1f} tok/s; "
          f"{valid}/{len(work) * args.rounds} outputs parse as JSON (the rest hit max_tokens {args.max_tokens})")
    print(f"free run:   {total} tokens in {free_s:.2f} s = {free_tps:.1f} tok/s")
    print(f"grammar mask fill + apply: {per_token_us:.1f} us per token ({guide.num_masked_rows} masked rows)")
    print(f"free tok/s / schema tok/s = {ratio:.3f}")
    engine.check_integrity()
    print_target("json_schema_overhead", ratio, "<=", GOAL, ".3f")
    return 0


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
