"""ClusterBackend's decisions with fake Serve handles (the real path runs in
tests/integration/cluster): no live prefill replica -> 503, or the counted
colocated fallback on the decode pool."""

from __future__ import annotations

import pytest

from pdcluster.router.routing_header import RoutingHeader
from pdcluster.services.backend import BackendUnavailable
from pdcluster.services.messages import GenerateRequest
from pdcluster.services.gateway.cluster_backend import ClusterBackend
from pdcluster.services.sampling_params import greedy
from pdcluster.services.messages import TokenDelta
from tests.unit.services.liveness_fake import FakeLiveness


class _Stream:
    def __init__(self, deltas):
        self.deltas, self.cancelled = deltas, False

    def __aiter__(self):
        async def gen():
            for d in self.deltas:
                yield d
        return gen()

    def cancel(self):
        self.cancelled = True


class _Method:
    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def remote(self, *args, **kwargs):
        self.owner.calls.append((self.name, args, kwargs))
        return _Stream([TokenDelta([7], "hi", None), TokenDelta([8], "!", "length")])


class _Handle:
    def __init__(self):
        self.calls = []

    def options(self, **_):
        return self

    def __getattr__(self, name):
        return _Method(self, name)


def _backend(live, fallback):
    handles = {"prefill": _Handle(), "decode": _Handle()}
    return ClusterBackend(handles, mode="disaggregated", model_name="m", max_model_len=64, block_size=16,
                          liveness=FakeLiveness(live), fallback_to_colocated=fallback), handles


async def _collect(backend):
    return [c async for c in backend.generate(GenerateRequest("r1", [1, 2, 3], greedy(2), RoutingHeader((), 3)))]


async def test_no_live_prefill_replica_prefills_on_the_decode_pool_and_is_counted():
    backend, handles = _backend({"prefill": 0, "decode": 1}, fallback=False)  # no 503 while decode lives
    chunks = await _collect(backend)
    assert [c.text for c in chunks] == ["hi", "!"] and chunks[-1].finish_reason == "length"
    assert [name for name, *_ in handles["decode"].calls] == ["generate_colocated"] and handles["prefill"].calls == []
    assert backend.num_colocated_fallbacks == 1
    health = await backend.health()
    assert health["status"] == "ok" and health["live_replicas"] == {"decode": 1}


async def test_fallback_to_colocated_runs_on_decode_and_is_counted():
    backend, handles = _backend(0, fallback=True)
    chunks = await _collect(backend)
    assert [c.text for c in chunks] == ["hi", "!"] and chunks[-1].finish_reason == "length"
    assert [name for name, *_ in handles["decode"].calls] == ["generate_colocated"]
    assert backend.num_colocated_fallbacks == 1 and handles["prefill"].calls == []


async def test_unknown_liveness_never_refuses():
    backend, handles = _backend(None, fallback=False)
    with pytest.raises(Exception) as err:  # the fake prefill handle returns a stream, not a hand-off
        await _collect(backend)
    assert not isinstance(err.value, BackendUnavailable)
    assert [name for name, *_ in handles["prefill"].calls] == ["prefill"]


@pytest.mark.parametrize("tokens,limit,local", [(3, 0, False), (3, 3, True), (4, 3, False), (0, 8, False)])
def test_prefill_locally_only_short_prompts_when_enabled(tokens, limit, local):
    from pdcluster.services.gateway.cluster_backend import prefill_locally

    assert prefill_locally(tokens, limit) is local


async def test_short_prompt_prefills_on_the_decode_replica_and_is_counted():
    handles = {"prefill": _Handle(), "decode": _Handle()}
    backend = ClusterBackend(handles, mode="disaggregated", model_name="m", max_model_len=64, block_size=16,
                             liveness=FakeLiveness(1), local_prefill_max_tokens=3)
    chunks = await _collect(backend)  # a 3-token prompt
    assert [c.text for c in chunks] == ["hi", "!"]
    assert [name for name, *_ in handles["decode"].calls] == ["generate_colocated"]
    assert handles["prefill"].calls == [] and backend.num_local_prefills == 1
    backend.local_prefill_max_tokens = 2  # longer than the limit: the prefill pool again
    with pytest.raises(Exception):
        await _collect(backend)
    assert [name for name, *_ in handles["prefill"].calls] == ["prefill"] and backend.num_local_prefills == 1


async def test_a_prefill_pool_scaled_to_zero_on_purpose_prefills_on_the_decode_replica_without_fallback():
    handles = {"prefill": _Handle(), "decode": _Handle()}
    liveness = FakeLiveness({"prefill": 0, "decode": 1}, targets={"prefill": 0, "decode": 1})
    backend = ClusterBackend(handles, mode="disaggregated", model_name="m", max_model_len=64, block_size=16,
                             liveness=liveness, fallback_to_colocated=False)
    chunks = await _collect(backend)  # no 503: the pool is away by design, not dead
    assert [c.text for c in chunks] == ["hi", "!"] and chunks[-1].finish_reason == "length"
    assert [name for name, *_ in handles["decode"].calls] == ["generate_colocated"] and handles["prefill"].calls == []
    assert backend.num_colocated_fallbacks == 0  # not a fallback
    health = await backend.health()
    assert health["status"] == "ok" and health["live_replicas"] == {"decode": 1}
    # the pool's target back above zero: a missing replica is a counted fallback
    liveness.targets["prefill"] = 1
    await _collect(backend)
    assert backend.num_colocated_fallbacks == 1 and handles["prefill"].calls == []


@pytest.mark.parametrize("mode,published,adopted", [
    ("disaggregated", {"prefill": 0.0005, "decode": 0.0009}, 0.0005),  # the prefill pool's, where it has one
    ("disaggregated", {"decode": 0.0009}, 0.0009),
    ("colocated", {"colocated": 0.0006}, 0.0006),
    ("disaggregated", {}, None),                                       # none published: the configured line
    ("colocated", {"colocated": (0.0006, 4e-8)}, 0.0006),              # with its square term: the whole line
])
async def test_admission_starts_from_the_replicas_start_up_prefill_time(mode, published, adopted):
    from pdcluster.services.gateway.admission import DEFAULT_RULES, Admission

    handles = {"prefill": _Handle(), "decode": _Handle(), "colocated": _Handle()}
    admission = Admission(2.0, 1 << 30, shed=False, adopts_measured_prefill=True)
    backend = ClusterBackend(handles, mode=mode, model_name="m", max_model_len=64, block_size=16,
                             liveness=FakeLiveness(1, per_token_s=published), admission=admission)
    await backend.admit(GenerateRequest("r1", [1, 2, 3], greedy(2), RoutingHeader((), 3)))
    configured = DEFAULT_RULES.prefill.per_token_s
    assert admission.rules.prefill.per_token_s == (adopted or configured)
    assert ("measured at start-up" in admission.view()["prefill_model"]) is (adopted is not None)
    square = published.get(mode)
    if isinstance(square, tuple):
        assert (admission.rules.prefill.per_token2_s, admission.rules.prefill.overhead_s) == (square[1], 0.0)
    else:
        assert admission.rules.prefill.per_token2_s == DEFAULT_RULES.prefill.per_token2_s
