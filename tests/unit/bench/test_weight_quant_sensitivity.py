"""bench/micro/weight_quant_sensitivity.py's pure parts (no model): its fake
quantization is the int8 kernels' references' arithmetic, groups scale
each 32 k alone, and the score reads departures and margins as the bench
does."""

import pytest
import torch

from bench.micro.weight_quant_sensitivity import fake_quant, score
from pdcluster.kernels import int8_linear


def test_per_channel_and_per_token_fake_quantization_is_the_w8a8_reference():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    w = torch.randn(32, 64, generator=gen)
    wq, w_scale = int8_linear.quantize_weight(w)
    want = int8_linear.int8_linear_ref(x, wq, w_scale, out_dtype=torch.float32)
    got = fake_quant(x.float(), "token", rows_are_weights=False) @ fake_quant(w, "channel", rows_are_weights=True).T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(fake_quant(w, None, rows_are_weights=True), w)


def test_groups_scale_each_32_k_alone():
    row = torch.full((1, 64), 0.01)
    row[0, 0] = 100.0  # an outlier in the first group
    per_row = fake_quant(row, "token", rows_are_weights=False)
    grouped = fake_quant(row, "g32", rows_are_weights=False)
    assert torch.all(per_row[0, 32:] == 0)  # one scale for the row: the small channels round to 0
    torch.testing.assert_close(grouped[0, 32:], row[0, 32:])  # their own scale: exact here
    assert grouped[0, 0] == 100.0


def test_score_reads_first_departures_flips_and_margin_errors():
    vocab = 4
    ref = torch.zeros(3, vocab)
    ref[:, 0], ref[:, 1] = 1.0, torch.tensor([0.5, 0.9, 0.2])  # bf16's gaps 0.5, 0.1, 0.8; its answer: token 0
    got = ref.clone()
    got[1, 1] = 1.2  # flips where the gap was 0.1 (margin error 0.3)
    got[2, 1] = 1.1  # and where it was 0.8 (margin error 0.9)
    s = score([got, ref], [ref, ref], [[0, 0, 0], [0, 0, 0]])
    assert s.departed == 1
    assert s.max_first_gap == pytest.approx(0.1)
    assert (s.flips, s.flips_over) == (2, 1)
    assert s.margin_rms == pytest.approx(((0.3 ** 2 + 0.9 ** 2) / 6) ** 0.5)
