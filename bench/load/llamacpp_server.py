"""llama.cpp's llama-server as a race peer, started and stopped through the
shared script (``../shared/peer/llamacpp.sh serve VARIANT | stop``, port
PEER_PORT).  ``serve VARIANT`` runs ``$LLAMACPP_DIR/smollm2-VARIANT.gguf``
with the script's flags (2 threads, 16 slots, continuous batching), so every
variant is launched the same way:

    bf16, q4_1   made by the script's ``setup``
    q8_0         made here (``ensure_q8_0``): the built llama-quantize requantizes the
                 bf16 GGUF to Q8_0 in the same directory; the script is not edited

Launch-to-ready is timed like the other servers (script start to GET
/v1/models answering 200); RSS is summed over the server's process tree.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.load.servers import last_line, tree_rss_bytes, wait_ready


def llamacpp_dir() -> Path:
    return Path(os.environ.get("LLAMACPP_DIR", Path.home() / ".cache" / "pdcluster-llamacpp"))


def built_binary(peer_dir: Path, name: str) -> Path | None:
    """The script builds into llama_cpp_python-<version>/vendor/llama.cpp/build/bin."""
    found = sorted(peer_dir.glob(f"llama_cpp_python-*/vendor/llama.cpp/build/bin/{name}"))
    return found[-1] if found else None


def missing_reason(peer_dir: Path, variant: str = "bf16") -> str | None:
    """Why this variant cannot be served, or None when it can."""
    if built_binary(peer_dir, "llama-server") is None:
        return f"llama-server is not built in {peer_dir}: run `bash ../shared/peer/llamacpp.sh setup` (~10 min)"
    if not (peer_dir / f"smollm2-{variant}.gguf").is_file():
        return f"{peer_dir}/smollm2-{variant}.gguf is missing: run `bash ../shared/peer/llamacpp.sh setup`"
    return None


def ensure_q8_0(peer_dir: Path) -> str | None:
    """Makes smollm2-q8_0.gguf from the bf16 GGUF once; returns why it could not, else None."""
    out = peer_dir / "smollm2-q8_0.gguf"
    if out.is_file():
        return None
    quantize = built_binary(peer_dir, "llama-quantize")
    source = peer_dir / "smollm2-bf16.gguf"
    if quantize is None or not source.is_file():
        return f"llama-quantize or {source.name} missing in {peer_dir}: run the script's setup"
    tmp = out.with_suffix(".gguf.part")
    done = subprocess.run([str(quantize), "--allow-requantize", str(source), str(tmp), "Q8_0"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        return f"llama-quantize exited {done.returncode}: {last_line(done.stderr + done.stdout)}"
    tmp.rename(out)
    return None


@dataclass
class LlamaCppServer:
    """One llama-server variant through ``llamacpp.sh serve VARIANT``."""
    script: Path
    port: int
    variant: str = "bf16"
    peer_dir: Path | None = None
    launch_to_ready_s: float = 0.0

    @property
    def name(self) -> str:
        return f"llama.cpp {self.variant}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def _dir(self) -> Path:
        return self.peer_dir or llamacpp_dir()

    @property
    def _env(self) -> dict:
        return os.environ | {"PEER_PORT": str(self.port), "LLAMACPP_DIR": str(self._dir)}

    def log_tail(self) -> str:
        log = self._dir / "serve.log"
        return last_line(log.read_text(errors="replace")) if log.is_file() else "(no serve.log)"

    def start(self, timeout_s: float = 300) -> None:
        """Raises RuntimeError naming the log's last line when the server does not come up."""
        t0 = time.monotonic()
        done = subprocess.run(["bash", str(self.script), "serve", self.variant], env=self._env,
                              capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"llama-server {self.variant} did not start (serve exited {done.returncode}); "
                               f"log's last line: {self.log_tail()}")
        wait_ready(self.url + "/v1/models", None, 30)
        self.launch_to_ready_s = time.monotonic() - t0

    def rss_bytes(self) -> int:
        pid_file = self._dir / "serve.pid"
        return tree_rss_bytes(int(pid_file.read_text())) if pid_file.is_file() else 0

    def stop(self) -> None:
        subprocess.run(["bash", str(self.script), "stop"], check=False, env=self._env)
