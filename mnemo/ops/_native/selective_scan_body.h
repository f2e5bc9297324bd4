/* Body of the selective-scan kernels for one scalar type, written with GCC/Clang vector
   extensions so that every W-channel operation is one SIMD instruction (or a few, where the
   machine's registers are narrower). Included by selective_scan.c with these defined:
   S (scalar), V (W x S vector), VI (W x same-width int vector), SUF (name suffix) and
   V EXPV(V) (lane-wise exp). See selective_scan.c for the layouts. */

#define NAME2(a, b) a##b
#define NAME(a, b) NAME2(a, b)
#define SEL(m, a, b) ((V)(((VI)(a) & (m)) | ((VI)(b) & ~(m))))

static inline V NAME(load_, SUF)(const S *p) {
    V x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void NAME(store_, SUF)(S *p, V x) { memcpy(p, &x, sizeof x); }

#define LD NAME(load_, SUF)
#define ST NAME(store_, SUF)

/* silu(z) = z σ(z) and σ(z), lane-wise. */
static inline V NAME(sigmoid_, SUF)(V z) { return (S)1 / ((S)1 + EXPV(-z)); }

#define SIGMOID NAME(sigmoid_, SUF)

/* Forward for the jobs [job0, job1): job = (b, tile of W channels). v = Δ ⊙ u is formed here, and
   the output is y = (C·h + D ⊙ u) ⊙ silu(z) (Dsk and z may be NULL: no skip / no gate). Also
   writes the state before every block of L tokens into starts ([B, ceil(T / L), N, Dp]) for the
   backward. work: N vectors. */
void NAME(ss_fwd_, SUF)(int64_t job0, int64_t job1, int64_t T, int64_t Dp, int64_t Dgp, int64_t G,
                        int64_t N, int64_t L, const S *restrict delta, const S *restrict u,
                        const S *restrict At, const S *restrict Bm, const S *restrict Cm,
                        const S *restrict h0, const S *restrict Dsk, const S *restrict z,
                        S *restrict y, S *restrict hT, S *restrict starts, V *restrict h) {
    const int64_t tiles = Dp / W, nblk = (T + L - 1) / L;
    const V lo = (V){0} + (S)LOG_GATE_MIN;
    for (int64_t job = job0; job < job1; job++) {
        const int64_t b = job / tiles, d0 = (job % tiles) * W, g = d0 / Dgp;
        const V Dv = Dsk ? LD(Dsk + d0) : (V){0};
        for (int64_t n = 0; n < N; n++) h[n] = LD(h0 + (b * N + n) * Dp + d0);
        for (int64_t t = 0; t < T; t++) {
            if (t % L == 0)
                for (int64_t n = 0; n < N; n++) ST(starts + ((b * nblk + t / L) * N + n) * Dp + d0, h[n]);
            const int64_t row = (b * T + t) * Dp + d0, grow = ((b * T + t) * G + g) * N;
            const V dl = LD(delta + row), ut = LD(u + row), vt = dl * ut;
            V acc = Dv * ut;
            for (int64_t n = 0; n < N; n++) {
                V la = dl * LD(At + n * Dp + d0);
                la = SEL(la < lo, lo, la);
                const V hv = EXPV(la) * h[n] + vt * Bm[grow + n];
                h[n] = hv;
                acc += hv * Cm[grow + n];
            }
            if (z) {
                const V zt = LD(z + row);
                acc *= zt * SIGMOID(zt);
            }
            ST(y + row, acc);
        }
        for (int64_t n = 0; n < N; n++) ST(hT + (b * N + n) * Dp + d0, h[n]);
    }
}

/* Backward for the jobs [job0, job1), block by block from the last: for each job the block's
   states, decays and pre-gate outputs are recomputed from starts into an L2-sized buffer, then
   the reverse scan g_t = C_t dy_t + exp(Δ_{t+1} A) g_{t+1} runs through it. The blocks are the
   outer loop so that the block's slice of dB/dC stays in cache across the jobs. dB, dC
   ([B, T, G, N] vectors: one partial sum per lane, which the caller adds up) are accumulated
   (+=); dD ([B, Dp], summed over b by the caller; only if Dsk) and dz (only if z) and the rest
   are written. work: (2 L + 1) N + L + (2 N + 1) (job1 - job0) vectors. */
void NAME(ss_bwd_, SUF)(int64_t job0, int64_t job1, int64_t T, int64_t Dp, int64_t Dgp, int64_t G,
                        int64_t N, int64_t L, const S *restrict delta, const S *restrict u,
                        const S *restrict At, const S *restrict Bm, const S *restrict Cm,
                        const S *restrict starts, const S *restrict Dsk, const S *restrict z,
                        const S *restrict dy, const S *restrict dhT, S *restrict ddelta,
                        S *restrict du, S *restrict dA, S *restrict dD, S *restrict dz,
                        V *restrict dB, V *restrict dC, S *restrict dh0, V *restrict work) {
    const int64_t tiles = Dp / W, nblk = (T + L - 1) / L, jobs = job1 - job0;
    const V lo = (V){0} + (S)LOG_GATE_MIN;
    V *restrict H = work;               /* [L + 1][N]: H[j + 1] = h_{t0 + j}, H[0] = state before */
    V *restrict E = H + (L + 1) * N;    /* [L][N]: exp(Δ A) */
    V *restrict YP = E + L * N;         /* [L]: C·h (the output before skip and gate) */
    V *restrict grs = YP + L;           /* [jobs][N]: dL/dh carried from block to block */
    V *restrict dAs = grs + jobs * N;   /* [jobs][N] */
    V *restrict dDs = dAs + jobs * N;   /* [jobs] */
    for (int64_t job = job0; job < job1; job++) {
        const int64_t b = job / tiles, d0 = (job % tiles) * W;
        for (int64_t n = 0; n < N; n++) {
            grs[(job - job0) * N + n] = LD(dhT + (b * N + n) * Dp + d0);
            dAs[(job - job0) * N + n] = (V){0};
        }
        dDs[job - job0] = (V){0};
    }
    for (int64_t k = nblk - 1; k >= 0; k--) {
        const int64_t t0 = k * L, l = (T - t0 < L) ? T - t0 : L;
        for (int64_t job = job0; job < job1; job++) {
            const int64_t b = job / tiles, d0 = (job % tiles) * W, g = d0 / Dgp;
            V *restrict gr = grs + (job - job0) * N, *restrict dAa = dAs + (job - job0) * N;
            const V Dv = Dsk ? LD(Dsk + d0) : (V){0};
            for (int64_t n = 0; n < N; n++) H[n] = LD(starts + ((b * nblk + k) * N + n) * Dp + d0);
            for (int64_t j = 0; j < l; j++) {
                const int64_t t = t0 + j;
                const int64_t row = (b * T + t) * Dp + d0, grow = ((b * T + t) * G + g) * N;
                const V dl = LD(delta + row), vt = dl * LD(u + row);
                V yp = (V){0};
                for (int64_t n = 0; n < N; n++) {
                    V la = dl * LD(At + n * Dp + d0);
                    la = SEL(la < lo, lo, la);
                    const V e = EXPV(la);
                    const V hv = e * H[j * N + n] + vt * Bm[grow + n];
                    E[j * N + n] = e;
                    H[(j + 1) * N + n] = hv;
                    yp += hv * Cm[grow + n];
                }
                YP[j] = yp;
            }
            for (int64_t j = l - 1; j >= 0; j--) {
                const int64_t t = t0 + j;
                const int64_t row = (b * T + t) * Dp + d0, grow = ((b * T + t) * G + g) * N;
                const V dl = LD(delta + row), ut = LD(u + row), vt = dl * ut;
                V gy = LD(dy + row);
                if (z) { /* y = ypre ⊙ silu(z): dz = dy ypre σ (1 + z (1 − σ)), dypre = dy silu(z) */
                    const V zt = LD(z + row), sg = SIGMOID(zt);
                    ST(dz + row, gy * (YP[j] + Dv * ut) * sg * ((S)1 + zt * ((S)1 - sg)));
                    gy *= zt * sg;
                }
                dDs[job - job0] += gy * ut;
                V sdv = (V){0}, sdd = (V){0};
                for (int64_t n = 0; n < N; n++) {
                    const V An = LD(At + n * Dp + d0);
                    const V e = E[j * N + n];
                    const V gv = gr[n] + gy * Cm[grow + n];
                    dC[grow + n] += gy * H[(j + 1) * N + n];
                    dB[grow + n] += gv * vt;
                    sdv += gv * Bm[grow + n];
                    V w = gv * e * H[j * N + n];
                    w = SEL(dl * An < lo, (V){0}, w);
                    sdd += w * An;
                    dAa[n] += w * dl;
                    gr[n] = gv * e;
                }
                /* v = Δ u: dΔ gets dv u, du gets dv Δ (+ the skip's dy D) */
                ST(ddelta + row, sdd + sdv * ut);
                ST(du + row, sdv * dl + gy * Dv);
            }
        }
    }
    for (int64_t job = job0; job < job1; job++) {
        const int64_t b = job / tiles, d0 = (job % tiles) * W;
        for (int64_t n = 0; n < N; n++) {
            ST(dh0 + (b * N + n) * Dp + d0, grs[(job - job0) * N + n]);
            ST(dA + (b * N + n) * Dp + d0, dAs[(job - job0) * N + n]);
        }
        if (dD) ST(dD + b * Dp + d0, dDs[job - job0]);
    }
}

#undef SIGMOID
#undef LD
#undef ST
#undef SEL
#undef NAME
#undef NAME2
