"""bench.load.prefix_tiers --cluster: what each row is configured with and how it is counted."""

from pathlib import Path

from bench.load.prefix_tiers_cluster import (VLLM_BLOCK_TOKENS, cluster_config, counters_delta, vllm_computed_tokens,
                                             vllm_serve_args)

METRICS = """\
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 1234.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 5000.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="local_compute"} 6.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 6234.0
"""


def test_vllm_row_has_prefix_caching_on_and_one_replicas_pool():
    flags = vllm_serve_args(pool_tokens=5040, max_model_len=640)
    assert "--enable-prefix-caching" in flags
    blocks = int(flags[flags.index("--num-gpu-blocks-override") + 1])
    assert blocks == 40 and blocks * VLLM_BLOCK_TOKENS >= 5040  # whole blocks, rounded up
    assert flags[flags.index("--block-size") + 1] == str(VLLM_BLOCK_TOKENS)
    assert flags[flags.index("--max-model-len") + 1] == "640"


def test_vllm_pool_holds_the_longest_request_even_when_smaller_than_it():
    flags = vllm_serve_args(pool_tokens=100, max_model_len=512)
    assert int(flags[flags.index("--num-gpu-blocks-override") + 1]) == 4


def test_vllm_computed_tokens_counts_local_compute_only_over_engines():
    assert vllm_computed_tokens(METRICS) == 1240
    assert vllm_computed_tokens("") == 0


def test_counters_delta_per_replica_and_a_new_replica_counts_from_zero():
    before = {"prefill:a": {"prompt_tokens_computed": 10, "peer_blocks_pulled": 1}}
    after = {"prefill:a": {"prompt_tokens_computed": 25, "peer_blocks_pulled": 4},
             "decode:b": {"prompt_tokens_computed": 7, "peer_blocks_pulled": 0}}
    assert counters_delta(before, after) == {"prefill:a": {"prompt_tokens_computed": 15, "peer_blocks_pulled": 3},
                                             "decode:b": {"prompt_tokens_computed": 7, "peer_blocks_pulled": 0}}


def test_tiers_on_row_may_fetch_from_peers_and_off_row_never(tmp_path: Path):
    on = cluster_config("1p1d", True, 20, tmp_path, peer_fetch=True)
    off = cluster_config("1p1d", False, 20, tmp_path)
    assert on.kv_tiers.enabled and on.peer_fetch.enabled
    assert not off.kv_tiers.enabled and not off.peer_fetch.enabled
    assert on.mode == "disaggregated" and on.prefill.kv_cache_mib == on.decode.kv_cache_mib == 20
