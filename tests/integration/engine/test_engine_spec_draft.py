"""Speculative decoding with a draft model (spec_draft.py) on the real model
in fp32 (in bf16 a k+1-token verification query rounds unlike a one-token
step and a near tie can flip: test_engine_spec_decode.py): greedy output is
plain decoding's token for token, colocated and after a real socket KV
hand-off (the draft catches up on the whole prompt there); a seeded sampled
request draws what plain decoding draws; a full-depth draft (the target
itself) gets nearly every draft accepted, so broken drafting fails here;
and the draft's per-request caches go when requests end or are aborted."""

from __future__ import annotations

from pdcluster.services.engine.config import EngineConfig, SpeculativeConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.sampling_params import SamplingParams, greedy
from tests.integration.engine.hand_off import decode_all, prefill_and_pull

EARLY_EXIT_LAYERS = 12


def _draft(num_layers: int | None = None) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft", draft_model="default", draft_num_layers=num_layers)


def _engine(loaded, spec: SpeculativeConfig, kv_cache_dtype: str = "auto") -> Engine:
    return Engine(EngineConfig(dtype="float32", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64, speculative=spec),
                  loaded=loaded)


def _requests(tok):
    return [("chat", tok.apply_chat_template([{"role": "user", "content": "Name three colours."}]), greedy(10)),
            ("plain", tok.encode("The capital of France is"), greedy(10)),
            ("seeded", tok.encode("Once upon a time"), SamplingParams(max_tokens=8, temperature=0.8, seed=11))]


def _acceptance(outputs) -> float:
    """Accepted / drafted tokens over the given requests' outputs."""
    drafted = sum(o.num_draft_tokens for o in outputs)
    assert drafted > 0, "nothing was drafted"
    return sum(o.num_accepted_draft_tokens for o in outputs) / drafted


def _drained(engine: Engine) -> None:
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    if engine.speculator is not None:
        proposer = engine.speculator.proposer
        assert proposer.num_sequences == 0 and proposer.bytes_held == 0, "a draft cache outlived its request"


def test_draft_model_output_is_plain_decodings_and_a_full_depth_draft_is_accepted(smol_fp32):
    """The full-depth draft (the target itself, run densely) must be accepted
    on greedy requests but for near ties; the seeded request samples at 0.8,
    where a greedy draft is rightly rejected now and then."""
    requests = _requests(smol_fp32.tokenizer)
    prompts, params = [p for _, p, _ in requests], [s for _, _, s in requests]
    plain = _engine(smol_fp32, SpeculativeConfig())
    want = [o.new_token_ids for o in plain.generate(prompts, params)]
    engine = _engine(smol_fp32, _draft())
    outs = engine.generate(prompts, params)
    assert [o.new_token_ids for o in outs] == want
    _drained(engine)
    assert _acceptance(outs[:2]) >= 0.9, [(o.num_draft_tokens, o.num_accepted_draft_tokens) for o in outs]
    assert engine.stats().spec_tokens_per_step > 2.5, engine.stats()


def test_an_aborted_request_frees_its_draft_cache(smol_fp32):
    engine = _engine(smol_fp32, _draft(EARLY_EXIT_LAYERS))
    engine.add_request("a", smol_fp32.tokenizer.encode("One, two, three,"), greedy(32))
    while not engine.speculator.proposer.num_sequences:
        engine.step()
    assert engine.speculator.proposer.bytes_held > 0
    assert engine.abort("a")
    _drained(engine)


def test_draft_speculation_after_a_hand_off_equals_one_engine_without_it(smol_fp32):
    """int8 KV, as test_spec_decode_hand_off.py (fp32 KV is ~70 s slower
    there); the draft's own cache is dense and in the model's dtype, so
    nothing of it travels: it catches up on the pulled prompt."""
    requests = _requests(smol_fp32.tokenizer)[:2]
    whole = _engine(smol_fp32, SpeculativeConfig(), "int8")
    want = {rid: o.new_token_ids for (rid, _, _), o in
            zip(requests, whole.generate([p for _, p, _ in requests], [s for _, _, s in requests]))}
    prefill, decode = _engine(smol_fp32, SpeculativeConfig(), "int8"), _engine(smol_fp32, _draft(), "int8")
    first, num_bytes, num_blocks = prefill_and_pull(prefill, decode, requests)
    assert num_bytes == num_blocks * prefill.kv_spec.block_bytes > 0  # the K/V really travelled
    got = decode_all(decode, first)
    assert got == want
    assert decode.stats().spec_accepted_tokens >= 0.8 * decode.stats().spec_proposed_tokens > 0, decode.stats()
    for e in (whole, prefill, decode):
        _drained(e)
