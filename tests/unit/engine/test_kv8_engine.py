"""The engine with an 8-bit KV cache (``kv_cache_dtype``): pool sizes at the
same memory budget, the block-hash seed per KV dtype, a tiny model's forward
over int8 KV against bf16 KV, the fused native stack against the per-op
path (K rotated or not), the K rotation's exactness over a plain pool, and
a full generate that returns every block."""

from types import SimpleNamespace

import pytest
import torch

from pdcluster.kernels import cpu_native
from pdcluster.kernels.kv_quant import pool_dtype
from pdcluster.services.engine.config import EngineConfig
from pdcluster.services.engine.engine import kv_spec_for
from pdcluster.services.engine.kv_cache import KVCache, KVCacheSpec
from pdcluster.services.engine.model.config import ModelConfig
from pdcluster.services.engine.model.llama import LlamaModel
from pdcluster.services.engine.model.loader import block_hash_seed

BS = 16
SMOL = dict(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M's KV shape


def spec(dtype: torch.dtype, num_blocks: int = 8) -> KVCacheSpec:
    return KVCacheSpec(num_blocks, BS, dtype=dtype, **SMOL)


def test_int8_blocks_are_half_the_bytes_and_twice_as_many_fit():
    bf16, int8 = spec(torch.bfloat16), spec(torch.int8)
    assert int8.shape == (8, 30, 2, BS, 3, 66) and int8.row_width == 66
    assert int8.block_bytes / bf16.block_bytes <= 0.55
    budget = 512 * 2**20
    assert (budget // int8.block_bytes) / (budget // bf16.block_bytes) >= 1.9
    cache = KVCache(int8)
    assert cache.kv_pool.dtype is torch.int8 and cache.kv_pool.shape == int8.shape
    assert cache.kv_pool.nbytes == 8 * int8.block_bytes
    cache.check_integrity()


def test_kv_spec_follows_the_config_and_the_seed_differs_per_kv_dtype():
    loaded = SimpleNamespace(config=SimpleNamespace(**SMOL), model=torch.nn.Linear(2, 2).to(torch.bfloat16))
    dtypes = {name: kv_spec_for(EngineConfig(kv_cache_dtype=name, num_kv_blocks=4), loaded).dtype
              for name in ("auto", "bf16", "int8", "fp8_e4m3")}
    assert dtypes == {"auto": torch.bfloat16, "bf16": torch.bfloat16, "int8": torch.int8,
                      "fp8_e4m3": torch.float8_e4m3fn}
    seeds = {name: block_hash_seed("weights-1", dt, BS) for name, dt in dtypes.items()}
    assert seeds["auto"] == seeds["bf16"]  # the same bytes in every block: blocks may be shared
    assert len({seeds["bf16"], seeds["int8"], seeds["fp8_e4m3"]}) == 3
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")


def test_the_cluster_config_passes_kv_cache_dtype_to_both_pools():
    from pdcluster.services.config import ClusterConfig

    cfg = ClusterConfig(kv_cache_dtype="int8")
    assert cfg.engine_config(cfg.prefill).kv_cache_dtype == "int8"
    assert cfg.engine_config(cfg.decode).kv_cache_dtype == "int8"
    assert ClusterConfig().engine_config(ClusterConfig().decode).kv_cache_dtype == "auto"
    assert pool_dtype("auto", torch.bfloat16) is torch.bfloat16


def tiny_model(dtype: torch.dtype = torch.bfloat16) -> LlamaModel:
    cfg = ModelConfig(arch="llama", vocab_size=320, hidden_size=128, intermediate_size=256, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model = model.to(dtype)
    model.reset_rope()
    model.pack_weights()
    return model


def prompt_batches(chunks: tuple[int, ...] = (37,)) -> list:
    """A 37-token prompt in blocks [3, 7, 1], prefilled in ``chunks``, then one
    decode step: a ForwardBatch per forward, logits of each one's last token."""
    from pdcluster.services.engine.forward_batch import ForwardBatch

    table = [3, 7, 1]
    n = sum(chunks)
    assert n == 37
    ids = [(7 * p + 3) % 320 for p in range(n + 1)]
    slot = lambda p: table[p // BS] * BS + p % BS  # noqa: E731
    t = torch.tensor([table], dtype=torch.int32)
    empty = torch.zeros(0, 1, dtype=torch.int32)
    batches, done = [], 0
    for c in chunks:
        batches.append(ForwardBatch(
            input_ids=torch.tensor(ids[done:done + c]), positions=torch.arange(done, done + c),
            slot_mapping=torch.tensor([slot(p) for p in range(done, done + c)]),
            num_decode_tokens=0, decode_block_tables=empty, decode_context_lens=torch.zeros(0, dtype=torch.int32),
            prefill_block_tables=t, prefill_query_start_loc=torch.tensor([0, c], dtype=torch.int32),
            prefill_context_lens=torch.tensor([done + c], dtype=torch.int32), logits_indices=torch.tensor([c - 1]),
            prefill_fresh_kv=torch.ones(1, dtype=torch.int32)))
        done += c
    batches.append(ForwardBatch(
        input_ids=torch.tensor([ids[n]]), positions=torch.tensor([n]), slot_mapping=torch.tensor([slot(n)]),
        num_decode_tokens=1, decode_block_tables=t, decode_context_lens=torch.tensor([n + 1], dtype=torch.int32),
        prefill_block_tables=empty, prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_context_lens=torch.zeros(0, dtype=torch.int32), logits_indices=torch.tensor([0]),
        prefill_fresh_kv=torch.zeros(0, dtype=torch.int32)))
    return batches


def prefill_then_decode(model: LlamaModel, pool: torch.Tensor, chunks: tuple[int, ...] = (37,),
                        shifts: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The logits of :func:`prompt_batches`' forwards over ``pool``.
    ``shifts``: the model's K shift for each of those forwards in turn."""
    logits = []
    for i, batch in enumerate(prompt_batches(chunks)):
        if shifts is not None:
            model.k_shift = shifts[i]
        logits.append(model(batch, pool))
    return torch.cat(logits)


def tiny_shift() -> torch.Tensor:
    """A K smoothing shift for tiny_model: [layers, kv_heads, head_dim] fp32."""
    return (torch.randn(3, 2, 32, generator=torch.Generator().manual_seed(4)) * 0.5).bfloat16().float()


@pytest.mark.parametrize("chunks", [(37,), (21, 16)])
@pytest.mark.parametrize("smoothed", [False, True])
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_tiny_model_logits_over_8bit_kv_are_close_to_plain_kv(dtype, model_dtype, smoothed, chunks):
    model = tiny_model(model_dtype)
    model.k_shift = tiny_shift() if smoothed else None  # plain pools never see it
    want = prefill_then_decode(model, torch.zeros(10, 3, 2, BS, 2, 32, dtype=model_dtype), chunks)
    got = prefill_then_decode(model, torch.zeros(10, 3, 2, BS, 2, 34, dtype=dtype), chunks)
    err = (got - want).abs().max() / want.abs().max()
    assert err < (0.02 if dtype is torch.int8 else 0.08), err
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.skipif(not cpu_native.available(), reason="needs AVX-512 BF16 or AVX2+FMA, and a C compiler")
@pytest.mark.parametrize("chunks", [(37,), (21, 16)])
@pytest.mark.parametrize("rotated", [True, False])
@pytest.mark.parametrize("smoothed", [False, True])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_fused_native_stack_over_8bit_kv_equals_the_per_op_path(dtype, smoothed, rotated, chunks):
    model = tiny_model()
    assert model.native_stack is not None
    model.k_shift = tiny_shift() if smoothed else None
    model.k_rotation = rotated
    pools = [torch.zeros(10, 3, 2, BS, 2, 34, dtype=dtype) for _ in range(3)]
    fused = prefill_then_decode(model, pools[0], chunks)
    stack, model.native_stack = model.native_stack, None
    per_op = prefill_then_decode(model, pools[1], chunks)
    model.native_stack = stack
    assert torch.equal(pools[0].view(torch.uint8), pools[1].view(torch.uint8))
    torch.testing.assert_close(fused, per_op, atol=1e-2, rtol=1e-2)
    if smoothed:  # both paths shifted K: the bytes are not the unshifted ones
        model.k_shift = None
        prefill_then_decode(model, pools[2], chunks)
        assert not torch.equal(pools[0].view(torch.uint8), pools[2].view(torch.uint8))


@pytest.mark.parametrize("native", [True, False])
def test_a_chunk_after_a_cached_prefix_adds_back_the_shift_its_rows_carry(native):
    """The second chunk's own K is unshifted and the first chunk's rows carry
    the model's K shift: it must add back exactly that shift.  Written under
    one shift and read back under another, the logits move far off."""
    if native and not cpu_native.available():
        pytest.skip("needs AVX-512 BF16 or AVX2+FMA, and a C compiler")
    model = tiny_model()
    if not native:
        model.native_stack = None
    big = tiny_shift() * 8
    want = prefill_then_decode(model, torch.zeros(10, 3, 2, BS, 2, 32, dtype=torch.bfloat16), (21, 16))
    err = lambda got: ((got - want).abs().max() / want.abs().max()).item()  # noqa: E731
    pool = lambda: torch.zeros(10, 3, 2, BS, 2, 34, dtype=torch.int8)  # noqa: E731
    same = err(prefill_then_decode(model, pool(), (21, 16), [big, big, big]))
    other = err(prefill_then_decode(model, pool(), (21, 16), [big, -big, -big]))
    assert same < 0.02 and other > 5 * same, (same, other)


@pytest.mark.skipif(not cpu_native.available(), reason="needs AVX-512 BF16 or AVX2+FMA, and a C compiler")
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_both_paths_write_rotated_k_and_only_k(dtype):
    """A rotated pool's K rows are not the unrotated ones' (on both paths:
    the bytes above are equal), its V rows are (layer 0's: later layers'
    inputs already carry the K rows' other rounding); plain pools never turn."""
    model = tiny_model()
    pools = {}
    for rotated in (True, False):
        model.k_rotation = rotated
        pools[rotated] = torch.zeros(10, 3, 2, BS, 2, 34, dtype=dtype)
        prefill_then_decode(model, pools[rotated])
    k, v = (lambda pool: pool[:, 0, 0].view(torch.uint8)), (lambda pool: pool[:, 0, 1].view(torch.uint8))  # noqa: E731
    assert not torch.equal(k(pools[True]), k(pools[False])) and torch.equal(v(pools[True]), v(pools[False]))
    plain = torch.zeros(10, 3, 2, BS, 2, 32, dtype=torch.bfloat16)
    assert not model.rotates_kv(plain) and model.pool_k_shift(plain) is None
    model.k_rotation = True
    assert model.rotates_kv(pools[True])


@pytest.mark.parametrize("chunks", [(37,), (21, 16)])
def test_rotating_q_and_k_leaves_attention_unchanged_over_a_plain_pool(chunks):
    """q . k = (H q) . (H k): each layer's attention, turned or not, over an
    fp32 pool (prefill chunks reading the first chunk's rows, then decode)."""
    model = tiny_model(torch.float32)
    gen = torch.Generator().manual_seed(6)
    for layer in model.layers:
        pools = [torch.zeros(10, 3, 2, BS, 2, 32) for _ in range(2)]
        for batch in prompt_batches(chunks):
            x = torch.randn(batch.num_tokens, 128, generator=gen)
            plain, turned = (layer.attention(x, batch, pool, model.rope_cos, model.rope_sin, None, rotate)
                             for pool, rotate in zip(pools, (False, True)))
            torch.testing.assert_close(turned, plain, atol=1e-5, rtol=1e-5)
            assert (turned - plain).abs().max() > 0  # it did turn: fp32 rounding differs


def test_the_rotated_shift_is_h_b_and_computed_once():
    from pdcluster.kernels.kv_rotation import rotate_heads

    model = tiny_model()
    model.k_shift = tiny_shift()
    pool = torch.zeros(10, 3, 2, BS, 2, 34, dtype=torch.int8)
    first = model.pool_k_shift(pool)
    assert torch.equal(first, rotate_heads(model.k_shift)) and model.pool_k_shift(pool) is first
    model.k_rotation = False
    assert model.pool_k_shift(pool) is model.k_shift
