"""Which native kernel variant a CPU gets, and that every variant builds
here (compiling needs only the compiler, not the instructions)."""

import shutil

import pytest

from pdcluster.kernels import cpu_native

AVX512_BF16 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
AVX2_ONLY = {"avx", "avx2", "fma", "f16c"}
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize("flags,env,expected", [
    (AMX, None, "amx_bf16"),                  # the best variant the CPU runs
    (AVX512_BF16, None, "avx512_bf16"),
    (AMX - {"amx_bf16"}, None, "avx512_bf16"),  # tiles without their bf16 products
    (AMX, "avx512_bf16", "avx512_bf16"),      # forced: today's AVX-512 kernels on an AMX machine
    (AVX2_ONLY, None, "avx2"),
    (AVX2_ONLY - {"fma"}, None, None),        # neither: the torch references
    (AVX512_BF16, "avx2", "avx2"),            # forced, e.g. to test the AVX2 path on an AVX-512 machine
    (AVX2_ONLY, "avx512_bf16", "avx2"),       # forced but not runnable here: the best runnable one
    (AVX512_BF16, "0", None),
])
def test_variant_is_the_best_the_cpu_runs(monkeypatch, flags, env, expected):
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: frozenset(flags))
    if env is None:
        monkeypatch.delenv("PDCLUSTER_CPU_KERNELS", raising=False)
    else:
        monkeypatch.setenv("PDCLUSTER_CPU_KERNELS", env)
    chosen = cpu_native.variant()
    assert (chosen.name if chosen else None) == expected
    assert cpu_native.cpu_supports() == bool(cpu_native.supported_variants())


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="needs a C compiler")
@pytest.mark.parametrize("which", cpu_native.VARIANTS, ids=lambda v: v.name)
def test_every_variant_builds_into_its_own_cached_library(tmp_path, monkeypatch, which):
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path))
    out = cpu_native.build(which=which)
    assert out.exists() and out.parent == tmp_path and which.name in out.name
    assert cpu_native.build(which=which) == out  # cached
    exported = out.read_bytes()
    for name in cpu_native._SIGNATURES:
        assert name.encode() in exported
    for name in cpu_native._AMX_SIGNATURES:  # only the amx build has the tile path
        assert (name.encode() in exported) == (which.name == "amx_bf16")


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="needs a C compiler")
def test_a_variant_that_does_not_build_falls_back_to_the_next(monkeypatch, tmp_path):
    """A compiler too old for -mamx-tile costs the AMX build only, not the native kernels."""
    real_build = cpu_native.build

    def build(compiler=None, which=cpu_native.VARIANTS[0]):
        if which.name == "amx_bf16":
            raise RuntimeError("cc: error: unrecognized command-line option '-mamx-tile'")
        return real_build(compiler, which)

    flags = AMX if cpu_native._cpu_flags() >= AMX else AVX2_ONLY
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cpu_native, "build", build)
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PDCLUSTER_CPU_KERNELS", raising=False)
    cpu_native._loaded.cache_clear()
    try:
        expected = "avx512_bf16" if flags is AMX else "avx2"
        assert cpu_native.loaded_variant() == expected
        assert cpu_native.linear_path(1024, 960, 576, cpu_native.loaded_variant()) == "dot"
    finally:
        cpu_native._loaded.cache_clear()
