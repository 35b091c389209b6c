"""Priority scheduling (vLLM's ``priority``: lower first) on a tiny pool, no
model: the more urgent are admitted first, ties keep arrival order, and
running out of KV preempts the least urgent -- never a more urgent request
for a less urgent one.  With one priority (the default) nothing changes:
tests/unit/engine/test_scheduler.py."""

import dataclasses

import pytest
import torch

from pdcluster.services.engine.config import SchedulerConfig
from pdcluster.services.engine_errors import InvalidRequestError
from pdcluster.services.engine.kv_cache import KVCache, KVCacheSpec
from pdcluster.services.engine.request import Request, RequestStatus
from pdcluster.services.sampling_params import SamplingParams, greedy
from pdcluster.services.engine.scheduler import Scheduler, _insert_by_priority

BS = 4


def make_scheduler(num_blocks=8, **cfg):
    kv = KVCache(KVCacheSpec(num_blocks, BS, 1, 1, 2, torch.float32))
    return Scheduler(SchedulerConfig(**cfg), kv, hash_seed=42)


def make_request(rid, n_prompt, priority=0, max_tokens=8, first=0):
    params = dataclasses.replace(greedy(max_tokens), priority=priority)
    return Request(rid, list(range(first, first + n_prompt)), params)


def step(s, token=7):
    out = s.schedule()
    s.update(out, {e.request.request_id: token for e in out.scheduled if e.samples})
    s.kv.check_integrity()
    return out


@pytest.mark.parametrize("arrivals, order", [
    ([("a", 0), ("b", 0), ("c", 0)], "abc"),          # one priority: arrival order
    ([("a", 5), ("b", 0), ("c", 5), ("d", -1)], "dbac"),
    ([("a", 1), ("b", 1), ("c", 0), ("d", 1)], "cabd"),
])
def test_waiting_is_ordered_by_priority_then_arrival(arrivals, order):
    s = make_scheduler()
    for rid, p in arrivals:
        s.add(make_request(rid, 2, priority=p))
    assert "".join(r.request_id for r in s.waiting) == order


def test_a_preempted_request_goes_first_among_its_priority_only():
    queue = [make_request(r, 1, priority=p) for r, p in (("u", -1), ("x", 0), ("y", 0), ("z", 3))]
    back = make_request("back", 1, priority=0)
    _insert_by_priority(queue, back, first_of_its_priority=True)
    assert [r.request_id for r in queue] == ["u", "back", "x", "y", "z"]


def test_the_urgent_are_admitted_first_when_seats_are_few():
    s = make_scheduler(num_blocks=16, max_num_seqs=1)
    s.add(make_request("late-batch", 3, priority=10))
    s.add(make_request("urgent", 3, priority=-5, first=40))
    step(s)
    assert [r.request_id for r in s.running] == ["urgent"]


def test_out_of_kv_preempts_the_least_urgent_not_the_newest():
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=32, kv_watermark_high=1.0, kv_watermark_low=1.0)
    low = make_request("low", 7, priority=9, max_tokens=10)
    high = make_request("high", 6, priority=-1, max_tokens=10, first=50)   # newer, but more urgent
    s.add(low)
    s.add(high)
    step(s)
    step(s)
    preempted = []
    for _ in range(4):
        preempted += step(s).preempted
    assert preempted and all(r is low for r in preempted) and high.status is RequestStatus.RUNNING


def test_priority_must_be_a_bounded_integer():
    assert SamplingParams(priority=-3).priority == -3
    for bad in (1.5, True, 2**40):
        with pytest.raises(InvalidRequestError, match="priority"):
            SamplingParams(priority=bad)
