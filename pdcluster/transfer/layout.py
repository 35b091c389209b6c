"""The KV pool layout both sides of a transfer must agree on.

    kv_pool[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
            |<- one block: contiguous, block_bytes long ------------------>|

An 8-bit pool (dtype int8 or float8_e4m3fn) widens each (token, kv head) row
by a 2-byte scale stored after its payload (pdcluster/kernels/kv_quant.py)::

    kv_pool[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim + 2]
                                                                 |<- payload | scale ->|

so the scales live inside the block's region and move with it: a transfer
needs no second descriptor, and block_bytes is about half of bf16's.

A pull copies whole blocks as raw bytes, so the two pools must match in every
field below; ``num_blocks`` alone may differ.  The transfer layer knows this
layout and nothing else of the engine."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from pdcluster.transfer.errors import LayoutMismatchError

_MAX_U64 = 2**64 - 1
# Bytes of each row's scale in an 8-bit pool (pdcluster.kernels.kv_quant.SCALE_BYTES; a test pins the two together).
EIGHT_BIT_SCALE_BYTES = 2
_EIGHT_BIT = ("int8", "float8_e4m3fn")


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    block_size: int  # tokens per block
    model_fingerprint: int  # 64-bit; the same seed pdcluster.prefix_store.hashing uses

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, str) or not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"KVLayout.dtype must name a torch dtype such as 'bfloat16', got {self.dtype!r}")
        fp = self.model_fingerprint
        if not isinstance(fp, int) or isinstance(fp, bool) or not 0 <= fp <= _MAX_U64:
            raise ValueError(f"KVLayout.model_fingerprint must be an unsigned 64-bit int, got {fp!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def row_width(self) -> int:
        """Elements of one (token, kv head) row: head_dim, plus the scale in 8-bit pools."""
        return self.head_dim + (EIGHT_BIT_SCALE_BYTES if self.dtype in _EIGHT_BIT else 0)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.row_width)

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.torch_dtype.itemsize

    @classmethod
    def of_pool(cls, kv_pool: torch.Tensor, model_fingerprint: int) -> KVLayout:
        """Reads the layout off a block-major pool tensor."""
        if kv_pool.dim() != 6 or kv_pool.shape[2] != 2:
            raise ValueError(
                "kv_pool must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
                f"got shape {tuple(kv_pool.shape)}")
        _, layers, _, block_size, heads, row = kv_pool.shape
        dtype = dtype_name(kv_pool.dtype)
        head_dim = row - EIGHT_BIT_SCALE_BYTES if dtype in _EIGHT_BIT else row
        return cls(layers, heads, head_dim, dtype, block_size, model_fingerprint)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> KVLayout:
        names = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or sorted(data) != sorted(names):
            raise ValueError(f"a KV layout needs exactly the keys {names}, got {data!r:.200}")
        return cls(**data)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_pool(kv_pool: torch.Tensor, layout: KVLayout) -> None:
    """Raises ValueError unless ``kv_pool`` is a contiguous block-major pool of ``layout``."""
    expected = layout.block_shape
    if kv_pool.dim() != 6 or tuple(kv_pool.shape[1:]) != expected:
        raise ValueError(
            f"kv_pool shape {tuple(kv_pool.shape)} does not match the layout: expected "
            f"[num_blocks, {', '.join(map(str, expected))}]")
    if kv_pool.dtype != layout.torch_dtype:
        raise ValueError(f"kv_pool dtype {dtype_name(kv_pool.dtype)} does not match the layout's {layout.dtype}")
    if not kv_pool.is_contiguous():
        raise ValueError("kv_pool must be contiguous (block-major, one region per block); "
                         "allocate it with torch.empty(...) rather than a view")
    if kv_pool.shape[0] == 0:
        raise ValueError("kv_pool has no blocks")


def layout_differences(local: KVLayout, remote: KVLayout) -> list[tuple[str, Any, Any]]:
    """(field, local value, remote value) for every field that differs."""
    return [(f.name, getattr(local, f.name), getattr(remote, f.name))
            for f in fields(KVLayout) if getattr(local, f.name) != getattr(remote, f.name)]


def check_compatible(local: KVLayout, remote: KVLayout, local_name: str, remote_name: str) -> None:
    """Raises LayoutMismatchError naming both sides' values of every differing field."""
    diffs = layout_differences(local, remote)
    if not diffs:
        return
    parts = "; ".join(f"{name}: {_show(name, a)} here vs {_show(name, b)} on {remote_name}"
                      for name, a, b in diffs)
    raise LayoutMismatchError(
        f"KV layout mismatch between {local_name} (this side) and {remote_name}: {parts}. "
        "Both replicas must serve the same model with the same dtype and block_size; "
        "fix the deployment config so they agree.")


def _show(name: str, value: Any) -> str:
    return f"{value:#018x}" if name == "model_fingerprint" else repr(value)
