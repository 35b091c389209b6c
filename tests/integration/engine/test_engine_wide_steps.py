"""Wide steps beside decoding streams (engine/step_limits.py) on the real model:
a burst of long prompts beside a young stream is prefilled in steps past the
colocated caps, and every request's greedy tokens are those the capped steps
give (how wide a step goes never changes what it computes)."""

from __future__ import annotations

from pdcluster.services.engine import step_limits
from pdcluster.services.sampling_params import greedy
from tests.integration.engine.conftest import document, make_engine, run_staggered

# a colocated replica's caps (services/config.py): 256-token chunks, 320-token steps, short prompts first
CAPS = dict(max_num_batched_tokens=320, prefill_chunk_size=256, long_prefill_tokens=512)


def test_a_burst_beside_a_stream_runs_wide_and_answers_as_capped_steps_do(smol_bf16, monkeypatch):
    # The time a wide step may take (0.3 s) holds 130 tokens on 2 AVX2 cores and 1,700 on AMX: lifted
    # here so the steps go as wide as the cap on any machine; the time rule is the unit tests' table.
    monkeypatch.setattr(step_limits, "WIDE_STEP_S", 1e6)
    tok = smol_bf16.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": "Summarise: " + document(3)}])]
    prompts += [tok.encode(document(60, seed) + " In short,") for seed in range(1, 5)]
    assert len(prompts[0]) >= step_limits.MIN_SAMPLE_TOKENS and min(len(p) for p in prompts[1:]) > 512

    wide = make_engine(smol_bf16, 512, **CAPS, wide_step_tokens=1024, wide_step_tpot_s=10.0)
    widths: list[int] = []
    schedule = wide.scheduler.schedule

    def recording_schedule():
        out = schedule()
        widths.append(out.num_tokens)
        return out

    monkeypatch.setattr(wide.scheduler, "schedule", recording_schedule)
    # the chat first, then a long prompt every second step while it decodes
    got = run_staggered(wide, prompts, greedy(24, ignore_eos=True), every_steps=2)
    capped = run_staggered(make_engine(smol_bf16, 512, **CAPS), prompts, greedy(24, ignore_eos=True), every_steps=2)
    assert got == capped
    assert max(widths) > CAPS["max_num_batched_tokens"], widths


def test_streams_that_cannot_afford_a_wide_step_keep_the_caps(smol_bf16, monkeypatch):
    monkeypatch.setattr(step_limits, "WIDE_STEP_S", 1e6)
    tok = smol_bf16.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": "Summarise: " + document(3)}])]
    prompts += [tok.encode(document(60, seed) + " In short,") for seed in range(1, 3)]
    engine = make_engine(smol_bf16, 512, **CAPS, wide_step_tokens=1024, wide_step_tpot_s=1e-6)
    widths: list[int] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        widths.append((out.num_tokens, len(out.decodes)))
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    run_staggered(engine, prompts, greedy(24, ignore_eos=True), every_steps=2)
    # every step with a stream decoding in it stayed within the caps
    assert all(n <= CAPS["max_num_batched_tokens"] for n, decodes in widths if decodes), widths
