"""Block id lists -> coalesced runs, id validation (pure functions)."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.transfer.runs import (BlockRun, as_block_ids, check_block_ids, coalesce_block_runs, runs_to_regions,
                           split_block_runs)


def expand(runs):
    return [(r.remote_start + i, r.local_start + i) for r in runs for i in range(r.num_blocks)]


def test_empty_pull_has_no_runs():
    assert coalesce_block_runs([], []) == []


def test_single_block_is_one_run():
    assert coalesce_block_runs([7], [3]) == [BlockRun(7, 3, 1)]


def test_long_consecutive_run_is_one_descriptor():
    assert coalesce_block_runs(list(range(100, 356)), list(range(0, 256))) == [BlockRun(100, 0, 256)]


def test_runs_break_where_either_side_jumps():
    runs = coalesce_block_runs([7, 8, 9, 3, 4], [0, 1, 2, 5, 9])
    assert runs == [BlockRun(7, 0, 3), BlockRun(3, 5, 1), BlockRun(4, 9, 1)]


def test_descending_ids_do_not_coalesce():
    assert coalesce_block_runs([5, 4, 3], [2, 1, 0]) == [BlockRun(5, 2, 1), BlockRun(4, 1, 1), BlockRun(3, 0, 1)]


def test_scattered_ids_give_one_run_per_block():
    assert len(coalesce_block_runs([1, 9, 4, 30], [0, 2, 4, 6])) == 4


def test_unequal_lengths_are_refused():
    with pytest.raises(ValueError, match="3 remote block ids but 2 local"):
        coalesce_block_runs([1, 2, 3], [1, 2])


pairs = st.lists(st.tuples(st.integers(0, 64), st.integers(0, 64)), max_size=80)


@given(pairs)
def test_runs_cover_exactly_the_pairs_in_order_and_are_maximal(pairs_list):
    remote = [r for r, _ in pairs_list]
    local = [loc for _, loc in pairs_list]
    runs = coalesce_block_runs(remote, local)
    assert expand(runs) == pairs_list
    for a, b in zip(runs, runs[1:]):  # no two neighbours could have been merged
        assert not (b.remote_start == a.remote_start + a.num_blocks and b.local_start == a.local_start + a.num_blocks)


@given(pairs, st.integers(1, 10))
def test_split_keeps_the_pairs_and_bounds_every_run(pairs_list, max_blocks):
    runs = coalesce_block_runs([r for r, _ in pairs_list], [loc for _, loc in pairs_list])
    split = split_block_runs(runs, max_blocks)
    assert expand(split) == pairs_list
    assert all(r.num_blocks <= max_blocks for r in split)


def test_regions_are_addresses_and_lengths_of_each_side():
    runs = [BlockRun(2, 0, 3), BlockRun(9, 5, 1)]
    assert runs_to_regions(runs, 1000, 10, "remote") == [(1020, 30), (1090, 10)]
    assert runs_to_regions(runs, 0, 10, "local") == [(0, 30), (50, 10)]


def test_block_ids_from_lists_arrays_and_tensors():
    assert as_block_ids(np.array([3, 4], dtype=np.int64)) == [3, 4]
    assert as_block_ids(torch.tensor([5, 1])) == [5, 1]
    assert as_block_ids((2,)) == [2]
    with pytest.raises(TypeError):
        as_block_ids([1.5])


def test_out_of_range_ids_name_the_side_and_the_range():
    with pytest.raises(ValueError, match="remote block id 8 is outside the remote pool's 0..7"):
        check_block_ids([8], [0], remote_num_blocks=8, local_num_blocks=4)
    with pytest.raises(ValueError, match="local block id -1"):
        check_block_ids([0], [-1], remote_num_blocks=8, local_num_blocks=4)


def test_a_local_block_named_twice_is_refused():
    with pytest.raises(ValueError, match="local block 2 appears twice"):
        check_block_ids([0, 1], [2, 2], remote_num_blocks=8, local_num_blocks=4)
    check_block_ids([1, 1], [2, 3], remote_num_blocks=8, local_num_blocks=4)  # one remote block twice is fine
