/* bf16 <-> fp32 scalar conversions shared by every kernel variant
 * (cpu_kernels.c: AVX-512 BF16; cpu_kernels_avx2.c: AVX2 + FMA). */
#ifndef PD_BF16_SCALAR_H
#define PD_BF16_SCALAR_H

#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float to_f32(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

#endif
