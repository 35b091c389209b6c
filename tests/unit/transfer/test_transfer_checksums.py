"""A pulled block is used only if it is what the owner handed off (issue 33 b):
the owner's per-block checksums travel with the hand-off and the puller
checks them once the bytes landed.  A block that changed in between -- its
lease released early and the block reused by another request -- fails the
pull with TransferCorruptError and no release notification, on every backend
(real NIXL READ, NIXL WRITE and the socket fallback, in one process)."""

import pytest
import torch

from pdcluster.transfer.checksum import block_checksum, block_checksums, first_mismatch
from pdcluster.transfer.errors import TransferCorruptError, TransferError
from transfer_lease_fakes import PULL_KINDS, owner_and_puller, same_bytes, wait_until


@pytest.fixture(params=PULL_KINDS)
def pair(request):
    yield from owner_and_puller(request.param)


def test_checksums_tell_blocks_apart_and_survive_the_trip(pair):
    owner, puller, owner_pool, puller_pool = pair
    remote, local = [3, 4, 9], [10, 11, 12]
    expected = owner.checksums(remote)
    assert len(set(expected)) == 3  # random blocks: three different sums
    puller.pull(owner.describe(), remote, local, expected_checksums=expected)
    assert same_bytes(puller_pool[local], owner_pool[remote]) and puller.checksums(local) == expected
    assert puller.num_corrupt_pulls == 0


def test_a_block_reused_after_the_hand_off_is_refused_not_used(pair):
    owner, puller, owner_pool, puller_pool = pair
    remote, local = [3, 4, 9], [10, 11, 12]
    expected = owner.checksums(remote)          # at hand-off
    owner_pool[4].copy_(owner_pool[20])         # another request's K/V lands in block 4 (released early, reused)
    with pytest.raises(TransferCorruptError, match="block 1 of 3 .* differs from what it handed off"):
        puller.pull(owner.describe(), remote, local, notif="req-1", expected_checksums=expected)
    assert isinstance(TransferCorruptError("x"), TransferError)  # the serving layer's pull-failure path takes it
    assert puller.num_corrupt_pulls == 1
    # No release for req-1 (the lease is not the puller's to end now): a later one arrives alone.
    puller.pull(owner.describe(), [], [], notif="req-2")
    got = []
    assert wait_until(lambda: bool(got.extend(owner.poll_notifications()) or got))
    assert [n.lease_id for n in got] == ["req-2"]


def test_a_checksum_sees_any_changed_byte_and_the_tail_of_odd_sized_blocks():
    block = torch.arange(37, dtype=torch.uint8)  # 4 whole words and a 5-byte tail
    base = block_checksum(block)
    for i in (0, 20, 36):
        changed = block.clone()
        changed[i] += 1
        assert block_checksum(changed) != base
    pool = torch.zeros(4, 16, dtype=torch.bfloat16)
    pool[2, 5] = 1.0
    assert block_checksums(pool, [0, 1, 2]) == (0, 0, block_checksum(pool[2])) and block_checksum(pool[2]) != 0


def test_first_mismatch_names_the_block_or_a_length_difference():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


def test_checksums_must_match_the_blocks_one_for_one(pair):
    owner, puller, _, _ = pair
    with pytest.raises(ValueError, match="2 checksums for 3 blocks"):
        puller.pull(owner.describe(), [1, 2, 3], [4, 5, 6], expected_checksums=[0, 0])

