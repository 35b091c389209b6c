"""The closed-loop prediction bench/plan/accuracy.py checks: exact at one
client, bounded by the prefill replica at saturation, and the context,
gap and long-prompt terms as their formulas say."""

from __future__ import annotations

import pytest

from bench.plan.perf_model import PrefillModel, StepModel
from bench.plan.inputs import MODEL_PRESETS
from bench.plan.predict import (
    Gaps, PrefillBeyond, attention_flops_per_token, predict_closed_loop, prefill_at, prefill_beyond, step_at_context,
)

SHAPE = MODEL_PRESETS["smollm2-135m"]
STEP = StepModel(base_s=0.04, per_seq_s=0.01)
PREFILL = PrefillModel(overhead_s=0.1, per_token_s=0.01)


def predict(concurrency: int, prompt: int = 50, output: int = 21, gaps: Gaps = Gaps()):
    return predict_closed_loop(STEP, PREFILL, SHAPE, concurrency=concurrency, prompt_tokens=prompt,
                               output_tokens=output, profile_context=prompt + output / 2, gaps=gaps)


def test_one_client_is_prefill_then_decode_at_batch_one():
    p = predict(1)
    assert p.ttft_s == pytest.approx(0.6)  # 0.1 + 50 x 0.01
    assert p.tpot_s == pytest.approx(0.05) and p.decode_batch == pytest.approx(1.0)
    assert p.output_tok_s == pytest.approx(21 / (0.6 + 20 * 0.05))


def test_handoff_and_skew_lengthen_the_gaps():
    p = predict(1, gaps=Gaps(handoff_s=0.2, skew=1.1))
    assert p.tpot_s == pytest.approx(0.05 * 1.1 + 0.2 / 20)
    assert p.output_tok_s == pytest.approx(21 / (0.6 + 20 * 0.055 + 0.2))


def test_more_clients_queue_at_prefill_and_batch_at_decode():
    one, three = predict(1), predict(3)
    assert three.ttft_s > one.ttft_s and three.decode_batch > 1.5 and three.tpot_s > one.tpot_s
    assert three.output_tok_s > one.output_tok_s


def test_throughput_never_exceeds_what_the_prefill_replica_can_start():
    p = predict(8, prompt=200, output=5)  # 2 s busy per request, 0.16 s decoding
    assert p.prefill_utilization == pytest.approx(1.0)
    assert p.output_tok_s == pytest.approx(5 / 2.0)


def test_long_contexts_cost_attention_per_sequence():
    ratio = (2 * SHAPE.params + attention_flops_per_token(SHAPE, 1000)) / (2 * SHAPE.params + attention_flops_per_token(SHAPE, 0))
    assert step_at_context(STEP, SHAPE, 2, 1000, 0) == pytest.approx(0.04 + 0.02 * ratio)


def test_long_prompts_continue_the_last_measured_segment():
    beyond = prefill_beyond([(32, 0.18), (32, 0.20), (128, 0.60), (256, 1.10), (256, 1.14)])
    assert beyond == PrefillBeyond(256, pytest.approx(1.12), pytest.approx((1.12 - 0.60) / 128))
    assert prefill_at(PREFILL, 200, beyond) == pytest.approx(PREFILL.time_s(200))  # inside: the fitted line
    assert prefill_at(PREFILL, 512, beyond) == pytest.approx(1.12 + 256 * 0.52 / 128)
    assert prefill_beyond([(32, 0.2), (32, 0.3)]) is None
