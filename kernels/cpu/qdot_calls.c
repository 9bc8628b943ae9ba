/* The integer path's calls over qdot_body.c's kernels (included at its end, inside its IF
 * naming, once per instruction set): qlinear_int (a call: the panels from their rows, else
 * the row kernels on the call's own threads) and qlinear_int_team (the row kernels from
 * inside a team's parallel region, for the decode loop). */

/* output rows r0 .. end - 1 of x (quantized in a; oct: one row in row32_oct's order) */
static inline void IF(int_range)(const acts_t *a, int oct, int64_t M, const uint8_t *w,
                                 int64_t r0, int64_t end, int64_t row_bytes, int qtype,
                                 const float *bias, float *out, int64_t ldo) {
    float s[IDOT_ROWS];
    const int64_t K = a->K;
    for (int64_t r = r0; r < end; r++) {
        const uint8_t *p = w + r * row_bytes;
        if (oct) {
            const float v = IF(row32_oct)(p, row_bytes, qtype, a);
            out[r] = bias ? v + bias[r] : v;
            continue;
        }
        for (int64_t m0 = 0; m0 < M; m0 += IDOT_ROWS) {
            acts_t am = *a; /* rows m0 .. of x */
            am.q = a->q + m0 * K, am.d = a->d + m0 * a->nb, am.s = a->s + m0 * a->nb;
            am.bs = a->bs + m0 * (K / 16);
            const int64_t mr = M - m0 < IDOT_ROWS ? M - m0 : IDOT_ROWS;
            switch (mr) {
            case 4: IF(row)(4, p, row_bytes, qtype, &am, s); break;
            case 3: IF(row)(3, p, row_bytes, qtype, &am, s); break;
            case 2: IF(row)(2, p, row_bytes, qtype, &am, s); break;
            default: IF(row)(1, p, row_bytes, qtype, &am, s); break;
            }
            for (int64_t m = 0; m < mr; m++)
                out[(m0 + m) * ldo + r] = bias ? s[m] + bias[r] : s[m];
        }
    }
}

/* x's layout for the row kernels, once a call: the K types' on AVX512-VNNI, one row of
 * Q4_0/Q4_1 (-> 1 where row32_oct reads it) */
static inline int IF(row_order)(acts_t *a, int64_t M, int qtype) {
#ifdef IDOT_ZMM
    if (qtype == Q4_K || qtype == Q5_K) IF(qk_zmm_order)(a, M);
#endif
    const int oct = M == 1 && IF(oct_type)(qtype, a->nb);
    if (oct) IF(oct_order)(a);
    return oct;
}

/* 1 where qlinear_int takes its panels for M rows of qtype, not the row kernels */
static inline int IF(int_panels)(int qtype, int64_t M) {
#ifdef IDOT_ZMM
    return idot_type(qtype) && M >= rf_qset_int_gemm_rows(-1);
#else
    return (idot_block(qtype) == 256 || g8b_type(qtype)) && M >= gemm8_rows(qtype);
#endif
}

static int IF(qlinear_int)(const float *x, int64_t M, int64_t ldx, int64_t K,
                           const uint8_t *w, int64_t N, int64_t row_bytes, int qtype,
                           const float *bias, float *out, int64_t ldo, int threads) {
    acts_t a;
    if (IF(acts)(x, M, ldx, K, idot_block(qtype), &a)) return -2;
    if (IF(int_panels)(qtype, M)) {
#ifdef IDOT_ZMM
        const int status =
            idot_block(qtype) == 256
                ? IF(qlinear_gemm)(&a, M, w, N, row_bytes, qtype, bias, out, ldo, threads)
                : IF(qlinear_gemm32)(&a, M, w, N, row_bytes, qtype, bias, out, ldo, threads);
#else
        const int status = IF(qlinear_gemm8)(&a, M, w, N, row_bytes, qtype, bias, out, ldo, threads);
#endif
        free(a.q);
        return status;
    }
    const int oct = IF(row_order)(&a, M, qtype);
    /* threads as the fused path splits them (quant.c: rf_qset_fused_split), on the same
     * measure of work; dynamic chunks of rows, so a preempted thread's share goes elsewhere */
    int64_t work = N * K * (M + 4) / 4 / (fused_split_set ? fused_split_set : FUSED_SPLIT) + 1;
    int nt = threads < 1 ? 1 : work < threads ? (int)work : threads;
    int64_t chunk = N / (8 * nt) > 4 ? N / (8 * nt) : 4;
    int64_t chunks = (N + chunk - 1) / chunk;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
    const unsigned csr = denormals_off();
#pragma omp for schedule(dynamic, 1)
    for (int64_t ci = 0; ci < chunks; ci++) {
        const int64_t end = (ci + 1) * chunk < N ? (ci + 1) * chunk : N;
        IF(int_range)(&a, oct, M, w, ci * chunk, end, row_bytes, qtype, bias, out, ldo);
    }
    _mm_setcsr(csr);
    }
    free(a.q);
    return 0;
}

/* qlinear_int's row kernels (a call IF(int_panels) leaves to them) from inside rf_team_run's
 * parallel region, by every thread of the team: each quantizes x itself into its own scratch
 * (a microsecond at these sizes, and no barrier), the output rows shared out two chunks a
 * thread as the fused team path does; no barrier at the end. The same sums per output as
 * qlinear_int's. Without scratch (out of memory) the outputs are NaN, not garbage. */
static void IF(qlinear_int_team)(const float *x, int64_t M, int64_t ldx, int64_t K,
                                 const uint8_t *w, int64_t N, int64_t row_bytes, int qtype,
                                 const float *bias, float *out, int64_t ldo, int nt) {
    acts_t a;
    uint8_t *mem = x24_scratch(IF(acts_bytes)(M, K, idot_block(qtype)));
    int oct = 0;
    if (mem) {
        IF(acts_into)(x, M, ldx, K, idot_block(qtype), &a, mem);
        oct = IF(row_order)(&a, M, qtype);
    }
    const int64_t chunk = N / (2 * nt) > 4 ? N / (2 * nt) : 4, chunks = (N + chunk - 1) / chunk;
    const unsigned csr = denormals_off();
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t end = (c + 1) * chunk < N ? (c + 1) * chunk : N;
        if (!mem)
            for (int64_t r = c * chunk; r < end; r++)
                for (int64_t m = 0; m < M; m++) out[m * ldo + r] = __builtin_nanf("");
        else
            IF(int_range)(&a, oct, M, w, c * chunk, end, row_bytes, qtype, bias, out, ldo);
    }
    _mm_setcsr(csr);
}

