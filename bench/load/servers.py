"""Servers a benchmark starts and stops itself: our cluster through
``pdcluster up`` (with a config, or none: the default cluster) and the vLLM-CPU
reference through its script (llama.cpp: llamacpp_server.py), each timed
from launch to ready and measured for resident memory.

    launch --(poll GET /v1/models every 0.25 s)--> ready  (launch_to_ready_s)
    rss_bytes(): RSS summed over the server's whole process tree
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def wait_ready(url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    """Polls ``url`` until it answers 200; raises if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")


def last_line(text: str) -> str:
    """The last non-blank line, stripped (what a crash log ends with)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(empty)"


def tree_rss_bytes(pid: int) -> int:
    """RSS of ``pid`` and all its descendants (shared pages counted per process)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def up_command(config: Path | None, port: int, extra_args: tuple[str, ...] = (),
               checkout: Path | None = None) -> list[str]:
    """The ``pdcluster up`` command line; no --config when ``config`` is None.  ``checkout``: another
    checkout's own ``.venv/bin/pdcluster`` (an older commit's, whose modules may live elsewhere)."""
    with_config = ["--config", str(config)] if config is not None else []
    program = [str(checkout / ".venv" / "bin" / "pdcluster")] if checkout is not None \
        else [sys.executable, "-m", "pdcluster.services.cli.main"]
    return [*program, "up", *with_config, "--port", str(port), *extra_args]


@dataclass
class OurServer:
    """``pdcluster up [--config CONFIG] --port PORT [EXTRA...]`` in its own session;
    no config is what a user gets from a bare ``pdcluster up``."""
    config: Path | None
    port: int
    log: Path
    name: str = "pdcluster"
    launch_to_ready_s: float = 0.0
    # /health: 200 once every pool the mode needs has a live replica (a request sent now succeeds).
    # /v1/models answers about 2.5 s before that, and the first requests sent then took 3 s here.
    ready_path: str = "/health"
    extra_args: tuple[str, ...] = ()  # more `pdcluster up` flags, e.g. ("--weight-dtype", "int8")
    checkout: Path | None = None      # run another checkout (its .venv, its working directory); None: this one
    _proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300) -> None:
        t0 = time.monotonic()
        with open(self.log, "w") as log:
            self._proc = subprocess.Popen(
                up_command(self.config, self.port, self.extra_args, self.checkout), cwd=self.checkout or REPO,
                stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        try:
            wait_ready(self.url + self.ready_path, self._proc, timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}; {self.log}'s last line: {self.log_tail()}") from exc
        self.launch_to_ready_s = time.monotonic() - t0

    def log_tail(self) -> str:
        return last_line(self.log.read_text(errors="replace")) if self.log.is_file() else "(no log)"

    @property
    def pid(self) -> int:
        """The `pdcluster up` process (the root of the cluster's process tree); 0 before start."""
        return self._proc.pid if self._proc else 0

    def rss_bytes(self) -> int:
        return tree_rss_bytes(self.pid) if self.pid else 0

    def stop(self) -> None:
        """SIGTERM (``pdcluster up`` then stops Serve, Ray and Redis), SIGKILL to the group after 60 s."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()


@dataclass
class PeerServer:
    """The vLLM-CPU reference, through ``vllm-cpu.sh serve|stop``."""
    script: Path
    port: int
    name: str = "vLLM"
    launch_to_ready_s: float = 0.0
    serve_args: tuple[str, ...] = ()   # more `vllm serve` flags

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def _env(self) -> dict:
        return os.environ | {"PEER_PORT": str(self.port)}

    def setup(self) -> None:
        subprocess.run(["bash", str(self.script), "setup"], check=True, env=self._env)

    def start(self, timeout_s: float = 600) -> None:
        t0 = time.monotonic()
        subprocess.run(["bash", str(self.script), "serve", *self.serve_args], check=True, env=self._env,
                       timeout=timeout_s)
        wait_ready(self.url + "/v1/models", None, 30)
        self.launch_to_ready_s = time.monotonic() - t0

    def _pid(self) -> int | None:
        pid_file = Path(os.environ.get("PEER_DIR", Path.home() / ".cache" / "pdcluster-peer")) / "serve.pid"
        return int(pid_file.read_text()) if pid_file.exists() else None

    def rss_bytes(self) -> int:
        pid = self._pid()
        return tree_rss_bytes(pid) if pid else 0

    def stop(self) -> None:
        subprocess.run(["bash", str(self.script), "stop"], check=False, env=self._env)
