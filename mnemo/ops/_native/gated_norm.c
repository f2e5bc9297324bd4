/* Gated RMSNorm on the CPU: the output norm of Mamba-2, Gated DeltaNet, GLA and RetNet, in one
   pass over memory each way instead of the half-dozen elementwise passes of its PyTorch form.

   Each row of D channels is cut into G groups of c = D / G; per group (Zhang & Sennrich 2019, RMSNorm;
   the gate silu(z) = z σ(z) as in Mamba-2, Dao & Gu 2024, §7):

       gate_first = 1 (Mamba-2):         a = x ⊙ silu(z),  y = a · r ⊙ w
       gate_first = 0 (GDN, GLA, RetNet): a = x,            y = a · r ⊙ w ⊙ silu(z)

   with r = 1 / sqrt(mean(a²) + eps) over the group, saved as rstd. The backward, with n = a · r:

       gate_first = 1:  dn = dy ⊙ w,           da = r (dn − n · mean(dn ⊙ n)),
                        dx = da ⊙ silu(z),     dz = da ⊙ x ⊙ silu'(z),     dw += dy ⊙ n
       gate_first = 0:  dn = dy ⊙ w ⊙ silu(z), dx = r (dn − n · mean(dn ⊙ n)),
                        dz = dy ⊙ w ⊙ n ⊙ silu'(z),                        dw += dy ⊙ n ⊙ silu(z)

   with silu'(z) = σ(z) (1 + z (1 − σ(z))). A job is one row; slot s of nt adds its rows' weight
   gradient into its own partial sum dw[s] (the caller sums the nt partials). The backward's first
   pass parks silu(z) in dx (and x ⊙ silu'(z) in dz) for its second pass, so exp runs once per
   element each way (exp_vf32 of vexp.h, one SIMD register at a time).
   Layouts: x, z: [jobs, D] rows xs / zs elements apart (a slice of a wider projection, unit channel
   stride); contiguous: y, dy, dx, dz: [jobs, D]; w: [D]; rstd: [jobs, G]; dw: [nt, D].
   The PyTorch twin is mnemo.layers.norm.gated_rms_norm's reference form. */

#include <stdint.h>
#include <string.h>

#include "slots.h"
#include "vexp.h"

#define DEFINE_GN(SUF, S, V, EXPV)                                                                 \
    static inline S hsum_##SUF(V v) {                                                              \
        S s = 0;                                                                                   \
        for (int j = 0; j < W; j++) s += v[j];                                                     \
        return s;                                                                                  \
    }                                                                                              \
    static inline V sigmoid_##SUF(V z) { return (S)1 / ((S)1 + EXPV(-z)); }                        \
                                                                                                   \
    static void gn_fwd_range_##SUF(int64_t r0, int64_t r1, int64_t D, int64_t G, int64_t gf, S eps, \
                                   const S *restrict x, int64_t xs, const S *restrict z,           \
                                   int64_t zs, const S *restrict w,                                \
                                   S *restrict y, S *restrict rstd) {                              \
        const int64_t c = D / G;                                                                   \
        for (int64_t r = r0; r < r1; r++)                                                          \
            for (int64_t g = 0; g < G; g++) {                                                      \
                const int64_t o = r * D + g * c;                                                   \
                const S *restrict xr = x + r * xs + g * c, *restrict zr = z + r * zs + g * c;      \
                const S *restrict wr = w + g * c;                                                  \
                S *restrict yr = y + o;                                                            \
                V acc = {0};                                                                       \
                for (int64_t i = 0; i < c; i += W) {                                               \
                    const int64_t n = c - i < W ? c - i : W;                                       \
                    V a = vload_##SUF(xr + i, n);                                                   \
                    if (gf) {                                                                      \
                        const V zv = vload_##SUF(zr + i, n);                                        \
                        a = a * zv * sigmoid_##SUF(zv);                                            \
                        vstore_##SUF(yr + i, a, n);                                                 \
                    }                                                                              \
                    acc += a * a;                                                                  \
                }                                                                                  \
                const S rs = (S)1 / sqrt(hsum_##SUF(acc) / (S)c + eps);                            \
                rstd[r * G + g] = rs;                                                              \
                for (int64_t i = 0; i < c; i += W) {                                               \
                    const int64_t n = c - i < W ? c - i : W;                                       \
                    const V wv = vload_##SUF(wr + i, n);                                            \
                    V out;                                                                         \
                    if (gf) {                                                                      \
                        out = vload_##SUF(yr + i, n) * rs * wv;                                     \
                    } else {                                                                       \
                        const V zv = vload_##SUF(zr + i, n);                                        \
                        out = vload_##SUF(xr + i, n) * rs * wv * (zv * sigmoid_##SUF(zv));          \
                    }                                                                              \
                    vstore_##SUF(yr + i, out, n);                                                   \
                }                                                                                  \
            }                                                                                      \
    }                                                                                              \
                                                                                                   \
    static void gn_bwd_range_##SUF(int64_t r0, int64_t r1, int64_t D, int64_t G, int64_t gf,       \
                                   const S *restrict x, int64_t xs, const S *restrict z,           \
                                   int64_t zs, const S *restrict w,                                \
                                   const S *restrict rstd, const S *restrict dy, S *restrict dx,   \
                                   S *restrict dz, S *restrict dw) {                               \
        const int64_t c = D / G;                                                                   \
        for (int64_t i = 0; i < D; i++) dw[i] = 0;                                                 \
        for (int64_t r = r0; r < r1; r++)                                                          \
            for (int64_t g = 0; g < G; g++) {                                                      \
                const int64_t o = r * D + g * c;                                                   \
                const S *restrict xr = x + r * xs + g * c, *restrict zr = z + r * zs + g * c;      \
                const S *restrict gr = dy + o;                                                     \
                const S *restrict wr = w + g * c;                                                  \
                S *restrict dxr = dx + o, *restrict dzr = dz + o, *restrict dwr = dw + g * c;      \
                const S rs = rstd[r * G + g];                                                      \
                V dot = {0};                                                                       \
                for (int64_t i = 0; i < c; i += W) {                                               \
                    const int64_t n = c - i < W ? c - i : W;                                       \
                    const V xv = vload_##SUF(xr + i, n), zv = vload_##SUF(zr + i, n);                \
                    const V gv = vload_##SUF(gr + i, n), wv = vload_##SUF(wr + i, n);                \
                    const V s = sigmoid_##SUF(zv), sl = zv * s;                                    \
                    const V dsl = s * ((S)1 + zv * ((S)1 - s));                                    \
                    V nv, dn, dwv;                                                                 \
                    if (gf) {                                                                      \
                        nv = xv * sl * rs;                                                         \
                        dn = gv * wv;                                                              \
                        dwv = gv * nv;                                                             \
                        vstore_##SUF(dzr + i, xv * dsl, n);                                         \
                    } else {                                                                       \
                        nv = xv * rs;                                                              \
                        const V gw = gv * wv;                                                      \
                        dn = gw * sl;                                                              \
                        dwv = gv * nv * sl;                                                        \
                        vstore_##SUF(dzr + i, gw * nv * dsl, n);                                    \
                    }                                                                              \
                    vstore_##SUF(dxr + i, sl, n);                                                   \
                    vstore_##SUF(dwr + i, vload_##SUF(dwr + i, n) + dwv, n);                         \
                    dot += dn * nv;                                                                \
                }                                                                                  \
                const S m = hsum_##SUF(dot) / (S)c;                                                \
                for (int64_t i = 0; i < c; i += W) {                                               \
                    const int64_t n = c - i < W ? c - i : W;                                       \
                    const V xv = vload_##SUF(xr + i, n), sl = vload_##SUF(dxr + i, n);               \
                    const V gv = vload_##SUF(gr + i, n), wv = vload_##SUF(wr + i, n);                \
                    if (gf) {                                                                      \
                        const V nv = xv * sl * rs;                                                 \
                        const V da = rs * (gv * wv - nv * m);                                      \
                        vstore_##SUF(dxr + i, da * sl, n);                                          \
                        vstore_##SUF(dzr + i, da * vload_##SUF(dzr + i, n), n);                      \
                    } else {                                                                       \
                        const V nv = xv * rs;                                                      \
                        vstore_##SUF(dxr + i, rs * (gv * wv * sl - nv * m), n);                     \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
    }                                                                                              \
                                                                                                   \
    /* entry points: the rows split into nt slots (see slots.h) */                                 \
    void gn_fwd_##SUF(int64_t jobs, int64_t nt, int64_t slot0, int64_t slot1, int64_t D, int64_t G, \
                      int64_t gate_first, const S *eps, const S *x, int64_t xs, const S *z,         \
                      int64_t zs, const S *w, S *y, S *rstd) {                                     \
        FOR_SLOTS(GN_FWD_##SUF);                                                                   \
    }                                                                                              \
    void gn_bwd_##SUF(int64_t jobs, int64_t nt, int64_t slot0, int64_t slot1, int64_t D, int64_t G, \
                      int64_t gate_first, const S *x, int64_t xs, const S *z, int64_t zs,           \
                      const S *w, const S *rstd, const S *dy, S *dx, S *dz, S *dw) {               \
        FOR_SLOTS(GN_BWD_##SUF);                                                                   \
    }

#define GN_FWD_f32(s)                                                                              \
    gn_fwd_range_f32(jobs * (s) / nt, jobs * ((s) + 1) / nt, D, G, gate_first, eps[0], x, xs, z, zs, w, \
                     y, rstd)
#define GN_BWD_f32(s)                                                                              \
    gn_bwd_range_f32(jobs * (s) / nt, jobs * ((s) + 1) / nt, D, G, gate_first, x, xs, z, zs, w, rstd, dy, \
                     dx, dz, dw + (s) * D)
#define GN_FWD_f64(s)                                                                              \
    gn_fwd_range_f64(jobs * (s) / nt, jobs * ((s) + 1) / nt, D, G, gate_first, eps[0], x, xs, z, zs, w, \
                     y, rstd)
#define GN_BWD_f64(s)                                                                              \
    gn_bwd_range_f64(jobs * (s) / nt, jobs * ((s) + 1) / nt, D, G, gate_first, x, xs, z, zs, w, rstd, dy, \
                     dx, dz, dw + (s) * D)

DEFINE_GN(f32, float, vf32, exp_vf32)
DEFINE_GN(f64, double, vf64, exp_vf64)
