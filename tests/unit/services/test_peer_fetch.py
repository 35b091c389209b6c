"""Peer prefix fetch between two replicas in one process (no Ray, no model):
real KV pools, lease tables and peer imports, the real socket-fallback
transfer backend with the cluster secret, the in-memory prefix index.  The
puller gets the holder's bytes into its prefix cache under a lease the
holder then drops; every failure (holder gone, lease ran out, broken
transfer, no room) is counted, recomputes, and leaves both pools with every
block accounted for."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from pdcluster.prefix_store.events import EventBatch
from pdcluster.prefix_store.hashing import hash_prompt_blocks
from pdcluster.prefix_store.memory_index import InMemoryPrefixIndex
from pdcluster.prefix_store.worker_id import WorkerId
from pdcluster.router.peer_fetch import DEFAULT_PULL_OVERHEAD_S, DEFAULT_PULL_S_PER_BLOCK
from pdcluster.router.routing_header import RoutingHeader
from pdcluster.services.engine.engine import Engine
from pdcluster.services.engine.kv_cache import KVCache, KVCacheSpec
from pdcluster.services.engine.lease import LeaseTable
from pdcluster.services.engine.peer_import import PeerImports
from pdcluster.services.sampling_params import SamplingParams
from pdcluster.services.messages import GenerateRequest
from pdcluster.services.pools.peer_fetch import PeerFetcher, lend_prefix
from pdcluster.services.pools.pull_estimate import PullEstimate
from pdcluster.services.pools.worker import WorkerCounters
from pdcluster.transfer import KVLayout, create_backend

SECRET = b"unit-test-cluster-secret-0123456789"
SEED, BS = 4242, 4
TOKENS = list(range(200, 227))  # 6 full blocks + 3 tokens
HASHES = hash_prompt_blocks(SEED, TOKENS, BS)


class _EngineThread:
    """AsyncEngine's surface that the fetch uses, running each call inline."""

    def __init__(self, engine: Engine):
        self.engine = engine

    async def run(self, fn):
        return fn(self.engine)

    async def run_or_undo(self, fn, undo):
        return fn(self.engine)

    async def release_quarantine(self, key: int) -> int:
        return self.engine.release_quarantine(key)

    async def release_lease(self, lease_id: str) -> bool:
        return self.engine.release_lease(lease_id)


def _engine(num_blocks: int) -> Engine:
    """An Engine with its KV bookkeeping and no model (what peer fetch touches)."""
    e = Engine.__new__(Engine)
    e.kv = KVCache(KVCacheSpec(num_blocks, BS, 2, 1, 8, torch.float32))
    e.kv_spec, e.hash_seed, e.tiers = e.kv.spec, SEED, None
    e.leases = LeaseTable(e.kv.free, default_ttl_s=30.0)
    e.peer_imports = PeerImports(e.kv, SEED)
    e._quarantine, e._quarantine_key = {}, 0
    e.scheduler = SimpleNamespace(running=[object(), object()])  # two requests decoding: a block kept for each
    return e


@dataclass
class _Replica:
    name: str
    engine: Engine
    transfer: object
    index: InMemoryPrefixIndex
    counters: WorkerCounters = field(default_factory=WorkerCounters)
    pull_estimate: PullEstimate = field(default_factory=lambda: PullEstimate(DEFAULT_PULL_S_PER_BLOCK))
    _prefill_rate_tps: float = 100.0  # a slow prefill: 24 tokens take 0.24 s, a pull is worth it

    def __post_init__(self):
        self.aengine = _EngineThread(self.engine)

    def prompt_hashes(self, request):
        return request.block_hashes


def _replica(name: str, index, num_blocks: int = 16) -> _Replica:
    engine = _engine(num_blocks)
    backend = create_backend("fallback", peer_id=name, secret=SECRET, timeout_s=5.0)
    backend.register_pool(engine.kv.kv_pool, KVLayout.of_pool(engine.kv.kv_pool, SEED), lease_guard=engine.leases)
    return _Replica(name, engine, backend, index)


def _request(request_id: str = "r1") -> GenerateRequest:
    return GenerateRequest(request_id, TOKENS, SamplingParams(max_tokens=4),
                           RoutingHeader(tuple(HASHES), len(TOKENS), BS))


@pytest.fixture
async def pair():
    index = InMemoryPrefixIndex()
    holder, puller = _replica("prefill-a", index), _replica("decode-b", index)
    # The holder computed the prompt: its bytes are something to recognise, and the index knows.
    blocks = holder.engine.kv.allocate(len(HASHES))
    for i, b in enumerate(blocks):
        holder.engine.kv.kv_pool[b].fill_(float(i + 1))
    holder.engine.kv.commit(blocks, HASHES, TOKENS)
    holder.engine.kv.free(blocks)
    wid = WorkerId(holder.name, 1)
    await index.register(wid, ttl_s=60.0)
    batch = EventBatch()
    batch.add("stored", HASHES)
    await index.publish(wid, batch)
    yield holder, puller, blocks
    for r in (holder, puller):
        r.transfer.close()


def _lend_from(holder: _Replica):
    async def call(role, ask):
        assert role == "prefill" and ask.routing.target_worker == holder.name
        return await lend_prefix(holder, ask)
    return call


def _settle(holder: _Replica) -> None:
    """The holder's notification loop, once: each pull's notification drops its lease."""
    for n in holder.transfer.wait_notifications(2.0):
        holder.engine.release_lease(n.lease_id)


def _accounted(r: _Replica) -> None:
    kv = r.engine.kv
    kv.check_integrity()
    held = list(r.engine.leases.held_block_ids()) + r.engine.peer_imports.held_block_ids()
    held += [b for blocks in r.engine._quarantine.values() for b in blocks]
    assert [kv.ref_count(b) for b in range(kv.num_total_blocks)] == [held.count(b) for b in range(kv.num_total_blocks)]


async def test_the_puller_gets_the_holders_blocks_into_its_prefix_cache(pair):
    holder, puller, holder_blocks = pair
    fetcher = PeerFetcher(puller, _lend_from(holder), min_blocks=2)
    result = await fetcher.fetch(_request())
    assert (result.outcome, result.num_blocks, result.holder) == ("pulled", 6, "prefill-a"), result
    match = puller.engine.kv.match_prefix(HASHES, TOKENS)
    assert match.num_blocks == 6  # admission finds them as a local hit
    for i, b in enumerate(match.block_ids):
        assert torch.equal(puller.engine.kv.kv_pool[b], holder.engine.kv.kv_pool[holder_blocks[i]])
    c = puller.counters
    assert (c.peer_fetches, c.peer_blocks_pulled, c.peer_fetch_failures) == (1, 6, 0) and c.peer_bytes_pulled > 0
    assert holder.counters.peer_blocks_lent == 6
    await asyncio.to_thread(_settle, holder)
    assert len(holder.engine.leases) == 0
    _accounted(holder)
    _accounted(puller)
    # The next one finds them here: nothing to pull.
    assert (await fetcher.fetch(_request("r2"))).outcome == "skipped"


async def test_a_fetch_measured_dearer_than_recomputing_is_not_asked_for(pair):
    """The rule weighs this replica's own fetches: the first one measures what asking costs beyond
    the transfer; made to cost more than recomputing the blocks, the next prompt is computed here,
    and the puller holds nothing from the holder."""
    holder, puller, _ = pair
    fetcher = PeerFetcher(puller, _lend_from(holder), min_blocks=2)
    assert fetcher.overhead.seconds() == DEFAULT_PULL_OVERHEAD_S  # nothing measured yet
    first = await fetcher.fetch(_request())
    assert first.outcome == "pulled" and 0 <= first.transfer_s <= first.seconds
    assert fetcher.overhead.seconds() == pytest.approx(first.seconds - first.transfer_s)
    await asyncio.to_thread(_settle, holder)
    recompute_s = len(HASHES) * puller.engine.kv_spec.block_size * fetcher._recompute_s_per_token()
    fetcher.overhead.observe(recompute_s * 10)
    fetcher.overhead.observe(recompute_s * 10)  # the median of three: the dear ones
    puller.engine.kv.reset_prefix_cache()  # the pulled blocks gone: there is something to pull again
    assert puller.engine.kv.match_prefix(HASHES, TOKENS).num_blocks == 0
    assert (await fetcher.fetch(_request("r2"))).outcome == "skipped"
    # the contrast: with nothing measured, the same prompt is pulled
    again = await PeerFetcher(puller, _lend_from(holder), min_blocks=2).fetch(_request("r3"))
    assert again.outcome == "pulled", again
    await asyncio.to_thread(_settle, holder)
    _accounted(puller)


async def test_only_the_blocks_past_the_pullers_own_are_pulled(pair):
    holder, puller, _ = pair
    mine = puller.engine.kv.allocate(2)
    puller.engine.kv.commit(mine, HASHES[:2], TOKENS)
    puller.engine.kv.free(mine)
    result = await PeerFetcher(puller, _lend_from(holder)).fetch(_request())
    assert (result.outcome, result.num_blocks) == ("pulled", 4)
    assert puller.engine.kv.match_prefix(HASHES, TOKENS).block_ids[:2] == tuple(mine)
    await asyncio.to_thread(_settle, holder)
    _accounted(holder)
    _accounted(puller)


async def test_a_holder_that_is_gone_costs_a_recompute(pair):
    holder, puller, _ = pair

    async def gone(role, ask):
        raise RuntimeError("replica died")
    result = await PeerFetcher(puller, gone).fetch(_request())
    assert result.outcome == "failed" and "replica died" in result.reason
    assert puller.counters.peer_fetch_failures == 1 and puller.engine.kv.num_cached_blocks == 0
    _accounted(holder)
    _accounted(puller)


async def test_a_holder_that_evicted_the_prefix_lends_nothing(pair):
    holder, puller, _ = pair
    holder.engine.kv.reset_prefix_cache()  # the index still says it holds it
    result = await PeerFetcher(puller, _lend_from(holder)).fetch(_request())
    assert result.outcome == "failed" and "no longer holds" in result.reason
    _accounted(holder)
    _accounted(puller)


async def test_a_broken_transfer_gives_every_block_back_and_releases_the_lease(pair):
    holder, puller, _ = pair

    async def lend_then_die(role, ask):
        lease = await lend_prefix(holder, ask)
        holder.transfer.close()  # the holder's block server goes away before the read
        return lease
    result = await PeerFetcher(puller, lend_then_die).fetch(_request())
    assert result.outcome == "failed" and "pull from prefill-a failed" in result.reason
    assert puller.engine.kv.num_cached_blocks == 0 and puller.engine.kv.num_free_blocks == 16
    _accounted(puller)
    _accounted(holder)  # its lease still pins them: the TTL frees them (the release could not reach it)


async def test_a_lease_that_ran_out_at_the_holder_is_never_read(pair):
    holder, puller, _ = pair

    async def short_lease(role, ask):
        lease = await lend_prefix(holder, ask)
        holder.engine.leases.shorten(ask.lease_id, 0.01)  # the holder's clock says it is over
        await asyncio.sleep(0.05)
        return lease
    result = await PeerFetcher(puller, short_lease).fetch(_request())
    assert result.outcome == "failed" and "expired" in result.reason, result
    assert puller.engine.kv.num_cached_blocks == 0 and puller.engine.kv.num_free_blocks == 16
    _accounted(puller)


async def test_a_lease_too_short_to_pull_in_is_released_unread(pair):
    holder, puller, _ = pair

    async def nearly_over(role, ask):
        lease = await lend_prefix(holder, ask)
        return dataclasses.replace(lease, lease_deadline_unix=time.time() + 0.1)
    result = await PeerFetcher(puller, nearly_over).fetch(_request())
    assert result.outcome == "failed" and "ran out" in result.reason, result
    for _ in range(20):
        await asyncio.to_thread(_settle, holder)
        if not len(holder.engine.leases):
            break
    assert len(holder.engine.leases) == 0
    _accounted(holder)
    _accounted(puller)


async def test_no_room_for_the_pulled_blocks_releases_the_lease_at_once(pair):
    holder, puller, _ = pair
    puller.engine.kv.allocate(12)  # 4 left, 2 of them kept for the running requests
    result = await PeerFetcher(puller, _lend_from(holder)).fetch(_request())
    assert result.outcome == "failed" and "no room" in result.reason
    for _ in range(20):
        await asyncio.to_thread(_settle, holder)
        if not len(holder.engine.leases):
            break
    assert len(holder.engine.leases) == 0  # released, not left to its TTL
    _accounted(holder)


async def test_a_lease_naming_blocks_the_holder_lacks_costs_a_recompute_not_the_request(pair):
    holder, puller, _ = pair

    async def bad_lease(role, ask):
        lease = await lend_prefix(holder, ask)
        return dataclasses.replace(lease, block_ids=(999,) * len(lease.block_ids))
    result = await PeerFetcher(puller, bad_lease).fetch(_request())
    assert result.outcome == "failed" and puller.counters.peer_fetch_failures == 1
    assert puller.engine.kv.num_free_blocks == 16 and puller.engine.kv.num_cached_blocks == 0
    _accounted(puller)


async def test_a_request_that_leaves_mid_pull_gives_the_blocks_back_once_the_transfer_stopped(pair):
    holder, puller, _ = pair
    real_pull = puller.transfer.pull
    started, go_on = threading.Event(), threading.Event()

    def held_pull(*args, **kwargs):   # the request leaves while the transfer runs, whatever the machine's speed
        started.set()
        go_on.wait(30)
        return real_pull(*args, **kwargs)
    puller.transfer.pull = held_pull
    task = asyncio.create_task(PeerFetcher(puller, _lend_from(holder)).fetch(_request()))
    assert await asyncio.to_thread(started.wait, 30)
    assert len(puller.engine.peer_imports.held_block_ids()) == 6  # the transfer writes into them
    task.cancel()
    go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert puller.engine.peer_imports.held_block_ids() == [] and puller.engine.kv.num_cached_blocks == 0
    assert puller.engine.kv.num_free_blocks == 16
    await asyncio.to_thread(_settle, holder)  # the pull finished and notified: the lease goes
    assert len(holder.engine.leases) == 0
    _accounted(holder)
    _accounted(puller)
