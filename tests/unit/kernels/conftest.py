"""Kernel tests run the Triton kernels through the CPU interpreter."""

import pytest

from kernel_cases import interpreted_kernels


@pytest.fixture(scope="session")
def tk():
    """The Triton kernel modules, interpreted (``tk.rope.apply_rope_triton`` ...)."""
    return interpreted_kernels()


@pytest.fixture(autouse=True)
def _seed():
    import torch
    torch.manual_seed(0)
