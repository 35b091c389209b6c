"""Speculative decoding on the decode side of a real KV hand-off (issue 23,
"works on the decode pool after a KV hand-off"): a prefill engine computes
the prompts, their blocks go over a real pull (socket backend) into a decode
engine that drafts by n-gram lookup; its output is plain one-engine decoding's
token for token.  fp32 weights, as in test_engine_spec_decode.py (in bf16 a
(k+1)-token verification query rounds unlike a one-token step and a near tie
can flip).  With int8 KV too: the pulled 8-bit blocks, scales inside, feed
the verification queries as they feed plain decode.

The same on a real Ray Serve cluster (fp32 KV, Serve's RPC between the
pools): tests/integration/pools/test_spec_decode_cluster.py."""

from __future__ import annotations

import pytest

from pdcluster.services.engine.config import EngineConfig, SpeculativeConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.sampling_params import SamplingParams, greedy
from tests.integration.engine.hand_off import decode_all, prefill_and_pull
from tests.integration.engine.test_engine_spec_decode import CODE


# int8 only: the hand-off and verification code is the same for every KV dtype, and the
# int8 case also covers the scales travelling with the blocks (fp32 KV: ~70 s more per run).
@pytest.mark.parametrize("kv_cache_dtype", ["int8"])
def test_ngram_speculation_after_a_hand_off_equals_one_engine_without_it(smol_fp32, kv_cache_dtype):
    tok = smol_fp32.tokenizer
    code = tok.apply_chat_template([{"role": "user", "content": "Repeat this code exactly:\n" + CODE}])
    requests = [("copy", code, greedy(24)),                      # copies its prompt: drafts get accepted
                ("stop", code, greedy(24, stop=("mul",))),       # a stop string inside an accepted draft
                ("seeded", tok.encode("The capital of France is"),
                 SamplingParams(max_tokens=10, temperature=0.7, seed=7))]

    def engine(method: str) -> Engine:
        return Engine(EngineConfig(dtype="float32", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=128,
                                   speculative=SpeculativeConfig(method=method)), loaded=smol_fp32)

    whole = engine("none")
    want = {rid: o.new_token_ids for (rid, _, _), o in
            zip(requests, whole.generate([p for _, p, _ in requests], [s for _, _, s in requests]))}
    prefill, decode = engine("none"), engine("ngram")
    first, num_bytes, num_blocks = prefill_and_pull(prefill, decode, requests)
    assert num_bytes == num_blocks * prefill.kv_spec.block_bytes > 0  # the K/V really travelled
    got = decode_all(decode, first)

    assert got == want
    stats = decode.stats()
    assert stats.spec_accepted_tokens > 0 and stats.spec_tokens_per_step > 1, stats
    for e in (whole, prefill, decode):
        e.check_integrity()
        assert e.kv.num_free_blocks == e.kv.num_total_blocks  # rejected drafts' blocks came back too
