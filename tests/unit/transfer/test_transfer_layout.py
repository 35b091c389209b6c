"""The layout fingerprint both sides of a transfer must share."""

import pytest
import torch

from pdcluster.transfer.errors import LayoutMismatchError
from pdcluster.transfer.layout import KVLayout, check_compatible, check_pool, layout_differences

SMOLLM2 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", block_size=16,
                   model_fingerprint=0x1234)


def test_smollm2_block_is_368640_bytes():
    assert SMOLLM2.block_bytes == 30 * 2 * 16 * 3 * 64 * 2 == 368_640


def test_layout_is_read_off_a_block_major_pool():
    pool = torch.empty(5, 30, 2, 16, 3, 64, dtype=torch.bfloat16)
    assert KVLayout.of_pool(pool, model_fingerprint=0x1234) == SMOLLM2
    check_pool(pool, SMOLLM2)


def test_a_pool_that_does_not_fit_the_layout_is_refused():
    with pytest.raises(ValueError, match="does not match the layout"):
        check_pool(torch.empty(5, 30, 2, 16, 3, 32, dtype=torch.bfloat16), SMOLLM2)
    with pytest.raises(ValueError, match="dtype float32"):
        check_pool(torch.empty(5, 30, 2, 16, 3, 64), SMOLLM2)
    with pytest.raises(ValueError, match="contiguous"):
        check_pool(torch.empty(30, 5, 2, 16, 3, 64, dtype=torch.bfloat16).transpose(0, 1), SMOLLM2)


@pytest.mark.parametrize("bad", [{"num_layers": 0}, {"head_dim": -1}, {"dtype": "bfloat17"},
                                 {"model_fingerprint": 2**64}, {"block_size": 1.5}])
def test_invalid_layouts_raise(bad):
    fields = {**SMOLLM2.to_dict(), **bad}
    with pytest.raises(ValueError):
        KVLayout(**fields)


def test_layout_round_trips_through_a_dict():
    assert KVLayout.from_dict(SMOLLM2.to_dict()) == SMOLLM2
    with pytest.raises(ValueError, match="exactly the keys"):
        KVLayout.from_dict({"num_layers": 30})


def test_mismatch_names_every_differing_field_with_both_values():
    other = KVLayout(30, 4, 64, "float16", 16, 0xBEEF)
    assert [d[0] for d in layout_differences(SMOLLM2, other)] == ["num_kv_heads", "dtype", "model_fingerprint"]
    with pytest.raises(LayoutMismatchError) as e:
        check_compatible(SMOLLM2, other, "decode-0", "prefill-1")
    message = str(e.value)
    assert "num_kv_heads: 3 here vs 4 on prefill-1" in message
    assert "dtype: 'bfloat16' here vs 'float16' on prefill-1" in message
    assert "0x0000000000001234 here vs 0x000000000000beef" in message
    assert "decode-0" in message and "same model" in message
    check_compatible(SMOLLM2, SMOLLM2, "a", "b")
