"""Peer benchmark tools, unmodified, against the live cluster: each must
finish every request with none failed.

    vllm bench serve   tests/integration/admission/test_vllm_bench_on_default.py
                       (on the default cluster, at issue 32's shapes); it
                       shares this file's tokenizer and tool runner
    guidellm           /v1/chat/completions, from its own venv under
                       ~/.cache/pdcluster-tools, made on first use with pinned
                       versions: installed into .venv it would move click
                       and multidict; skipped when pip cannot install it

Both count tokens with the default model's tokenizer, saved from its GGUF
into a local directory, and run with the Hugging Face hub offline: nothing is
downloaded at run time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.peer]

PEER_DIR = Path(os.environ.get("PEER_DIR", Path.home() / ".cache" / "pdcluster-peer"))
TOOLS_DIR = Path(os.environ.get("PDCLUSTER_TOOLS_DIR", Path.home() / ".cache" / "pdcluster-tools"))
GUIDELLM_VERSION = "0.8.1"
# 8 in flight: within one prefill replica's queue (the cluster fixture's max_queue), so nothing is refused
NUM_REQUESTS, INPUT_TOKENS, OUTPUT_TOKENS, CONCURRENCY = 16, 64, 16, 8
TOOL_TIMEOUT_S = 300
INSTALL_TIMEOUT_S = 900
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}


def run_tool(argv: list[str], timeout_s: float, cwd: Path) -> tuple[int, str]:
    """Runs a tool, echoing its output as it comes (progress), killed after
    timeout_s.  Returns its exit status and whole output."""
    print("$", " ".join(argv), flush=True)
    proc = subprocess.Popen(argv, cwd=cwd, env=os.environ | OFFLINE_ENV, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    killer = threading.Timer(timeout_s, proc.kill)
    killer.start()
    lines = []
    try:
        for line in proc.stdout:
            print("  |", line.rstrip("\n"), flush=True)
            lines.append(line)
        rc = proc.wait()
    finally:
        killer.cancel()
        if proc.poll() is None:   # interrupted: leave nothing running
            proc.kill()
            proc.wait()
    if rc < 0:
        lines.append(f"[killed by the test after {timeout_s:.0f} s]\n")
    return rc, "".join(lines)


def tail(output: str, lines: int = 40) -> str:
    return "\n".join(output.splitlines()[-lines:])


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The default model's tokenizer (with its chat template) and config as a
    Hugging Face directory both tools can load offline (vllm reads the
    config of what it is told is the model)."""
    from transformers import AutoConfig

    from bench.tokenizer import load_tokenizer, locate_default_gguf

    path, gguf = tmp_path_factory.mktemp("tokenizer"), locate_default_gguf()
    load_tokenizer(None).tokenizer.save_pretrained(str(path))
    AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def guidellm() -> Path:
    """The guidellm executable in its own venv, installed once.  torch is
    pinned to ours so pip takes the same (CPU) build rather than a CUDA one."""
    venv = TOOLS_DIR / f"guidellm-{GUIDELLM_VERSION}"
    exe, done = venv / "bin" / "guidellm", venv / ".installed"
    if done.exists() and exe.exists():
        return exe
    shutil.rmtree(venv, ignore_errors=True)  # a half-made venv from an interrupted install
    venv.parent.mkdir(parents=True, exist_ok=True)
    steps = ([sys.executable, "-m", "venv", str(venv)],
             [str(venv / "bin" / "pip"), "install", "--progress-bar", "off", f"guidellm=={GUIDELLM_VERSION}",
              f"torch=={metadata.version('torch')}"])
    print(f"installing guidellm {GUIDELLM_VERSION} into {venv} (once; a few minutes)", flush=True)
    for argv in steps:
        rc, output = run_tool(argv, INSTALL_TIMEOUT_S, cwd=venv.parent)
        if rc != 0:
            shutil.rmtree(venv, ignore_errors=True)
            pytest.skip(f"cannot install guidellm=={GUIDELLM_VERSION} (is a package index reachable?): "
                        f"`{' '.join(argv)}` exited {rc}:\n{tail(output, 15)}")
    done.touch()
    return exe


def test_guidellm_completes_without_failures(cluster, base_url, tokenizer_dir, guidellm, tmp_path):
    report = tmp_path / "guidellm.json"
    argv = [str(guidellm), "run",
            "--backend", f"kind=openai_http,target={base_url},model={cluster.config.served_model_name},"
                         "request_format=/v1/chat/completions,timeout=120",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
            "--data", f"kind=synthetic_text,prompt_tokens={INPUT_TOKENS},output_tokens={OUTPUT_TOKENS}",
            "--profile", f"kind=concurrent,streams={CONCURRENCY}",
            "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
            "--seed", "kind=static,value=0",
            "--output", f"kind=json,path={report}",   # the console summary is always printed too
            "--disable-console-interactive"]
    rc, output = run_tool(argv, TOOL_TIMEOUT_S, cwd=tmp_path)
    assert rc == 0, f"guidellm exited {rc}:\n{tail(output)}"
    benchmarks = json.loads(report.read_text())["benchmarks"]
    totals = [b["metrics"]["request_totals"] for b in benchmarks]
    assert len(totals) == 1, f"expected one benchmark, got {len(totals)}:\n{tail(output)}"
    errors = [r["info"].get("error") for r in benchmarks[0].get("requests", {}).get("errored", [])[:3]]
    assert (totals[0]["successful"], totals[0]["errored"], totals[0]["incomplete"]) == (NUM_REQUESTS, 0, 0), \
        f"guidellm request totals {totals[0]}; first errors {errors}:\n{tail(output)}"
