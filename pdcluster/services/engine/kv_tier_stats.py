"""What the KV tiers count (kv_tiers.py), and the view of it that
`pdcluster status` shows per replica."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TierStats:
    host_blocks: int = 0
    host_capacity_blocks: int = 0
    disk_blocks: int = 0
    disk_capacity_blocks: int = 0
    block_bytes: int = 0
    offloaded_blocks: int = 0       # device -> host
    spilled_blocks: int = 0         # host -> disk, written
    loaded_host_blocks: int = 0     # host -> device, verified
    loaded_disk_blocks: int = 0     # disk -> device, verified
    load_failures: int = 0          # a block that failed verification or could not be read: recomputed
    disk_write_failures: int = 0    # full or failing disk: the block is dropped
    spill_drops: int = 0            # the disk writer is WRITE_BACK_BLOCKS behind: the oldest host block is dropped
    host_full_drops: int = 0        # every spare host slot pinned by I/O: the evicted block is dropped
    admissions: int = 0             # requests admitted (scheduler.py)
    admissions_from_tiers: int = 0  # ... with blocks loaded from a tier
    loads_in_flight: int = 0

    @property
    def bytes_loaded(self) -> int:
        return (self.loaded_host_blocks + self.loaded_disk_blocks) * self.block_bytes


def tier_status(stats: TierStats | None) -> dict | None:
    """What `pdcluster status` shows per replica: blocks, bytes and hit rate per tier."""
    if stats is None:
        return None
    bb = stats.block_bytes
    return {
        "host": {"blocks": stats.host_blocks, "capacity_blocks": stats.host_capacity_blocks,
                 "bytes": stats.host_blocks * bb, "loaded_blocks": stats.loaded_host_blocks},
        "disk": {"blocks": stats.disk_blocks, "capacity_blocks": stats.disk_capacity_blocks,
                 "bytes": stats.disk_blocks * bb, "loaded_blocks": stats.loaded_disk_blocks,
                 "write_failures": stats.disk_write_failures},
        "hit_rate": stats.admissions_from_tiers / stats.admissions if stats.admissions else None,
        "bytes_loaded": stats.bytes_loaded, "load_failures": stats.load_failures,
        "dropped_blocks": stats.spill_drops + stats.host_full_drops,
    }
