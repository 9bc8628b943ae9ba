/* The driver of the integer panels, shared by every family (qdot_gemm.c and qdot_gemm32.c on
 * AVX512-VNNI, qdot_gemm8.c on AVX2): x's rows in blocks, the panels over the threads.
 * Included by qdot_body.c in each instruction set's copy, before the panels. */

#define GEMM_XBYTES (1024 * 1024) /* x's quantized rows a pass over the panels reads */
/* rows up to which the next panel is prefetched: 7B's Q4_K rows (2304 bytes) gained 15-20%
 * at 1-16 rows; Q6_K's 9030-byte rows (ffn_down) lost 6-12%, the hardware's streams on
 * such rows already ahead */
#define GEMM_PF_ROW 4096
#define GEMM_CHUNK 4 /* panels a thread takes at a time (dynamic: a preempted one takes fewer) */

/* x's sums over 32 (Q4_K, Q5_K minima) from its sums over 16: M * nb * 8 int16 */
static int16_t *IF(gemm_sums32)(const acts_t *a, int64_t M) {
    const int64_t n = M * (a->K / 16) / 2;
    int16_t *xp = aligned_alloc(64, (size_t)(n * 2 + 63) / 64 * 64);
    if (xp)
        for (int64_t i = 0; i < n; i++) xp[i] = (int16_t)(a->bs[2 * i] + a->bs[2 * i + 1]);
    return xp;
}

/* off times x's sums over each 32-block: M * nb int32 (NULL where off is 0 or no memory) */
static int32_t *IF(g32_sums)(const acts_t *a, int64_t M, int off) {
    const int64_t n = M * a->nb;
    int32_t *xo = off ? aligned_alloc(64, (size_t)(n * 4 + 63) / 64 * 64) : NULL;
    const __m256i ones = _mm256_set1_epi8(1);
    for (int64_t i = 0; xo && i < n; i++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(a->q + 32 * i));
        __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, v), _mm256_set1_epi16(1));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        xo[i] = off * _mm_cvtsi128_si32(t);
    }
    return xo;
}

/* One family's panels: the size of an unpacked block, the features a panel holds (width),
 * the rows of x its kernel takes at a time (mr), the unpacking of a panel's features and
 * the run of rows over them */
typedef struct {
    size_t block_size;
    int width, mr;
    void (*unpack)(const uint8_t *, int64_t, int64_t, int, int64_t, int, int, void *);
    void (*panel)(int, const void *, const acts_t *, const void *, int64_t, int64_t, int64_t,
                  int, const float *, float *, int64_t);
} IF(gemm_kind_t);

/* out = x w^T (+ bias) over a family's panels: x's rows in blocks of about GEMM_XBYTES, the
 * panels in dynamic chunks of GEMM_CHUNK over the threads, each thread with its own unpacked
 * panel (`flag` and `sums`, x's per-block sums, go to the family's panel); -2 on no memory */
static int IF(gemm_drive)(const IF(gemm_kind_t) *kind, int flag, const void *sums,
                          const acts_t *a, int64_t M, const uint8_t *w, int64_t N,
                          int64_t row_bytes, int qtype, const float *bias, float *out,
                          int64_t ldo, int threads) {
    const int64_t width = kind->width, panels = (N + width - 1) / width, nb = a->nb;
    int64_t xrows = GEMM_XBYTES / a->K / kind->mr * kind->mr;
    if (xrows < kind->mr) xrows = kind->mr;
    const int64_t chunks = (panels + GEMM_CHUNK - 1) / GEMM_CHUNK;
    const int nt = threads < 1 ? 1 : chunks < threads ? (int)chunks : threads;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
    const unsigned csr = denormals_off();
    void *o = aligned_alloc(64, (size_t)nb * kind->block_size);
    if (!o) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
    for (int64_t x0 = 0; x0 < M; x0 += xrows) {
        const int64_t x1 = x0 + xrows < M ? x0 + xrows : M;
#pragma omp for schedule(dynamic, 1)
        for (int64_t ci = 0; ci < chunks; ci++) {
            const int64_t end = (ci + 1) * GEMM_CHUNK < panels ? (ci + 1) * GEMM_CHUNK : panels;
            for (int64_t pi = ci * GEMM_CHUNK; o && pi < end; pi++) {
                const int64_t n0 = width * pi, left = N - n0;
                const int nf = left < width ? (int)left : (int)width;
                const int nn = pi + 1 == end || row_bytes > GEMM_PF_ROW ? 0
                               : left < 2 * width ? (int)(left - width) : (int)width;
                kind->unpack(w, row_bytes, nb, qtype, n0, nf, nn, o);
                kind->panel(flag, o, a, sums, x0, x1, n0, nf, bias, out, ldo);
            }
        }
    }
    free(o);
    _mm_setcsr(csr);
    }
    return failed ? -2 : 0;
}
