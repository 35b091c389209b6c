"""``pdcluster.kernels.ops`` dispatch, the interpreter set-up, and a full CUDA compile
of every kernel (no GPU needed).

The CUDA test at the end runs only on a GPU; to exercise the compiled
kernels rather than the interpreter there, run it on its own:
``TRITON_INTERPRET=0 .venv/bin/python -m pytest tests/unit/kernels/test_ops_dispatch.py -k cuda``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pdcluster.kernels.ops as ops
from kernel_cases import ATTENTION_TOL, make_paged_case, query_start_loc
from pdcluster.kernels.rope import rope_cos_sin

REPO = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent


def _run(code: str, tmp_path: Path, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    clean.update(env, PYTHONPATH=f"{REPO}{os.pathsep}{HERE}", TRITON_CACHE_DIR=str(tmp_path / "triton"))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_cpu_ops_never_import_triton(tmp_path):
    out = _run("""
import sys, torch
import pdcluster.kernels.ops as ops
from kernel_cases import make_paged_case, query_start_loc
c = make_paged_case([5, 20], 1, 64, 16, torch.float32)
q = torch.randn(2, 3, 64)
ops.paged_decode_attention(q, c.kv_pool, 1, c.block_tables, c.context_lens, 0.125)
ops.prefill_attention(q, c.kv_pool, 1, c.block_tables, query_start_loc([1, 1]), c.context_lens, 0.125)
ops.write_kv(c.kv_pool, 1, q[:, :1], q[:, :1], torch.tensor([0, 1]))
ops.scatter_blocks(c.kv_pool, torch.tensor([0]), ops.gather_blocks(c.kv_pool, torch.tensor([1])))
ops.fused_add_rmsnorm(q, q.clone(), torch.ones(64), 1e-6); ops.rmsnorm(q, torch.ones(64), 1e-6)
ops.apply_rope(q, q.clone(), torch.tensor([0, 1]), torch.ones(4, 64), torch.zeros(4, 64))
print("triton" in sys.modules)
""", tmp_path)
    assert out.strip() == "False"


def test_interpreter_works_after_compiled_mode_import(tmp_path):
    """triton and the kernel modules first imported without TRITON_INTERPRET
    (compiled-mode kernels, compiled-mode ``tl.zeros``/``tl.sum``): the
    kernel tests still pass, through ``interpreted_kernels``."""
    out = _run(f"""
import sys, triton, triton.runtime.jit as jit, pytest
import pdcluster.kernels.triton_rope, pdcluster.kernels.triton_paged_decode_attention as dec
assert isinstance(dec._decode_kernel, jit.JITFunction)
tests = {str(HERE)!r}
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", tests + "/test_triton_elementwise.py", "-k", "bf16",
                      tests + "/test_triton_attention.py::test_decode_default_split_heuristic_and_strided_q",
                      tests + "/test_triton_attention.py::test_prefill_with_max_query_len_given"]))
""", tmp_path)
    assert " passed" in out and "failed" not in out, out


def test_every_kernel_compiles_for_sm90(tmp_path):
    """Catches what the interpreter lets through but the compiler rejects."""
    import triton
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton ships no ptxas")
    out = _run(f"import runpy; runpy.run_path({str(HERE / 'aot_compile.py')!r}, run_name='__main__')", tmp_path,
               TRITON_DEFAULT_FP_FUSION="1")
    assert "failed 0" in out, out


def test_compiled_kernels_refuse_cpu_and_mixed_devices(tk):
    import triton
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        with pytest.raises(ValueError, match="one CUDA device"):
            tk.common.check_device(torch.zeros(1), torch.zeros(1))


def test_cpu_tensors_take_the_reference_path():
    x, weight = torch.randn(3, 64), torch.randn(64)
    assert torch.equal(ops.rmsnorm(x, weight, 1e-6), ops.rmsnorm_ref(x, weight, 1e-6))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_ops_match_cpu_reference(dtype):
    case = make_paged_case([1, 37, 150], 3, 64, 16, dtype)
    pool, bt, ctx = case.kv_pool, case.block_tables, case.context_lens
    q = torch.randn(3, 9, 64).to(dtype)
    want = ops.paged_decode_attention(q, pool, 1, bt, ctx, 0.125)
    got = ops.paged_decode_attention(q.cuda(), pool.cuda(), 1, bt.cuda(), ctx.cuda(), 0.125)
    atol, rtol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=atol, rtol=rtol)
    qsl = query_start_loc([1, 5, 20])
    qp = torch.randn(26, 9, 64).to(dtype)
    want = ops.prefill_attention(qp, pool, 1, bt, qsl, ctx, 0.125)
    got = ops.prefill_attention(qp.cuda(), pool.cuda(), 1, bt.cuda(), qsl.cuda(), ctx.cuda(), 0.125)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=atol, rtol=rtol)
    cos, sin = rope_cos_sin(64, 200, 1e5)
    k = torch.randn(26, 3, 64).to(dtype)
    wq, wk = ops.apply_rope(qp.clone(), k.clone(), torch.arange(26), cos, sin)
    gq, gk = ops.apply_rope(qp.cuda(), k.cuda(), torch.arange(26).cuda(), cos.cuda(), sin.cuda())
    torch.testing.assert_close(gq.cpu(), wq, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gk.cpu(), wk, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_cuda_ops_over_8bit_pools_match_cpu_reference(dtype):
    """The compiled 8-bit kernels: the writer's bytes are the reference's
    (K shifted), attention as close as under the interpreter (test_triton_kv8.py)."""
    from pdcluster.kernels.kv_write import write_kv_ref
    from pdcluster.kernels.paged_decode_attention import paged_decode_attention_ref
    from pdcluster.kernels.prefill_attention import ChunkKV, prefill_attention_ref

    case = make_paged_case([1, 37, 150], 3, 64, 16, torch.bfloat16)
    pool = torch.zeros((*case.kv_pool.shape[:-1], 66), dtype=torch.uint8).view(dtype)
    shift = torch.randn(3, 64)
    gpu = pool.cuda()
    for s, ctx in enumerate(case.context_lens.tolist()):
        slots = torch.tensor([int(case.block_tables[s, t // 16]) * 16 + t % 16 for t in range(ctx)])
        write_kv_ref(pool, 1, case.keys[s], case.values[s], slots, shift)
        ops.write_kv(gpu, 1, case.keys[s].cuda(), case.values[s].cuda(), slots.cuda(), shift.cuda())
    assert torch.equal(gpu.cpu().view(torch.uint8), pool.view(torch.uint8))
    bt, ctx = case.block_tables, case.context_lens
    q = torch.randn(3, 9, 64).bfloat16()
    want = paged_decode_attention_ref(q, pool, 1, bt, ctx, 0.125)
    got = ops.paged_decode_attention(q.cuda(), gpu, 1, bt.cuda(), ctx.cuda(), 0.125)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=1e-5, rtol=2 ** -7)
    qsl = query_start_loc([1, 5, 20])
    qp = torch.randn(26, 9, 64).bfloat16()
    kv = torch.randn(2, 26, 3, 64).bfloat16()
    chunk = ChunkKV(kv[0], kv[1], torch.tensor([1, 1, 0], dtype=torch.int32), shift)
    want = prefill_attention_ref(qp, pool, 1, bt, qsl, ctx, 0.125, chunk)
    chunk_gpu = ChunkKV(kv[0].cuda(), kv[1].cuda(), chunk.fresh.cuda(), shift.cuda())
    got = ops.prefill_attention(qp.cuda(), gpu, 1, bt.cuda(), qsl.cuda(), ctx.cuda(), 0.125, chunk_gpu)
    atol, rtol = ATTENTION_TOL[torch.bfloat16]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=atol, rtol=rtol)
