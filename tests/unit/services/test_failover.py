"""Failover decisions (pure), the seeded random stream, and ClusterBackend's
stream loop with fake Serve handles: a stream that loses its decode replica
resumes elsewhere from prompt + the tokens sent, counted once, at most
max_failovers times."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from ray import exceptions as ray_exceptions

from pdcluster.observability import tracing
from pdcluster.observability.exporters import read_spans
from pdcluster.router.routing_header import RoutingHeader
from pdcluster.services.backend import (BackendFailure, BackendInvalidRequest, BackendKVTransferFailed, BackendLeaseExpired,
                              BackendOverloaded, BackendTimeout, BackendUnavailable)
from pdcluster.services.config import ClusterConfig, RouterSettings, SchedulerSettings
from pdcluster.services.gateway.cluster_backend import ClusterBackend
from pdcluster.services.engine.random_stream import position_seed
from pdcluster.services.sampling_params import SamplingParams, greedy
from pdcluster.services.gateway.failover import (FailoverReason, ResumeTarget, decide, live_elsewhere, lost_reason, resume_path,
                                       resume_target)
from pdcluster.services.gateway.failover_log import summary
from pdcluster.services.gateway.resume import with_stream_seed
from pdcluster.services.messages import GenerateRequest, PrefillResponse, TokenDelta
from tests.unit.services.serve_fakes import HANDOFF, SERVERS, FakeResponse, FakeStream
from tests.unit.services.liveness_fake import FakeLiveness

R = FailoverReason


# ---- pure decisions ------------------------------------------------------------------------------
@pytest.mark.parametrize("reason, done, left, elsewhere, resume", [
    (R.REPLICA_DIED, 0, 10, 1, True),
    (R.REPLICA_DIED, 0, 10, 0, True),          # a respawn is coming: wait for it
    (R.REPLICA_DIED, 2, 10, 1, False),         # max_failovers (2) used up
    (R.REPLICA_DIED, 0, 0, 1, False),          # nothing left to generate
    (R.INTER_TOKEN_DEADLINE, 0, 10, 1, True),
    (R.INTER_TOKEN_DEADLINE, 0, 10, 0, False),  # the stalled replica is the only one
    (R.INTER_TOKEN_DEADLINE, 0, 10, None, False),
    (R.KV_TRANSFER_FAILED, 1, 10, None, True),
])
def test_decide(reason, done, left, elsewhere, resume):
    decision = decide(reason, done, 2, left, elsewhere)
    assert decision.resume is resume and (resume or decision.why)


def test_resume_target_prefers_another_decode_replica_then_the_fallback():
    assert resume_target("disaggregated", 1, 1, True).pool == "decode"
    assert resume_target("disaggregated", None, 1, True).pool == "decode"
    assert resume_target("disaggregated", 0, 1, True) == resume_target("disaggregated", 0, 1, True)
    assert resume_target("disaggregated", 0, 1, True).pool == "prefill"
    assert resume_target("disaggregated", 0, 0, True).pool == "decode"    # wait for the respawn
    assert resume_target("disaggregated", 0, 1, False).pool == "decode"
    assert resume_target("colocated", 0, None, False).method == "generate"
    assert live_elsewhere(2, 1) == 1 and live_elsewhere(1, 3) == 0 and live_elsewhere(None, 1) is None


DECODE = ResumeTarget("decode", "generate_colocated")
VIA_PREFILL = ResumeTarget("decode", "generate", via_prefill_pool=True)


@pytest.mark.parametrize("target, num_tokens, prefill_live, decode_live, reason, want", [
    (DECODE, 513, 1, 1, R.REPLICA_DIED, VIA_PREFILL),           # long: prefilled by the prefill pool, handed off
    (DECODE, 513, None, None, R.STREAM_BROKEN, VIA_PREFILL),    # liveness unknown: as for a fresh long prompt
    (DECODE, 512, 1, 1, R.REPLICA_DIED, DECODE),                # short: recomputed on the new decode replica
    (DECODE, 513, 0, 1, R.REPLICA_DIED, DECODE),                # no live prefill replica
    (DECODE, 513, 1, 0, R.REPLICA_DIED, DECODE),                # waiting for a respawn: no lease to run down
    (DECODE, 513, 1, 1, R.KV_TRANSFER_FAILED, DECODE),          # the hand-off itself was lost: no second one
    (DECODE, 513, 1, 1, R.KV_LEASE_EXPIRED, DECODE),
    (ResumeTarget("prefill", "generate_colocated"), 513, 1, 0, R.REPLICA_DIED,
     ResumeTarget("prefill", "generate_colocated")),            # the fallback runs both phases on a prefill replica
    (ResumeTarget("colocated", "generate"), 513, None, None, R.REPLICA_DIED, ResumeTarget("colocated", "generate")),
])
def test_resume_path(target, num_tokens, prefill_live, decode_live, reason, want):
    got = resume_path(target, num_tokens, 512, prefill_live, decode_live, reason)
    assert got == want
    assert got.path == ("prefill_pool" if want.via_prefill_pool else "recompute")


def test_resume_local_max_tokens_defaults_to_what_a_decode_replica_would_prefill_itself():
    assert ClusterConfig().resume_local_max_tokens() == 512  # one prefill chunk (the default chunk size)
    assert ClusterConfig(scheduler=SchedulerSettings(prefill_chunk_size=128)).resume_local_max_tokens() == 128
    assert ClusterConfig(router=RouterSettings(local_prefill_max_tokens=300)).resume_local_max_tokens() == 300
    configured = RouterSettings(local_prefill_max_tokens=300, resume_local_max_tokens=0)
    assert ClusterConfig(router=configured).resume_local_max_tokens() == 0  # every long-enough resume: prefill pool
    with pytest.raises(ValueError, match="resume_local_max_tokens"):
        RouterSettings(resume_local_max_tokens=-1)


def test_lost_reasons_are_replica_losses_only():
    assert lost_reason(BackendKVTransferFailed("x")) is R.KV_TRANSFER_FAILED
    assert lost_reason(BackendLeaseExpired("x")) is R.KV_LEASE_EXPIRED
    assert lost_reason(BackendUnavailable("engine loop died")) is R.ENGINE_DIED
    for err in (BackendOverloaded("full"), BackendInvalidRequest("bad"), BackendFailure("nan logits"),
                BackendTimeout("late")):
        assert lost_reason(err) is None


def test_position_seeds_differ_by_seed_and_position():
    seeds = {position_seed(s, k) for s in range(50) for k in range(50)}
    assert len(seeds) == 2500 and all(0 <= x < 2**64 for x in seeds)
    assert position_seed(-1, 0) == position_seed(2**64 - 1, 0)  # one 64-bit seed, however written
    with pytest.raises(ValueError):
        position_seed(1, -1)


# ---- the stream loop ------------------------------------------------------------------------------


class _Cluster:
    """Fake Serve handles: each streaming call takes the next scripted stream,
    each prefill call the next scripted hand-off (a PrefillResponse, or the
    error it raises; HANDOFF once the script is used up)."""

    def __init__(self, streams, prefills=()):
        self.streams, self.prefills, self.calls = list(streams), list(prefills), []

    def pool(self, name):
        cluster = self

        class Handle:
            def options(self, **_):
                return self

            def __getattr__(self, method):
                class Method:
                    def remote(self, *args, **kwargs):
                        inspect.signature(getattr(SERVERS[name], method)).bind(None, *args, **kwargs)
                        cluster.calls.append((f"{name}.{method}", args, kwargs))
                        if method == "prefill":
                            answer = cluster.prefills.pop(0) if cluster.prefills else HANDOFF
                            if isinstance(answer, BaseException):
                                return FakeResponse(None, error=answer)
                            return FakeResponse(answer)
                        if method == "release":
                            return FakeResponse(True)
                        return cluster.streams.pop(0)
                return Method()
        return Handle()


def _backend(streams, live=None, prefills=(), **kw):
    cluster = _Cluster(streams, prefills)
    handles = {"prefill": cluster.pool("prefill"), "decode": cluster.pool("decode")}
    backend = ClusterBackend(handles, mode="disaggregated", model_name="m", max_model_len=64, block_size=16,
                             liveness=FakeLiveness({"prefill": 1} | live) if live is not None else None, **kw)
    return backend, cluster


async def _drain(backend, max_tokens=5, params=None):
    request = GenerateRequest("r1", list(range(20)), params or greedy(max_tokens), RoutingHeader((), 20))
    return [c async for c in backend.generate(request)]


def _d(token, text, replica="decode-A", finish=None):
    return TokenDelta([token], text, finish, streamed_by=replica)


def _resumes(cluster):
    return [(name, args[0], args[0].routing) for name, args, _ in cluster.calls
            if name.endswith("generate_colocated")]


async def test_a_dead_decode_replica_is_resumed_on_another_with_the_tokens_sent():
    died = ray_exceptions.ActorDiedError()
    streams = [FakeStream([_d(6, "b"), _d(7, "c")], error=died),
               FakeStream([_d(8, "d", "decode-B"), _d(9, "e", "decode-B", "length")])]
    backend, cluster = _backend(streams, live={"decode": 2})
    chunks = await _drain(backend)
    assert [t for c in chunks for t in c.token_ids] == [5, 6, 7, 8, 9]  # each token once
    assert "".join(c.text for c in chunks) == "abcde" and chunks[-1].finish_reason == "length"
    (name, message, routing), = _resumes(cluster)
    assert name == "decode.generate_colocated" and isinstance(message, GenerateRequest) and message.handoff is None
    assert message.prior_output_token_ids == (5, 6, 7) and message.prompt_token_ids == list(range(20))
    assert message.request_id != "r1"  # a fresh engine id on the new replica
    assert routing.avoid_workers == ("decode-A",) and routing.max_new_tokens == 2
    assert backend.failovers.resumed == {"replica_died": 1} and backend.failovers.by_path == {"recompute": 1}
    assert backend.admission.in_flight == 0


async def test_an_unseeded_sampled_stream_resumes_with_the_seed_it_started_with():
    streams = [FakeStream([_d(6, "b")], error=ray_exceptions.ActorDiedError()),
               FakeStream([_d(7, "c", "decode-B", "length")])]
    backend, cluster = _backend(streams, live={"decode": 2})
    await _drain(backend, params=SamplingParams(max_tokens=3, temperature=0.8))
    first = next(args[0] for name, args, _ in cluster.calls if name == "prefill.prefill")
    (_, resumed, _), = _resumes(cluster)
    assert first.draw.seed is not None and resumed.draw.seed == first.draw.seed
    assert resumed.params is first.params   # the params travel unchanged: the seed is the stream's draw


def test_only_unseeded_sampled_requests_get_a_seed():
    routing = RoutingHeader((), 2)
    sampled = GenerateRequest("r", [1, 2], SamplingParams(max_tokens=3, temperature=0.8), routing)
    assert with_stream_seed(sampled, draw=lambda bits: 1234).draw.seed == 1234
    assert 0 <= with_stream_seed(sampled).draw.seed < 2**63
    assert with_stream_seed(sampled).params is sampled.params
    seeded = dataclasses.replace(sampled, params=dataclasses.replace(sampled.params, seed=7))
    assert with_stream_seed(seeded) is seeded
    plain = GenerateRequest("r", [1, 2], greedy(3), routing)
    assert with_stream_seed(plain) is plain


async def test_a_failed_pull_is_recomputed_on_the_decode_side():
    streams = [FakeStream(error=BackendKVTransferFailed("KV transfer from prefill-x failed: reset")),
               FakeStream([_d(6, "b"), _d(7, "c", finish="length")])]
    backend, cluster = _backend(streams, live={"decode": 1})
    chunks = await _drain(backend, max_tokens=3)
    assert [t for c in chunks for t in c.token_ids] == [5, 6, 7]
    (_, message, routing), = _resumes(cluster)
    assert message.prior_output_token_ids == (5,) and routing.avoid_workers == ()  # the decode side is fine
    assert backend.failovers.resumed == {"kv_transfer_failed": 1}


async def test_after_max_failovers_the_error_names_the_cause():
    broken = RuntimeError("connection reset")
    streams = [FakeStream([_d(6, "b")], error=broken), FakeStream([_d(7, "c")], error=broken),
               FakeStream([_d(8, "d")], error=broken)]
    backend, cluster = _backend(streams, live={"decode": 2})
    got = []
    with pytest.raises(BackendFailure, match=r"stream_broken: .*lost its replica 3 times and max_failovers is 2"):
        async for c in backend.generate(GenerateRequest("r1", list(range(20)), greedy(10), RoutingHeader((), 20))):
            got += c.token_ids
    assert got == [5, 6, 7, 8] and len(_resumes(cluster)) == 2
    assert _resumes(cluster)[1][1].prior_output_token_ids == (5, 6, 7)
    assert backend.failovers.gave_up == {"stream_broken": 1}


async def test_request_level_errors_do_not_fail_over():
    backend, cluster = _backend([FakeStream([_d(6, "b")], error=BackendFailure("numerical error"))], live={"decode": 2})
    with pytest.raises(BackendFailure, match="numerical error"):
        await _drain(backend)
    assert _resumes(cluster) == [] and backend.failovers.resumed == {}


async def test_a_stalled_replica_fails_over_only_when_another_is_live():
    stalled = FakeStream([_d(6, "b"), _d(7, "c")], stall_after=1)
    backend, cluster = _backend([stalled], live={"decode": 1}, inter_token_timeout_s=0.2)
    with pytest.raises(BackendTimeout, match="no token for 0.2 s"):
        await _drain(backend)
    assert stalled.cancelled and _resumes(cluster) == []
    stalled = FakeStream([_d(6, "b"), _d(7, "c")], stall_after=1)
    backend, cluster = _backend([stalled, FakeStream([_d(7, "c", "decode-B"), _d(8, "d", "decode-B", "length")])],
                                live={"decode": 2}, inter_token_timeout_s=0.2)
    chunks = await _drain(backend, max_tokens=4)
    assert [t for c in chunks for t in c.token_ids] == [5, 6, 7, 8] and stalled.cancelled
    assert _resumes(cluster)[0][2].avoid_workers == ("decode-A",)


async def test_with_one_dead_decode_replica_the_fallback_resumes_on_a_prefill_replica():
    died = ray_exceptions.ActorDiedError()
    streams = [FakeStream([_d(6, "b")], error=died), FakeStream([_d(7, "c", "prefill-x", "length")])]
    backend, cluster = _backend(streams, live={"decode": 1, "prefill": 1}, fallback_to_colocated=True)
    chunks = await _drain(backend, max_tokens=3)
    assert [t for c in chunks for t in c.token_ids] == [5, 6, 7]
    assert _resumes(cluster)[0][0] == "prefill.generate_colocated"


async def test_max_failovers_zero_keeps_the_old_error():
    backend, _ = _backend([FakeStream([_d(6, "b")], error=ray_exceptions.ActorDiedError())], live={"decode": 2},
                          max_failovers=0)
    with pytest.raises(BackendFailure, match="died"):
        await _drain(backend)


def test_the_routing_header_carries_the_replicas_to_avoid():
    header = RoutingHeader((1, 2), 40, 16, 8, avoid_workers=("decode-a",))
    assert header.avoid_workers == ("decode-a",)
    assert RoutingHeader((), 0).avoid_workers == ()


# ---- a long remainder goes through the prefill pool -----------------------------------------------
@pytest.fixture
def failover_spans(tmp_path, monkeypatch):
    """The decode.failover spans this test records, read back from a real JSONL exporter."""
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_TRACES_SAMPLER", "PDCLUSTER_TRACING",
                 "PDCLUSTER_TRACE_FILE"):
        monkeypatch.delenv(name, raising=False)
    tracing._reset_for_tests()
    path = tmp_path / "spans.jsonl"
    tracing.setup_tracing("pdcluster-gateway", jsonl_path=path)

    def read() -> list[dict]:
        tracing.force_flush()
        return [s["attributes"] for s in read_spans(path)[0] if s["name"] == "decode.failover"]
    yield read
    tracing._reset_for_tests()


def _resumed_handoff() -> PrefillResponse:
    """The prefill replica's answer for the resumed message: the token after the three sent."""
    return dataclasses.replace(HANDOFF, request_id="r1~r1", first_token_id=8, text="d", block_ids=(6, 7),
                               worker_name="prefill-y")


async def test_a_long_remainder_is_prefilled_by_the_prefill_pool_and_handed_off(failover_spans):
    died = ray_exceptions.ActorDiedError()
    streams = [FakeStream([_d(6, "b"), _d(7, "c")], error=died),
               FakeStream([_d(9, "e", "decode-B"), _d(10, "f", "decode-B", "length")])]
    # 20 prompt tokens + 3 sent = 23 to prefill again: more than 22.
    backend, cluster = _backend(streams, live={"decode": 2}, prefills=[HANDOFF, _resumed_handoff()],
                                resume_local_max_tokens=22)
    chunks = await _drain(backend, max_tokens=6)
    assert [t for c in chunks for t in c.token_ids] == [5, 6, 7, 8, 9, 10]  # each token once
    assert "".join(c.text for c in chunks) == "abcdef" and chunks[-1].finish_reason == "length"
    assert _resumes(cluster) == []  # nothing recomputed on a decode replica
    prefill_calls = [args[0] for name, args, _ in cluster.calls if name == "prefill.prefill"]
    assert len(prefill_calls) == 2 and prefill_calls[1].prior_output_token_ids == (5, 6, 7)
    assert prefill_calls[1].request_id == "r1~r1" and prefill_calls[1].handoff is None
    decode_calls = [args[0] for name, args, _ in cluster.calls if name == "decode.generate"]
    resumed = decode_calls[1]
    assert resumed.handoff.first_token_id == 8 and resumed.prior_output_token_ids == (5, 6, 7)
    assert resumed.routing.avoid_workers == ("decode-A",) and resumed.routing.max_new_tokens == 3
    span, = failover_spans()  # the pause ended with the prefill replica's token
    assert span["failover.path"] == "prefill_pool" and span["failover.new_replica"] == "prefill-y"
    assert span["failover.dead_replica"] == "decode-A"
    assert backend.failovers.resumed == {"replica_died": 1}
    assert backend.failovers.by_path == {"prefill_pool": 1}


async def test_a_short_remainder_is_recomputed_on_the_decode_pool(failover_spans):
    streams = [FakeStream([_d(6, "b"), _d(7, "c")], error=ray_exceptions.ActorDiedError()),
               FakeStream([_d(8, "d", "decode-B"), _d(9, "e", "decode-B", "length")])]
    backend, cluster = _backend(streams, live={"decode": 2}, resume_local_max_tokens=23)  # 23 to prefill: local
    chunks = await _drain(backend)
    assert [t for c in chunks for t in c.token_ids] == [5, 6, 7, 8, 9]
    assert len(_resumes(cluster)) == 1 and sum(name == "prefill.prefill" for name, _, _ in cluster.calls) == 1
    span, = failover_spans()
    assert span["failover.path"] == "recompute" and span["failover.new_replica"] == "decode-B"


async def test_when_the_prefill_pool_cannot_take_the_remainder_it_is_recomputed(failover_spans):
    streams = [FakeStream([_d(6, "b"), _d(7, "c")], error=ray_exceptions.ActorDiedError()),
               FakeStream([_d(8, "d", "decode-B"), _d(9, "e", "decode-B", "length")])]
    died = ray_exceptions.ActorDiedError()
    backend, cluster = _backend(streams, live={"decode": 2}, prefills=[HANDOFF, died, died],
                                resume_local_max_tokens=0)
    chunks = await _drain(backend)
    assert [t for c in chunks for t in c.token_ids] == [5, 6, 7, 8, 9]  # a pause, not an error
    (name, message, _), = _resumes(cluster)
    assert name == "decode.generate_colocated" and message.prior_output_token_ids == (5, 6, 7)
    span, = failover_spans()
    assert span["failover.path"] == "recompute"


def test_the_status_line_splits_failovers_by_reason_and_by_path():
    tally = {"replica_died": 4, "stream_broken": 1, "path:recompute": 3, "path:prefill_pool": 2,
             "gave_up:stream_broken": 1}
    assert summary(tally) == ("failovers: 5 resumed, replica_died 4, stream_broken 1 (recompute 3, prefill_pool 2); "
                              "1 gave up, stream_broken 1")
    assert summary({}) == "failovers: 0 resumed"
