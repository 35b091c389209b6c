"""The greedy head's int8 screen (kernels/greedy_head.py, csrc/greedy_head.h): its quantization keeps
the bound it states, and the token it chooses is the full bf16 head's argmax (the same packed kernel's
logits, torch.argmax's tie-break) on random heads, on heads made from 8-bit groups as the default
model's is, on exact ties and near-ties; where it cannot decide it says so (None) and the caller runs
the full head."""

import pytest
import torch

from pdcluster.kernels import cpu_native, greedy_head

SCREEN = pytest.mark.skipif(not greedy_head.available(), reason="needs the AVX-512 BF16 kernels and AVX-512 VNNI")


def _q8_like(v: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A bf16 head whose values are 8-bit codes times a per-group scale, as a Q8_0 GGUF's."""
    w = torch.randn(v, k, generator=gen) * 0.04
    d = (w.reshape(v, k // 32, 32).abs().amax(-1, keepdim=True) / 127).half().float()
    return (torch.round(w.reshape(v, k // 32, 32) / d) * d).reshape(v, k).to(torch.bfloat16)


def _full_argmax(x: torch.Tensor, w: torch.Tensor) -> list[int]:
    return cpu_native.linear(x, cpu_native.pack_weight(w)).float().argmax(dim=1).tolist()


def test_the_quantization_keeps_the_bound_it_states():
    gen = torch.Generator().manual_seed(1)
    w = torch.cat([torch.randn(64, 96, generator=gen) * 0.05, torch.zeros(32, 96),
                   torch.randn(32, 96, generator=gen) * 1e-30]).to(torch.bfloat16)
    q, d, l1, err = greedy_head.quantize(w)
    wd, dd = w.double().reshape(128, 3, 32), d.double().unsqueeze(-1)
    qd = q.double().reshape(128, 3, 32)
    assert q.abs().max() <= 127
    assert ((wd - dd * qd).abs().amax(-1) <= err.double()).all()
    assert (dd.squeeze(-1) * qd.abs().sum(-1) <= l1.double()).all()
    # rounding to nearest: half a step at most (E itself rounded up to bf16)
    assert (err.double()[:64] <= dd.squeeze(-1)[:64] * 0.5 * (1 + 2 ** -7)).all()
    assert (d[64:96] == 0).all() and (q[64:96] == 0).all() and (err[64:96] == 0).all()
    # scales under fp16's range: no codes, and E is the weights themselves (the bound still holds, above)
    assert (q[96:] == 0).all() and (err.double()[96:] >= wd[96:].abs().amax(-1)).all()


@SCREEN
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 16])
def test_the_choice_is_the_full_heads_argmax(rows):
    gen = torch.Generator().manual_seed(rows)
    for make in (lambda: (torch.randn(4096, 576, generator=gen) * 0.05).to(torch.bfloat16),
                 lambda: _q8_like(4096, 576, gen)):
        w = make()
        head, packed = greedy_head.build(w), cpu_native.pack_weight(w)
        decided = 0
        for trial in range(12):
            # a peaked row (one hidden direction) and a flat one, with outliers as real hidden states have
            x = torch.randn(rows, 576, generator=gen)
            x[:, 7] *= 20
            if trial % 2:
                x += 3 * w[trial * 97].float() / w[trial * 97].float().norm() * 40
            x = x.to(torch.bfloat16)
            got = greedy_head.choose(head, packed, x)
            if got is not None:
                decided += 1
                assert got == _full_argmax(x, w)
        assert decided >= 6  # the peaked rows at least: the screen is not a stub that always declines


@SCREEN
def test_ties_go_to_the_first_index_as_the_full_head_breaks_them():
    gen = torch.Generator().manual_seed(7)
    w = _q8_like(2048, 576, gen)
    w[1500] = w[300]                      # two equal columns that will be the maximum
    w[301] = (w[300].float() * (1 + 2 ** -8)).to(torch.bfloat16)  # a near-tie just above or equal after rounding
    x = (w[300].float() * 50).to(torch.bfloat16).unsqueeze(0)
    head, packed = greedy_head.build(w), cpu_native.pack_weight(w)
    got = greedy_head.choose(head, packed, x)
    assert got is not None and got == _full_argmax(x, w)


@SCREEN
def test_what_the_screen_cannot_decide_goes_to_the_full_head():
    gen = torch.Generator().manual_seed(3)
    w = _q8_like(4096, 576, gen)
    head, packed = greedy_head.build(w), cpu_native.pack_weight(w)
    nan = torch.randn(1, 576, generator=gen).to(torch.bfloat16)
    nan[0, 5] = float("nan")
    assert greedy_head.choose(head, packed, nan) is None
    flat = torch.zeros(1, 576, dtype=torch.bfloat16)  # every logit 0: every tile a candidate
    assert greedy_head.choose(head, packed, flat) is None
    too_many = torch.randn(greedy_head.MAX_ROWS + 1, 576, generator=gen).to(torch.bfloat16)
    assert greedy_head.choose(head, packed, too_many) is None
    assert greedy_head.choose(head, packed, torch.randn(1, 576, generator=gen)) is None  # fp32 rows
    assert greedy_head.choose(head, w, nan.nan_to_num()) is None  # an unpacked head


def test_the_screen_is_not_built_where_it_cannot_run():
    assert greedy_head.build(torch.randn(64, 96)) is None                       # fp32: not a bf16 head
    assert greedy_head.build(torch.randn(48, 96).to(torch.bfloat16)) is None     # 48 columns: not whole tiles
    assert greedy_head.build(torch.randn(64, 100).to(torch.bfloat16)) is None    # k not whole groups


@SCREEN
def test_threads_sharing_one_head_get_their_own_answers():
    # engines that share a model's weights may step on different threads: the scratch is per thread
    import threading

    gen = torch.Generator().manual_seed(11)
    w = _q8_like(4096, 576, gen)
    head, packed = greedy_head.build(w), cpu_native.pack_weight(w)
    rows = [(w[i * 131].float() * 60).to(torch.bfloat16).unsqueeze(0) for i in range(8)]
    want = [_full_argmax(x, w) for x in rows]
    got: dict[int, list] = {}

    def work(t: int) -> None:
        got[t] = [greedy_head.choose(head, packed, x) for _ in range(20) for x in rows]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(got[t] == want * 20 for t in range(2))
