"""A stream's own draw (StreamDraw: seed, prompt logprobs) beside params built once: the
engine samples with the draw's seed exactly as with the same seed in the params, and a
stream whose draw drops the prompt's logprobs reports none and uses the prefix cache
(choice k > 0 of n).  Real engine, default model."""

from __future__ import annotations

import pytest
import torch

from pdcluster.services.engine.config import EngineConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.engine_errors import InvalidRequestError
from pdcluster.services.engine.request import Request
from pdcluster.services.engine.sampler import Sampler
from pdcluster.services.sampling_params import SamplingParams, StreamDraw


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(num_kv_blocks=64, num_threads=1, enable_prefix_caching=True))


def _run(engine: Engine, rid: str, prompt: list[int], params: SamplingParams, draw: StreamDraw | None = None):
    engine.add_request(rid, prompt, params, draw=draw)
    tokens, first = [], None
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            first = o if first is None else first
    return tokens, first


def test_a_draws_seed_samples_as_the_same_seed_in_the_params(engine):
    prompt = engine.tokenizer.encode("Once upon a time, in a land far away,")
    seeded, _ = _run(engine, "a", prompt, SamplingParams(max_tokens=12, temperature=1.3, seed=99))
    drawn, _ = _run(engine, "b", prompt, SamplingParams(max_tokens=12, temperature=1.3), StreamDraw(99, None))
    other, _ = _run(engine, "c", prompt, SamplingParams(max_tokens=12, temperature=1.3), StreamDraw(100, None))
    assert drawn == seeded and len(seeded) == 12
    assert other != seeded   # the seed is what decided it (12 tokens at T=1.3 agree by chance ~never)


def test_a_draw_without_prompt_logprobs_reports_none_and_uses_the_cache(engine):
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    _, choice0 = _run(engine, "p0", prompt, params)
    _, choice1 = _run(engine, "p1", prompt, params, StreamDraw(None, None))
    assert len(choice0.prompt_logprobs) == len(prompt) - 1
    assert choice1.prompt_logprobs is None
    assert choice1.num_cached_tokens > 0 and choice0.num_cached_tokens == 0  # prompt logprobs skip the cache


def test_the_sampler_takes_each_rows_seed_over_its_params():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=1)
    by_params = Sampler().sample_batch(logits, ["a", "b"], [p, SamplingParams(temperature=1.0, seed=2)])
    by_seeds = Sampler().sample_batch(logits, ["a", "b"], [p, p], seeds=[1, 2])
    assert by_seeds.token_ids == by_params.token_ids


def test_a_request_without_a_draw_takes_its_params_and_a_draw_is_validated():
    params = SamplingParams(seed=4, prompt_logprobs=1)
    assert Request("r", [1, 2], params).draw == StreamDraw(4, 1)
    with pytest.raises(InvalidRequestError, match="seed"):
        StreamDraw(2**64, None)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        StreamDraw(None, 99)
