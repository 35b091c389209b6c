"""Speculative decoding by n-gram lookup on the real model, in fp32 (in bf16
a k+1-token query and a one-token decode round differently, and a near tie
can flip): output is plain decoding's token for token, drafts really get
accepted, a stop string cuts an accepted draft, and every KV block comes back."""

from __future__ import annotations

from pdcluster.services.engine.config import EngineConfig, SpeculativeConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.sampling_params import SamplingParams, greedy

CODE = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\ndef sub(a, b):\n    return a - b\n"


def _engine(loaded, method: str) -> Engine:
    return Engine(EngineConfig(num_kv_blocks=128, speculative=SpeculativeConfig(method=method)), loaded=loaded)


def test_ngram_drafts_change_nothing_but_the_number_of_steps(smol_fp32):
    """One batch, with and without drafts: a greedy request that copies its
    prompt (drafts get accepted), the same one cut by a stop string (which
    falls inside an accepted draft), and a seeded sampled request (it draws
    what plain decoding draws).  Everything equal, every block back."""
    tok = smol_fp32.tokenizer
    code = tok.apply_chat_template([{"role": "user", "content": "Repeat this code exactly:\n" + CODE}])
    prompts = [code, code, tok.encode("The capital of France is")]
    params = [greedy(24), greedy(24, stop=("mul",)), SamplingParams(max_tokens=10, temperature=0.7, seed=7)]
    outs, stats = {}, {}
    for method in ("none", "ngram"):
        engine = _engine(smol_fp32, method)
        got = engine.generate(prompts, params)
        engine.check_integrity()
        assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
        outs[method] = [(o.new_token_ids, o.text_delta, o.finish_reason, o.num_output_tokens) for o in got]
        stats[method] = (engine.num_steps, engine.stats())
    assert outs["ngram"] == outs["none"]
    assert outs["none"][1][2] == "stop" and "mul" not in outs["none"][1][1]
    (plain_steps, _), (steps, s) = stats["none"], stats["ngram"]
    assert s.spec_accepted_tokens > 0 and s.spec_tokens_per_step > 1, s
    assert steps < plain_steps, (steps, plain_steps)
