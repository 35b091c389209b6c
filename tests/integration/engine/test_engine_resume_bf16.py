"""Identity across a hop in bf16, the default dtype, on the real model: a
request resumed from prompt + its first t tokens on an engine that never saw
it (no prefix cache to lend it the original's K/V) continues with exactly
the tokens of the undisturbed run, greedy and seeded.

It holds by construction (runner.py, ``exact_resume``): the recomputed
output positions run as decode rows, and every kernel computes a row
independently of the rows beside it, so the originals (batched together)
and the resumed requests (batched together, at other hop points) see the
same numbers.  A preempted request recomputes the same way.  With one prefill pass instead (``exact_resume=False``), 13
of 24 such resumed runs differed (bench/micro/resume_identity.py)."""

from __future__ import annotations

import pytest

from pdcluster.services.engine.config import EngineConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.sampling_params import SamplingParams

N = 40
HOPS = (1, 13, 29)
PROMPTS = ["The history of the printing press begins", "Write a short story about a lighthouse keeper who",
           "Explain why the sky is blue to a ten year old:", "In the year 2050, cities will"]


def _generate(loaded, requests: dict[str, tuple[list[int], list[int]]], params: SamplingParams,
              num_kv_blocks: int = 128) -> tuple[dict[str, list[int]], int]:
    """Each request (prompt, prior output) batched on one fresh engine: its
    new tokens, and how many times the engine preempted a request."""
    engine = Engine(EngineConfig(num_kv_blocks=num_kv_blocks, enable_prefix_caching=False), loaded=loaded)
    for rid, (prompt, prior) in requests.items():
        engine.add_request(rid, prompt, params, prior_output_token_ids=prior)
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    return out, engine.scheduler.num_preemptions


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=N, temperature=0, ignore_eos=True),
                                    SamplingParams(max_tokens=N, temperature=0.8, seed=1234, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_a_resumed_request_continues_the_original_exactly_in_bf16(smol_bf16, params):
    prompts = {f"p{i}": smol_bf16.tokenizer.encode(p) for i, p in enumerate(PROMPTS)}
    original, _ = _generate(smol_bf16, {rid: (p, []) for rid, p in prompts.items()}, params)
    assert all(len(t) == N for t in original.values())
    resumed, _ = _generate(smol_bf16, {f"{rid}@{hop}": (p, original[rid][:hop]) for rid, p in prompts.items()
                                    for hop in HOPS}, params)
    differ = {key: tokens for key, tokens in resumed.items()
              if original[key.split("@")[0]][:int(key.split("@")[1])] + tokens != original[key.split("@")[0]]}
    assert differ == {}


def test_a_preempted_request_continues_exactly_in_bf16(smol_bf16):
    """Preemption frees a request's blocks and recomputes prompt + output
    later: the same replay, so the same tokens as with room to spare."""
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    requests = {f"p{i}": (smol_bf16.tokenizer.encode(p), []) for i, p in enumerate(PROMPTS)}
    roomy, _ = _generate(smol_bf16, requests, params)
    tight, preemptions = _generate(smol_bf16, requests, params, num_kv_blocks=9)  # 4 x up to 4 blocks of 16
    assert preemptions > 0
    assert tight == roomy
