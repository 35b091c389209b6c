"""SwiGLU's gate: ``silu(gate) * up`` over the fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up``: [T, 2 * I] = [gate | up]; returns [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
