"""Redis going away, slowing down and coming back: routing never fails, the
index re-syncs.  Also the RedisServer utility itself."""

import asyncio
import os
import socket
import threading
import time

from pdcluster.prefix_store.index import HeartbeatStatus
from pdcluster.prefix_store.publisher import KVEventPublisher
from pdcluster.prefix_store.redis_index import RedisPrefixIndex
from pdcluster.prefix_store.redis_server import RedisServer
from pdcluster.prefix_store.worker_id import WorkerId

H = [500 + i for i in range(6)]
TIMEOUT_S = 0.05


def make_index(server, model):
    return RedisPrefixIndex(server.url, cluster="test", model=model, lookup_timeout_s=TIMEOUT_S,
                            write_timeout_s=0.3, retry_after_s=0.2)


async def timed_lookup(index, hashes):
    t0 = time.monotonic()
    result = await index.lookup(hashes)
    return result, time.monotonic() - t0


async def test_killing_redis_degrades_lookups_and_republish_restores_them(redis_server, redis_outage, unique_model):
    index = make_index(redis_server, unique_model)
    pub = KVEventPublisher(index, WorkerId("engine", 1), heartbeat_ttl_s=30.0)
    pub.on_event("stored", H[:4])
    assert await pub.sync_once()
    assert (await index.lookup(H)).matched_blocks == {"engine": 4}

    redis_outage.kill()
    result, elapsed_s = await timed_lookup(index, H)
    assert result.matched_blocks == {} and result.degraded
    assert elapsed_s < TIMEOUT_S + 0.1
    result, elapsed_s = await timed_lookup(index, H)           # marked down: answered at once
    assert result.degraded and elapsed_s < 0.01
    assert index.counters.lookup_failures == 1 and index.counters.lookups_skipped == 1

    pub.on_event("stored", H[4:6])                              # the engine keeps running
    assert not await pub.sync_once(heartbeat=True)
    assert pub.counters.heartbeat_failures == 1

    redis_outage.restart()                                       # same port, empty
    await asyncio.sleep(0.25)                                    # past retry_after_s
    assert (await index.lookup(H)).matched_blocks == {}
    assert await pub.sync_once(heartbeat=True)                   # "registered": republish all
    assert pub.counters.resyncs == 2
    assert (await index.lookup(H)).matched_blocks == {"engine": 6}
    await pub.stop()
    await index.close()


def _debug_sleep(server, seconds):
    with socket.create_connection((server.host, server.port)) as s:
        s.sendall(f"AUTH {server.password}\r\nDEBUG SLEEP {seconds}\r\n".encode())
        reply = b""
        while reply.count(b"\r\n") < 2:  # +OK, then DEBUG's reply once the server wakes
            reply += s.recv(16)


async def test_slow_redis_times_out_to_no_matches(redis_server, unique_model):
    index = make_index(redis_server, unique_model)
    w = WorkerId("w", 1)
    assert await index.register(w, ttl_s=30) is HeartbeatStatus.REGISTERED
    assert (await index.lookup(H)).matched_blocks == {}
    sleeper = threading.Thread(target=_debug_sleep, args=(redis_server, 0.4))
    sleeper.start()
    await asyncio.sleep(0.05)
    result, elapsed_s = await timed_lookup(index, H)
    sleeper.join()
    assert result.degraded and result.matched_blocks == {}
    assert elapsed_s < TIMEOUT_S + 0.1
    await asyncio.sleep(0.25)
    assert not (await index.lookup(H)).degraded                 # recovered by itself
    await index.close()


def test_redis_server_utility_starts_restarts_and_leaves_no_process():
    with RedisServer() as server:
        pid, port, password = server.pid, server.port, server.password
        assert server.ping() and server.url == f"redis://:{password}@127.0.0.1:{port}/0"
        server.kill()
        assert not server.is_running() and not server.ping()
        server.start()                                           # same port, same password
        assert server.port == port and server.password == password and server.ping() and server.pid != pid
        pid = server.pid
    assert not server.is_running()
    assert not os.path.exists(f"/proc/{pid}")  # reaped, not a zombie
