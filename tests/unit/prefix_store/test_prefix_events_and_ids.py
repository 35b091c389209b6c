"""Event batches (coalescing, msgpack) and worker ids (epochs)."""

import pytest

from pdcluster.prefix_store.events import EventBatch
from pdcluster.prefix_store.worker_id import WorkerId


def test_batch_keeps_only_the_last_event_per_block_in_order():
    batch = EventBatch()
    batch.add("stored", [1, 2, 3])
    batch.add("evicted", [2, 4])
    batch.add("stored", [4])
    assert batch.stored == [1, 3, 4]
    assert batch.evicted == [2]
    assert len(batch) == 4


def test_batch_round_trips_through_msgpack_with_full_64_bit_hashes():
    batch = EventBatch.of(stored=[2**64 - 1, 0], evicted=[2**63])
    again = EventBatch.from_msgpack(batch.to_msgpack())
    assert again.stored == [2**64 - 1, 0] and again.evicted == [2**63]


def test_batch_rejects_bad_kinds_and_hashes():
    with pytest.raises(ValueError, match="use one of"):
        EventBatch().add("removed", [1])
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        EventBatch().add("stored", [-1])


def test_worker_id_wire_form_and_validation():
    w = WorkerId("replica-abc", 17)
    assert w.key == "replica-abc@17" and WorkerId.parse(b"replica-abc@17") == w
    assert WorkerId.new("x").epoch > 0
    assert WorkerId.new("x") != WorkerId.new("y")
    for bad in ("", "a@b", "{tag}"):
        with pytest.raises(ValueError, match="must be non-empty"):
            WorkerId(bad, 1)
    with pytest.raises(ValueError, match="2\\*\\*53"):
        WorkerId("a", 2**53)
    with pytest.raises(ValueError, match="<name>@<epoch>"):
        WorkerId.parse("no-epoch")


def test_tier_events_coalesce_per_tier_and_travel_in_msgpack():
    batch = EventBatch()
    batch.add("stored", [1, 2])
    batch.add("evicted", [1])           # device: evicted ...
    batch.add("stored", [1], "host")    # ... into the host tier
    batch.add("stored", [1, 3], "disk")
    batch.add("evicted", [3], "disk")
    assert batch.stored == [2] and batch.evicted == [1]  # a consumer that knows no tiers sees the device only
    assert batch.stored_in("host") == [1] and batch.stored_in("disk") == [1] and batch.evicted_from("disk") == [3]
    back = EventBatch.from_msgpack(batch.to_msgpack())
    assert back.last_kind == batch.last_kind and back.tier_kind == batch.tier_kind
    with pytest.raises(ValueError, match="tier 'gpu' is unknown"):
        batch.add("stored", [1], "gpu")
