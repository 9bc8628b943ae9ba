/* The paths of one ISA copy (quant_body.c), over any type through the per-type dispatch
 * (deq_row, fused_rows, fused_any):
 * - gather (rf_qdequantize, rf_qget_rows): weight rows dequantized to fp32;
 * - fused (qlinear_fused, up to fused_rows(qtype) rows): each weight row dotted in place by
 *   its family's fused kernel, against x's block sums computed once a call;
 * - decode (qlinear, few rows): panels of NR weight rows dequantized into a per-thread
 *   scratch, every row of x dotted against them, MR rows at a time (tile, panel);
 * - panel (qlinear_rows, many rows; AVX2 and AVX-512): panels of PN weight rows dequantized
 *   and transposed a K-block at a time against an outer-product micro-kernel. */

/* ---- dequantized rows ---- */

/* Rows ids[i] (i when ids is NULL) of the weight, i < n -> out (n, K) */
static void FN(gather)(const uint8_t *w, int64_t row_bytes, int64_t K, int qtype,
                       const float *scale, const int64_t *ids, int64_t n, float *out,
                       int threads) {
    int nt = n * K < (1 << 16) ? 1 : threads;
#pragma omp parallel for schedule(dynamic, 4) num_threads(nt) if (nt > 1)
    for (int64_t i = 0; i < n; i++) {
        int64_t row = ids ? ids[i] : i;
        FN(deq_row)(qtype, w + row * row_bytes, K, scale ? scale[row] : 0.f, out + i * K);
    }
}

/* ---- the decode path ---- */

/* s[m][r] = x[m, :K] . w[r, :K] for m < mr (a compile-time constant once inlined), r < NR:
 * w's NR rows (stride kp) stream once per k step against mr rows of x. The accumulators are
 * named variables (an array of them stays in memory with GCC 12). */
#define ACC(m) vf a##m##0 = {}, a##m##1 = {}, a##m##2 = {}, a##m##3 = {}
#define STEP(m)                                                                             \
    if (mr > m) {                                                                           \
        vf xv = ld(x + m * ldx + k);                                                        \
        a##m##0 = FMA(w0, xv, a##m##0), a##m##1 = FMA(w1, xv, a##m##1);                    \
        a##m##2 = FMA(w2, xv, a##m##2), a##m##3 = FMA(w3, xv, a##m##3);                    \
    }
#define SUMS(m)                                                                             \
    if (mr > m) {                                                                           \
        s[m][0] = FN(hsum)(a##m##0), s[m][1] = FN(hsum)(a##m##1);                           \
        s[m][2] = FN(hsum)(a##m##2), s[m][3] = FN(hsum)(a##m##3);                           \
    }
static inline __attribute__((always_inline)) void FN(tile)(
    const int mr, const float *x, int64_t ldx, int64_t K, const float *w, int64_t kp,
    float s[MR][NR]) {
    ACC(0); ACC(1); ACC(2); ACC(3);
    int64_t k = 0;
    for (; k + VW <= K; k += VW) {
        vf w0 = ld(w + k), w1 = ld(w + kp + k), w2 = ld(w + 2 * kp + k), w3 = ld(w + 3 * kp + k);
        STEP(0) STEP(1) STEP(2) STEP(3)
    }
    SUMS(0) SUMS(1) SUMS(2) SUMS(3)
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < NR; r++)
            for (int64_t j = k; j < K; j++) s[m][r] += w[r * kp + j] * x[m * ldx + j];
}
#undef ACC
#undef STEP
#undef SUMS

/* out[:, n0 .. n0 + nr] = x . panel^T (+ bias) over all M rows of x */
static void FN(panel)(const float *x, int64_t M, int64_t ldx, int64_t K, const float *w,
                      int64_t kp, int nr, const float *bias, float *out, int64_t ldo) {
    float s[MR][NR];
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        int mr = M - m0 < MR ? (int)(M - m0) : MR;
        const float *xm = x + m0 * ldx;
        switch (mr) {
#if MR == 4
        case 4: FN(tile)(4, xm, ldx, K, w, kp, s); break;
        case 3: FN(tile)(3, xm, ldx, K, w, kp, s); break;
#endif
        case 2: FN(tile)(2, xm, ldx, K, w, kp, s); break;
        default: FN(tile)(1, xm, ldx, K, w, kp, s); break;
        }
        for (int m = 0; m < mr; m++)
            for (int r = 0; r < nr; r++)
                out[(m0 + m) * ldo + r] = bias ? s[m][r] + bias[r] : s[m][r];
    }
}

/* ---- the fused path ---- */

/* x's sums over 32 into xs: xs[m nb + b] for the K types and Q4_1R, and for Q4_0 and Q4_1 as
 * pairs (-8 sum, 0) and (0, sum) at xs[2 (m nb + b)], fused_row's against a block's (d, m) */
static void FN(block_sums)(const float *x, int64_t M, int64_t ldx, int64_t nb, int qtype,
                           float *xs) {
    const int pairs = qtype == Q4_0 || qtype == Q4_1;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + m * ldx + b * 32;
            vf acc = {};
            for (int c = 0; c < 32; c += VW) acc += ld(xb + c);
            const float sum = FN(hsum)(acc);
            if (!pairs)
                xs[m * nb + b] = sum;
            else
                xs[2 * (m * nb + b)] = qtype == Q4_0 ? -8.f * sum : 0.f,
                xs[2 * (m * nb + b) + 1] = qtype == Q4_1 ? sum : 0.f;
        }
}

/* out[:, r .. end] of the fused path: each weight row dotted in place against x's M rows */
static void FN(fused_range)(const float *x, int64_t M, int64_t ldx, int64_t K, const float *xs,
                            const uint8_t *w, int64_t r, int64_t end, int64_t row_bytes,
                            int qtype, const float *bias, float *out, int64_t ldo) {
    float s[FUSED_ROWS];
    if (M == 1 && (qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0))
        for (; r + 2 <= end; r += 2) {
            FN(fused_pair)(x, K, xs, w + r * row_bytes, row_bytes, qtype, s);
            out[r] = bias ? s[0] + bias[r] : s[0];
            out[r + 1] = bias ? s[1] + bias[r + 1] : s[1];
        }
    for (; r < end; r++) {
        const uint8_t *p = w + r * row_bytes;
        switch (M) {
        case 4: FN(fused_any)(4, x, ldx, K, xs, p, row_bytes, qtype, s); break;
        case 3: FN(fused_any)(3, x, ldx, K, xs, p, row_bytes, qtype, s); break;
        case 2: FN(fused_any)(2, x, ldx, K, xs, p, row_bytes, qtype, s); break;
        default: FN(fused_any)(1, x, ldx, K, xs, p, row_bytes, qtype, s); break;
        }
        for (int64_t m = 0; m < M; m++) out[m * ldo + r] = bias ? s[m] + bias[r] : s[m];
    }
}

/* bytes of x's parts for this copy's fixed-point kernels (quant_x24.c's on the AVX-512 copy:
 * Q4_1R, Q8_0R; quant_x24_avx2.c's on the AVX2 copy: Q4_1R), 0 where it has none for the type */
static inline size_t FN(fixed_bytes)(int qtype, int64_t M, int64_t K) {
#if VW == 16 && defined(QUANT_X86)
    return qtype == Q4_1R || qtype == Q8_0R ? x24_bytes_of(qtype, M, K) : 0;
#elif VW == 8 && defined(QUANT_X86)
    return qtype == Q4_1R ? x24a_bytes(M, K) : 0;
#else
    (void)qtype, (void)M, (void)K;
    return 0;
#endif
}

/* x's parts (FN(fixed_bytes) of them) at out */
static inline void FN(fixed_split)(int qtype, const float *x, int64_t M, int64_t ldx,
                                   int64_t K, uint8_t *out) {
#if VW == 16 && defined(QUANT_X86)
    x24_split_of(qtype, x, M, ldx, K, out);
#elif VW == 8 && defined(QUANT_X86)
    (void)qtype;
    x24a_split(x, M, ldx, K, out);
#else
    (void)qtype, (void)x, (void)M, (void)ldx, (void)K, (void)out;
#endif
}

/* fused_range, or the fixed-point kernels' range where x's parts are given */
static inline void FN(fused_or_x24)(const float *x, const uint8_t *parts, int64_t M,
                                      int64_t ldx, int64_t K, const float *xs,
                                      const uint8_t *w, int64_t r, int64_t end,
                                      int64_t row_bytes, int qtype, const float *bias,
                                      float *out, int64_t ldo) {
#if VW == 16 && defined(QUANT_X86)
    if (parts && qtype == Q8_0R) {
        x21_range(parts, M, K, w, r, end, row_bytes, bias, out, ldo);
        return;
    }
    if (parts) {
        x24_range(parts, M, K, xs, w, r, end, row_bytes, bias, out, ldo);
        return;
    }
#elif VW == 8 && defined(QUANT_X86)
    if (parts) {
        x24a_range(parts, M, K, xs, w, r, end, row_bytes, bias, out, ldo);
        return;
    }
#else
    (void)parts;
#endif
    FN(fused_range)(x, M, ldx, K, xs, w, r, end, row_bytes, qtype, bias, out, ldo);
}

/* the fused path's chunk of output rows for nt threads: several a thread, handed out
 * dynamically, so the others take the share of a thread another process preempts */
static inline int64_t FN(fused_chunk)(int64_t N, int nt) {
    return N / (8 * nt) > 4 ? N / (8 * nt) : 4;
}

/* x24: x's parts for quant_x24.c's kernels (Q4_1R, Q8_0R on AVX512-VNNI), else NULL */
static int FN(qlinear_fused)(const float *x, int64_t M, int64_t ldx, int64_t K,
                             const uint8_t *w, int64_t N, int64_t row_bytes, int qtype,
                             const float *bias, float *out, int64_t ldo, int threads, int x24) {
    const int64_t nb = K / 32;
    const int pairs = qtype == Q4_0 || qtype == Q4_1;
    float *xs = malloc((size_t)(M * nb * (pairs ? 2 : 1)) * sizeof(float) + 8);
    if (!xs) return -2;
    FN(block_sums)(x, M, ldx, nb, qtype, xs);
    uint8_t *parts = NULL;
    const size_t part_bytes = x24 ? FN(fixed_bytes)(qtype, M, K) : 0;
    if (part_bytes && (parts = aligned_alloc(64, (part_bytes + 127) / 64 * 64)))
        FN(fixed_split)(qtype, x, M, ldx, K, parts);
    if (qtype == Q8_0R && !parts) { /* it has no fused fp32 kernel: FN(qlinear) sent it here */
        free(xs);
        return -2;
    }
    /* split only a call of about 50 us or more: each split call wakes the sleeping OpenMP
     * worker, which costs tens of us. At one row this leaves SmolLM2's qkv and o projections
     * on one thread and splits gate_up, down and the head. With every call split a step took
     * 12.4-14.1 ms against 10.3-10.9 ms from 100 us; from 50 us (and the prefetch above) the
     * step measured 5% faster than from 100 us without it (2026-12-03, 2 runs each). */
    int64_t work = N * K * (M + 4) / (fused_split_set ? fused_split_set : FUSED_SPLIT) + 1;
    int nt = threads < 1 ? 1 : work < threads ? (int)work : threads;
    const int64_t chunk = FN(fused_chunk)(N, nt), chunks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t end = (c + 1) * chunk < N ? (c + 1) * chunk : N;
        FN(fused_or_x24)(x, parts, M, ldx, K, xs, w, c * chunk, end, row_bytes, qtype, bias,
                           out, ldo);
    }
    free(parts);
    free(xs);
    return 0;
}

/* The fused path from inside rf_team_run's parallel region, called by every thread of the
 * team: the output rows shared out in chunks, each thread with its own block
 * sums of x (on its stack: K <= TEAM_MAX_K, checked by rf_qteam_takes). No barrier at the
 * end (nowait): the caller waits once after the ranges of a projection. */
static void FN(qlinear_team)(const float *x, int64_t M, int64_t ldx, int64_t K,
                             const uint8_t *w, int64_t N, int64_t row_bytes, int qtype,
                             const float *bias, float *out, int64_t ldo, int nt, int x24) {
    float xs[2 * FUSED_ROWS * TEAM_MAX_K / 32];
    FN(block_sums)(x, M, ldx, K / 32, qtype, xs);
    uint8_t *parts = NULL; /* each thread splits x itself: a few hundred ns, no barrier */
    const size_t part_bytes = x24 ? FN(fixed_bytes)(qtype, M, K) : 0;
    if (part_bytes && (parts = x24_scratch(part_bytes)))
        FN(fixed_split)(qtype, x, M, ldx, K, parts);
    const int lost = qtype == Q8_0R && !parts; /* no scratch (out of memory): NaN, not garbage */
    /* two chunks a thread, not qlinear_fused's eight: a thread streams longer runs of rows
     * (its prefetches run ahead within a chunk), and one stolen chunk still evens out a
     * thread preempted late. SmolLM2, one row, 2 threads, the layers of a step: 3.75 ms
     * against 3.92 ms with eight (medians of 30 alternations, loaded machine); one chunk a
     * thread 3.74 ms. */
    const int64_t chunk = N / (2 * nt) > 4 ? N / (2 * nt) : 4, chunks = (N + chunk - 1) / chunk;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t end = (c + 1) * chunk < N ? (c + 1) * chunk : N;
        if (lost)
            for (int64_t r = c * chunk; r < end; r++)
                for (int64_t m = 0; m < M; m++) out[m * ldo + r] = __builtin_nanf("");
        else
            FN(fused_or_x24)(x, parts, M, ldx, K, xs, w, c * chunk, end, row_bytes, qtype,
                             bias, out, ldo);
    }
}

/* Few rows: the fused path where the type has a kernel for M rows, else the decode path */
static int FN(qlinear)(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w,
                       int64_t N, int64_t row_bytes, int qtype, const float *scale,
                       const float *bias, float *out, int64_t ldo, int threads, int x24) {
    if (M <= FN(fused_rows)(qtype) || (x24 && qtype == Q8_0R)) /* Q8_0R: x24's kernel only */
        return FN(qlinear_fused)(x, M, ldx, K, w, N, row_bytes, qtype, bias, out, ldo, threads,
                                 x24);
    const int64_t kp = (K + 15) / 16 * 16, panels = (N + NR - 1) / NR;
    /* a few us of work a thread at least; dynamic chunks, several a thread, so the others
     * take the share of a thread another process preempts (the join still waits for it to
     * check in: on a 2-core machine at load 10, a 100 us call then takes 0.2-8 ms) */
    int64_t work = N * K * (M + 4) / (1 << 17) + 1;
    int nt = threads < 1 ? 1 : work < threads ? (int)work : threads;
    int64_t chunk = panels / (8 * nt) > 1 ? panels / (8 * nt) : 1;
    int64_t chunks = (panels + chunk - 1) / chunk;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *buf = aligned_alloc(64, NR * kp * sizeof(float));
        if (!buf) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; c++) {
            if (!buf) continue;
            for (int64_t p = c * chunk; p < (c + 1) * chunk && p < panels; p++) {
                int64_t n0 = p * NR;
                int nr = N - n0 < NR ? (int)(N - n0) : NR;
                for (int r = 0; r < NR; r++) {
                    if (r < nr)
                        FN(deq_row)(qtype, w + (n0 + r) * row_bytes, K,
                                    scale ? scale[n0 + r] : 0.f, buf + r * kp);
                    else
                        memset(buf + r * kp, 0, K * sizeof(float));
                }
                FN(panel)(x, M, ldx, K, buf, kp, nr, bias ? bias + n0 : NULL, out + n0, ldo);
            }
        }
        free(buf);
    }
    return failed ? -2 : 0;
}

#if VW > 4
/* ---- many rows: the weight as the B of a GEMM, panels of PN output features ----
 * A panel's PN weight rows are dequantized a K-block (KB) at a time into pk[k][PN] (VW rows
 * at a time through a small row-major scratch, then transposed VW x VW in registers), and
 * every block of PM rows of x runs an outer-product micro-kernel against it: per k, PV panel
 * vectors times PM broadcast x[m, k] into PM x PV accumulators. The dequantization and the
 * transposition are paid once per weight and call, then amortized over all M rows. */
#define PV 2         /* vectors per panel row */
#define PN (PV * VW) /* output features per panel */
#if VW == 16
#define PM 8 /* rows of x per micro-kernel: 16 zmm accumulators */
#else
#define PM 6 /* 12 of the 16 ymm registers */
#endif
#define DC 256  /* k per dequantized chunk: a multiple of every block size */
#define KB 1024 /* most k per panel block (a multiple of DC); a longer K takes blocks of KB / 2 */

#if VW == 16
/* dst[j * ldd + i] = src[i * lds + j], i, j < 16 */
static inline void FN(transpose)(const float *src, int64_t lds, float *dst, int64_t ldd) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * lds);
    for (int i = 0; i < 16; i += 2) { /* lane L: rows i, i + 1 at columns 4L .. 4L + 3 */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
#define PD(v) _mm512_castps_pd(v)
#define PS(v) _mm512_castpd_ps(v)
    for (int i = 0; i < 16; i += 4) { /* r[i + c], lane L: column 4L + c of rows i .. i + 3 */
        r[i] = PS(_mm512_unpacklo_pd(PD(t[i]), PD(t[i + 2])));
        r[i + 1] = PS(_mm512_unpackhi_pd(PD(t[i]), PD(t[i + 2])));
        r[i + 2] = PS(_mm512_unpacklo_pd(PD(t[i + 1]), PD(t[i + 3])));
        r[i + 3] = PS(_mm512_unpackhi_pd(PD(t[i + 1]), PD(t[i + 3])));
    }
#undef PD
#undef PS
    for (int c = 0; c < 4; c++) { /* column 4L + c: lane L of r[c], r[4 + c], r[8 + c], r[12 + c] */
        __m512 u = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
        __m512 v = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
        __m512 u2 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
        __m512 v2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
        _mm512_storeu_ps(dst + c * ldd, _mm512_shuffle_f32x4(u, v, 0x88));
        _mm512_storeu_ps(dst + (4 + c) * ldd, _mm512_shuffle_f32x4(u2, v2, 0x88));
        _mm512_storeu_ps(dst + (8 + c) * ldd, _mm512_shuffle_f32x4(u, v, 0xdd));
        _mm512_storeu_ps(dst + (12 + c) * ldd, _mm512_shuffle_f32x4(u2, v2, 0xdd));
    }
}
#else
static inline void FN(transpose)(const float *src, int64_t lds, float *dst, int64_t ldd) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* r[i + c], half H: column 4H + c of rows i .. i + 3 */
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int c = 0; c < 4; c++) {
        _mm256_storeu_ps(dst + c * ldd, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));
        _mm256_storeu_ps(dst + (4 + c) * ldd, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));
    }
}
#endif

/* pk[k][PN] (k < kb rounded up to VW) = weight rows n0 .. n0 + PN at k0 .. k0 + kb, zero past
 * row N; rows: a VW x DC scratch */
static void FN(pack)(int qtype, const uint8_t *w, int64_t row_bytes, const float *scale,
                     int64_t n0, int64_t N, int64_t k0, int64_t kb, float *rows, float *pk) {
    int64_t size, bytes;
    block_of(qtype, &size, &bytes);
    for (int g = 0; g < PN; g += VW)
        for (int64_t k = k0; k < k0 + kb; k += DC) {
            int64_t len = k0 + kb - k < DC ? k0 + kb - k : DC;
            for (int r = 0; r < VW; r++) {
                int64_t n = n0 + g + r;
                if (n < N && qtype == Q4_1R) /* its blocks' parts lie apart in the row */
                    FN(deq_q4_1r)(w + n * row_bytes, row_bytes / 20, k / 32, len / 32,
                                  rows + r * DC);
                else if (n < N && qtype == Q8_0R)
                    FN(deq_q8_0r)(w + n * row_bytes, row_bytes / 34, k / 32, len / 32,
                                  rows + r * DC);
                else if (n < N)
                    FN(deq_row)(qtype, w + n * row_bytes + k / size * bytes, len,
                                scale ? scale[n] : 0.f, rows + r * DC);
                else
                    memset(rows + r * DC, 0, len * sizeof(float));
            }
            for (int64_t j = 0; j < len; j += VW) /* columns past len: read, never used */
                FN(transpose)(rows + j, DC, pk + (k - k0 + j) * PN + g, PN);
        }
}

/* c[m][:PN] (+)= x[m, :kb] . pk for m < mr (a constant once inlined), then + bias[:PN] if
 * bias; the accumulators are named variables, as tile's */
#define ACC(m) vf a##m##0 = {}, a##m##1 = {}
#define STEP(m)                                                                             \
    if (mr > m) {                                                                           \
        vf xb = splat(x[m * ldx + k]);                                                      \
        a##m##0 = FMA(p0, xb, a##m##0), a##m##1 = FMA(p1, xb, a##m##1);                    \
    }
#define STORE(m)                                                                            \
    if (mr > m) {                                                                           \
        if (add) a##m##0 += ld(c + m * ldc), a##m##1 += ld(c + m * ldc + VW);               \
        if (bias) a##m##0 += ld(bias), a##m##1 += ld(bias + VW);                            \
        st(c + m * ldc, a##m##0), st(c + m * ldc + VW, a##m##1);                            \
    }
static inline __attribute__((always_inline)) void FN(micro)(
    const int mr, const float *x, int64_t ldx, int64_t kb, const float *pk, float *c,
    int64_t ldc, int add, const float *bias) {
    ACC(0); ACC(1); ACC(2); ACC(3); ACC(4); ACC(5);
#if PM == 8
    ACC(6); ACC(7);
#endif
    for (int64_t k = 0; k < kb; k++) {
        vf p0 = ld(pk + k * PN), p1 = ld(pk + k * PN + VW);
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5)
#if PM == 8
        STEP(6) STEP(7)
#endif
    }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
#if PM == 8
    STORE(6) STORE(7)
#endif
}
#undef ACC
#undef STEP
#undef STORE

/* out[:, n0 .. n0 + nr] (+)= x[:, :kb] . pk (+ bias at the last block), PM rows at a time;
 * a panel past N goes through a PM x PN tile */
static void FN(rows_block)(const float *x, int64_t M, int64_t ldx, int64_t kb, const float *pk,
                           int nr, int add, const float *bias, float *out, int64_t ldo) {
    float tile[PM * PN];
    for (int64_t m0 = 0; m0 < M; m0 += PM) {
        int mr = M - m0 < PM ? (int)(M - m0) : PM;
        const float *xm = x + m0 * ldx;
        float *c = nr == PN ? out + m0 * ldo : tile;
        int64_t ldc = nr == PN ? ldo : PN;
        if (nr < PN && add)
            for (int m = 0; m < mr; m++) memcpy(tile + m * PN, out + (m0 + m) * ldo, nr * 4);
        switch (mr) {
#if PM == 8
        case 8: FN(micro)(8, xm, ldx, kb, pk, c, ldc, add, bias); break;
        case 7: FN(micro)(7, xm, ldx, kb, pk, c, ldc, add, bias); break;
#endif
        case 6: FN(micro)(6, xm, ldx, kb, pk, c, ldc, add, bias); break;
        case 5: FN(micro)(5, xm, ldx, kb, pk, c, ldc, add, bias); break;
        case 4: FN(micro)(4, xm, ldx, kb, pk, c, ldc, add, bias); break;
        case 3: FN(micro)(3, xm, ldx, kb, pk, c, ldc, add, bias); break;
        case 2: FN(micro)(2, xm, ldx, kb, pk, c, ldc, add, bias); break;
        default: FN(micro)(1, xm, ldx, kb, pk, c, ldc, add, bias); break;
        }
        if (nr < PN)
            for (int m = 0; m < mr; m++) memcpy(out + (m0 + m) * ldo, tile + m * PN, nr * 4);
    }
}

static int FN(qlinear_rows)(const float *x, int64_t M, int64_t ldx, int64_t K,
                            const uint8_t *w, int64_t N, int64_t row_bytes, int qtype,
                            const float *scale, const float *bias, float *out, int64_t ldo,
                            int threads) {
    const int64_t kb_max = K <= KB ? K : KB / 2, panels = (N + PN - 1) / PN;
    int64_t work = N * K * M / (1 << 17) + 1; /* as qlinear's */
    int nt = threads < 1 ? 1 : work < threads ? (int)work : threads;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        /* pk: (kb_max rounded up to VW) x PN; rows: VW x DC, zeroed so that the columns a
         * partial chunk's transposition reads past its length are numbers */
        int64_t pk_floats = (kb_max + VW - 1) / VW * VW * PN;
        float *pk = aligned_alloc(64, (pk_floats + VW * DC) * sizeof(float));
        float *rows = pk + pk_floats, bias_tile[PN];
        if (!pk) failed = 1;
        else memset(rows, 0, VW * DC * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < panels; p++) {
            if (!pk) continue;
            int64_t n0 = p * PN;
            int nr = N - n0 < PN ? (int)(N - n0) : PN;
            const float *b = bias ? bias + n0 : NULL;
            if (bias && nr < PN) {
                memset(bias_tile, 0, sizeof bias_tile);
                memcpy(bias_tile, bias + n0, nr * sizeof(float));
                b = bias_tile;
            }
            for (int64_t k0 = 0; k0 < K; k0 += kb_max) {
                int64_t kb = K - k0 < kb_max ? K - k0 : kb_max;
                FN(pack)(qtype, w, row_bytes, scale, n0, N, k0, kb, rows, pk);
                FN(rows_block)(x + k0, M, ldx, kb, pk, nr, k0 > 0, k0 + kb == K ? b : NULL,
                               out + n0, ldo);
            }
        }
        free(pk);
    }
    return failed ? -2 : 0;
}
#undef PV
#undef PN
#undef PM
#undef DC
#undef KB
#endif
