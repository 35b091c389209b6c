"""8-bit KV pools over both backends: the scales ride inside each block's
region, so a pull moves them with no extra descriptor, byte for byte, and a
block costs about half of bf16's bytes (stats count them)."""

import pytest
import torch

from pdcluster.transfer import KVLayout, LayoutMismatchError, allocate_kv_pool, create_backend
from pdcluster.transfer.layout import check_pool
from transfer_raw_client import SECRET

SHAPE = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, model_fingerprint=7)  # SmolLM2-135M


def layout(dtype: str) -> KVLayout:
    return KVLayout(dtype=dtype, **SHAPE)


def test_8bit_layouts_carry_the_scale_inside_the_block_and_halve_its_bytes():
    bf16, int8, fp8 = layout("bfloat16"), layout("int8"), layout("float8_e4m3fn")
    assert int8.block_shape == (30, 2, 16, 3, 66) and int8.block_bytes == fp8.block_bytes == 30 * 2 * 16 * 3 * 66
    assert int8.block_bytes / bf16.block_bytes == pytest.approx(66 / 128)
    pool = allocate_kv_pool(4, int8)
    check_pool(pool, int8)
    assert KVLayout.of_pool(pool, 7) == int8  # head_dim read back as 64, not the 66-byte row
    with pytest.raises(LayoutMismatchError, match="dtype"):
        from pdcluster.transfer.layout import check_compatible
        check_compatible(bf16, int8, "decode-0", "prefill-0")


@pytest.mark.parametrize("backend", ["nixl", "fallback"])
@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_8bit_blocks_arrive_byte_identical_with_their_scales(backend, dtype):
    lay = layout(dtype)
    owner_pool, puller_pool = allocate_kv_pool(12, lay), allocate_kv_pool(8, lay)
    gen = torch.Generator().manual_seed(0)
    owner_pool.view(torch.uint8).copy_(torch.randint(0, 256, owner_pool.shape, dtype=torch.uint8, generator=gen))
    with create_backend(backend, peer_id="prefill-0", secret=SECRET) as owner, \
            create_backend(backend, peer_id="decode-0", secret=SECRET, timeout_s=5.0) as puller:
        owner.register_pool(owner_pool, lay)
        puller.register_pool(puller_pool, lay)
        remote, local = [2, 3, 4, 9], [0, 1, 5, 6]
        stats = puller.pull(owner.describe(), remote, local)
    assert torch.equal(puller_pool[local].view(torch.uint8), owner_pool[remote].view(torch.uint8))
    assert stats.num_bytes == 4 * lay.block_bytes and stats.num_descriptors == 3
    assert stats.num_bytes / (4 * layout("bfloat16").block_bytes) <= 0.55
