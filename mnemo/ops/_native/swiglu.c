/* SwiGLU's gate on the CPU: the element-wise middle of the gated MLP (Shazeer 2020, "GLU Variants
   Improve Transformer", the SwiGLU of Eq. 6), one pass over memory each way instead of PyTorch's
   SiLU, product and (backward) SiLU gradient, two products and the concatenation of the two halves'
   gradients, each a pass of its own into a freshly allocated tensor.

   Each row of x holds 2H channels, the gate a = x[:H] and the value b = x[H:] (the halves of one
   projection, W_in x = [W_gate x, W_up x]); with σ the logistic function and silu(a) = a σ(a):

       forward:   y = silu(a) ⊙ b
       backward:  da = dy ⊙ b ⊙ silu'(a),   db = dy ⊙ silu(a),   silu'(a) = σ(a) + silu(a) (1 − σ(a))

   written into one [2H] row of dx (da first), the layout of x, so no concatenation follows. exp runs
   once per element each way (exp_vf32 / exp_vf64 of vexp.h, one SIMD register at a time).
   Layouts (contiguous): x, dx: [jobs, 2H]; y, dy: [jobs, H]; a job is one row.
   The PyTorch twin is mnemo.layers.mlp.swiglu's reference form. */

#include <stdint.h>
#include <string.h>

#include "slots.h"
#include "vexp.h"

#define DEFINE_GLU(SUF, S, V, EXPV)                                                                \
    static void glu_fwd_range_##SUF(int64_t r0, int64_t r1, int64_t H, const S *restrict x,        \
                                    S *restrict y) {                                               \
        for (int64_t r = r0; r < r1; r++) {                                                        \
            const S *restrict ar = x + r * 2 * H, *restrict br = ar + H;                           \
            S *restrict yr = y + r * H;                                                            \
            for (int64_t i = 0; i < H; i += W) {                                                   \
                const int64_t n = H - i < W ? H - i : W;                                           \
                const V a = vload_##SUF(ar + i, n), b = vload_##SUF(br + i, n);                    \
                vstore_##SUF(yr + i, a / ((S)1 + EXPV(-a)) * b, n);                                \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    static void glu_bwd_range_##SUF(int64_t r0, int64_t r1, int64_t H, const S *restrict x,        \
                                    const S *restrict dy, S *restrict dx) {                        \
        for (int64_t r = r0; r < r1; r++) {                                                        \
            const S *restrict ar = x + r * 2 * H, *restrict br = ar + H;                           \
            const S *restrict gr = dy + r * H;                                                     \
            S *restrict dar = dx + r * 2 * H, *restrict dbr = dar + H;                             \
            for (int64_t i = 0; i < H; i += W) {                                                   \
                const int64_t n = H - i < W ? H - i : W;                                           \
                const V a = vload_##SUF(ar + i, n), b = vload_##SUF(br + i, n);                    \
                const V g = vload_##SUF(gr + i, n);                                                \
                const V s = (S)1 / ((S)1 + EXPV(-a)), sl = a * s;                                  \
                vstore_##SUF(dar + i, g * b * (s + sl * ((S)1 - s)), n);                           \
                vstore_##SUF(dbr + i, g * sl, n);                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* entry points: the rows split into nt slots (see slots.h) */                                 \
    void glu_fwd_##SUF(int64_t jobs, int64_t nt, int64_t slot0, int64_t slot1, int64_t H,          \
                       const S *x, S *y) {                                                         \
        FOR_SLOTS(GLU_FWD_##SUF);                                                                  \
    }                                                                                              \
    void glu_bwd_##SUF(int64_t jobs, int64_t nt, int64_t slot0, int64_t slot1, int64_t H,          \
                       const S *x, const S *dy, S *dx) {                                           \
        FOR_SLOTS(GLU_BWD_##SUF);                                                                  \
    }

#define GLU_FWD_f32(s) glu_fwd_range_f32(jobs * (s) / nt, jobs * ((s) + 1) / nt, H, x, y)
#define GLU_BWD_f32(s) glu_bwd_range_f32(jobs * (s) / nt, jobs * ((s) + 1) / nt, H, x, dy, dx)
#define GLU_FWD_f64(s) glu_fwd_range_f64(jobs * (s) / nt, jobs * ((s) + 1) / nt, H, x, y)
#define GLU_BWD_f64(s) glu_bwd_range_f64(jobs * (s) / nt, jobs * ((s) + 1) / nt, H, x, dy, dx)

DEFINE_GLU(f32, float, vf32, exp_vf32)
DEFINE_GLU(f64, double, vf64, exp_vf64)
