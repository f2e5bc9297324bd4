/* Selective scan (Mamba / S6) on the CPU: one fused pass over time per tile of channels.

   Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", Alg. 2:
       h_t = exp(Δ_t A) ⊙ h_{t-1} + v_t B_t        y_t = C_t · h_t        (v_t = Δ_t u_t)
   with the log decay Δ_t A clamped from below at LOG_GATE_MIN (no gradient where it is clamped).

   A job is one sequence b and a tile of W adjacent channels (one SIMD register of floats):
   its [N][W] states stay in L1 while the loop walks the T tokens, so a token costs N vector
   updates and no dispatch or intermediate tensor. The step Δ = softplus(δ + bias) (or δ + bias)
   is formed in the kernel from the raw δ. The backward recomputes the tile's states and decays
   into a scratch buffer, then runs the reverse scan g_t = C_t dy_t + exp(Δ_{t+1} A) g_{t+1}.
   The jobs are split into thread slots (slots.h).

   Layouts (contiguous): delta (raw δ), u, z, y, dy, ddelta, du, dz: [B, T, Dp]; bias, Dsk: [Dp];
   At: [N, Dp] (A transposed); Bm, Cm: [B, T, G, N]; dB, dC: [nt, B, T, G, N] (one partial sum
   per slot); h0, hT, dhT, dh0, dA: [B, N, Dp]. Dp = G * Dgp with Dgp (the channels of a group,
   zero-padded) a multiple of W, so a tile never straddles two groups.

   Built by mnemo.ops._native with the system C compiler; -O3 -march=native (IEEE semantics, no
   fast-math), with -fopenmp when it builds. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "slots.h"

#define LOG_GATE_MIN (-60.0)
#include "simd.h"
#include "vexp.h"

int mnemo_simd_width(void) { return W; }

/* 1 when built with OpenMP (the slots of an entry point run on PyTorch's OpenMP threads). */
int mnemo_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* log(x) lane-wise for finite x ≥ 1: x = 2^k m with m in [√½, √2), log m = 2 atanh(s) with
   s = (m − 1) / (m + 1), |s| ≤ 0.172, by its series to s⁹ (relative error below 1e-8). */
static inline vf32 log_ge1_vf32(vf32 x) {
    const vi32 bits = (vi32)x;
    vi32 k = ((bits >> 23) & 0xff) - 127;
    vf32 m = (vf32)((bits & 0x7fffff) | 0x3f800000);
    const vi32 big = m > 1.41421356f;
    m = (vf32)(((vi32)(m * 0.5f) & big) | ((vi32)m & ~big));
    k -= big; /* the mask is −1 where m was halved */
    const vf32 s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
    vf32 p = (vf32){0} + 1.0f / 9.0f;
    p = p * s2 + 1.0f / 7.0f;
    p = p * s2 + 1.0f / 5.0f;
    p = p * s2 + 1.0f / 3.0f;
    p = p * s2 + 1.0f;
    const vf32 kf = __builtin_convertvector(k, vf32);
    return kf * 0.693359375f + (2.0f * s * p - kf * 2.12194440e-4f);
}

/* log1p(e) for e ≥ 0 given u1 = 1 + e (rounded): log(u1) · e / (u1 − 1) corrects the rounding of
   1 + e, and is e itself where u1 rounds to 1. */
static inline vf32 log1p_vf32(vf32 e, vf32 u1) {
    const vf32 d = u1 - 1.0f;
    const vi32 tiny = d == 0.0f;
    const vf32 r = log_ge1_vf32(u1) * e / (vf32)((vi32)d | (tiny & (vi32)((vf32){0} + 1.0f)));
    return (vf32)(((vi32)e & tiny) | ((vi32)r & ~tiny));
}

/* float64 (used by the tests and float64 research runs): libm per lane. */
static inline vf64 log1p_vf64(vf64 e, vf64 u1) {
    (void)u1;
    for (int j = 0; j < W; j++) e[j] = log1p(e[j]);
    return e;
}

#define S float
#define V vf32
#define VI vi32
#define SUF f32
#define EXPV exp_vf32
#define LOG1PV log1p_vf32
#include "selective_scan_body.h"
#undef S
#undef V
#undef VI
#undef SUF
#undef EXPV
#undef LOG1PV

#define S double
#define V vf64
#define VI vi64
#define SUF f64
#define EXPV exp_vf64
#define LOG1PV log1p_vf64
#include "selective_scan_body.h"
#undef S
#undef V
#undef VI
#undef SUF
#undef EXPV
#undef LOG1PV
