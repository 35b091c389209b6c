"""Fair shares between tenants within one priority (fair_queue.py, start-time
fair queueing): the rule's table, and the scheduler ordering a flood behind
the other tenants' requests.  One tenant keeps arrival order."""

import dataclasses

import pytest
import torch

from pdcluster.services.engine.config import SchedulerConfig
from pdcluster.services.engine.fair_queue import FairClock, start_tag
from pdcluster.services.engine.kv_cache import KVCache, KVCacheSpec
from pdcluster.services.engine.request import Request
from pdcluster.services.sampling_params import SamplingParams, greedy
from pdcluster.services.engine.scheduler import Scheduler

BS = 4


@pytest.mark.parametrize("clock, finish, cost, weight, expected", [
    (0, 0, 100, 1, (0, 100)),        # an idle tenant starts at the clock
    (50, 0, 100, 1, (50, 150)),      # ... never in the past
    (0, 300, 100, 1, (300, 400)),    # a backlogged one after its own last request
    (0, 0, 100, 4, (0, 25)),         # weight 4: a quarter of the virtual time per token
    (10, 0, 0, 1, (10, 11)),         # an empty request still costs a token (order stays strict)
])
def test_start_tag_table(clock, finish, cost, weight, expected):
    assert start_tag(clock, finish, cost, weight) == expected


def test_a_weight_must_be_positive():
    with pytest.raises(ValueError, match="weight"):
        start_tag(0, 0, 1, 0)


def test_a_flood_queues_behind_a_newcomer():
    clock = FairClock()
    a = [clock.tag("A", 100) for _ in range(5)]
    b = clock.tag("B", 100)
    assert a == [0, 100, 200, 300, 400] and b == 0


def test_weights_share_in_proportion():
    clock = FairClock({"gold": 3.0})
    tags = sorted([(clock.tag("gold", 30), "gold") for _ in range(6)] + [(clock.tag("std", 30), "std")
                                                                         for _ in range(2)])
    assert [t for _, t in tags][:5].count("gold") >= 3


def test_one_tenant_keeps_arrival_order():
    clock = FairClock()
    tags = []
    for cost in (5, 500, 1, 70, 3):
        tags.append(clock.tag("default", cost))
        clock.taken(tags[0])
    assert tags == sorted(tags)


def make_request(rid, n_prompt, tenant="default", priority=0):
    params = dataclasses.replace(greedy(4), tenant=tenant, priority=priority)
    return Request(rid, list(range(n_prompt)), params)


def test_the_scheduler_admits_the_other_tenants_request_before_the_flood():
    kv = KVCache(KVCacheSpec(64, BS, 1, 1, 2, torch.float32))
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, prefill_chunk_size=64), kv, hash_seed=1)
    for i in range(4):
        s.add(make_request(f"a{i}", 8, tenant="A"))
    s.add(make_request("b0", 8, tenant="B"))
    s.add(make_request("urgent", 8, tenant="A", priority=-1))
    assert [r.request_id for r in s.waiting] == ["urgent", "a0", "b0", "a1", "a2", "a3"]


def test_one_tenant_is_served_first_come_first_served():
    kv = KVCache(KVCacheSpec(64, BS, 1, 1, 2, torch.float32))
    s = Scheduler(SchedulerConfig(), kv, hash_seed=1)
    for i, n in enumerate((9, 2, 30, 1)):
        s.add(make_request(f"r{i}", n))
    assert [r.request_id for r in s.waiting] == ["r0", "r1", "r2", "r3"]


@pytest.mark.parametrize("bad", ["", "a" * 65, "no spaces", 7, None])
def test_a_bad_tenant_name_is_refused(bad):
    with pytest.raises(Exception, match="tenant"):
        SamplingParams(tenant=bad)
