/* Many rows of x against quantized weights on AMX tiles (Intel Sapphire Rapids and later),
 * included by quant.c after its ISA copies (it calls their AVX-512 deq_row and transpose).
 *
 * Why: a prefill's matmuls are compute-bound, and fp32 FMAs (quant.c's panel path, or oneDNN
 * on fp32 weights) reach about 100 GFLOP/s a core; an AMX tile product of bf16 pairs does 16
 * times the multiply-adds an instruction.
 *
 * Numerics: bf16 alone would round x and W to 8 significant bits. Each is split instead into
 * a bf16 high part and a bf16 low part (the rounding error of the high one), and the product
 * taken as hi(x) hi(W) + hi(x) lo(W) + lo(x) hi(W), accumulated in fp32 ("bf16x3"): what is
 * left out, lo(x) lo(W) and the low parts' own rounding, is about 2^-17 of each product, so
 * the result is within a few 1e-6 (relative) of the fp32 path's instead of 1e-7. The tests
 * hold it to the reference at a tolerance; greedy output on SmolLM2 stays the reference's.
 *
 * Layout: x is split once a call into hi and lo (Mp, K) bf16, Mp = M rounded up to 32, rows
 * past M zero. Each thread takes chunks of NC output features: their rows are dequantized
 * (deq_row) and split into hi and lo B tiles, pairs of k side by side ("VNNI"), 16 features a
 * panel; then every 32 rows of x run against every panel of the chunk, the tiles accumulating
 * over all of K: C0, C1 (two 16-row blocks), B hi, B lo, and A hi, lo of the two row blocks,
 * the eight tiles of the palette. */
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_NC 64 /* output features a chunk: its B tiles (NC x K x 4 bytes) stay in L2 */
static int amx_state = -1; /* -1 not yet asked, 0 not usable, 1 usable */
static int amx_rows_set = 0;
/* rows of x from which rf_qlinear takes the AMX path: below, the dequantization of the
 * weight into tiles (once a call) is not amortized (measured on SmolLM2's shapes, 2 threads
 * of this project's Xeon: 0.9x the panel path at 16 rows, 1.6-2.1x faster from 64) */
#define AMX_ROWS 32

/* whether the CPU has AMX-TILE, AMX-BF16 and AVX512-BF16 and the kernel lets this process use
 * the tile registers (Linux asks each process to request them: arch_prctl) */
static int amx_usable(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_RELAXED);
    if (state >= 0) return state;
    unsigned a, b, c, d, a1 = 0, b1, c1, d1;
    const char *env = getenv("RADIXFLOW_QUANT_AMX");
    int ok = !(env && !strcmp(env, "0")) && __get_cpuid_count(7, 0, &a, &b, &c, &d) &&
             (d & (1u << 22)) && (d & (1u << 24)) && __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) &&
             (a1 & (1u << 5));
#ifdef SYS_arch_prctl
    ok = ok && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    ok = 0;
#endif
    __atomic_store_n(&amx_state, ok, __ATOMIC_RELAXED);
    return ok;
}

/* From how many rows the AMX path is taken: `rows` > 0 sets it, 0 restores AMX_ROWS, a
 * negative value only asks; returns it, or 0 where AMX is not usable (then never taken). */
int rf_qset_amx_rows(int rows) {
    if (rows >= 0) amx_rows_set = rows;
    return amx_usable() ? (amx_rows_set ? amx_rows_set : AMX_ROWS) : 0;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static void amx_configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* 16 floats of bf16 lanes (the low or high 16 of 32) widened exactly */
static inline __m512 amx_widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* a, b (16 floats each: k .. k + 15 and k + 16 .. k + 31) -> their bf16 hi and lo, 32 each in
 * k order, rounded to nearest even */
static inline void amx_split(__m512 a, __m512 b, __m512i *hi, __m512i *lo) {
    __m512i h = (__m512i)_mm512_cvtne2ps_pbh(b, a);
    __m512 ra = _mm512_sub_ps(a, amx_widen(_mm512_castsi512_si256(h)));
    __m512 rb = _mm512_sub_ps(b, amx_widen(_mm512_extracti64x4_epi64(h, 1)));
    *hi = h, *lo = (__m512i)_mm512_cvtne2ps_pbh(rb, ra);
}

/* rows m of x (m < M; zeros up to Mp) -> hi, lo (Mp, K) bf16 */
static void amx_split_x(const float *x, int64_t M, int64_t ldx, int64_t K, int64_t Mp,
                        uint16_t *hi, uint16_t *lo, int exact, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && M * K >= 65536)
    for (int64_t m = 0; m < Mp; m++)
        for (int64_t k = 0; k < K; k += 32) {
            __m512i h = _mm512_setzero_si512(), l = _mm512_setzero_si512();
            if (m < M)
                amx_split(_mm512_loadu_ps(x + m * ldx + k), _mm512_loadu_ps(x + m * ldx + k + 16),
                          &h, &l);
            _mm512_storeu_si512(hi + m * K + k, h);
            if (exact) _mm512_storeu_si512(lo + m * K + k, l);
        }
}

/* weight rows n0 .. n0 + 15 (zero past N) -> B tiles bh, bl (K / 32 tiles of 16 pairs x 16
 * features, 1 KiB each); rows: a 16 x K fp32 scratch, tmp 2 x 256 uint32 */
static void amx_pack(int qtype, const uint8_t *w, int64_t row_bytes, const float *scale,
                     int64_t n0, int64_t N, int64_t K, float *rows, uint32_t *tmp, uint32_t *bh,
                     uint32_t *bl, int exact) {
    for (int r = 0; r < 16; r++) {
        if (n0 + r < N)
            deq_row_avx512(qtype, w + (n0 + r) * row_bytes, K, scale ? scale[n0 + r] : 0.f,
                           rows + r * K);
        else
            memset(rows + r * K, 0, K * sizeof(float));
    }
    for (int64_t k = 0; k < K; k += 32) {
        for (int r = 0; r < 16; r++) { /* row r's 16 pairs of k .. k + 31 */
            __m512i h, l;
            amx_split(_mm512_loadu_ps(rows + r * K + k), _mm512_loadu_ps(rows + r * K + k + 16),
                      &h, &l);
            _mm512_storeu_si512(tmp + r * 16, h);
            _mm512_storeu_si512(tmp + 256 + r * 16, l);
        }
        /* tile row j = pair j of every feature: the 16 x 16 transposition of 32-bit lanes */
        transpose_avx512((const float *)tmp, 16, (float *)(bh + k / 32 * 256), 16);
        if (exact)
            transpose_avx512((const float *)(tmp + 256), 16, (float *)(bl + k / 32 * 256), 16);
    }
}

/* c[2 i + j] (16 x 16 fp32) = rows 16 i .. 16 i + 15 of x (hi ah, lo al; K bf16 a row)
 * against panel j of the pair at bh, bl (bf16x3): four accumulators, each product's
 * operand tiles loaded once for the two it feeds (10 loads for 12 tile products a step of 32) */
static inline void amx_block(const uint16_t *ah, const uint16_t *al, int64_t K,
                             const uint32_t *bh, const uint32_t *bl, int exact, float c[4][256]) {
    const int64_t sa = K * 2, panel = 8 * K; /* an A tile row's stride (bytes); a panel */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < K / 32; s++) {
        _tile_loadd(4, ah + s * 32, sa);
        _tile_loadd(5, ah + 16 * K + s * 32, sa);
        _tile_loadd(6, bh + s * 256, 64);
        _tile_loadd(7, bh + panel + s * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (!exact) continue; /* bf16 x bf16 alone */
        _tile_loadd(6, bl + s * 256, 64);
        _tile_loadd(7, bl + panel + s * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        _tile_loadd(4, al + s * 32, sa);
        _tile_loadd(5, al + 16 * K + s * 32, sa);
        _tile_loadd(6, bh + s * 256, 64);
        _tile_loadd(7, bh + panel + s * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
}

static int qlinear_amx(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w,
                       int64_t N, int64_t row_bytes, int qtype, const float *scale,
                       const float *bias, float *out, int64_t ldo, int threads, int exact) {
    const int64_t Mp = (M + 31) / 32 * 32, chunks = (N + AMX_NC - 1) / AMX_NC;
    int nt = threads < 1 ? 1 : threads;
    if (chunks < nt) nt = (int)chunks;
    uint16_t *xh = aligned_alloc(64, (size_t)(Mp * K) * 2 * sizeof(uint16_t));
    if (!xh) return -2;
    uint16_t *xl = xh + Mp * K;
    amx_split_x(x, M, ldx, K, Mp, xh, xl, exact, nt);
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *rows = aligned_alloc(64, (size_t)(16 * K) * sizeof(float) + 2 * 256 * 4 +
                                            (size_t)(AMX_NC * K) * 2 * sizeof(uint16_t));
        uint32_t *tmp = rows ? (uint32_t *)(rows + 16 * K) : NULL;
        uint32_t *bh = tmp ? tmp + 512 : NULL, *bl = bh ? bh + AMX_NC * K / 2 : NULL;
        float c[4][256] __attribute__((aligned(64)));
        const unsigned csr = exact ? _mm_getcsr() : denormals_off(); /* quant.c */
        if (!rows) failed = 1;
        else amx_configure();
#pragma omp for schedule(dynamic, 1)
        for (int64_t ch = 0; ch < chunks; ch++) {
            if (!rows) continue;
            const int64_t c0 = ch * AMX_NC;
            const int panels = (int)((N - c0 < AMX_NC ? N - c0 : AMX_NC) + 15) / 16;
            for (int p = 0; p < (panels + 1) / 2 * 2; p++) /* a pair's second past N: zeros */
                amx_pack(qtype, w, row_bytes, scale, c0 + 16 * p, N, K, rows, tmp,
                         bh + p * 8 * K, bl + p * 8 * K, exact);
            for (int64_t m0 = 0; m0 < Mp; m0 += 32)
                for (int p = 0; p < panels; p += 2) { /* a pair of panels: 32 features */
                    amx_block(xh + m0 * K, xl + m0 * K, K, bh + p * 8 * K, bl + p * 8 * K, exact,
                              c);
                    for (int q = 0; q < 2 && p + q < panels; q++) {
                        const int64_t n0 = c0 + 16 * (p + q), nr = N - n0 < 16 ? N - n0 : 16;
                        const __mmask16 keep = (__mmask16)((1u << nr) - 1);
                        const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0)
                                              : _mm512_setzero_ps();
                        for (int i = 0; i < 32 && m0 + i < M; i++) {
                            __m512 v = _mm512_load_ps(c[2 * (i / 16) + q] + (i % 16) * 16);
                            _mm512_mask_storeu_ps(out + (m0 + i) * ldo + n0, keep,
                                                  bias ? _mm512_add_ps(v, b) : v);
                        }
                    }
                }
        }
        if (rows) _tile_release();
        _mm_setcsr(csr);
        free(rows);
    }
    free(xh);
    return failed ? -2 : 0;
}

#pragma GCC pop_options
#undef AMX_NC
