"""The planner's arithmetic against hand-computed cases.

The reference case, worked by hand (mbu = mfu = 1 so the rooflines are exact):
  model     1e9 params, 10 layers, 8 heads, 2 KV heads (GQA), head_dim 64, bf16
  device    12e9 B memory, 1e12 B/s, 1e15 FLOP/s; tp 1; reserve 10%
  traffic   1000 req/s, input mean 900 (p95 800 + output p95 200 = context 1000), output mean 200
  SLOs      TTFT 1 s, TPOT 10 ms;  redundancy 1.5, $4 per instance-hour
"""

import math

import pytest

from pdcluster.planning.speed import PrefillModel, StepModel, fit_prefill, fit_step
from pdcluster.planning.fleet import fleet_instances, fleet_needs
from pdcluster.planning.inputs import (
    Accelerator, Deployment, ModelShape, PerInstance, Pipeline, PrefixCache, Questions, Slos, Speculation, Traffic,
)
from pdcluster.planning.planner import Figure, final_instances, make_plan
from pdcluster.services.default_model import default_model_path
from pdcluster.services.model_meta import read_model_shape

MODEL = ModelShape("toy-gqa", 1e9, num_layers=10, num_heads=8, num_kv_heads=2, head_dim=64)
DEVICE = Accelerator("toy", memory_bytes=12e9, bandwidth_bytes_s=1e12, flops=1e15)
DEPLOY = Deployment(tp=1, reserve_fraction=0.1, block_size=16, safety=0.8, mbu=1.0, mfu=1.0,
                    max_num_seqs=256, redundancy=1.5, price_per_instance_hour=4.0)
TRAFFIC = Traffic(peak_rps=1000, input_mean=900, input_p95=800, output_mean=200, output_p95=200)
SLOS = Slos(ttft_s=1.0, tpot_s=0.010)


@pytest.fixture(scope="module")
def plan():
    return make_plan(MODEL, DEVICE, DEPLOY, TRAFFIC, SLOS)


def test_weights_per_device(plan):
    assert plan.value("weights_per_device_bytes") == 2e9  # 1e9 x 2 B / tp 1
    tp2 = make_plan(MODEL, DEVICE, Deployment(tp=2, mbu=1, mfu=1), TRAFFIC, SLOS)
    assert tp2.value("weights_per_device_bytes") == 1e9


def test_kv_bytes_per_token_gqa_vs_mha(plan):
    assert plan.value("kv_bytes_per_token") == 5120  # 2 x 10 x 2 x 64 x 2
    assert plan.value("kv_bytes_per_token_mha") == 20480  # 2 x 10 x 8 x 64 x 2
    assert plan.value("gqa_saving") == 4
    mha = ModelShape("toy-mha", 1e9, 10, 8, 8, 64)
    assert make_plan(mha, DEVICE, DEPLOY, TRAFFIC, SLOS).value("kv_bytes_per_token") == 20480


def test_8bit_kv_rows_carry_their_scale():
    """1 B per element + a 2 B scale per (token, KV head) row: 2 x 10 x 2 x (64 + 2)."""
    int8 = make_plan(MODEL, DEVICE, Deployment(kv_bytes=1.0, kv_scale_bytes=2.0), TRAFFIC, SLOS)
    assert int8.value("kv_bytes_per_token") == 2640
    assert int8.value("kv_bytes_per_token_mha") == 10560  # 8 heads
    tp2 = make_plan(MODEL, DEVICE, Deployment(tp=2, kv_bytes=1.0, kv_scale_bytes=2.0), TRAFFIC, SLOS)
    assert tp2.value("kv_bytes_per_token_device") == 1320  # one KV head per device, its scales with it
    with pytest.raises(ValueError, match="scale"):
        Deployment(kv_scale_bytes=-1)


def test_planner_scale_bytes_are_the_engines():
    from pdcluster.planning.inputs import KV_SCALE_BYTES
    from pdcluster.kernels.kv_quant import SCALE_BYTES

    assert KV_SCALE_BYTES == {"int8": SCALE_BYTES, "fp8": SCALE_BYTES}


def test_kv_per_device_splits_heads_over_tp():
    tp2 = make_plan(MODEL, DEVICE, Deployment(tp=2, reserve_fraction=0.1), TRAFFIC, SLOS)
    assert tp2.value("kv_bytes_per_token_device") == 2560  # 2 x 10 x ceil(2/2) x 64 x 2
    assert tp2.value("kv_capacity_tokens") == 3_828_125  # (10.8e9 - 1e9) / 2560
    tp4 = make_plan(MODEL, DEVICE, Deployment(tp=4), TRAFFIC, SLOS)
    assert tp4.value("kv_bytes_per_token_device") == 2560  # 2 KV heads over 4 devices: one head each


def test_kv_capacity_and_max_concurrency_with_safety(plan):
    assert plan.value("kv_budget_per_device_bytes") == pytest.approx(8.8e9)  # 12e9 x 0.9 - 2e9
    assert plan.value("kv_capacity_tokens") == 1_718_750  # 8.8e9 / 5120
    # context 1000 tokens -> 63 blocks of 16 = 1008 tokens; 1,718,750 // 1008 = 1705
    assert plan.value("max_concurrency") == 1705
    assert plan.value("safe_concurrency") == 1364  # floor(1705 x 0.8)


def test_decode_speed_from_bandwidth(plan):
    assert plan.value("decode_bound_tok_s") == 500  # 1e12 B/s / 2e9 B
    # step(B) = 2e9/1e12 + B x (900 + 200/2) x 5120 / 1e12 = 2 ms + B x 5.12 us
    assert plan.value("step_s_batch1") == pytest.approx(0.002 + 5.12e-6)
    # B* = min(256 max_num_seqs, 1364 safe, floor((10 ms - 2 ms) / 5.12 us) = 1562) = 256
    assert plan.batch == 256
    assert plan.value("step_s_batch") == pytest.approx(0.002 + 256 * 5.12e-6)
    assert plan.decode_tok_s == pytest.approx(256 / 0.00331072)


def test_prefill_time_from_flops(plan):
    # 2 x 1e9 x 900 / 1e15 + 2 x 10 x 8 x 64 x 900^2 / 1e15
    expected = 0.0018 + 1.024e-11 * 900**2
    assert plan.value("prefill_s_mean") == pytest.approx(expected)
    assert plan.value("prefill_tok_s") == pytest.approx(900 / expected)


def test_instances_from_each_constraint(plan):
    # decode: throughput 1000 x 200 / (256 / 0.00331072) = 2.5865 -> 3
    #         Little: L = 1000 x 200 x 0.00331072 = 662.14 in flight / B* 256 = 2.5865 -> 3
    #         KV: 662.14 x (900 + 100) / (1,718,750 x 0.8) = 0.4816 -> 1
    assert (plan.decode.throughput, plan.decode.concurrency, plan.decode.kv) == (3, 3, 1)
    assert plan.decode.final == 5  # ceil(3 x 1.5)
    # prefill: throughput 1000 x 900 / (900 / 0.0018083) = 1.808 -> 2; Little 1.808 / 256 -> 1; KV -> 1
    assert (plan.prefill.throughput, plan.prefill.concurrency, plan.prefill.kv) == (2, 1, 1)
    assert plan.prefill.final == 3  # ceil(2 x 1.5)
    assert plan.value("prefill_decode_ratio") == pytest.approx(3 / 5)


def test_littles_law_with_a_measured_step():
    step = StepModel(base_s=0.02, per_seq_s=0.001, source="measured")  # step(10) = 30 ms
    traffic = Traffic(peak_rps=10, input_mean=100, input_p95=100, output_mean=100, output_p95=100)
    plan = make_plan(MODEL, DEVICE, Deployment(max_num_seqs=10), traffic, Slos(1.0, 0.05), step=step)
    assert plan.batch == 10
    # L = 10 req/s x 100 tokens x 0.03 s = 30 requests in flight; 30 / B* 10 = 3 instances
    assert plan.decode.concurrency == 3
    assert plan.decode.throughput == 3  # 1000 tok/s / (10 / 0.03) = 3: the same law seen as a rate


def test_final_is_max_of_constraints_times_redundancy():
    needs = [Figure(k, k, v, "instances", "") for k, v in (("a", 2), ("b", 5), ("c", 3))]
    size, fig = final_instances("decode", needs, Deployment(redundancy=1.2))
    assert (size.final, fig.value, size.binding) == (6, 6, "concurrency")  # ceil(5 x 1.2)
    size, _ = final_instances("decode", needs, Deployment(redundancy=1.0))
    assert size.final == 5


def test_cost_per_million_tokens(plan):
    # $4/h x 3 prefill instances / (1000 x 900 tok/s x 3600 s) x 1e6
    assert plan.value("cost_per_m_input") == pytest.approx(12 / 3.24e9 * 1e6)
    # $4/h x 5 decode instances / (1000 x 200 tok/s x 3600 s) x 1e6
    assert plan.value("cost_per_m_output") == pytest.approx(20 / 7.2e8 * 1e6)
    assert plan.value("cost_per_hour") == 32


def test_kv_limits_the_batch_when_memory_is_short():
    small = Accelerator("small", memory_bytes=3e9, bandwidth_bytes_s=1e12, flops=1e15)
    plan = make_plan(MODEL, small, DEPLOY, TRAFFIC, SLOS)
    # budget 3e9 x 0.9 - 2e9 = 7e8 B -> 136,718 tokens -> 135 requests of 1008 -> safe 108
    assert plan.value("kv_capacity_tokens") == 136_718
    assert plan.value("safe_concurrency") == math.floor(135 * 0.8)
    assert plan.batch == 108


def test_every_figure_carries_its_inputs(plan):
    for _, figures in plan.sections:
        for fig in figures:
            assert fig.formula, fig.key
    assert "1,000,000,000" in plan.figure("weights_per_device_bytes").formula


def test_errors_say_what_to_do():
    with pytest.raises(ValueError, match="raise --tp"):
        make_plan(MODEL, Accelerator("tiny", 1e9, 1e12, 1e15), DEPLOY, TRAFFIC, SLOS)
    plan = make_plan(MODEL, DEVICE, DEPLOY, TRAFFIC, Slos(ttft_s=1e-4, tpot_s=0.001))
    assert any("TPOT" in w for w in plan.warnings) and any("TTFT" in w for w in plan.warnings)


def test_fits_recover_exact_lines():
    step = fit_step([1, 2, 4, 8], [0.010 + 0.002 * b for b in (1, 2, 4, 8)])
    assert (step.base_s, step.per_seq_s) == (pytest.approx(0.010), pytest.approx(0.002))
    assert step.max_batch_within(0.030) == 10
    prefill = fit_prefill([100, 200, 400], [0.05 + n / 1000 for n in (100, 200, 400)])
    assert prefill.overhead_s == pytest.approx(0.05) and prefill.per_token_s == pytest.approx(1e-3)
    assert PrefillModel(0.0, 1e-3).time_s(500) == pytest.approx(0.5)


def test_reads_the_default_gguf_shape():
    shape = read_model_shape(str(default_model_path()))
    assert (shape.params, shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (134_515_008, 30, 9, 3, 64)
    assert shape.max_context == 8192


def test_measured_prefill_overhead_adds_latency_not_load():
    prefill = PrefillModel(overhead_s=0.05, per_token_s=1e-3, source="measured")  # 1000 tok/s of compute
    traffic = Traffic(peak_rps=3, input_mean=500, input_p95=500, output_mean=10, output_p95=10)
    plan = make_plan(MODEL, DEVICE, Deployment(), traffic, Slos(1.0, 0.05), prefill=prefill)
    assert plan.value("prefill_s_mean") == pytest.approx(0.55)  # 0.05 + 500 x 1e-3
    assert plan.value("prefill_tok_s") == pytest.approx(1000)  # 500 / (0.55 - 0.05)
    assert plan.prefill.throughput == 2  # ceil(3 x 500 / 1000 = 1.5)


def test_no_request_fits_is_an_error_not_a_plan():
    # 1,718,750 tokens of KV per instance: a 2M-token context does not fit once
    with pytest.raises(ValueError, match="no request fits"):
        make_plan(MODEL, DEVICE, DEPLOY, TRAFFIC, SLOS, context_tokens=2_000_000)


@pytest.mark.parametrize("build, flag", [
    (lambda: Traffic(peak_rps=0, input_mean=1, input_p95=1, output_mean=1, output_p95=1), "--rps"),
    (lambda: Traffic(peak_rps=1, input_mean=0, input_p95=1, output_mean=1, output_p95=1), "--input-mean"),
    (lambda: Accelerator("x", 1e9, -1.0, 1e12), "--bandwidth-gbs"),
    (lambda: ModelShape("x", 1e9, 0, 8, 8, 64), "--layers"),
    (lambda: ModelShape("x", 1e9, 2, 8, 3, 64), "--kv-heads"),
    (lambda: Slos(ttft_s=0, tpot_s=0.1), "--ttft"),
    (lambda: Deployment(max_num_seqs=0), "--max-num-seqs"),
    (lambda: Speculation(k=4, accept=0.5, cost=0), "--spec-cost"),
    (lambda: PrefixCache(shared_prefix_tokens=10, hit_rate=2), "--prefix-hit-rate"),
    (lambda: Pipeline(stages=0, micro_batches=1), "--pp"),
    (lambda: PerInstance(tok_s=0), "--instance-tok-s"),
    (lambda: Questions(queue_s=-1), "--queue-s"),
])
def test_inputs_check_themselves_and_name_the_flag(build, flag):
    with pytest.raises(ValueError, match=flag):
        build()


def test_fleet_is_the_max_of_three_each_rounded_up_times_redundancy():
    output_tok_s = Figure("output_tok_s", "", 8000, "tok/s", "")
    active = Figure("active_requests", "", 420, "requests", "")
    safe = Figure("safe_concurrency", "", 51, "requests", "")
    needs = fleet_needs(PerInstance(tok_s=2500, active=64, kv_safe=48), output_tok_s, active, None, safe)
    assert [f.value for f in needs] == [4, 7, 9]  # ceil(3.2), ceil(6.56), ceil(8.75)
    size, fig = fleet_instances(needs, Deployment(redundancy=1.25))
    assert (size.final, fig.value, size.binding) == (12, 12, "KV")
    only_kv = fleet_needs(PerInstance(kv_safe=None), output_tok_s, active, 100, safe)
    assert [(f.key, f.value) for f in only_kv] == [("fleet_by_kv", 2)]  # 100 requests / 51 computed safe
