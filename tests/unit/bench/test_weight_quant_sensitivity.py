"""bench/micro/weight_quant_sensitivity.py's pure parts (no model): its fake
quantization is the int8 kernels' references' arithmetic, groups scale
each 32 k alone, and the score reads departures and margins as the bench
does."""

import pytest
import torch

from bench.micro.weight_quant_sensitivity import fake_quant, quantize_rows, score


def test_per_channel_and_per_token_fake_quantization_is_the_w8a8_arithmetic():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    w = torch.randn(32, 64, generator=gen)
    wq, w_scale = quantize_rows(w)
    xq, x_scale = quantize_rows(x)
    assert wq.abs().max() == 127 and torch.equal(wq.abs().amax(dim=1), torch.full((32,), 127, dtype=torch.int8))
    want = (xq.long() @ wq.long().T).float() * (x_scale[:, None] * w_scale[None, :])
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


def test_smoothing_leaves_each_layer_the_same_function():
    """x / s through the norm (or v, or up), W * s in the projection: the float product is unchanged."""
    from bench.micro.weight_smoothing import smooth_layer

    torch.manual_seed(1)
    h, inter, heads, kvh, d = 16, 24, 4, 2, 4
    w = {"qkv_proj": torch.randn((heads + 2 * kvh) * d, h), "o_proj": torch.randn(h, heads * d),
         "gate_up_proj": torch.randn(2 * inter, h), "down_proj": torch.randn(h, inter),
         "input_layernorm": torch.rand(h) + 0.5, "post_attention_layernorm": torch.rand(h) + 0.5,
         "qkv_bias": torch.randn((heads + 2 * kvh) * d)}
    maxima = {"qkv_proj": torch.rand(h) * 10, "o_proj": torch.rand(heads * d) * 10,
              "gate_up_proj": torch.rand(h) * 10, "down_proj": torch.rand(inter) * 10}
    s = smooth_layer(w, maxima, heads, kvh, d)
    x = torch.randn(5, h)
    ln = lambda t, g: t * g  # noqa: E731  (the norm's scaling part; the rest is the same on both sides)
    qkv_w = ln(x, w["input_layernorm"]) @ w["qkv_proj"].T + w["qkv_bias"]
    qkv_s = ln(x, s["input_layernorm"]) @ s["qkv_proj"].T + s["qkv_bias"]
    assert torch.allclose(qkv_s[:, :-kvh * d], qkv_w[:, :-kvh * d], rtol=1e-4, atol=1e-4)  # q, k unchanged
    assert not torch.allclose(qkv_s[:, -kvh * d:], qkv_w[:, -kvh * d:])  # v carries o's division
    v_w, v_s = qkv_w[:, -kvh * d:].view(5, kvh, 1, d), qkv_s[:, -kvh * d:].view(5, kvh, 1, d)
    attn = lambda v: v.expand(5, kvh, heads // kvh, d).reshape(5, heads * d)  # noqa: E731  (P = identity)
    assert torch.allclose(attn(v_s) @ s["o_proj"].T, attn(v_w) @ w["o_proj"].T, rtol=1e-4, atol=1e-4)
    gu_w, gu_s = ln(x, w["post_attention_layernorm"]) @ w["gate_up_proj"].T, ln(x, s["post_attention_layernorm"]) @ s["gate_up_proj"].T
    assert torch.allclose(gu_s[:, :inter], gu_w[:, :inter], rtol=1e-4, atol=1e-4)  # gate untouched
    act = lambda gu: torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]  # noqa: E731
    assert torch.allclose(act(gu_s) @ s["down_proj"].T, act(gu_w) @ w["down_proj"].T, rtol=1e-4, atol=1e-4)


