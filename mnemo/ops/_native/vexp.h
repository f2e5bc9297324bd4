/* Vector types of one SIMD register (simd.h) and a lane-wise exp, shared by the kernels that
   need exp on every element (the selective scan's decays, the gated norm's SiLU). */
#ifndef MNEMO_VEXP_H
#define MNEMO_VEXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

typedef float vf32 __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi32 __attribute__((vector_size(W * sizeof(int32_t))));
typedef double vf64 __attribute__((vector_size(W * sizeof(double))));
typedef int64_t vi64 __attribute__((vector_size(W * sizeof(int64_t))));

/* exp(x) lane-wise: 2^k · p(r) with k = round(x / ln2), r = x − k ln2 in [−ln2/2, ln2/2] (ln2
   split in two parts so r is exact) and p the degree-7 Taylor polynomial (relative error below
   1e-7 before rounding), for x in [ln FLT_MIN, 88.72]; inf above (float32 overflows at ln FLT_MAX =
   88.7228), 0 below -87.3 (where float32 would go subnormal), and NaN for NaN. */
static inline vf32 exp_vf32(vf32 x0) {
    const vf32 lo = (vf32){0} - 87.3365448f, hi = (vf32){0} + 88.7228391f;
    vf32 x = (vf32)(((vi32)lo & (x0 < lo)) | ((vi32)x0 & ~(x0 < lo)));
    x = (vf32)(((vi32)hi & (x > hi)) | ((vi32)x & ~(x > hi)));
    const vf32 z = x * 1.44269504088896341f;
    const vf32 half = (vf32)(((vi32)((vf32){0} + 0.5f) & ~(z < 0)) | ((vi32)((vf32){0} - 0.5f) & (z < 0)));
    const vi32 k = __builtin_convertvector(z + half, vi32);
    const vf32 kf = __builtin_convertvector(k, vf32);
    const vf32 r = (x - kf * 0.693359375f) + kf * 2.12194440e-4f;
    vf32 p = (vf32){0} + 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vi32 k1 = k >> 1; /* 2^k as 2^k1 · 2^(k − k1): k reaches 128 near ln FLT_MAX */
    vf32 e = p * (vf32)((k1 + 127) << 23) * (vf32)((k - k1 + 127) << 23);
    const vi32 over = x0 > 88.7228391f, under = x0 < -87.3365448f, nan = x0 != x0;
    e = (vf32)(((vi32)((vf32){0} + __builtin_inff()) & over) | ((vi32)e & ~over));
    e = (vf32)((vi32)e & ~under);
    return (vf32)(((vi32)x0 & nan) | ((vi32)e & ~nan));
}

/* n ≤ W lanes from or to memory (the partial register at a row's end: only its n lanes are touched;
   the rest of a load is 0), for the kernels that walk rows W at a time (gated_norm.c, swiglu.c). */
#define MNEMO_DEFINE_VMEM(SUF, S, V)                                                               \
    static inline V vload_##SUF(const S *p, int64_t n) {                                           \
        V v = {0};                                                                                 \
        if (n == W)                                                                                \
            memcpy(&v, p, sizeof(V));                                                              \
        else                                                                                       \
            memcpy(&v, p, (size_t)n * sizeof(S));                                                  \
        return v;                                                                                  \
    }                                                                                              \
    static inline void vstore_##SUF(S *p, V v, int64_t n) {                                        \
        if (n == W)                                                                                \
            memcpy(p, &v, sizeof(V));                                                              \
        else                                                                                       \
            memcpy(p, &v, (size_t)n * sizeof(S));                                                  \
    }
MNEMO_DEFINE_VMEM(f32, float, vf32)
MNEMO_DEFINE_VMEM(f64, double, vf64)

/* float64 (the tests and float64 research runs): libm's exp per lane. */
static inline vf64 exp_vf64(vf64 x) {
    for (int j = 0; j < W; j++) x[j] = exp(x[j]);
    return x;
}

#endif
