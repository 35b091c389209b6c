"""`pdcluster status`'s replica table: one line per replica, the KV dtype,
and speculative decoding's accepted/drafted tokens where it ran; a warning per replica hashing
blocks with a seed other than the config's."""

from pdcluster.services.cli.status import format_board

ROW = {"role": "decode", "name": "pdcluster#decode#abc", "running": 2, "waiting": 0, "kv_blocks_total": 100,
       "kv_blocks_free": 90, "kv_dtype": "int8", "leased_blocks": 0, "prompt_tokens_cached": 32,
       "prompt_tokens_computed": 64}


def test_a_line_per_replica_with_kv_dtype_and_spec_counters():
    header, plain, drafting = format_board([ROW, ROW | {"spec_proposed_tokens": 40, "spec_accepted_tokens": 25}])
    assert "spec acc/draft" in header and "kv used/total" in header
    assert plain.split()[-2] == "-" and "int8" in plain and "10/100" in plain
    assert drafting.split()[-2] == "25/40"


def test_blocks_held_in_quarantine_have_their_column():
    header, row = format_board([ROW | {"quarantined_blocks": 7}])
    assert "held" in header and row.split()[8] == "7"  # pool replica engine run wait used kv leased held


def test_a_replica_hashing_with_another_seed_is_a_warning():
    from pdcluster.services.cli.status import seed_warnings
    from pdcluster.services.config import ClusterConfig
    from pdcluster.services.default_model import default_model_path
    from pdcluster.services.model_meta import model_hash_seed

    state = {"config": ClusterConfig().model_dump()}
    seed = model_hash_seed(default_model_path(), "bfloat16", "auto", 16)
    board = [ROW | {"name": "d1", "hash_seed": seed}, ROW | {"name": "d2", "hash_seed": seed + 1}]
    [warning] = seed_warnings(state, board)
    assert warning.startswith("warning: replica d2") and f"{seed:#018x}" in warning
    assert seed_warnings({"config": {"no_such_field": 1}}, board) == []


def test_the_tenants_holding_kv_have_their_column():
    header, row, none = format_board([ROW | {"tenant_kv_blocks": {"b": 4, "a": 9, "c": 1, "d": 1}}, ROW])
    assert "tenants kv" in header
    assert row.endswith("a:9 b:4 c:1 ...") and none.split()[-1] == "-"


def test_kv_tiers_show_their_blocks_and_hit_rate():
    tiers = {"host": {"blocks": 12}, "disk": {"blocks": 40}, "hit_rate": 0.625}
    header, without, with_tiers = format_board([ROW, ROW | {"kv_tiers": tiers}])
    assert "tiers host/disk:hit" in header
    assert without.split()[-4] == "-" and with_tiers.split()[-4] == "12/40:62%"


def test_peer_prefix_fetches_show_blocks_pulled_lent_and_failures():
    counters = {"peer_fetches": 3, "peer_blocks_pulled": 24, "peer_blocks_lent": 5, "peer_fetch_failures": 1}
    header, without, with_peer = format_board([ROW | {"counters": {"peer_fetches": 0}}, ROW | {"counters": counters}])
    assert "peer pull/lent:fail" in header
    assert without.split()[-3] == "-" and with_peer.split()[-3] == "24/5:1"
