"""`pdcluster status`'s replica table: one line per replica, the KV dtype,
and speculative decoding's accepted/drafted tokens where it ran."""

from services.cli.status import format_board

ROW = {"role": "decode", "name": "pdcluster#decode#abc", "running": 2, "waiting": 0, "kv_blocks_total": 100,
       "kv_blocks_free": 90, "kv_dtype": "int8", "leased_blocks": 0, "prompt_tokens_cached": 32,
       "prompt_tokens_computed": 64}


def test_a_line_per_replica_with_kv_dtype_and_spec_counters():
    header, plain, drafting = format_board([ROW, ROW | {"spec_proposed_tokens": 40, "spec_accepted_tokens": 25}])
    assert "spec acc/draft" in header and "kv used/total" in header
    assert plain.split()[-1] == "-" and "int8" in plain and "10/100" in plain
    assert drafting.split()[-1] == "25/40"
