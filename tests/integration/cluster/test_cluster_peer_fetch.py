"""Peer prefix fetch on the directory's cluster (2 prefill + 1 decode,
peer_fetch on): a prompt computed on one prefill replica is then prefilled
by the decode replica (a decode-local prefill) and by the other prefill
replica (a resumed stream's path): both pull its blocks from a peer that
holds them instead of computing them, and their greedy tokens equal the
first replica's, which computed everything.  Nothing leaks."""

from __future__ import annotations

import time
import uuid

import pytest

from pdcluster.router.routing_header import RoutingHeader
from pdcluster.services.cli.cluster_runtime import APP_NAME
from pdcluster.services.sampling_params import SamplingParams
from pdcluster.services.messages import GenerateRequest
from tests.integration.cluster.conftest import board
from tests.integration.cluster.test_cluster_api import wait_no_leaks

pytestmark = pytest.mark.integration
PROMPT = [(7919 * i) % 40000 + 1000 for i in range(331)]  # 20 full blocks + 11 tokens, seen by no other test


def _generate(pool: str, target: str | None) -> tuple[list[int], int]:
    """Greedy tokens of PROMPT from ``pool``'s replica ``target`` (both phases there), and
    the prompt tokens it found cached."""
    from ray import serve

    req = GenerateRequest(f"peer-{uuid.uuid4().hex[:8]}", PROMPT, SamplingParams(max_tokens=8, temperature=0.0),
                          RoutingHeader((), len(PROMPT), 16, 8, target_worker=target))
    stream = serve.get_deployment_handle(pool, APP_NAME).options(stream=True).generate_colocated.remote(req)
    tokens, cached = [], None
    for delta in stream:
        tokens += delta.token_ids
        cached = delta.num_cached_tokens if cached is None else cached
    return tokens, cached


def _counters(cluster, name: str, key: str, at_least: int, wait_s: float = 10.0) -> int:
    """``key`` of replica ``name``'s counters once the board shows at least ``at_least`` (it
    publishes every half second)."""
    deadline = time.monotonic() + wait_s
    while True:
        value = next(s for s in board(cluster) if s["name"] == name)["counters"][key]
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.25)


def _wait_indexed(cluster, holder: str, seed: int, wait_s: float = 60.0) -> None:
    """Until the index lists ``holder`` with PROMPT's 20 full blocks (its publisher flushes every 20 ms;
    the deadline is a hang guard)."""
    import asyncio

    from pdcluster.prefix_store.hashing import hash_prompt_blocks
    from pdcluster.prefix_store.index import make_index

    cfg = cluster.config
    hashes = hash_prompt_blocks(seed, PROMPT, 16)[:20]

    async def matched() -> int:
        index = make_index(cfg.index_url, cluster=cfg.cluster_name, model=cfg.served_model_name)
        try:
            found = await index.lookup(hashes)
        finally:
            await index.close()
        return found.matched_blocks.get(holder, 0)

    deadline = time.monotonic() + wait_s
    while (got := asyncio.run(matched())) < 20:
        assert time.monotonic() < deadline, f"the index lists {got} of the prompt's 20 blocks on {holder}"
        time.sleep(0.05)


def test_a_prefix_cached_on_one_replica_is_pulled_by_the_others_with_the_same_tokens(cluster):
    before = {s["name"]: s for s in wait_no_leaks(cluster)}
    first, second = sorted(n for n, s in before.items() if s["role"] == "prefill")
    [decode] = [n for n, s in before.items() if s["role"] == "decode"]
    pulled_before = {n: s["counters"]["peer_blocks_pulled"] for n, s in before.items()}

    computed, cached = _generate("prefill", first)  # nobody holds it: computed in full
    assert cached == 0 and len(computed) == 8
    _wait_indexed(cluster, first, before[first]["hash_seed"])  # its KV events reached the index

    on_decode, cached = _generate("decode", None)  # a decode-local prefill
    assert on_decode == computed
    assert cached >= 320, cached  # the 20 full blocks came from the peer; only the last 11 tokens computed
    assert _counters(cluster, decode, "peer_blocks_pulled", pulled_before[decode] + 20) - pulled_before[decode] == 20

    on_second, cached = _generate("prefill", second)
    assert on_second == computed and cached >= 320, cached
    assert _counters(cluster, second, "peer_blocks_pulled", pulled_before[second] + 20) > pulled_before[second]

    after = {s["name"]: s for s in wait_no_leaks(cluster, timeout_s=30)}  # every lease released, no block held
    lent = sum(after[n]["counters"]["peer_blocks_lent"] - before[n]["counters"]["peer_blocks_lent"] for n in after)
    assert lent >= 40
    assert all(after[n]["counters"]["peer_fetch_failures"] == before[n]["counters"]["peer_fetch_failures"]
               for n in after)
