"""Speculative decoding on a real disaggregated cluster (issue 23: "works on
the decode pool after a KV hand-off"): Ray Serve, 1 prefill + 1 decode
replica, the decode pool drafting by n-gram lookup, the prompt's KV pulled
from the prefill replica.  Greedy and seeded outputs equal one offline
engine without speculation, drafts were accepted on the decode replica, and
every KV block came back.  fp32 weights: in bf16 a (k+1)-token verification
query rounds unlike a one-token step, and a near tie can flip
(tests/integration/engine/test_engine_spec_decode.py)."""

from __future__ import annotations

import httpx
import pytest

from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.services.config import ClusterConfig, SpeculativeSettings
from tests.integration.cluster.conftest import board, small_pool
from tests.integration.cluster.test_cluster_api import MODEL, wait_no_leaks
from tests.integration.engine.test_engine_spec_decode import CODE

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(shared_ray):
    config = ClusterConfig(port=free_service_port(), dtype="float32", prefill=small_pool(), decode=small_pool(),
                           speculative=SpeculativeSettings(method="ngram", num_tokens=4))
    with shared_ray.running(config) as c:
        yield c


def test_speculation_after_a_hand_off_equals_an_engine_without_it(cluster):
    from pdcluster.services.engine.config import EngineConfig
    from pdcluster.services.engine.engine import Engine
    from pdcluster.services.sampling_params import SamplingParams, greedy

    offline = Engine(EngineConfig(dtype="float32", num_kv_blocks=128))  # no speculation
    tok = offline.tokenizer
    code = tok.apply_chat_template([{"role": "user", "content": "Repeat this code exactly:\n" + CODE}])
    france = tok.encode("The capital of France is")
    cases = [(code, {"max_tokens": 32, "temperature": 0}, greedy(32)),  # copies its prompt: drafts accepted
             (france, {"max_tokens": 12, "temperature": 0.7, "seed": 7},
              SamplingParams(max_tokens=12, temperature=0.7, seed=7))]
    url = f"http://127.0.0.1:{cluster.config.port}/v1/completions"
    for prompt, body, params in cases:
        r = httpx.post(url, json={"model": MODEL, "prompt": prompt, **body}, timeout=300)
        assert r.status_code == 200, r.text
        want = offline.generate([prompt], params)[0]
        got = r.json()
        assert got["choices"][0]["text"] == want.text_delta, body
        assert got["usage"]["completion_tokens"] == len(want.new_token_ids)

    (decode,) = [s for s in board(cluster) if s["role"] == "decode"]
    assert decode["spec_accepted_tokens"] > 0 and decode["spec_tokens_per_step"] > 1, decode
    (prefill,) = [s for s in board(cluster) if s["role"] == "prefill"]
    assert prefill["spec_proposed_tokens"] == 0  # the prefill pool never drafts
    wait_no_leaks(cluster)
