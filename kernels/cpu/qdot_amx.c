/* Many rows of x against quantized weights with 8-bit integer tile products on AMX-INT8
 * (Intel Sapphire Rapids and later): batched decode and prefill. Included by quant.c after
 * qdot.c (it uses quant_amx.c's tile configuration and permission request, and qdot.c's
 * activations and unpacking).
 *
 * Why: the one-row integer path (qdot.c) costs a few instructions per 32 weights and row of
 * x, so 16 streams or a 512-token prompt are bound by those instructions; a tile product
 * `tdpbssd` does 16 x 16 x 32 multiply-adds in one instruction.
 *
 * Numerics: x quantized per block of 32 (as qdot.c's for the 32-block types; for the K types
 * too, finer than the one-row path's 256); each weight chunk (32 values, 16 for Q6_K) is
 * a * q + m with q an int8 (Q4_0: q - 8, Q5_0: q - 16, Q6_K: q - 32; Q4_K/Q5_K: a = d sc_j,
 * m = -dmin mn_j; Q4_1/Q5_1: a = d, m = the block's min). A chunk's integer products are
 * exact; each output adds dx (a (q . qx) + m sum(qx)) per chunk in fp32, so the result is
 * the reference's `linear_int8(x, w, block=32)` up to fp32 rounding.
 *
 * Layout: the weights are the A operand (16 output features x KC bytes of a chunk, row-major:
 * a weight row unpacked to int8 is already that layout), x the B operand (KC / 4 rows of 16 x
 * rows x 4 consecutive k: built once a call). Each thread takes panels of 16 features: it
 * unpacks them (K int8 each, plus a and m per chunk), then for every 16 rows of x runs the
 * chunks' tile products, scaling each 16 x 16 int32 result into 16 fp32 accumulators. */

#define AMXI_ROWS 1 /* rows from which rf_qlinear takes this path: above qdot.c's row limit */
#define AMXB_ROWS 64 /* and from which bf16 tile products alone (quant_amx.c, one pass) */
static int amxi_rows_set = 0, amxb_rows_set = 0;

/* (probed once: CPUID traps to the hypervisor in a VM, and this is asked on every call) */
static int amxi_usable(void) {
    static int usable = -1;
    int state = __atomic_load_n(&usable, __ATOMIC_RELAXED);
    if (state >= 0) return state;
    unsigned a, b, c, d;
    state = amx_usable() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25));
    __atomic_store_n(&usable, state, __ATOMIC_RELAXED);
    return state;
}

/* From how many rows the AMX-INT8 path is taken: `rows` > 0 sets it, 0 restores AMXI_ROWS,
 * a negative value only asks; returns it, or 0 where AMX-INT8 is not usable. */
int rf_qset_amx_int_rows(int rows) {
    if (rows >= 0) amxi_rows_set = rows;
    return amxi_usable() ? (amxi_rows_set ? amxi_rows_set : AMXI_ROWS) : 0;
}

/* From how many rows an int8-mode call takes quant_amx.c's bf16 tile products with a single
 * bf16 x bf16 pass (x and the dequantized weight rounded to bf16, fp32 sums): `rows` > 0
 * sets it, 0 restores AMXB_ROWS, negative only asks; 0 where AMX-BF16 is not usable. */
int rf_qset_amx_bf16_rows(int rows) {
    if (rows >= 0) amxb_rows_set = rows;
    return rf_qset_amx_rows(-1) > 0 ? (amxb_rows_set ? amxb_rows_set : AMXB_ROWS) : 0;
}

static inline int amxi_type(int qtype) { return idot_type(qtype); }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")

static void amxi_configure(int kc) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.colsb[0] = 64, cfg.rows[0] = 16;      /* C: 16 features x 16 rows of x, int32 */
    cfg.colsb[1] = kc, cfg.rows[1] = 16;      /* A: 16 features x kc int8 */
    cfg.colsb[2] = 64, cfg.rows[2] = kc / 4;  /* B: kc / 4 quads x 16 rows of x x 4 */
    cfg.colsb[3] = 64, cfg.rows[3] = 16;      /* and a second chunk's C, A, B */
    cfg.colsb[4] = kc, cfg.rows[4] = 16;
    cfg.colsb[5] = 64, cfg.rows[5] = kc / 4;
    _tile_loadconfig(&cfg);
}

/* weight row p (K values) -> q (K int8), a and m per chunk of kc (K / kc each) */
static void amxi_unpack(int qtype, const uint8_t *p, int64_t row_bytes, int64_t K, int8_t *q,
                        float *a, float *m) {
    const __m256i low = _mm256_set1_epi8(15);
    if (qtype == Q4_K || qtype == Q5_K) {
        const int five = qtype == Q5_K, stride = five ? 176 : 144;
        for (int64_t b = 0; b < K / 256; b++, p += stride) {
            const float d = _cvtsh_ss(rd16(p)), dmin = _cvtsh_ss(rd16(p + 2));
            uint8_t sc[8], mn[8];
            scale_min_k4(p + 4, sc, mn);
            const uint8_t *qs = p + (five ? 48 : 16);
            const __m256i hb = five ? _mm256_loadu_si256((const __m256i *)(p + 16)) : low;
            for (int j = 0; j < 4; j++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
                __m256i lo = _mm256_and_si256(v, low);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                if (five) {
                    const __m256i one = _mm256_set1_epi8(1);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(
                        _mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(
                        _mm256_and_si256(_mm256_srli_epi16(hb, 2 * j + 1), one), 4));
                }
                _mm256_storeu_si256((__m256i *)(q + 256 * b + 64 * j), lo);
                _mm256_storeu_si256((__m256i *)(q + 256 * b + 64 * j + 32), hi);
            }
            for (int j = 0; j < 8; j++)
                a[8 * b + j] = d * (float)sc[j], m[8 * b + j] = -(dmin * (float)mn[j]);
        }
        return;
    }
    if (qtype == Q6_K) {
        const __m256i off = _mm256_set1_epi8(32);
        for (int64_t b = 0; b < K / 256; b++, p += 210) {
            const int8_t *sc = (const int8_t *)(p + 192);
            const float d = _cvtsh_ss(rd16(p + 208));
            for (int h = 0; h < 2; h++) {
                __m256i v[4];
                q6k_half_vnni512(p, h, v);
                for (int i = 0; i < 4; i++)
                    _mm256_storeu_si256((__m256i *)(q + 256 * b + 128 * h + 32 * i),
                                        _mm256_sub_epi8(v[i], off));
            }
            for (int g = 0; g < 16; g++) a[16 * b + g] = d * (float)sc[g], m[16 * b + g] = 0.f;
        }
        return;
    }
    const int64_t nb = K / 32, bytes = qtype == Q4_1R ? 0 : row_bytes / nb;
    const uint8_t *blk = p;
    for (int64_t b = 0; b < nb; b++, blk += bytes) {
        float d, mm = 0.f;
        __m256i u;
        switch (qtype) {
        case Q4_1R:
            d = _cvtsh_ss(rd16(p + 2 * b)), mm = _cvtsh_ss(rd16(p + 2 * (nb + b)));
            u = nibbles_vnni512(p + 4 * nb + 16 * b);
            break;
        case Q4_0:
            d = _cvtsh_ss(rd16(blk));
            u = _mm256_sub_epi8(nibbles_vnni512(blk + 2), _mm256_set1_epi8(8));
            break;
        case Q4_1:
            d = _cvtsh_ss(rd16(blk)), mm = _cvtsh_ss(rd16(blk + 2));
            u = nibbles_vnni512(blk + 4);
            break;
        case Q5_0:
            d = _cvtsh_ss(rd16(blk));
            u = _mm256_sub_epi8(_mm256_or_si256(nibbles_vnni512(blk + 6), bit4_vnni512(blk + 2)),
                                _mm256_set1_epi8(16));
            break;
        case Q5_1:
            d = _cvtsh_ss(rd16(blk)), mm = _cvtsh_ss(rd16(blk + 2));
            u = _mm256_or_si256(nibbles_vnni512(blk + 8), bit4_vnni512(blk + 4));
            break;
        default: /* Q8_0 */
            d = _cvtsh_ss(rd16(blk));
            u = _mm256_loadu_si256((const __m256i *)(blk + 2));
        }
        _mm256_storeu_si256((__m256i *)(q + 32 * b), u);
        a[b] = d, m[b] = mm;
    }
}

static int qlinear_amx_int(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w,
                           int64_t N, int64_t row_bytes, int qtype, const float *bias,
                           float *out, int64_t ldo, int threads) {
    const int kc = qtype == Q6_K ? 16 : 32;
    const int64_t nb = K / 32, nc = K / kc, Mp = (M + 15) / 16 * 16, panels = (N + 15) / 16;
    acts_t acts;
    if (acts_vnni512(x, M, ldx, K, 32, &acts)) return -2;
    /* x as B tiles: xb[mb][k / 4][16][4]; its scales per block and 16 rows: dt[mb][b][16],
     * st[mb][b][16] (d sum(qx)) */
    int8_t *xb = aligned_alloc(64, (size_t)(Mp * K) + (size_t)(Mp * nb) * 8);
    if (!xb) {
        free(acts.q);
        return -2;
    }
    float *dt = (float *)(xb + Mp * K), *st = dt + Mp * nb;
    for (int64_t mb = 0; mb < Mp / 16; mb++) {
        int32_t *dst = (int32_t *)(xb + mb * 16 * K);
        for (int i = 0; i < 16; i++) {
            const int64_t mrow = 16 * mb + i;
            const int32_t *src = (const int32_t *)(acts.q + mrow * K);
            for (int64_t kq = 0; kq < K / 4; kq++) dst[kq * 16 + i] = mrow < M ? src[kq] : 0;
            for (int64_t b = 0; b < nb; b++) {
                dt[(mb * nb + b) * 16 + i] = mrow < M ? acts.d[mrow * nb + b] : 0.f;
                st[(mb * nb + b) * 16 + i] = mrow < M ? acts.s[mrow * nb + b] : 0.f;
            }
        }
    }
    free(acts.q);
    int nt = threads < 1 ? 1 : threads;
    if (panels < nt) nt = (int)panels;
    /* runs of panels a thread, several a thread (a preempted thread's share goes to the
     * others), in order within a run so the next panel is prefetched for its own thread */
    const int64_t chunk = panels / (4 * nt) > 1 ? panels / (4 * nt) : 1;
    const int has_min = qtype == Q4_1 || qtype == Q4_1R || qtype == Q5_1 || qtype == Q4_K ||
                        qtype == Q5_K;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int8_t *wq = aligned_alloc(64, (size_t)(16 * K) + (size_t)(16 * nc) * 8);
        float *wa = wq ? (float *)(wq + 16 * K) : NULL, *wm = wa ? wa + 16 * nc : NULL;
        int32_t c[512] __attribute__((aligned(64)));
        float res[256] __attribute__((aligned(64)));
        const unsigned csr = denormals_off();
        if (!wq) failed = 1;
        else amxi_configure(kc);
#pragma omp for schedule(dynamic, chunk)
        for (int64_t pn = 0; pn < panels; pn++) {
            if (!wq) continue;
            const int64_t n0 = 16 * pn, nr = N - n0 < 16 ? N - n0 : 16;
            /* the next panel's weight bytes, prefetched a few lines per chunk pair while
             * this one computes (the unpack alone would leave memory idle meanwhile) */
            const uint8_t *next = w + (n0 + 16) * row_bytes;
            const int64_t next_lines = pn + 1 < panels ? (N - n0 - 16 < 16 ? N - n0 - 16 : 16) *
                                                             row_bytes / 64 : 0;
            const int64_t per_step = next_lines / ((nc + 1) / 2 * (Mp / 16)) + 1;
            int64_t fetched = 0;
            for (int r = 0; r < 16; r++) {
                if (r < nr) {
                    amxi_unpack(qtype, w + (n0 + r) * row_bytes, row_bytes, K, wq + r * K,
                                wa + r * nc, wm + r * nc);
                } else {
                    memset(wq + r * K, 0, (size_t)K);
                    memset(wa + r * nc, 0, (size_t)nc * 4), memset(wm + r * nc, 0, (size_t)nc * 4);
                }
            }
            const __mmask16 keep = (__mmask16)((1u << nr) - 1);
            const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
            for (int64_t mb = 0; mb < Mp / 16; mb++) {
                __m512 acc[16];
#pragma GCC unroll 16
                for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
                const int8_t *xbm = xb + mb * 16 * K;
                /* two chunks at a time on their own tiles (C 0/3, A 1/4, B 2/5), so one's
                 * product runs while the other's result is scaled */
                for (int64_t ci = 0; ci < nc; ci += 2) {
                    const int two = ci + 1 < nc ? 2 : 1;
                    for (int64_t f = 0; f < per_step && fetched < next_lines; f++, fetched++)
                        _mm_prefetch((const char *)(next + 64 * fetched), _MM_HINT_T1);
                    _tile_zero(0);
                    _tile_loadd(1, wq + ci * kc, K);
                    _tile_loadd(2, xbm + ci * kc * 16, 64);
                    _tile_dpbssd(0, 1, 2);
                    if (two == 2) {
                        _tile_zero(3);
                        _tile_loadd(4, wq + (ci + 1) * kc, K);
                        _tile_loadd(5, xbm + (ci + 1) * kc * 16, 64);
                        _tile_dpbssd(3, 4, 5);
                    }
                    _tile_stored(0, c, 64);
                    if (two == 2) _tile_stored(3, c + 256, 64);
                    for (int h = 0; h < two; h++) {
                        const int64_t b = (ci + h) * kc / 32;
                        const __m512 dx = _mm512_loadu_ps(dt + (mb * nb + b) * 16);
                        const __m512 sx = _mm512_loadu_ps(st + (mb * nb + b) * 16);
                        const int32_t *ch = c + 256 * h;
#pragma GCC unroll 16
                        for (int r = 0; r < 16; r++) {
                            const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(ch + 16 * r));
                            const __m512 ad = _mm512_mul_ps(dx, _mm512_set1_ps(wa[r * nc + ci + h]));
                            acc[r] = _mm512_fmadd_ps(v, ad, acc[r]);
                            if (has_min)
                                acc[r] = _mm512_fmadd_ps(sx, _mm512_set1_ps(wm[r * nc + ci + h]), acc[r]);
                        }
                    }
                }
                /* acc[r][i]: feature n0 + r, row 16 mb + i -> out[row][n0 ..] */
#pragma GCC unroll 16
                for (int r = 0; r < 16; r++) _mm512_store_ps(res + 16 * r, acc[r]);
                transpose_avx512(res, 16, res, 16);
                for (int i = 0; i < 16 && 16 * mb + i < M; i++)
                    _mm512_mask_storeu_ps(out + (16 * mb + i) * ldo + n0, keep,
                                          _mm512_add_ps(_mm512_load_ps(res + 16 * i), bv));
            }
        }
        if (wq) _tile_release();
        _mm_setcsr(csr);
        free(wq);
    }
    free(xb);
    return failed ? -2 : 0;
}

#pragma GCC pop_options
