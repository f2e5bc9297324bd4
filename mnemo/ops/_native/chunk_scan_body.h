/* Body of the chunk-scan kernels for one scalar type; included by chunk_scan.c with S (scalar),
   V (a vector of LANES scalars, one SIMD register) and SUF (name suffix) defined. */

#define NAME2(a, b) a##b
#define NAME(a, b) NAME2(a, b)
#define LDV NAME(cs_load_, SUF)
#define STV NAME(cs_store_, SUF)
#define GEMM NAME(cs_gemm_, SUF)

static inline V LDV(const S *p) {
    V x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void STV(S *p, V x) { memcpy(p, &x, sizeof x); }

/* Σ_c a[c] b[c] over c < len, LANES at a time (the lanes added up at the end). */
static inline S NAME(cs_dot_, SUF)(const S *restrict a, const S *restrict b, int64_t len) {
    V x = {0};
    int64_t c = 0;
    for (; c + LANES <= len; c += LANES) x += LDV(a + c) * LDV(b + c);
    S t = 0;
    for (int i = 0; i < LANES; i++) t += x[i];
    for (; c < len; c++) t += a[c] * b[c];
    return t;
}

#define DOT NAME(cs_dot_, SUF)

/* dots[r] = Σ_c G[r, c] Sn[r, c] for the K rows of [K, V] matrices (the gradient of a chunk's
   log decay: every entry of the state leaving the chunk carries its decay). */
static inline void NAME(cs_row_dots_, SUF)(S *restrict dots, const S *restrict G, const S *restrict Sn,
                                           int64_t K, int64_t Vd) {
    for (int64_t r = 0; r < K; r++) dots[r] = DOT(G + r * Vd, Sn + r * Vd, Vd);
}

#define ROW_DOTS NAME(cs_row_dots_, SUF)

/* out[r, c] = D[r, c] (0 if D is NULL) + Σ_k A(r, k) Bm[k, c] for r < R, k < Kd, c < Cn, where
   A(r, k) = A[r ar + k ak] (so a transposed A is ar = 1, ak = its row stride) and out, D, Bm have
   row strides ldo, ldd, ldb. Four rows at a time: per k one vector of Bm feeds four
   multiply-adds. out must not overlap D or Bm. */
static void GEMM(S *restrict out, int64_t ldo, const S *restrict A, int64_t ar, int64_t ak,
                 const S *restrict Bm, int64_t ldb, const S *restrict D, int64_t ldd, int64_t R,
                 int64_t Kd, int64_t Cn) {
    const int64_t cv = Cn / LANES * LANES;
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) {
        const S *restrict a0 = A + r * ar, *restrict a1 = a0 + ar, *restrict a2 = a1 + ar,
                          *restrict a3 = a2 + ar;
        for (int64_t c = 0; c < cv; c += LANES) {
            V x0 = {0}, x1 = {0}, x2 = {0}, x3 = {0};
            if (D) {
                x0 = LDV(D + r * ldd + c);
                x1 = LDV(D + (r + 1) * ldd + c);
                x2 = LDV(D + (r + 2) * ldd + c);
                x3 = LDV(D + (r + 3) * ldd + c);
            }
            for (int64_t k = 0; k < Kd; k++) {
                const V b = LDV(Bm + k * ldb + c);
                x0 += a0[k * ak] * b;
                x1 += a1[k * ak] * b;
                x2 += a2[k * ak] * b;
                x3 += a3[k * ak] * b;
            }
            STV(out + r * ldo + c, x0);
            STV(out + (r + 1) * ldo + c, x1);
            STV(out + (r + 2) * ldo + c, x2);
            STV(out + (r + 3) * ldo + c, x3);
        }
        for (int64_t c = cv; c < Cn; c++)
            for (int64_t i = 0; i < 4; i++) {
                S x = D ? D[(r + i) * ldd + c] : (S)0;
                for (int64_t k = 0; k < Kd; k++) x += A[(r + i) * ar + k * ak] * Bm[k * ldb + c];
                out[(r + i) * ldo + c] = x;
            }
    }
    for (; r < R; r++)
        for (int64_t c = 0; c < Cn; c++) {
            S x = D ? D[r * ldd + c] : (S)0;
            for (int64_t k = 0; k < Kd; k++) x += A[r * ar + k * ak] * Bm[k * ldb + c];
            out[r * ldo + c] = x;
        }
}

/* S_{i+1} = M_i S_i + D_i over the n chunks of each head, from S_0 = S0[j]: writes states[j, i] =
   S_i (the state entering chunk i; [B H, n, K, V] contiguous) and Sf[j] = S_n. M and D are strided
   views [B, H, n, K, K] / [B, H, n, K, V] (element strides per b, h, chunk and row; unit column
   stride); S0, Sf: [B H, K, V]. */
static void NAME(scan_mat_fwd_range_, SUF)(int64_t j0, int64_t j1, int64_t H, int64_t n, int64_t K,
                                           int64_t Vd, const S *restrict S0, const S *restrict M,
                                           int64_t mb, int64_t mh, int64_t mn, int64_t mr,
                                           const S *restrict D, int64_t db, int64_t dh, int64_t dn,
                                           int64_t dr, S *restrict states, S *restrict Sf) {
    const int64_t kv = K * Vd;
    for (int64_t j = j0; j < j1; j++) {
        const int64_t b = j / H, h = j % H;
        S *restrict st = states + j * n * kv;
        memcpy(st, S0 + j * kv, (size_t)kv * sizeof(S));
        for (int64_t i = 0; i < n; i++) {
            S *out = i + 1 < n ? st + (i + 1) * kv : Sf + j * kv;
            GEMM(out, Vd, M + b * mb + h * mh + i * mn, mr, 1, st + i * kv, Vd, D + b * db + h * dh + i * dn,
                 dr, K, K, Vd);
        }
    }
}

void NAME(scan_mat_fwd_, SUF)(int64_t jobs, int64_t nt, int64_t slot0, int64_t slot1, int64_t H, int64_t n,
                              int64_t K, int64_t Vd, const S *S0, const S *M, int64_t mb, int64_t mh,
                              int64_t mn, int64_t mr, const S *D, int64_t db, int64_t dh, int64_t dn,
                              int64_t dr, S *states, S *Sf) {
#define RUN(s)                                                                                        \
    NAME(scan_mat_fwd_range_, SUF)(jobs * (s) / nt, jobs * ((s) + 1) / nt, H, n, K, Vd, S0, M, mb, mh, mn, \
                                   mr, D, db, dh, dn, dr, states, Sf)
    FOR_SLOTS(RUN);
#undef RUN
}

/* The reverse pass: G_i = M_iᵀ G_{i+1} + R_i from G_n = dSf[j]. R ([B H, n, K, V] contiguous) is
   consumed: R[j, i] is overwritten with G_{i+1}; dS0[j] = G_0. If dots is not NULL ([B H, n, K]),
   also dots[j, i, r] = Σ_c G_{i+1}[r, c] S_{i+1}[r, c] with S_{i+1} = states[j, i + 1] (Sf[j] for
   the last chunk). work: 2 K V scalars per slot. */
static void NAME(scan_mat_bwd_range_, SUF)(int64_t j0, int64_t j1, int64_t H, int64_t n, int64_t K,
                                           int64_t Vd, const S *restrict dSf, S *restrict R,
                                           const S *restrict M, int64_t mb, int64_t mh, int64_t mn,
                                           int64_t mr, S *restrict dS0, const S *restrict states,
                                           const S *restrict Sf, S *restrict dots, S *restrict work) {
    const int64_t kv = K * Vd;
    for (int64_t j = j0; j < j1; j++) {
        const int64_t b = j / H, h = j % H;
        S *G = work, *Gn = work + kv;
        memcpy(G, dSf + j * kv, (size_t)kv * sizeof(S));
        for (int64_t i = n - 1; i >= 0; i--) {
            S *Ri = R + (j * n + i) * kv;
            if (dots) ROW_DOTS(dots + (j * n + i) * K, G, i + 1 < n ? states + (j * n + i + 1) * kv : Sf + j * kv, K, Vd);
            GEMM(Gn, Vd, M + b * mb + h * mh + i * mn, 1, mr, G, Vd, Ri, Vd, K, K, Vd);
            memcpy(Ri, G, (size_t)kv * sizeof(S));
            S *t = G;
            G = Gn;
            Gn = t;
        }
        memcpy(dS0 + j * kv, G, (size_t)kv * sizeof(S));
    }
}

void NAME(scan_mat_bwd_, SUF)(int64_t jobs, int64_t nt, int64_t slot0, int64_t slot1, int64_t H, int64_t n,
                              int64_t K, int64_t Vd, const S *dSf, S *R, const S *M, int64_t mb, int64_t mh,
                              int64_t mn, int64_t mr, S *dS0, const S *states, const S *Sf, S *dots, S *work) {
#define RUN(s)                                                                                        \
    NAME(scan_mat_bwd_range_, SUF)(jobs * (s) / nt, jobs * ((s) + 1) / nt, H, n, K, Vd, dSf, R, M, mb, mh, \
                                   mn, mr, dS0, states, Sf, dots, work + (s) * 2 * K * Vd)
    FOR_SLOTS(RUN);
#undef RUN
}

/* S_{i+1} = λ_i ⊙ S_i + dS_i (λ_i: one factor per row, Kl = K, or per chunk, Kl = 1; lam NULL:
   1). dS ([B H, n, K, V] contiguous) is consumed: dS[j, i] is overwritten with S_i; Sf[j] = S_n.
   lam: [B H, n, Kl]. work: K V scalars per slot. */
static void NAME(scan_dec_fwd_range_, SUF)(int64_t j0, int64_t j1, int64_t n, int64_t K, int64_t Vd,
                                           int64_t Kl, const S *restrict S0, S *restrict dS,
                                           const S *restrict lam, S *restrict Sf, S *restrict Sc) {
    const int64_t kv = K * Vd;
    for (int64_t j = j0; j < j1; j++) {
        memcpy(Sc, S0 + j * kv, (size_t)kv * sizeof(S));
        for (int64_t i = 0; i < n; i++) {
            S *restrict d = dS + (j * n + i) * kv;
            const S *restrict l = lam ? lam + (j * n + i) * Kl : NULL;
            for (int64_t r = 0; r < K; r++) {
                const S f = l ? l[Kl == 1 ? 0 : r] : (S)1;
                S *restrict dr = d + r * Vd, *restrict sr = Sc + r * Vd;
                for (int64_t c = 0; c < Vd; c++) {
                    const S t = f * sr[c] + dr[c];
                    dr[c] = sr[c];
                    sr[c] = t;
                }
            }
        }
        memcpy(Sf + j * kv, Sc, (size_t)kv * sizeof(S));
    }
}

void NAME(scan_dec_fwd_, SUF)(int64_t jobs, int64_t nt, int64_t slot0, int64_t slot1, int64_t n, int64_t K,
                              int64_t Vd, int64_t Kl, const S *S0, S *dS, const S *lam, S *Sf, S *work) {
#define RUN(s)                                                                                        \
    NAME(scan_dec_fwd_range_, SUF)(jobs * (s) / nt, jobs * ((s) + 1) / nt, n, K, Vd, Kl, S0, dS, lam, Sf,  \
                                   work + (s) * K * Vd)
    FOR_SLOTS(RUN);
#undef RUN
}

/* The reverse pass: G_i = λ_i ⊙ G_{i+1} + R_i from G_n = dSf[j]; R is consumed (R[j, i] ← G_{i+1},
   or λ_i ⊙ G_{i+1} if scale_out); dS0[j] = G_0. dots as in scan_mat_bwd (may be NULL). work: K V
   scalars per slot. */
static void NAME(scan_dec_bwd_range_, SUF)(int64_t j0, int64_t j1, int64_t n, int64_t K, int64_t Vd,
                                           int64_t Kl, const S *restrict dSf, S *restrict R,
                                           const S *restrict lam, S *restrict dS0, const S *restrict states,
                                           const S *restrict Sf, S *restrict dots, int64_t scale_out,
                                           S *restrict G) {
    const int64_t kv = K * Vd;
    for (int64_t j = j0; j < j1; j++) {
        memcpy(G, dSf + j * kv, (size_t)kv * sizeof(S));
        for (int64_t i = n - 1; i >= 0; i--) {
            S *restrict ri = R + (j * n + i) * kv;
            const S *restrict l = lam ? lam + (j * n + i) * Kl : NULL;
            if (dots) ROW_DOTS(dots + (j * n + i) * K, G, i + 1 < n ? states + (j * n + i + 1) * kv : Sf + j * kv, K, Vd);
            for (int64_t r = 0; r < K; r++) {
                const S f = l ? l[Kl == 1 ? 0 : r] : (S)1, fo = scale_out ? f : (S)1;
                S *restrict rr = ri + r * Vd, *restrict gr = G + r * Vd;
                for (int64_t c = 0; c < Vd; c++) {
                    const S t = f * gr[c] + rr[c];
                    rr[c] = fo * gr[c];
                    gr[c] = t;
                }
            }
        }
        memcpy(dS0 + j * kv, G, (size_t)kv * sizeof(S));
    }
}

void NAME(scan_dec_bwd_, SUF)(int64_t jobs, int64_t nt, int64_t slot0, int64_t slot1, int64_t n, int64_t K,
                              int64_t Vd, int64_t Kl, const S *dSf, S *R, const S *lam, S *dS0, const S *states,
                              const S *Sf, S *dots, int64_t scale_out, S *work) {
#define RUN(s)                                                                                        \
    NAME(scan_dec_bwd_range_, SUF)(jobs * (s) / nt, jobs * ((s) + 1) / nt, n, K, Vd, Kl, dSf, R, lam, dS0, \
                                   states, Sf, dots, scale_out, work + (s) * K * Vd)
    FOR_SLOTS(RUN);
#undef RUN
}

/* A ← A⁻¹ for unit lower-triangular C × C matrices (A: [jobs, C, C] contiguous, with ones on the
   diagonal and zeros above it, which are read as such and left as they are). Row i of the
   inverse is X[i, :i] = −Σ_{j<i} A[i, j] X[j, :i] (forward substitution; X[j] holds its 1 on the
   diagonal and zeros beyond), formed a vector of columns at a time in a scratch row (C scalars
   per slot) and written over row i, whose entries are not needed again. */
static void NAME(unit_lower_inv_range_, SUF)(int64_t j0, int64_t j1, int64_t C, S *restrict A,
                                             S *restrict tmp) {
    for (int64_t m = j0; m < j1; m++) {
        S *restrict X = A + m * C * C;
        for (int64_t i = 1; i < C; i++) {
            const S *restrict ai = X + i * C;
            int64_t c0 = 0;
            for (; c0 < i && c0 + LANES <= C; c0 += LANES) { /* X[j, c0:] is zero for j < c0 */
                V x0 = {0}, x1 = {0};
                int64_t j = c0;
                for (; j + 1 < i; j += 2) {
                    x0 += ai[j] * LDV(X + j * C + c0);
                    x1 += ai[j + 1] * LDV(X + (j + 1) * C + c0);
                }
                if (j < i) x0 += ai[j] * LDV(X + j * C + c0);
                STV(tmp + c0, -(x0 + x1));
            }
            for (int64_t c = c0; c < i; c++) { /* a last block narrower than a vector */
                S x = 0;
                for (int64_t j = c; j < i; j++) x += ai[j] * X[j * C + c];
                tmp[c] = -x;
            }
            memcpy(X + i * C, tmp, (size_t)i * sizeof(S));
        }
    }
}

void NAME(unit_lower_inv_, SUF)(int64_t jobs, int64_t nt, int64_t slot0, int64_t slot1, int64_t C, S *A,
                                S *work) {
#define RUN(s) NAME(unit_lower_inv_range_, SUF)(jobs * (s) / nt, jobs * ((s) + 1) / nt, C, A, work + (s) * C)
    FOR_SLOTS(RUN);
#undef RUN
}

#undef GEMM
#undef DOT
#undef ROW_DOTS
#undef LDV
#undef STV
#undef NAME
#undef NAME2
