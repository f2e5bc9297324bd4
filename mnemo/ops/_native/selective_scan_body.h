/* Body of the selective-scan kernels for one scalar type, written with GCC/Clang vector
   extensions so that every W-channel operation is one SIMD instruction (or a few, where the
   machine's registers are narrower). Included by selective_scan.c with these defined:
   S (scalar), V (W x S vector), VI (W x same-width int vector), SUF (name suffix),
   V EXPV(V) (lane-wise exp) and V LOG1PV(V e, V u1) (lane-wise log1p(e), given u1 = 1 + e).
   See selective_scan.c for the layouts. */

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

/* Δ from the raw step δ: x = δ + bias (bias may be NULL), then softplus(x) if sp, else x.
   *sg gets dΔ/dx: σ(x) under softplus (1 above the threshold 20, as torch.nn.functional.softplus),
   else 1. */
static inline V NAME(step_, SUF)(V x, const S *restrict bias, int64_t d0, int64_t sp, V *sg) {
    if (bias) x += LD(bias + d0);
    if (!sp) {
        *sg = (V){0} + (S)1;
        return x;
    }
    const V big = (V){0} + (S)20;
    const V e = EXPV(SEL(x > big, (V){0}, x)), u1 = (S)1 + e;
    *sg = SEL(x > big, (V){0} + (S)1, e / u1);
    return SEL(x > big, x, LOG1PV(e, u1));
}

#define STEP NAME(step_, SUF)

/* Forward for the jobs [job0, job1): job = (b, tile of W channels). Δ = step(δ) and v = Δ ⊙ u are
   formed here, and the output is y = (C·h + D ⊙ u) ⊙ silu(z) (bias, Dsk and z may be NULL: no
   bias / skip / gate). Also writes the state before every block of L tokens into starts
   ([B, ceil(T / L), N, Dp]) for the backward. h: N vectors of scratch. */
static void NAME(ss_fwd_range_, SUF)(int64_t job0, int64_t job1, int64_t T, int64_t Dp, int64_t Dgp,
                                     int64_t G, int64_t N, int64_t L, const S *restrict delta,
                                     const S *restrict bias, int64_t sp, const S *restrict u,
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
            V sg;
            const V dl = STEP(LD(delta + row), bias, d0, sp, &sg), ut = LD(u + row), vt = dl * ut;
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

/* Entry point: runs the thread slots [slot0, slot1) of nt (slot s takes the jobs
   [jobs s / nt, jobs (s + 1) / nt) and the scratch work + s N), in parallel on the OpenMP team
   when built with OpenMP and more than one slot is asked for. */
void NAME(ss_fwd_, SUF)(int64_t jobs, int64_t nt, int64_t slot0, int64_t slot1, int64_t T, int64_t Dp,
                        int64_t Dgp, int64_t G, int64_t N, int64_t L, const S *delta, const S *bias,
                        int64_t sp, const S *u, const S *At, const S *Bm, const S *Cm, const S *h0,
                        const S *Dsk, const S *z, S *y, S *hT, S *starts, V *work) {
#define RUN(s)                                                                                        \
    NAME(ss_fwd_range_, SUF)(jobs * (s) / nt, jobs * ((s) + 1) / nt, T, Dp, Dgp, G, N, L, delta, bias,  \
                             sp, u, At, Bm, Cm, h0, Dsk, z, y, hT, starts, work + (s) * N)
    FOR_SLOTS(RUN);
#undef RUN
}

/* Backward for the jobs [job0, job1), block by block from the last: for each job the block's
   states, decays, steps and pre-gate outputs are recomputed from starts into an L2-sized buffer,
   then the reverse scan g_t = C_t dy_t + exp(Δ_{t+1} A) g_{t+1} runs through it. The blocks are the
   outer loop so that the block's dB/dC partial sums stay in cache across the jobs: one [L, N]
   vector buffer per (b, group) pair, whose lanes are added up once per block into dB, dC
   ([B, T, G, N], this thread's partial sums, zeroed here; the caller adds the threads'). ddelta
   is the gradient of the raw step δ; dD ([B, Dp], summed over b by the caller; only if Dsk) and
   dz (only if z) and the rest are written. work: see ss_bwd_work below. */
static void NAME(ss_bwd_range_, SUF)(int64_t job0, int64_t job1, int64_t Bsz, int64_t T, int64_t Dp,
                                     int64_t Dgp, int64_t G, int64_t N, int64_t L,
                                     const S *restrict delta, const S *restrict bias, int64_t sp,
                                     const S *restrict u, const S *restrict At, const S *restrict Bm,
                                     const S *restrict Cm, const S *restrict starts,
                                     const S *restrict Dsk, const S *restrict z, const S *restrict dy,
                                     const S *restrict dhT, S *restrict ddelta, S *restrict du,
                                     S *restrict dA, S *restrict dD, S *restrict dz, S *restrict dB,
                                     S *restrict dC, S *restrict dh0, V *restrict work) {
    const int64_t tiles = Dp / W, nblk = (T + L - 1) / L, jobs = job1 - job0, tpg = Dgp / W;
    const V lo = (V){0} + (S)LOG_GATE_MIN;
    memset(dB, 0, (size_t)(Bsz * T * G * N) * sizeof(S));
    memset(dC, 0, (size_t)(Bsz * T * G * N) * sizeof(S));
    if (jobs <= 0) return;
    const int64_t pair0 = job0 / tpg, npairs = (job1 - 1) / tpg - pair0 + 1;
    V *restrict H = work;               /* [L + 1][N]: H[j + 1] = h_{t0 + j}, H[0] = state before */
    V *restrict E = H + (L + 1) * N;    /* [L][N]: exp(Δ A) */
    V *restrict YP = E + L * N;         /* [L]: C·h (the output before skip and gate) */
    V *restrict DL = YP + L;            /* [L]: Δ */
    V *restrict SG = DL + L;            /* [L]: dΔ/dδ */
    V *restrict grs = SG + L;           /* [jobs][N]: dL/dh carried from block to block */
    V *restrict dAs = grs + jobs * N;   /* [jobs][N] */
    V *restrict dDs = dAs + jobs * N;   /* [jobs] */
    V *restrict PB = dDs + jobs;        /* [npairs][L][N]: this block's dB, per lane */
    V *restrict PC = PB + npairs * L * N; /* [npairs][L][N]: this block's dC, per lane */
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
        memset(PB, 0, (size_t)(2 * npairs * L * N) * sizeof(V));
        for (int64_t job = job0; job < job1; job++) {
            const int64_t b = job / tiles, d0 = (job % tiles) * W, g = d0 / Dgp;
            V *restrict gr = grs + (job - job0) * N, *restrict dAa = dAs + (job - job0) * N;
            V *restrict pb = PB + (job / tpg - pair0) * L * N, *restrict pc = PC + (job / tpg - pair0) * L * N;
            const V Dv = Dsk ? LD(Dsk + d0) : (V){0};
            for (int64_t n = 0; n < N; n++) H[n] = LD(starts + ((b * nblk + k) * N + n) * Dp + d0);
            for (int64_t j = 0; j < l; j++) {
                const int64_t t = t0 + j;
                const int64_t row = (b * T + t) * Dp + d0, grow = ((b * T + t) * G + g) * N;
                const V dl = STEP(LD(delta + row), bias, d0, sp, &SG[j]), vt = dl * LD(u + row);
                DL[j] = dl;
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
                const V dl = DL[j], ut = LD(u + row), vt = dl * ut;
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
                    pc[j * N + n] += gy * H[(j + 1) * N + n];
                    pb[j * N + n] += gv * vt;
                    sdv += gv * Bm[grow + n];
                    V w = gv * e * H[j * N + n];
                    w = SEL(dl * An < lo, (V){0}, w);
                    sdd += w * An;
                    dAa[n] += w * dl;
                    gr[n] = gv * e;
                }
                /* v = Δ u: dΔ gets dv u, du gets dv Δ (+ the skip's dy D); dδ = dΔ dΔ/dδ */
                ST(ddelta + row, (sdd + sdv * ut) * SG[j]);
                ST(du + row, sdv * dl + gy * Dv);
            }
        }
        for (int64_t p = 0; p < npairs; p++) { /* add up the lanes of this block's partial sums */
            const int64_t b = (pair0 + p) / G, g = (pair0 + p) % G;
            for (int64_t j = 0; j < l; j++) {
                const int64_t grow = ((b * T + t0 + j) * G + g) * N;
                for (int64_t n = 0; n < N; n++) {
                    const V vb = PB[(p * L + j) * N + n], vc = PC[(p * L + j) * N + n];
                    S sb = 0, sc = 0;
                    for (int i = 0; i < W; i++) {
                        sb += vb[i];
                        sc += vc[i];
                    }
                    dB[grow + n] += sb;
                    dC[grow + n] += sc;
                }
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

/* Scratch vectors one backward slot needs (the caller allocates nt times this). */
int64_t NAME(ss_bwd_work_, SUF)(int64_t jobs, int64_t nt, int64_t Dgp, int64_t N, int64_t L) {
    int64_t most = 0;
    for (int64_t s = 0; s < nt; s++) {
        const int64_t j0 = jobs * s / nt, j1 = jobs * (s + 1) / nt, tpg = Dgp / W;
        if (j1 <= j0) continue;
        const int64_t npairs = (j1 - 1) / tpg - j0 / tpg + 1;
        const int64_t need = (2 * L + 1) * N + 3 * L + (2 * N + 1) * (j1 - j0) + 2 * npairs * L * N;
        if (need > most) most = need;
    }
    return most;
}

/* Entry point (slots as in ss_fwd): slot s takes work + s work_stride vectors and writes its
   partial dB, dC at offset s B T G N. */
void NAME(ss_bwd_, SUF)(int64_t jobs, int64_t nt, int64_t slot0, int64_t slot1, int64_t Bsz, int64_t T,
                        int64_t Dp, int64_t Dgp, int64_t G, int64_t N, int64_t L, const S *delta,
                        const S *bias, int64_t sp, const S *u, const S *At, const S *Bm, const S *Cm,
                        const S *starts, const S *Dsk, const S *z, const S *dy, const S *dhT, S *ddelta,
                        S *du, S *dA, S *dD, S *dz, S *dB, S *dC, S *dh0, V *work, int64_t work_stride) {
    const int64_t part = Bsz * T * G * N;
#define RUN(s)                                                                                        \
    NAME(ss_bwd_range_, SUF)(jobs * (s) / nt, jobs * ((s) + 1) / nt, Bsz, T, Dp, Dgp, G, N, L, delta,   \
                             bias, sp, u, At, Bm, Cm, starts, Dsk, z, dy, dhT, ddelta, du, dA, dD, dz,  \
                             dB + (s) * part, dC + (s) * part, dh0, work + (s) * work_stride)
    FOR_SLOTS(RUN);
#undef RUN
}

#undef STEP
#undef SIGMOID
#undef LD
#undef ST
#undef SEL
#undef NAME
#undef NAME2
