"""`vllm bench serve` (vLLM's own benchmark, unmodified) against the default
cluster at the two shapes issue 32 found refused (46 of 48 and 23 of 24
requests answered 429 before): every request completes.

    256 in / 128 out at concurrency 16, 48 requests
    1024 in / 32 out at concurrency 8, 24 requests

A closed loop at a fixed concurrency is a bounded queue, not overload: the
cluster serves it (late where it must), it does not refuse it.  Skipped
when the peer venv is absent (../shared/peer/vllm-cpu.sh setup builds it)."""

from __future__ import annotations

import json
import os

import pytest

from tests.integration.cluster.test_cluster_peer_tools import (PEER_DIR, TOOL_TIMEOUT_S, run_tool, tail,
                                                               tokenizer_dir)  # noqa: F401 - a fixture

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("input_tokens, output_tokens, concurrency, num_prompts",
                         [(256, 128, 16, 48), (1024, 32, 8, 24)])
def test_vllm_bench_serve_race_shapes_complete_every_request(default_cluster, default_url, tokenizer_dir,  # noqa: F811
                                                             tmp_path, input_tokens, output_tokens, concurrency,
                                                             num_prompts):
    vllm = PEER_DIR / "venv" / "bin" / "vllm"
    if not os.access(vllm, os.X_OK):
        pytest.skip(f"peer venv absent: no {vllm}; build it with ../shared/peer/vllm-cpu.sh setup")
    argv = [str(vllm), "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
            "--base-url", default_url, "--model", str(tokenizer_dir),
            "--served-model-name", default_cluster.config.served_model_name, "--tokenizer", str(tokenizer_dir),
            "--dataset-name", "random", "--random-input-len", str(input_tokens),
            "--random-output-len", str(output_tokens), "--ignore-eos", "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--seed", "0", "--disable-tqdm",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "vllm.json"]
    rc, output = run_tool(argv, TOOL_TIMEOUT_S, cwd=tmp_path)
    assert rc == 0, f"vllm bench serve exited {rc}:\n{tail(output)}"
    result = json.loads((tmp_path / "vllm.json").read_text())
    assert (result["completed"], result["failed"]) == (num_prompts, 0), \
        f"vllm bench serve: {result['completed']} completed, {result['failed']} failed:\n{tail(output)}"
    assert result["total_output_tokens"] == num_prompts * output_tokens, tail(output)
