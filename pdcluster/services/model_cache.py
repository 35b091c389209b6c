"""A GGUF file converted once into a local directory, so that every later
load (each replica, the gateway, the CLI, each test) skips the ``gguf``
package's metadata parse (it reads the 49k-entry vocabulary and merges
arrays field by field: tens of seconds) and the dequantization::

    <cache root>/<key>/
        model_config.json    our ModelConfig, read from the GGUF metadata once
        model.safetensors    every tensor dequantized to fp32, Hugging Face names, q/k rows unpermuted
        tokenizer/           the tokenizer as transformers saves it (tokenizer.json, chat template)
        weights-<scheme>.safetensors   the same weights in another scheme (int8 projections:
                             pdcluster/services/engine/model/weight_quant.py), made once on first use (derived_file)

    key         <file stem>-<blake2b(file name, size, mtime, FORMAT_VERSION)>
    cache root  $PDCLUSTER_MODEL_CACHE, else ~/.cache/pdcluster/models

The tensors are exactly what the direct read produced (fp32 dequantized
values, cast to the model dtype at load), so outputs do not change.  One
process converts, holding an flock on ``<key>.lock``; the others wait on the
lock and read.  A conversion is written to a temporary directory and renamed
into place, so a directory at ``<key>`` is always complete.  The weights'
identity (``model_meta.weights_id``: block-hash seeds) is still the GGUF's.

Torch-free: numpy, safetensors' numpy API, and transformers for the tokenizer."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from pdcluster.services.engine.model.config import ModelConfig

FORMAT_VERSION = 1  # bump when the directory's contents change meaning
CACHE_ENV = "PDCLUSTER_MODEL_CACHE"
CONFIG_FILE, TENSORS_FILE, TOKENIZER_DIR = "model_config.json", "model.safetensors", "tokenizer"


class ModelCacheError(OSError):
    """The cache root cannot be written; the message names the fix."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pdcluster" / "models")


def derived_dir() -> Path:
    """Where files computed from weights are kept, each named by the digest of what it was
    computed from (e.g. the greedy head's screen: pdcluster/kernels/greedy_head_file.py)."""
    return cache_root() / "derived"


def cache_key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{gguf_path.name}:{st.st_size}:{st.st_mtime_ns}:{FORMAT_VERSION}".encode())
    return f"{gguf_path.stem}-{h.hexdigest()}"


def converted(gguf_path: Path) -> Path:
    """The converted directory of ``gguf_path``, converting it first if no
    process has (blocks while another process converts it)."""
    root = cache_root()
    final = root / cache_key(gguf_path)
    if final.is_dir():
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{final.name}.lock", "w")
    except OSError as e:
        raise ModelCacheError(f"cannot write the converted-model cache at {root} ({e}); "
                              f"set {CACHE_ENV} to a writable directory") from e
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_dir():  # another process converted it while this one waited
            return final
        for stale in root.glob(f"{final.name}.tmp-*"):  # left by a converter that was killed
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f"{final.name}.tmp-"))
        print(f"converting {gguf_path.name} once into {final} (about a minute; later loads take seconds)",
              file=sys.stderr, flush=True)
        try:
            _convert(gguf_path, tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _convert(gguf_path: Path, out: Path) -> None:
    import gguf
    from safetensors.numpy import save_file

    from pdcluster.services.engine.model.gguf_format import read_gguf_config

    reader = gguf.GGUFReader(str(gguf_path))
    cfg = read_gguf_config(reader)
    save_file(_hf_tensors(reader, cfg), str(out / TENSORS_FILE))
    _save_tokenizer(gguf_path, out / TOKENIZER_DIR)
    (out / CONFIG_FILE).write_text(json.dumps(asdict(cfg), indent=1))


def _hf_tensors(reader, cfg: ModelConfig) -> dict:
    """Every tensor the model uses, dequantized to fp32 under its Hugging Face name."""
    import gguf
    import numpy as np

    from pdcluster.services.engine.model.gguf_format import hf_name, unpermute

    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute(w, cfg.num_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute(w, cfg.num_kv_heads)
        tensors[name] = np.ascontiguousarray(w)
    return tensors


def _save_tokenizer(gguf_path: Path, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    tok.save_pretrained(str(out))


def cached_config(gguf_path: Path) -> ModelConfig:
    """The model's shape, from the converted directory (converting first if needed)."""
    raw = json.loads((converted(gguf_path) / CONFIG_FILE).read_text())
    raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
    return ModelConfig(**raw)


def tokenizer_dir(gguf_path: Path) -> Path:
    return converted(gguf_path) / TOKENIZER_DIR


def tensors_file(gguf_path: Path) -> Path:
    return converted(gguf_path) / TENSORS_FILE


def derived_file(gguf_path: Path, name: str, make: Callable[[Path], None]) -> Path:
    """``<converted dir>/<name>``, made once by ``make(tmp_path)`` (which writes the file at
    ``tmp_path``) under the conversion's lock and renamed into place, so a file there is complete."""
    final = converted(gguf_path) / name
    if final.is_file():
        return final
    with open(cache_root() / f"{final.parent.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_file():
            return final
        tmp = final.with_name(f"{name}.tmp-{os.getpid()}")
        try:
            make(tmp)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
    return final
