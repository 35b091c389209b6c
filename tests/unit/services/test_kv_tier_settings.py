"""`kv_tiers` in the cluster config maps onto each replica's engine: off by
default, a disk-tier directory of its own per replica, sizes in MiB, and a
bad value refused with the field named."""

import pytest
from pydantic import ValidationError

from pdcluster.services.config import ClusterConfig, KVTierSettings


def test_off_by_default_and_a_directory_per_replica_when_on():
    assert not ClusterConfig().engine_config(ClusterConfig().prefill).kv_tiers.enabled
    cfg = ClusterConfig(kv_tiers=KVTierSettings(enabled=True, host_mib=64, disk_mib=256, dir="/tmp/t"))
    a = cfg.engine_config(cfg.prefill, replica="pdcluster#prefill#a:1").kv_tiers
    b = cfg.engine_config(cfg.decode, replica="pdcluster#decode#b").kv_tiers
    assert a.enabled and a.host_bytes == 64 * 2**20 and a.disk_bytes == 256 * 2**20
    assert a.disk_dir == "/tmp/t/pdcluster-prefill-a-1" and b.disk_dir == "/tmp/t/pdcluster-decode-b"
    no_disk = ClusterConfig(kv_tiers=KVTierSettings(enabled=True, disk=False)).engine_config(ClusterConfig().prefill)
    assert no_disk.kv_tiers.disk_dir is None and no_disk.kv_tiers.disk_bytes is None


def test_a_bad_size_names_the_field():
    with pytest.raises(ValidationError, match="host_mib"):
        KVTierSettings(host_mib=0)
