/* Short causal depthwise convolution on the CPU (the ShortConvolution of H3 / Mamba / GLA /
   DeltaNet, before its SiLU):

       y[b, t, c] = bias[c] + Σ_{i < W} w[i, c] · xp[b, t + i, c]

   where xp = [state; x] holds the W − 1 previous inputs in front of the T new ones. A job is a
   range of channels [c0, c1) over every sequence and token, so the weight gradient of a channel
   is owned by one thread slot (see slots.h); the inner loops run over contiguous channels and
   vectorise.
   Layouts (contiguous): xp, dxp: [B, T + W − 1, C]; y, dy: [B, T, C]; w, dw: [W, C] (taps
   first); bias, dbias: [C]. PyTorch's autograd Function in mnemo/layers/conv.py is the twin. */

#include <stdint.h>
#include <string.h>

#include "slots.h"

#define DEFINE_CONV(SUF, S)                                                                        \
    static void conv_fwd_range_##SUF(int64_t c0, int64_t c1, int64_t B, int64_t T, int64_t C, int64_t W,        \
                        const S *restrict xp, const S *restrict w, const S *restrict bias,         \
                        S *restrict y) {                                                           \
        const int64_t Tp = T + W - 1;                                                              \
        for (int64_t b = 0; b < B; b++)                                                            \
            for (int64_t t = 0; t < T; t++) {                                                      \
                S *restrict yt = y + (b * T + t) * C;                                              \
                for (int64_t c = c0; c < c1; c++) yt[c] = bias ? bias[c] : (S)0;                   \
                for (int64_t i = 0; i < W; i++) {                                                  \
                    const S *restrict xr = xp + (b * Tp + t + i) * C, *restrict wi = w + i * C;    \
                    for (int64_t c = c0; c < c1; c++) yt[c] += wi[c] * xr[c];                      \
                }                                                                                  \
            }                                                                                      \
    }                                                                                              \
                                                                                                   \
    /* dxp (may be NULL), dw and dbias (may be NULL) are written for the channels [c0, c1). */     \
    static void conv_bwd_range_##SUF(int64_t c0, int64_t c1, int64_t B, int64_t T, int64_t C, int64_t W,        \
                        const S *restrict xp, const S *restrict w, const S *restrict dy,           \
                        S *restrict dxp, S *restrict dw, S *restrict dbias) {                      \
        const int64_t Tp = T + W - 1;                                                              \
        for (int64_t i = 0; i < W; i++)                                                            \
            for (int64_t c = c0; c < c1; c++) dw[i * C + c] = 0;                                   \
        if (dbias)                                                                                 \
            for (int64_t c = c0; c < c1; c++) dbias[c] = 0;                                        \
        for (int64_t b = 0; b < B; b++) {                                                          \
            for (int64_t s = 0; s < Tp; s++) {                                                     \
                /* dxp[s] = Σ_i w[i] dy[s − i] over the taps that reach a token t = s − i */       \
                const int64_t ilo = s - (T - 1) > 0 ? s - (T - 1) : 0, ihi = s < W - 1 ? s : W - 1; \
                const S *restrict xr = xp + (b * Tp + s) * C;                                      \
                S *restrict dr = dxp ? dxp + (b * Tp + s) * C : NULL;                              \
                if (dr)                                                                            \
                    for (int64_t c = c0; c < c1; c++) dr[c] = 0;                                   \
                for (int64_t i = ilo; i <= ihi; i++) {                                             \
                    const S *restrict g = dy + (b * T + s - i) * C, *restrict wi = w + i * C;      \
                    S *restrict dwi = dw + i * C;                                                  \
                    if (dr)                                                                        \
                        for (int64_t c = c0; c < c1; c++) dr[c] += wi[c] * g[c];                   \
                    for (int64_t c = c0; c < c1; c++) dwi[c] += xr[c] * g[c];                      \
                }                                                                                  \
            }                                                                                      \
            if (dbias)                                                                             \
                for (int64_t t = 0; t < T; t++) {                                                  \
                    const S *restrict g = dy + (b * T + t) * C;                                    \
                    for (int64_t c = c0; c < c1; c++) dbias[c] += g[c];                            \
                }                                                                                  \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* entry points: the channels split into nt slots (see slots.h) */                             \
    void conv_fwd_##SUF(int64_t jobs, int64_t nt, int64_t slot0, int64_t slot1, int64_t B,         \
                        int64_t T, int64_t C, int64_t W, const S *xp, const S *w, const S *bias,   \
                        S *y) {                                                                    \
        FOR_SLOTS(CONV_FWD_##SUF);                                                                 \
    }                                                                                              \
    void conv_bwd_##SUF(int64_t jobs, int64_t nt, int64_t slot0, int64_t slot1, int64_t B,         \
                        int64_t T, int64_t C, int64_t W, const S *xp, const S *w, const S *dy,     \
                        S *dxp, S *dw, S *dbias) {                                                 \
        FOR_SLOTS(CONV_BWD_##SUF);                                                                 \
    }

#define CONV_FWD_f32(s) conv_fwd_range_f32(jobs * (s) / nt, jobs * ((s) + 1) / nt, B, T, C, W, xp, w, bias, y)
#define CONV_BWD_f32(s) \
    conv_bwd_range_f32(jobs * (s) / nt, jobs * ((s) + 1) / nt, B, T, C, W, xp, w, dy, dxp, dw, dbias)
#define CONV_FWD_f64(s) conv_fwd_range_f64(jobs * (s) / nt, jobs * ((s) + 1) / nt, B, T, C, W, xp, w, bias, y)
#define CONV_BWD_f64(s) \
    conv_bwd_range_f64(jobs * (s) / nt, jobs * ((s) + 1) / nt, B, T, C, W, xp, w, dy, dxp, dw, dbias)

DEFINE_CONV(f32, float)
DEFINE_CONV(f64, double)
