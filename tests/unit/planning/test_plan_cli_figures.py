"""`pdcluster plan` answers a capacity-planning textbook's questions from
its flags: each test runs the CLI (``main(argv)``, JSON on stdout) and checks
the figure against the value worked by hand from the formula.

The three worked examples of docs/planning.md ("Capacity planning") are
EXAMPLE_1..3 below; their numbers are the ones that page shows."""

import json
import math

import pytest

from pdcluster.planning.inputs import GiB, MODEL_PRESETS
from pdcluster.planning.view import JSON_SCHEMA
from pdcluster.services.cli.plan import main
from pdcluster.services.model_meta import read_model_shape

EXAMPLE_1 = ("--model llama-3.1-8b --accelerator h100-sxm --rps 10 --input-mean 2000 --output-mean 500 "
             "--context 8192 --concurrency 32").split()
EXAMPLE_2 = ("--model llama-3.1-70b --accelerator h100-sxm --tp 4 --rps 20 --input-mean 1000 --output-mean 400 "
             "--queue-s 0.2 --ttft 0.8 --tpot 0.05 --instance-tok-s 2500 --active-per-instance 64 "
             "--kv-safe-per-instance 48 --redundancy 1.25 --price-per-hour 12").split()
EXAMPLE_3 = ("--model default --accelerator l4 --rps 50 --input-mean 1200 --output-mean 200 "
             "--shared-prefix-tokens 800 --prefix-hit-rate 0.75 --spec-k 4 --spec-accept 0.7 --spec-cost 0.05 "
             "--pp 4 --micro-batches 12").split()
# a small request mix, so that the workload's lengths play no part
SMALL = "--model default --rps 5 --input-mean 100 --output-mean 50".split()


def run_json(capsys, argv: list[str]) -> dict:
    assert main([*argv, "--json", "-"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def values(capsys, argv: list[str]) -> dict[str, float]:
    return {key: f["value"] for key, f in run_json(capsys, argv)["figures"].items()}


# --- memory ---------------------------------------------------------------


def test_example_1_kv_per_token_per_request_and_for_n_requests(capsys):
    v = values(capsys, EXAMPLE_1)
    assert v["kv_bytes_per_token"] == 131_072  # 2 x 32 layers x 8 KV heads x 128 x 2 B
    assert v["kv_bytes_per_token_mha"] == 524_288  # 32 heads
    assert v["gqa_saving"] == 4
    assert v["kv_bytes_per_request"] == 2**30  # 131,072 B x 8,192 tokens = 1 GiB
    assert v["kv_bytes_concurrent"] == 32 * 2**30  # 32 requests
    assert v["weights_per_device_bytes"] == 16.06e9  # 8.03e9 x 2 B
    # H100 80 GiB x 0.9 - 16.06e9 = 61,249,411,328 B -> / 131,072 = 467,295 tokens -> 57 requests of 8,192
    assert v["kv_capacity_tokens"] == 467_295
    assert (v["max_concurrency"], v["safe_concurrency"]) == (57, 51)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_8bit_kv_per_token_counts_each_rows_scale_as_the_engine_stores_it(capsys, kv_dtype):
    """An 8-bit KV row is head_dim bytes + a 2-byte scale (pdcluster/kernels/kv_quant.py):
    the planner's KV bytes per token is the engine's block bytes / block size."""
    import torch

    from pdcluster.services.engine.kv_cache import KVCacheSpec
    from pdcluster.kernels.kv_quant import pool_dtype

    v = values(capsys, [*SMALL, "--kv-dtype", kv_dtype])
    assert v["kv_bytes_per_token"] == 2 * 30 * 3 * (64 + 2)  # not 2 x 30 x 3 x 64 x 1
    assert v["kv_bytes_per_token_device"] == v["kv_bytes_per_token"]
    engine_dtype = pool_dtype({"int8": "int8", "fp8": "fp8_e4m3"}[kv_dtype], torch.bfloat16)
    spec = KVCacheSpec(1, 16, 30, 3, 64, engine_dtype)
    assert v["kv_bytes_per_token"] == spec.block_bytes / 16
    bf16 = values(capsys, SMALL)
    assert v["kv_bytes_per_token"] / bf16["kv_bytes_per_token"] == pytest.approx(66 / 128)
    assert v["kv_capacity_tokens"] == math.floor(v["kv_budget_per_device_bytes"] / v["kv_bytes_per_token_device"])


def test_8bit_kv_formula_shows_the_scale(capsys):
    assert main([*EXAMPLE_1, "--kv-dtype", "int8", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "= 2 x layers x kv_heads x (head_dim x kv_bytes + scale_bytes)\n" in out
    assert "= 2 x layers 32 x kv_heads 8 x (head_dim 128 x 1 B + scale 2 B)\n" in out


@pytest.mark.parametrize("dtype, bytes_per_param", [("fp32", 4), ("bf16", 2), ("fp8", 1), ("int4", 0.5)])
def test_weight_bytes_by_dtype(capsys, dtype, bytes_per_param):
    v = values(capsys, [*EXAMPLE_1, "--weight-dtype", dtype, "--accelerator", "h200"])
    assert v["weights_per_device_bytes"] == pytest.approx(8.03e9 * bytes_per_param)


def test_bandwidth_bound_decode_ceiling_in_decimal_gb_s(capsys):
    v = values(capsys, EXAMPLE_1)
    assert v["decode_bound_tok_s"] == pytest.approx(3.35e12 / 16.06e9)  # 208.6 tok/s
    v = values(capsys, [*EXAMPLE_1, "--bandwidth-gbs", "2000"])
    assert v["decode_bound_tok_s"] == pytest.approx(2000e9 / 16.06e9)  # GB/s is 1e9 B/s


def test_memory_in_gib_or_gb_and_reserve_gib_replaces_the_fraction(capsys):
    gib = run_json(capsys, [*SMALL, "--memory-gib", "24"])
    gb = run_json(capsys, [*SMALL, "--memory-gb", "24"])
    assert gib["inputs"]["accelerator"]["memory_bytes"] == 24 * GiB
    assert gb["inputs"]["accelerator"]["memory_bytes"] == 24e9
    weights = 134_515_008 * 2
    v = values(capsys, [*SMALL, "--memory-gib", "24", "--reserve-gib", "2"])
    assert v["kv_budget_per_device_bytes"] == 22 * GiB - weights  # not also x (1 - 0.1)
    v = values(capsys, [*SMALL, "--memory-gib", "24", "--reserve-fraction", "0"])  # zero is zero
    assert v["kv_budget_per_device_bytes"] == 24 * GiB - weights


def test_model_default_is_the_bundled_smollm2_shape(capsys):
    data = run_json(capsys, SMALL)
    m = data["inputs"]["model"]
    assert (m["num_layers"], m["num_heads"], m["num_kv_heads"], m["head_dim"]) == (30, 9, 3, 64)
    # tied embeddings 49,152 x 576, 30 layers of (q, o 576^2; k, v 576 x 192; MLP 3 x 576 x 1,536; 2 norms), final norm
    layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576
    assert m["params"] == 49_152 * 576 + 30 * layer + 576 == 134_515_008
    assert read_model_shape(None) == read_model_shape("default") == MODEL_PRESETS["smollm2-135m"]
    assert data["figures"]["kv_bytes_per_token"]["value"] == 2 * 30 * 3 * 64 * 2


def test_a_mean_without_its_p95_replaces_the_workloads_lengths(capsys):
    data = run_json(capsys, ["--model", "default", "--rps", "1", "--input-mean", "2000", "--output-p95", "300"])
    assert data["inputs"]["traffic"]["input_p95"] == 2000
    assert data["figures"]["context_tokens"]["value"] == 2300  # input p95 2000 + output p95 300
    assert any("--input-mean" in note for note in data["inputs"]["notes"])


# --- demand, latency ------------------------------------------------------


def test_example_1_token_demand_and_prefill_flops(capsys):
    v = values(capsys, EXAMPLE_1)
    assert (v["input_tok_s"], v["output_tok_s"]) == (20_000, 5_000)  # 10 req/s x 2000, x 500
    assert v["prefill_flops_per_request"] == pytest.approx(3.212e13)  # 2 x 8.03e9 x 2000
    assert v["prefill_flops_s"] == pytest.approx(3.212e14)  # x 10 req/s
    assert v["prefill_s_flops"] == pytest.approx(3.212e13 / (989e12 * 0.5))  # 64.95 ms at mfu 0.5


def test_example_2_e2e_decomposition_and_active_requests(capsys):
    v = values(capsys, EXAMPLE_2)
    assert v["e2e_s_slo"] == pytest.approx(0.2 + 0.8 + 400 * 0.05)  # queue + TTFT + 400 x TPOT = 21 s
    assert v["active_requests"] == pytest.approx(20 * 21)  # Little: rps x dwell (E2E at the SLOs)
    v = values(capsys, [*EXAMPLE_2, "--dwell-s", "12"])
    assert v["active_requests"] == 240
    v = values(capsys, [*EXAMPLE_2, "--queue-s", "0"])  # zero is zero
    assert v["e2e_s_slo"] == pytest.approx(0.8 + 20)
    predicted = v["prefill_s_mean"] + 400 * v["step_s_batch"]
    assert v["e2e_s_predicted"] == pytest.approx(predicted)


# --- instances from per-instance facts -----------------------------------


def test_example_2_max_of_three_times_redundancy(capsys):
    data = run_json(capsys, EXAMPLE_2)
    v = {k: f["value"] for k, f in data["figures"].items()}
    assert v["fleet_by_throughput"] == 4  # ceil(20 x 400 = 8,000 tok/s / 2,500 = 3.2)
    assert v["fleet_by_active"] == 7  # ceil(420 / 64 = 6.56)
    assert v["fleet_by_kv"] == 9  # ceil(420 / 48 = 8.75)
    assert v["fleet_instances"] == 12  # ceil(9 x 1.25 = 11.25)
    assert data["fleet"] == {"needs": {"throughput": 4, "active": 7, "KV": 9}, "final": 12, "binding": "KV"}


def test_max_of_three_with_a_measured_dwell_and_a_known_concurrency(capsys):
    v = values(capsys, [*EXAMPLE_2, "--dwell-s", "12"])
    # active 20 x 12 = 240: by active ceil(3.75) = 4, by KV ceil(240 / 48) = 5; ceil(5 x 1.25) = 7
    assert (v["fleet_by_throughput"], v["fleet_by_active"], v["fleet_by_kv"], v["fleet_instances"]) == (4, 4, 5, 7)
    v = values(capsys, [*EXAMPLE_2, "--dwell-s", "12", "--concurrency", "500"])
    assert (v["fleet_by_kv"], v["fleet_instances"]) == (11, 14)  # ceil(500 / 48 = 10.4); ceil(11 x 1.25 = 13.75)


def test_each_requirement_is_rounded_up_before_redundancy(capsys):
    flags = ["--model", "default", "--rps", "21", "--input-mean", "100", "--output-mean", "100",
             "--instance-tok-s", "1000", "--active-per-instance", "1e6", "--kv-safe-per-instance", "1e6", "--redundancy", "1.4"]
    v = values(capsys, flags)
    assert v["fleet_by_throughput"] == 3  # ceil(2,100 / 1,000 = 2.1)
    assert v["fleet_instances"] == 5  # ceil(3 x 1.4 = 4.2), not ceil(2.1 x 1.4 = 2.94) = 3


def test_kv_rule_defaults_to_the_computed_safe_concurrency(capsys):
    data = run_json(capsys, [*SMALL, "--instance-tok-s", "100", "--concurrency", "5000"])
    v = {k: f["value"] for k, f in data["figures"].items()}
    assert v["fleet_by_kv"] == math.ceil(5000 / v["safe_concurrency"])
    assert "fleet_by_active" not in v  # not measured: left out, not guessed
    assert set(data["fleet"]["needs"]) == {"throughput", "KV"}


# --- prefix cache, speculation, pipeline, cost ---------------------------


def test_example_3_prefix_cache_savings(capsys):
    v = values(capsys, EXAMPLE_3)
    assert v["prefix_tok_s"] == 40_000  # 50 req/s x 800 shared tokens
    assert v["prefix_saved_tok_s"] == 30_000  # x hit rate 0.75
    assert v["prefix_saved_fraction"] == 0.5  # 600 of 1,200 prompt tokens
    assert v["prefill_tok_s_after_cache"] == 30_000  # 50 x (1,200 - 600)
    assert v["prefix_saved_flops_s"] == pytest.approx(2 * 134_515_008 * 30_000)
    assert v["prefill_by_throughput"] == math.ceil(30_000 / v["prefill_tok_s"])  # the pool prefills what is not cached
    assert values(capsys, [*EXAMPLE_3, "--prefix-hit-rate", "0"])["prefix_saved_tok_s"] == 0  # zero is zero


def test_prefix_cache_shrinks_the_prefill_pool(capsys):
    slow = [*EXAMPLE_3, "--tflops", "1"]  # ~1,900 prefill tok/s, so the pool is many instances
    cold = values(capsys, [*slow, "--prefix-hit-rate", "0"])
    warm = values(capsys, slow)
    assert cold["prefill_by_throughput"] == math.ceil(60_000 / cold["prefill_tok_s"])
    assert warm["prefill_by_throughput"] == math.ceil(30_000 / warm["prefill_tok_s"])
    assert warm["prefill_by_throughput"] < cold["prefill_by_throughput"]


def test_example_3_speculative_decoding_speedup(capsys):
    v = values(capsys, EXAMPLE_3)
    assert v["spec_tokens_per_step"] == pytest.approx((1 - 0.7**5) / 0.3)  # 2.7731
    assert v["spec_cost_per_step"] == pytest.approx(1.2)  # 1 + 0.05 x 4
    assert v["spec_speedup"] == pytest.approx((1 - 0.7**5) / (0.3 * 1.2))  # 2.3109
    assert v["spec_speedup_bound"] == pytest.approx(20)  # 1 / c
    assert v["spec_tpot_s_batch1"] == pytest.approx(v["step_s_batch1"] / v["spec_speedup"])


@pytest.mark.parametrize("k, a, c", [(1, 0.5, 0.5), (8, 0.9, 0.1), (64, 0.99, 0.02), (4, 1.0, 0.25), (16, 1.0, 1.0)])
def test_speculation_speedup_never_exceeds_one_over_c(capsys, k, a, c):
    v = values(capsys, [*SMALL, "--spec-k", str(k), "--spec-accept", str(a), "--spec-cost", str(c)])
    expected = (k + 1) / (1 + c * k) if a == 1 else (1 - a ** (k + 1)) / ((1 - a) * (1 + c * k))
    assert v["spec_speedup"] == pytest.approx(expected)
    assert v["spec_speedup"] <= 1 / c + 1e-12


def test_speculation_at_low_acceptance_is_a_slowdown_and_says_so(capsys):
    data = run_json(capsys, [*SMALL, "--spec-k", "4", "--spec-accept", "0.2", "--spec-cost", "0.3"])
    speedup = data["figures"]["spec_speedup"]["value"]
    assert speedup == pytest.approx((1 - 0.2**5) / (0.8 * 2.2)) and speedup < 1  # 0.568
    assert any("slows decoding" in w for w in data["warnings"])


@pytest.mark.parametrize("s, m, bubble", [(4, 12, 0.2), (8, 1, 7 / 8), (1, 5, 0.0), (2, 99, 0.01)])
def test_pipeline_bubble_gpipe(capsys, s, m, bubble):
    v = values(capsys, [*SMALL, "--pp", str(s), "--micro-batches", str(m)])
    assert v["pipeline_bubble"] == pytest.approx(bubble)  # (s - 1) / (m + s - 1)
    assert v["pipeline_efficiency"] == pytest.approx(1 - bubble)


def test_example_2_cost_per_million_output_tokens_at_capacity(capsys):
    v = values(capsys, EXAMPLE_2)
    assert v["cost_per_m_output_at_capacity"] == pytest.approx(12 / (2500 * 3600) * 1e6)  # $1.3333
    v = values(capsys, [*SMALL, "--price-per-hour", "2.5"])  # no measured rate: the plan's decode tok/s at B*
    assert v["cost_per_m_output_at_capacity"] == pytest.approx(2.5 / (v["decode_tok_s"] * 3600) * 1e6)


# --- output ---------------------------------------------------------------


def test_json_is_stable_and_documented(capsys):
    data = run_json(capsys, EXAMPLE_2)
    assert data["schema"] == JSON_SCHEMA
    assert set(data) == {"schema", "inputs", "sections", "figures", "prefill", "decode", "fleet", "batch",
                         "decode_tok_s", "warnings", "reproduce"}
    assert list(data["sections"]) == [
        "memory", "demand", "speed", "latency", "instances", "instances from per-instance facts", "cost"]
    for key, f in data["figures"].items():
        assert set(f) == {"section", "label", "value", "unit", "rule", "formula"}, key
        assert f["rule"] and f["formula"], key
    for title, figures in data["sections"].items():  # the same figures, in print order
        for f in figures:
            assert data["figures"][f.pop("key")] == {"section": title, **f}
    assert set(data["prefill"]) == {"pool", "throughput", "concurrency", "kv", "final", "binding"}
    assert data["reproduce"].startswith("pdcluster plan ")


def test_tables_show_memory_in_gb_and_gib_and_explain_walks_the_arithmetic(capsys):
    assert main(EXAMPLE_1) == 0
    out = capsys.readouterr().out
    assert "1.07 GB (1.00 GiB)" in out and "85.90 GB (80.00 GiB)" in out
    assert main([*EXAMPLE_1, "--explain"]) == 0
    out = capsys.readouterr().out
    assert "= 2 x layers x kv_heads x head_dim x kv_bytes\n" in out
    assert "= 2 x layers 32 x kv_heads 8 x head_dim 128 x 2 B\n" in out
    assert "= 131.07 kB (128.00 KiB)\n" in out
    assert "reproduce: pdcluster plan" in out


def test_a_cluster_config_sets_the_kv_bytes_and_the_speculation_k_the_cluster_runs(capsys, tmp_path):
    """--config: the planner's KV dtype, weight dtype, block size and spec k
    are the cluster's; a flag given on the command line still wins."""
    config = tmp_path / "cluster.yaml"
    config.write_text("dtype: float32\nkv_cache_dtype: int8\nblock_size: 32\n"
                      "speculative: {method: ngram, num_tokens: 6}\n")
    spec = ["--spec-accept", "0.5", "--spec-cost", "0.1"]
    from_config = run_json(capsys, [*SMALL, "--config", str(config), *spec])
    by_flags = run_json(capsys, [*SMALL, "--weight-dtype", "fp32", "--kv-dtype", "int8", "--block-size", "32",
                                 "--spec-k", "6", *spec])
    assert from_config["figures"] == by_flags["figures"]
    v = {k: f["value"] for k, f in from_config["figures"].items()}
    shape = read_model_shape("default")
    assert v["kv_bytes_per_token"] == 2 * shape.num_layers * shape.num_kv_heads * (shape.head_dim + 2)
    assert v["spec_tokens_per_step"] == pytest.approx((1 - 0.5 ** 7) / 0.5)  # k = 6
    assert any("--kv-dtype int8 from" in n for n in from_config["inputs"]["notes"])
    overridden = values(capsys, [*SMALL, "--config", str(config), "--kv-dtype", "bf16"])
    assert overridden["kv_bytes_per_token"] == 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
