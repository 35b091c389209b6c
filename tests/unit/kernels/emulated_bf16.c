/* cpu_kernels.c's AVX-512 BF16 build for a CPU with AVX-512F/BW/VL but not AVX-512 BF16: the three BF16
 * instructions the kernels use emulated with AVX-512F (VDPBF16PS as two FMAs on the widened halves, the
 * conversions as round-to-nearest-even), so tests/unit/kernels/test_int8_linear*.py can run that build's
 * int8 paths here.  A correctness harness: its roundings are those of Intel's pseudocode (not checked
 * against BF16 hardware; no DAZ/FTZ, so denormals differ), its speed means nothing. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
static inline __m512 emu_bf16_lo(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
static inline __m512 emu_bf16_hi(__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u))); }
/* the odd element of each pair first, then the even one, as Intel's pseudocode for VDPBF16PS (no DAZ/FTZ here) */
static inline __m512 emu_dpbf16_ps(__m512 acc, __m512bh a, __m512bh b) {
    const __m512i ai = (__m512i)a, bi = (__m512i)b;
    acc = _mm512_fmadd_ps(emu_bf16_hi(ai), emu_bf16_hi(bi), acc);
    return _mm512_fmadd_ps(emu_bf16_lo(ai), emu_bf16_lo(bi), acc);
}
static inline __m256i emu_round16(__m512 v) {  /* fp32 -> bf16 round to nearest even (no NaN care) */
    __m512i u = _mm512_castps_si512(v);
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}
static inline __m256bh emu_cvtneps_pbh(__m512 v) { return (__m256bh)emu_round16(v); }
static inline __m512bh emu_cvtne2ps_pbh(__m512 hi, __m512 lo) {
    return (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(emu_round16(lo)), emu_round16(hi), 1);
}
#define _mm512_dpbf16_ps emu_dpbf16_ps
#define _mm512_cvtneps_pbh emu_cvtneps_pbh
#define _mm512_cvtne2ps_pbh emu_cvtne2ps_pbh
#define __AVX512BF16__ 1
#include "cpu_kernels.c"
