"""The embedded Redis requires its generated password: a client without it
is refused (NOAUTH); the prefix index, the status board and pool liveness
work with the password URL; and no message or warning shows the password."""

import asyncio
import contextlib
import logging
import os
import socket

import psutil
import pytest
import redis

from pdcluster.prefix_store.events import EventBatch
from pdcluster.prefix_store.redis_index import RedisPrefixIndex
from pdcluster.prefix_store.redis_server import RedisServer, free_port
from pdcluster.prefix_store.worker_id import WorkerId
from pdcluster.services.gateway.liveness import PoolLiveness
from pdcluster.services.pools.status_board import publish_forever, read_board

H = [700 + i for i in range(4)]


def raw_reply(server, command: bytes) -> bytes:
    with socket.create_connection((server.host, server.port), timeout=2) as s:
        s.sendall(command)
        return s.recv(64)


def test_the_embedded_redis_refuses_a_client_without_the_password(redis_server):
    assert redis_server.password and len(redis_server.password) >= 32
    assert raw_reply(redis_server, b"PING\r\n").startswith(b"-NOAUTH")
    assert raw_reply(redis_server, b"KEYS *\r\n").startswith(b"-NOAUTH")
    for url in (f"redis://{redis_server.host}:{redis_server.port}/0",
                f"redis://:guess@{redis_server.host}:{redis_server.port}/0"):
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url, socket_timeout=2).ping()
    assert redis.Redis.from_url(redis_server.url, socket_timeout=2).ping()


def test_the_password_is_neither_on_the_command_line_nor_on_disk(redis_server):
    cmdline = " ".join(psutil.Process(redis_server.pid).cmdline())
    assert redis_server.password not in cmdline and "127.0.0.1" in cmdline
    for root, _, files in os.walk(redis_server._workdir):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                assert redis_server.password.encode() not in f.read(), name


async def test_the_prefix_index_works_with_the_password_url(redis_server, unique_model):
    index = RedisPrefixIndex(redis_server.url, cluster="test", model=unique_model, lookup_timeout_s=0.5)
    w = WorkerId("engine", 1)
    await index.register(w, ttl_s=30)
    await index.publish(w, EventBatch.of(stored=H))
    result = await index.lookup(H)
    assert result.matched_blocks == {"engine": 4} and not result.degraded
    await index.close()


async def test_a_wrong_password_degrades_lookups_and_the_warning_hides_it(redis_server, unique_model, caplog):
    wrong = "not-the-password-" + "x" * 16
    url = f"redis://:{wrong}@{redis_server.host}:{redis_server.port}/0"
    index = RedisPrefixIndex(url, cluster="test", model=unique_model, lookup_timeout_s=0.5)
    with caplog.at_level(logging.WARNING, logger="pdcluster.prefix_store.redis_index"):
        result = await index.lookup(H)
    assert result.degraded and result.matched_blocks == {}
    assert "redis://:***@127.0.0.1" in result.error
    assert wrong not in result.error and wrong not in caplog.text and caplog.text
    await index.close()


async def test_the_status_board_and_pool_liveness_work_with_the_password_url(redis_server, unique_model):
    cluster = unique_model  # a cluster name no other test uses
    status = {"name": "prefill-1", "role": "prefill", "engine_alive": True}
    task = asyncio.create_task(publish_forever(redis_server.url, cluster, "prefill-1", lambda: status))
    try:
        for _ in range(100):
            board = await asyncio.to_thread(read_board, redis_server.url, cluster)
            if board:
                break
            await asyncio.sleep(0.02)
        assert board == [status]
        assert await PoolLiveness(redis_server.url, cluster).live("prefill") == 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    no_password = f"redis://{redis_server.host}:{redis_server.port}/0"
    with pytest.raises(redis.AuthenticationError):
        read_board(no_password, cluster)
    assert await PoolLiveness(no_password, cluster).live("prefill") is None  # unknown, not "none alive"


def test_a_server_without_a_password_is_still_possible():
    with RedisServer(free_port(), require_password=False) as server:
        assert server.password is None and server.url == f"redis://127.0.0.1:{server.port}/0"
        assert server.ping() and raw_reply(server, b"PING\r\n").startswith(b"+PONG")


def test_pdcluster_status_reads_the_0600_state_file_and_prints_only_the_redacted_url(
        redis_server, unique_model, tmp_path, monkeypatch, capsys):
    import argparse
    import json

    from pdcluster.services.cli import status as cli_status
    from pdcluster.services.cli.cluster_runtime import STATE_FILE, write_state
    from pdcluster.services.pools.status_board import put_status_sync

    monkeypatch.chdir(tmp_path)
    write_state({"pid": 1, "redis_url": redis_server.url, "port": 8000, "mode": "disaggregated",
                 "cluster": unique_model, "config": {"index_url": redis_server.url}})
    assert os.stat(STATE_FILE).st_mode & 0o777 == 0o600
    put_status_sync(redis.Redis.from_url(redis_server.url), unique_model, "decode-1",
                    {"name": "decode-1", "role": "decode", "running": 0, "waiting": 0, "kv_blocks_total": 8,
                     "kv_blocks_free": 8, "leased_blocks": 0, "prompt_tokens_cached": 0, "prompt_tokens_computed": 0},
                    ttl_s=30)
    assert cli_status.run_status(argparse.Namespace(json=False)) == 0
    table = capsys.readouterr().out
    assert "decode-1" in table and f"index redis://:***@127.0.0.1:{redis_server.port}/0" in table
    assert cli_status.run_status(argparse.Namespace(json=True)) == 0
    board = capsys.readouterr().out
    assert json.loads(board)[0]["name"] == "decode-1"
    assert redis_server.password not in table + board

    redis_server_down = redis_server.url.replace(f":{redis_server.port}/", f":{free_port()}/")
    write_state({"pid": 1, "redis_url": redis_server_down, "port": 8000, "mode": "colocated", "cluster": "c"})
    with pytest.raises(SystemExit) as exit_:
        cli_status.run_status(argparse.Namespace(json=False))
    assert "redis://:***@127.0.0.1" in str(exit_.value) and redis_server.password not in str(exit_.value)


def test_a_server_leaves_no_working_directory_behind():
    """The workdir (config, log) goes with close(), which the context manager
    and the process's exit both call, even after a plain stop()."""
    server = RedisServer().start()
    workdir = server._workdir
    assert os.path.isdir(workdir) and server.ping()
    server.stop()
    assert os.path.isdir(workdir)  # stop() alone keeps it: start() may be called again
    server.close()
    assert not os.path.exists(workdir)
    with RedisServer() as scoped:
        scoped_dir = scoped._workdir
        assert scoped.ping()
    assert not os.path.exists(scoped_dir)
