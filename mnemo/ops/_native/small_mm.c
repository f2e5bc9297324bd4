/* Products of a few rows with a weight matrix on the CPU, for one-token decoding: y = x wᵀ (+ bias)
   with x [M, K], M ≤ 8 (the batch of a decode step), w [N, K] an nn.Linear weight (its rows
   contiguous) and y [M, N]. A decode step reads every weight once and does 2 M flops per weight
   read, so the product should run at the speed of reading w from memory. BLAS (MKL sgemv / sgemm)
   reads it at about a quarter of the STREAM triad here (docs/benchmarks/matvec_cpu_2core.txt), and
   inductor's fused multiply-sum loop rereads each weight row once per row of x.

   Here each weight row is read once, for all M rows of x at a time: a block of R weight rows is
   multiplied with the M rows of x (which stay in L1) into R·M accumulator registers, one SIMD
   register of the shared dimension K at a time, each accumulator summed across its lanes at the
   end (R·M ≤ 24 with AVX-512's 32 registers, ≤ 12 with AVX2's 16). With 8 rows a core does 2·8
   flops per 4 bytes, so the arithmetic runs about as long as reading the weight from memory; the
   next block's weight rows are prefetched while a block is multiplied, so the two overlap (without
   the prefetch the reads and the arithmetic alternate: 1.3x slower, measured in session 31).
   Summation order: lane-wise partial sums over K, then a tree over the lanes (another rounding
   than BLAS's, within the same float error bound).
   Layouts (contiguous): x [M, K]; w [jobs, K] (jobs = N, the weight's rows: the unit a slot splits);
   bias [jobs] or NULL; y [M, jobs]. The PyTorch twin is mnemo.ops.small_mm._linear (F.linear). */

#include <stdint.h>
#include <string.h>

#include "simd.h"
#include "slots.h"

/* accumulators per block (R·M), kept in registers */
#define SMM_ACC ((W) >= 16 ? 24 : 12)
#define SMM_R(M) (SMM_ACC / (M) < 8 ? (SMM_ACC / (M) > 0 ? SMM_ACC / (M) : 1) : 8)

/* the fewest rows of x for which the next block is prefetched: one row is a pure read that the
   hardware prefetcher keeps up with, and the prefetches would take load slots (session 31, 1 row:
   33.5-33.7 GB/s with them against 34.8-37.0 without, two [1536 or 2752, 512] shapes) */
#ifndef SMM_PREFETCH_MIN_M
#define SMM_PREFETCH_MIN_M 2
#endif

typedef float smm_vf32 __attribute__((vector_size(W * sizeof(float))));
typedef double smm_vf64 __attribute__((vector_size(W / 2 * sizeof(double)))); /* one register */

/* the lanes' sum as a tree: add the register's halves, then their halves, ... down to 2 lanes
   (half-width vector types, so the compiler emits lane extracts and vector adds, not a chain of
   scalar adds); HALVE(T, a, b) writes the sum of b's two halves into a of type T */
#define HALVE(T, a, b)                                                                             \
    do {                                                                                           \
        T lo_, hi_;                                                                                \
        memcpy(&lo_, &(b), sizeof lo_);                                                            \
        memcpy(&hi_, (const char *)&(b) + sizeof lo_, sizeof hi_);                                 \
        (a) = lo_ + hi_;                                                                           \
    } while (0)

#define DEFINE_HSUM(SUF, S, V)                                                                     \
    static inline S hsum_##SUF(V v) {                                                              \
        typedef S V8 __attribute__((vector_size(8 * sizeof(S))));                                  \
        typedef S V4 __attribute__((vector_size(4 * sizeof(S))));                                  \
        typedef S V2 __attribute__((vector_size(2 * sizeof(S))));                                  \
        enum { L = sizeof(V) / sizeof(S) };                                                        \
        V8 a8 = {0};                                                                               \
        V4 a4 = {0};                                                                               \
        V2 a2;                                                                                     \
        if (L == 16) HALVE(V8, a8, v);                                                             \
        if (L == 8) memcpy(&a8, &v, sizeof a8);                                                    \
        if (L >= 8) HALVE(V4, a4, a8);                                                             \
        if (L == 4) memcpy(&a4, &v, sizeof a4);                                                    \
        if (L >= 4) HALVE(V2, a2, a4);                                                             \
        else memcpy(&a2, &v, sizeof a2);                                                           \
        return a2[0] + a2[1];                                                                      \
    }
DEFINE_HSUM(f32, float, smm_vf32)
DEFINE_HSUM(f64, double, smm_vf64)

/* rows [n0, n1) of y for a compile-time M: R weight rows at a time, the last n1 − n0 mod R rows one
   at a time (each in its own function, so the block's accumulators stay in registers) */
#define DEFINE_SMM_M(SUF, S, V, M)                                                                 \
    static void smm_one_##SUF##_m##M(int64_t n, int64_t N, int64_t K, const S *x, const S *w,      \
                                     const S *bias, S *y) {                                        \
        enum { L = sizeof(V) / sizeof(S) };                                                        \
        const int64_t Kv = K - K % L;                                                              \
        const S *wn = w + n * K;                                                                   \
        V acc[M];                                                                                  \
        S tail[M];                                                                                 \
        for (int b = 0; b < M; b++) {                                                              \
            acc[b] = (V){0};                                                                       \
            tail[b] = 0;                                                                           \
        }                                                                                          \
        for (int64_t k = 0; k < Kv; k += L) {                                                      \
            V u;                                                                                   \
            memcpy(&u, wn + k, sizeof(V));                                                         \
            for (int b = 0; b < M; b++) {                                                          \
                V xb;                                                                              \
                memcpy(&xb, x + b * K + k, sizeof(V));                                             \
                acc[b] += u * xb;                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int64_t k = Kv; k < K; k++) /* K's last K mod L columns */                            \
            for (int b = 0; b < M; b++) tail[b] += wn[k] * x[b * K + k];                           \
        for (int b = 0; b < M; b++)                                                                \
            y[b * N + n] = hsum_##SUF(acc[b]) + tail[b] + (bias ? bias[n] : (S)0);                 \
    }                                                                                              \
                                                                                                   \
    static void smm_rows_##SUF##_m##M(int64_t n0, int64_t n1, int64_t N, int64_t K, const S *x,   \
                                      const S *w, const S *bias, S *y) {                           \
        enum { L = sizeof(V) / sizeof(S), R = SMM_R(M) };                                          \
        const int64_t Kv = K - K % L;                                                              \
        int64_t n = n0;                                                                            \
        for (; n + R <= n1; n += R) {                                                              \
            const S *wn = w + n * K;                                                               \
            /* the next block's rows, to prefetch: an address only (prefetches never fault; past  \
               the end of w they fetch nothing that is read) */                                    \
            const uintptr_t pf = (uintptr_t)wn + (uintptr_t)R * (uintptr_t)K * sizeof(S);          \
            V acc[R][M];                                                                           \
            S tail[R][M];                                                                          \
            for (int r = 0; r < R; r++)                                                            \
                for (int b = 0; b < M; b++) {                                                      \
                    acc[r][b] = (V){0};                                                            \
                    tail[r][b] = 0;                                                                \
                }                                                                                  \
            for (int64_t k = 0; k < Kv; k += L) {                                                  \
                V u[R];                                                                            \
                for (int r = 0; r < R; r++) {                                                      \
                    if (M >= SMM_PREFETCH_MIN_M)                                                   \
                        __builtin_prefetch((const void *)(pf + (uintptr_t)(r * K + k) * sizeof(S)), 0, 3); \
                    memcpy(&u[r], wn + r * K + k, sizeof(V));                                      \
                }                                                                                  \
                for (int b = 0; b < M; b++) {                                                      \
                    V xb;                                                                          \
                    memcpy(&xb, x + b * K + k, sizeof(V));                                         \
                    for (int r = 0; r < R; r++) acc[r][b] += u[r] * xb;                            \
                }                                                                                  \
            }                                                                                      \
            for (int64_t k = Kv; k < K; k++) /* K's last K mod L columns */                        \
                for (int r = 0; r < R; r++)                                                        \
                    for (int b = 0; b < M; b++) tail[r][b] += wn[r * K + k] * x[b * K + k];        \
            for (int r = 0; r < R; r++)                                                            \
                for (int b = 0; b < M; b++)                                                        \
                    y[b * N + n + r] =                                                             \
                        hsum_##SUF(acc[r][b]) + tail[r][b] + (bias ? bias[n + r] : (S)0);          \
        }                                                                                          \
        for (; n < n1; n++) smm_one_##SUF##_m##M(n, N, K, x, w, bias, y);                          \
    }

#define DEFINE_SMM(SUF, S, V)                                                                      \
    DEFINE_SMM_M(SUF, S, V, 1)                                                                     \
    DEFINE_SMM_M(SUF, S, V, 2)                                                                     \
    DEFINE_SMM_M(SUF, S, V, 3)                                                                     \
    DEFINE_SMM_M(SUF, S, V, 4)                                                                     \
    DEFINE_SMM_M(SUF, S, V, 5)                                                                     \
    DEFINE_SMM_M(SUF, S, V, 6)                                                                     \
    DEFINE_SMM_M(SUF, S, V, 7)                                                                     \
    DEFINE_SMM_M(SUF, S, V, 8)                                                                     \
    static void smm_range_##SUF(int64_t n0, int64_t n1, int64_t N, int64_t M, int64_t K,          \
                                const S *x, const S *w, const S *bias, S *y) {                     \
        switch (M) {                                                                               \
        case 1: smm_rows_##SUF##_m1(n0, n1, N, K, x, w, bias, y); break;                           \
        case 2: smm_rows_##SUF##_m2(n0, n1, N, K, x, w, bias, y); break;                           \
        case 3: smm_rows_##SUF##_m3(n0, n1, N, K, x, w, bias, y); break;                           \
        case 4: smm_rows_##SUF##_m4(n0, n1, N, K, x, w, bias, y); break;                           \
        case 5: smm_rows_##SUF##_m5(n0, n1, N, K, x, w, bias, y); break;                           \
        case 6: smm_rows_##SUF##_m6(n0, n1, N, K, x, w, bias, y); break;                           \
        case 7: smm_rows_##SUF##_m7(n0, n1, N, K, x, w, bias, y); break;                           \
        default: smm_rows_##SUF##_m8(n0, n1, N, K, x, w, bias, y); break;                          \
        }                                                                                          \
    }                                                                                              \
    /* entry point: the weight's rows split into nt slots (see slots.h); 1 ≤ M ≤ 8 */              \
    void smm_fwd_##SUF(int64_t jobs, int64_t nt, int64_t slot0, int64_t slot1, int64_t M,          \
                       int64_t K, const S *x, const S *w, const S *bias, S *y) {                   \
        FOR_SLOTS(SMM_##SUF);                                                                      \
    }

#define SMM_f32(s) smm_range_f32(jobs * (s) / nt, jobs * ((s) + 1) / nt, jobs, M, K, x, w, bias, y)
#define SMM_f64(s) smm_range_f64(jobs * (s) / nt, jobs * ((s) + 1) / nt, jobs, M, K, x, w, bias, y)

DEFINE_SMM(f32, float, smm_vf32)
DEFINE_SMM(f64, double, smm_vf64)
