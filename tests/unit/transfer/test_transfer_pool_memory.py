"""Pool allocation on huge pages, and block bytes read/written in place or
through a bounded staging buffer (the path accelerator pools take)."""

import pytest
import torch

from pdcluster.transfer import KVLayout, allocate_kv_pool, create_backend
from pdcluster.transfer.pool_alloc import HUGE_PAGE_BYTES
from pdcluster.transfer.pool_bytes import PoolBytes
from pdcluster.transfer.runs import BlockRun

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", block_size=4, model_fingerprint=7)


def test_allocated_pool_is_zeroed_contiguous_and_huge_page_aligned():
    pool = allocate_kv_pool(2048, LAYOUT)  # 2 MiB
    assert pool.shape == (2048, *LAYOUT.block_shape) and pool.dtype == torch.bfloat16
    assert pool.is_contiguous() and pool.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not pool.view(torch.uint8).any()
    pool[7].fill_(2.0)
    assert pool[7].float().mean().item() == 2.0
    with pytest.raises(ValueError):
        allocate_kv_pool(0, LAYOUT)


def test_backends_pull_between_allocated_pools():
    with create_backend("nixl", peer_id="a") as owner, create_backend("nixl", peer_id="b") as puller:
        src, dst = allocate_kv_pool(16, LAYOUT), allocate_kv_pool(16, LAYOUT)
        src.view(torch.uint8).view(-1).copy_(torch.arange(src.numel() * 2).remainder(256).to(torch.uint8))
        owner.register_pool(src, LAYOUT)
        puller.register_pool(dst, LAYOUT)
        puller.pull(owner.describe(), [3, 4, 9], [0, 1, 2])
        assert torch.equal(dst[:3].view(torch.uint8), src[[3, 4, 9]].view(torch.uint8))


def numbered_pool(num_blocks):
    pool = torch.empty(num_blocks, *LAYOUT.block_shape, dtype=torch.bfloat16)
    pool.view(torch.uint8).view(num_blocks, -1).copy_(torch.arange(num_blocks, dtype=torch.uint8)[:, None])
    return pool


@pytest.mark.parametrize("staged", [False, True])
def test_block_bytes_read_and_write_whole_blocks(staged):
    pool = numbered_pool(8)
    pb = PoolBytes(pool, LAYOUT.block_bytes, max_stage_bytes=2 * LAYOUT.block_bytes, staged=staged)
    assert bytes(pb.read(5, 2)) == bytes([5]) * LAYOUT.block_bytes + bytes([6]) * LAYOUT.block_bytes
    buf = pb.write_buffer(1, 2)
    buf[:] = bytes([9]) * (2 * LAYOUT.block_bytes)
    pb.commit(1, 2, buf)
    assert pool.view(torch.uint8).view(8, -1)[1:3].eq(9).all() and pool.view(torch.uint8).view(8, -1)[3].eq(3).all()


def test_staging_cuts_runs_to_the_buffer_size():
    pb = PoolBytes(numbered_pool(8), LAYOUT.block_bytes, max_stage_bytes=3 * LAYOUT.block_bytes, staged=True)
    assert pb.chunks([BlockRun(0, 2, 7)]) == [BlockRun(0, 2, 3), BlockRun(3, 5, 3), BlockRun(6, 8, 1)]
    host = PoolBytes(numbered_pool(8), LAYOUT.block_bytes)
    assert host.chunks([BlockRun(0, 2, 7)]) == [BlockRun(0, 2, 7)]
