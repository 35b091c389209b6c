"""pdcluster/services/model_meta.py: a model's shape, weights id and block-hash seed
read without torch; the seed the same as the engine's; the gateway's check
that every replica hashes with its seed."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys

import pytest
import torch

from pdcluster.kernels.kv_quant import KV_CACHE_DTYPES, pool_dtype
from pdcluster.prefix_store.hashing import model_fingerprint
from pdcluster.services.default_model import default_model_path
from pdcluster.services.engine.model.loader import parse_dtype
from pdcluster.services.gateway.seed_check import SeedCheck
from pdcluster.services.model_meta import (K_ROTATION_ID, K_SMOOTHING_ID, MODEL_DTYPES, block_hash_seed, count_parameters,
                                 kv_pool_dtype_name, model_hash_seed, read_model_config, seed_mismatches, weights_id)
from tests.unit.services.serve_fakes import FakeResponse


def test_the_gateway_cli_and_planner_read_models_without_torch():
    code = ("import sys, pdcluster.services.model_meta, pdcluster.services.gateway.deployment, pdcluster.services.cli.model, pdcluster.planning.inputs; "
            "assert 'torch' not in sys.modules, [m for m in sys.modules if m.startswith('torch')][:5]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_reads_the_bundled_gguf_shape():
    path = default_model_path()
    cfg = read_model_config(path)
    assert (cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("llama", 30, 9, 3, 64)
    assert cfg.max_position_embeddings == 8192
    assert count_parameters(path) == 134_515_008


def test_reads_an_hf_directory_and_counts_safetensors_headers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    header = json.dumps({"__metadata__": {}, "a": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 24]},
                         "b": {"dtype": "BF16", "shape": [5], "data_offsets": [24, 34]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(34))
    cfg = read_model_config(tmp_path)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert count_parameters(tmp_path) == 17
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_model_config(tmp_path / "model.safetensors")


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("dtype", sorted(MODEL_DTYPES))
def test_kv_pool_dtype_names_agree_with_the_kernels(kv_cache_dtype, dtype):
    torch_dtype = pool_dtype(kv_cache_dtype, parse_dtype(dtype))
    assert kv_pool_dtype_name(kv_cache_dtype, dtype) == str(torch_dtype).removeprefix("torch.")


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.float32])
def test_the_seed_is_the_engines_whether_given_a_dtype_or_its_name(kv_dtype):
    engine_seed = block_hash_seed("w1", kv_dtype, 16)
    assert block_hash_seed("w1", str(kv_dtype).removeprefix("torch."), 16) == engine_seed
    unsmoothed = model_fingerprint("w1", kv_dtype, 16)   # what the engine hashed before model_meta
    if kv_dtype in (torch.int8, torch.float8_e4m3fn):  # K rotated and smoothed: never a plain block's
        assert engine_seed == model_fingerprint("w1", f"{kv_dtype}+{K_SMOOTHING_ID}+{K_ROTATION_ID}", 16)
        assert engine_seed not in (unsmoothed, model_fingerprint("w1", f"{kv_dtype}+{K_SMOOTHING_ID}", 16))
    else:  # plain pools: the seed a running index already holds
        assert engine_seed == unsmoothed


def test_the_gateway_seed_of_a_model_is_the_engines():
    path = default_model_path()
    engine_seed = block_hash_seed(weights_id(path), pool_dtype("int8", parse_dtype("bfloat16")), 32)
    assert model_hash_seed(path, "bfloat16", "int8", 32) == engine_seed
    assert model_hash_seed(path, "bfloat16", "auto", 32) != engine_seed


def test_seed_mismatches_name_the_replica_and_both_seeds():
    statuses = [{"name": "prefill-a", "role": "prefill", "hash_seed": 7},
                {"name": "decode-b", "role": "decode", "hash_seed": 9},
                {"name": "decode-c", "role": "decode"}]   # has not reported a seed: nothing to compare
    assert seed_mismatches(7, statuses[:1] + statuses[2:]) == []
    [line] = seed_mismatches(7, statuses)
    assert "decode-b" in line and f"{9:#018x}" in line and f"{7:#018x}" in line


class _Board:
    def __init__(self, statuses):
        self.statuses = statuses

    async def read(self):
        return self.statuses


class _StatusHandle:
    def __init__(self, status):
        self.status = self
        self.value = status

    def remote(self):
        return FakeResponse(self.value)


async def test_seed_check_reads_the_board_and_logs_each_mismatch_once(caplog):
    check = SeedCheck(7, _Board([{"name": "p", "role": "prefill", "hash_seed": 8}]), handles={})
    with caplog.at_level(logging.ERROR, logger="pdcluster.gateway"):
        assert len(await check.problems()) == 1
        assert len(await check.problems()) == 1
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    check.board.statuses = [{"name": "p", "role": "prefill", "hash_seed": 7}]
    assert await check.problems() == []


async def test_seed_check_without_a_board_asks_each_pool():
    handles = {"prefill": _StatusHandle({"name": "p", "hash_seed": 7}),
               "decode": _StatusHandle({"name": "d", "hash_seed": 5})}
    [line] = await SeedCheck(7, _Board(None), handles).problems()
    assert "replica d" in line
