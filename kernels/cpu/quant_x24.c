/* A few rows of fp32 x against Q4_1R (and Q8_0R: below) on AVX512-VNNI, near-exact: each
 * block of 32 of x is put in 24-bit fixed point (x = dx * v, |v| <= V24_MAX, dx = the block's
 * largest |x| / V24_MAX) and v split into three signed bytes, v = 65536 h + 256 m + l, so
 * the nibble products are integer dot products (vpdpbusd, 64 a instruction) exact in int32,
 * and one conversion and fma scale four blocks. The fp32 fused kernel (quant_legacy.c
 * fused_row_r) converts every nibble to float and spends some seven vector operations a
 * block; this spends under four. Error: v's rounding, at most dx / 2 = 2^-24 of the block's
 * largest |x| an element, the size of fp32's own rounding of x; against the dequantized
 * reference a SmolLM2 row measures level with the fp32 kernel's (both ~1e-6). Blocks whose
 * largest |x| is below 1e-30 count as zero,
 * and a block holding an inf or NaN gives a NaN sum, as the fp32 kernels do.
 *
 * rf_qlinear and rf_qteam_linear take them for 1-4 rows of Q4_1R or Q8_0R where the
 * activations are neither int8 nor the explicit exact mode (RF_FP32_ACTS, or no flag under
 * the fp32 process default) and the CPU has AVX512-VNNI: `auto`'s choice for a small model's
 * one stream (rf_qset_x24 turns them off). A team thread keeps its x's parts in a buffer of
 * its own (x24_scratch), kept for the thread's life.
 * Included by quant.c before the ISA copies, under its own target. */

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

#define V24_MAX 8323072.f /* 2^23 - 2^16: h stays within a signed byte */
#define X24_GROUP 448   /* bytes of x's parts a group of 4 blocks: 6 x 64, 16 floats of dx */
/* how far ahead of a group its row's bytes are prefetched: 4-8 KiB measured best on SmolLM2's
 * K = 576 rows from L3 (12.1 GB/s a thread without, 14.4-15.0 with) */
#define X24_AHEAD 4096

/* bytes of x24_split's output for M rows of K */
static inline size_t x24_bytes(int64_t M, int64_t K) {
    return (size_t)(M * ((K / 32 + 3) / 4) * X24_GROUP);
}

/* a block of 32 of x (x0, x1) in fixed point: v[half] = x / dx rounded, |v| <= vmax, dx =
 * the block's largest |x| / vmax; NaN where the block holds an inf or NaN (so its sums are),
 * 0 where its largest |x| is below 1e-30 (the block counts as zero) */
static inline float fixed_block(__m512 x0, __m512 x1, float vmax, __m512i v[2]) {
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    float dx = amax / vmax, inv = vmax / amax;
    /* inf or NaN (max_ps may drop a NaN: look again) */
    if (!(amax <= 3.4e38f) || _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) ||
        _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q))
        dx = __builtin_nanf(""), inv = 0.f;
    else if (amax < 1e-30f)
        dx = 0.f, inv = 0.f;
    v[0] = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));
    v[1] = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
    return dx;
}

/* v = 65536 h + 256 m + l, each a signed byte: stored 16 bytes each at at, at + gap, at + 2 gap */
static inline void split_bytes(__m512i v, uint8_t *at, int gap) {
    const __m512i k128 = _mm512_set1_epi32(128), k255 = _mm512_set1_epi32(255);
    const __m512i l = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, k128), k255), k128);
    const __m512i r = _mm512_srai_epi32(_mm512_sub_epi32(v, l), 8);
    const __m512i m = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, k128), k255), k128);
    const __m512i h = _mm512_srai_epi32(_mm512_sub_epi32(r, m), 8);
    _mm_storeu_si128((void *)at, _mm512_cvtepi32_epi8(h));
    _mm_storeu_si128((void *)(at + gap), _mm512_cvtepi32_epi8(m));
    _mm_storeu_si128((void *)(at + 2 * gap), _mm512_cvtepi32_epi8(l));
}

/* M rows of x into their parts: per row ceil(nb / 4) groups of six 64-byte vectors (h, m, l
 * for the blocks' elements 0-15, then for 16-31: byte 16 j + e of a vector is element e of
 * the group's block j, as a Q4_1R nibble vector holds them) and 16 floats (dx, lane 4 j + i
 * for block j), blocks past the row zero */
static void x24_split(const float *x, int64_t M, int64_t ldx, int64_t K, uint8_t *out) {
    const int64_t nb = K / 32, groups = (nb + 3) / 4;
    memset(out, 0, x24_bytes(M, K));
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + m * ldx + 32 * b;
            uint8_t *g = out + (m * groups + b / 4) * X24_GROUP;
            const int j = (int)(b & 3);
            __m512i v[2];
            const float dx = fixed_block(_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16), V24_MAX, v);
            _mm_storeu_ps((float *)(g + 384) + 4 * j, _mm_set1_ps(dx));
            for (int half = 0; half < 2; half++) split_bytes(v[half], g + 64 * half + 16 * j, 128);
        }
}

/* the sums of two vectors' lanes, s[0] of a and s[1] of b, in one reduction tree */
static inline void x24_sum2(__m512 a, __m512 b, float s[2]) {
    /* lanes 0-7: a's halves added, 8-15: b's */
    __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
    t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0xb1)); /* 128-bit quarters: 0+1, 2+3 */
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4e));       /* pairs of lanes */
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xb1));       /* neighbours */
    s[0] = _mm512_cvtss_f32(t);
    s[1] = _mm512_cvtss_f32(_mm512_castps128_ps512(_mm512_extractf32x4_ps(t, 2)));
}

/* which of 16 d's a group's lanes take: lane 4 j + i block j of group g of a 16-block step */
static const int32_t X24_LANES[4][16] = {
    {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},
    {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7},
    {8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11},
    {12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15}};

/* sum q v of a group's lanes (8 products each), q the nibbles of v (4 blocks of Q4_1R: low
 * nibbles elements 0-15, high 16-31), v x's parts at p (h, m, l; each elements 0-15 then
 * 16-31): the high parts' sums shifted up 8 bits before the next part's are added */
static inline __m512i x24_dot(__m512i q, const uint8_t *p) {
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i lo = _mm512_and_si512(q, low);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
    __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(p));
    acc = _mm512_slli_epi32(_mm512_dpbusd_epi32(acc, hi, _mm512_loadu_si512(p + 64)), 8);
    acc = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, lo, _mm512_loadu_si512(p + 128)), hi,
                              _mm512_loadu_si512(p + 192));
    acc = _mm512_slli_epi32(acc, 8);
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, lo, _mm512_loadu_si512(p + 256)), hi,
                               _mm512_loadu_si512(p + 320));
}

/* one Q4_1R row against mr rows of split x (xp, a row's parts every `stride` bytes) and x's
 * block sums xs (xs[m nb + b], for the m terms, in fp32 as fused_row_r's) */
static inline __attribute__((always_inline)) void x24_row(
    const int mr, const uint8_t *xp, int64_t stride, int64_t nb, const float *xs,
    const uint8_t *row, float s[4]) {
    __m512 a[4], e[4];
    for (int m = 0; m < mr; m++) a[m] = e[m] = _mm512_setzero_ps();
    const uint8_t *qs = row + 4 * nb;
    __builtin_prefetch(row + 4096), __builtin_prefetch(row + 4096 + 64);
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int cnt = nb - b0 < 16 ? (int)(nb - b0) : 16;
        const __mmask16 keep = (__mmask16)((1u << cnt) - 1);
        const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, row + 2 * b0));
        const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, row + 2 * (nb + b0)));
        for (int m = 0; m < mr; m++)
            e[m] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(keep, xs + m * nb + b0), e[m]);
        for (int g = 0; 4 * g < cnt; g++) {
            const int64_t G = b0 / 4 + g;
            const int left = cnt - 4 * g;
            const __m512i v = left >= 4 ? _mm512_loadu_si512(qs + 64 * G)
                                        : _mm512_maskz_loadu_epi8((1ull << (16 * left)) - 1,
                                                                  qs + 64 * G);
            __builtin_prefetch(qs + 64 * G + X24_AHEAD);
            const __m512 d = _mm512_permutexvar_ps(_mm512_loadu_si512(X24_LANES[g]), dv);
            for (int m = 0; m < mr; m++) {
                const uint8_t *p = xp + m * stride + G * X24_GROUP;
                const __m512i acc = x24_dot(v, p);
                const __m512 scale = _mm512_mul_ps(d, _mm512_loadu_ps((const float *)(p + 384)));
                a[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), scale, a[m]);
            }
        }
    }
    for (int m = 0; m < mr; m++) s[m] = _mm512_reduce_add_ps(_mm512_add_ps(a[m], e[m]));
}

/* two Q4_1R rows (row, row + row_bytes) against one row of split x: x's parts loaded once
 * for both, two independent chains in flight */
static inline __attribute__((always_inline)) void x24_pair(
    const uint8_t *xp, int64_t nb, const float *xs, const uint8_t *row, int64_t row_bytes,
    float s[2]) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    const uint8_t *q0 = row + 4 * nb, *q1 = q0 + row_bytes, *row1 = row + row_bytes;
    __builtin_prefetch(row + 4096), __builtin_prefetch(row1 + 4096);
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int cnt = nb - b0 < 16 ? (int)(nb - b0) : 16;
        const __mmask16 keep = (__mmask16)((1u << cnt) - 1);
        const __m512 d0 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, row + 2 * b0));
        const __m512 d1 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, row1 + 2 * b0));
        const __m512 sums = _mm512_maskz_loadu_ps(keep, xs + b0);
        a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, row + 2 * (nb + b0))),
                             sums, a0);
        a1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, row1 + 2 * (nb + b0))),
                             sums, a1);
        for (int g = 0; 4 * g < cnt; g++) {
            const int64_t G = b0 / 4 + g;
            const int left = cnt - 4 * g;
            const __mmask64 part = left >= 4 ? ~0ull : (1ull << (16 * left)) - 1;
            const __m512i v0 = _mm512_maskz_loadu_epi8(part, q0 + 64 * G);
            const __m512i v1 = _mm512_maskz_loadu_epi8(part, q1 + 64 * G);
            __builtin_prefetch(q0 + 64 * G + X24_AHEAD);
            __builtin_prefetch(q1 + 64 * G + X24_AHEAD);
            const uint8_t *p = xp + G * X24_GROUP;
            const __m512 dx = _mm512_loadu_ps((const float *)(p + 384));
            const __m512i lanes = _mm512_loadu_si512(X24_LANES[g]);
            a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(x24_dot(v0, p)),
                                 _mm512_mul_ps(_mm512_permutexvar_ps(lanes, d0), dx), a0);
            a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(x24_dot(v1, p)),
                                 _mm512_mul_ps(_mm512_permutexvar_ps(lanes, d1), dx), a1);
        }
    }
    x24_sum2(a0, a1, s);
}

/* out[:, r .. end] of M (1-4) rows of split x (xp: x24_split's) against Q4_1R rows of w */
static void x24_range(const uint8_t *xp, int64_t M, int64_t K, const float *xs,
                        const uint8_t *w, int64_t r, int64_t end, int64_t row_bytes,
                        const float *bias, float *out, int64_t ldo) {
    const int64_t nb = K / 32, stride = (nb + 3) / 4 * X24_GROUP;
    float s[4];
    if (M == 1)
        for (; r + 2 <= end; r += 2) {
            x24_pair(xp, nb, xs, w + r * row_bytes, row_bytes, s);
            out[r] = bias ? s[0] + bias[r] : s[0];
            out[r + 1] = bias ? s[1] + bias[r + 1] : s[1];
        }
    for (; r < end; r++) {
        const uint8_t *p = w + r * row_bytes;
        switch (M) {
        case 4: x24_row(4, xp, stride, nb, xs, p, s); break;
        case 3: x24_row(3, xp, stride, nb, xs, p, s); break;
        case 2: x24_row(2, xp, stride, nb, xs, p, s); break;
        default: x24_row(1, xp, stride, nb, xs, p, s); break;
        }
        for (int64_t m = 0; m < M; m++) out[m * ldo + r] = bias ? s[m] + bias[r] : s[m];
    }
}

/* ---- Q8_0R: signed weights ----
 * vpdpbusd multiplies unsigned by signed bytes: the weights go in as q + 128 (one xor) and
 * 128 times the sum of x's values under each lane comes off after. With q + 128 up to 255
 * and four products a lane, |v| stays below 2^21 (X21_MAX), not 2^23, so the lane sums stay
 * in int32: 2^-22 of the block's largest |x| an element, 8 times x24's; against the
 * dequantized reference a few times the fp32 kernel's error, some 1e-6 of the largest
 * output. */

#define X21_MAX 2080768.f /* 2^21 - 2^14: 4 x 255 x X21_MAX < 2^31 */
#define X21_PAIR 320      /* bytes of x's parts a pair of blocks: 3 x 64, 16 int32, 16 floats */

static inline size_t x21_bytes(int64_t M, int64_t K) {
    return (size_t)(M * ((K / 32 + 1) / 2) * X21_PAIR);
}

/* M rows of x into their parts: per row ceil(nb / 2) pairs of blocks, each three 64-byte
 * vectors (h, m, l of v, the pair's 64 elements in order, as a Q8_0R row holds its bytes),
 * 16 int32 (128 times the sum of v over lane i's four elements) and 16 floats (dx, lanes
 * 0-7 the first block's, 8-15 the second's), a missing second block zero */
static void x21_split(const float *x, int64_t M, int64_t ldx, int64_t K, uint8_t *out) {
    const int64_t nb = K / 32, pairs = (nb + 1) / 2;
    memset(out, 0, x21_bytes(M, K));
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + m * ldx + 32 * b;
            uint8_t *g = out + (m * pairs + b / 2) * X21_PAIR;
            const int j = (int)(b & 1);
            __m512i v[2];
            const float dx = fixed_block(_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16), X21_MAX, v);
            _mm256_storeu_ps((float *)(g + 256) + 8 * j, _mm256_set1_ps(dx));
            for (int half = 0; half < 2; half++) {
                split_bytes(v[half], g + 32 * j + 16 * half, 64);
                /* lane sums of four: int32 lanes 8 j + 4 half + i, i < 4 */
                int32_t vs[16], *corr = (int32_t *)(g + 192) + 8 * j + 4 * half;
                _mm512_storeu_si512(vs, v[half]);
                for (int i = 0; i < 4; i++)
                    corr[i] = 128 * (vs[4 * i] + vs[4 * i + 1] + vs[4 * i + 2] + vs[4 * i + 3]);
            }
        }
}

/* which of 16 d's a pair's lanes take: lanes 0-7 block 2 p, 8-15 block 2 p + 1 */
static const int32_t X21_LANES[8][16] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
    {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
    {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9},
    {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
    {14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};

/* nw (1 or 2) Q8_0R rows (row, row + row_bytes) against mr rows of split x, nw * mr <= 4 */
static inline __attribute__((always_inline)) void x21_rows(
    const int nw, const int mr, const uint8_t *xp, int64_t stride, int64_t nb,
    const uint8_t *row, int64_t row_bytes, float *s) {
    __m512 a[4];
    for (int i = 0; i < nw * mr; i++) a[i] = _mm512_setzero_ps();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int w = 0; w < nw; w++) __builtin_prefetch(row + w * row_bytes + 4096);
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int cnt = nb - b0 < 16 ? (int)(nb - b0) : 16;
        const __mmask16 keep = (__mmask16)((1u << cnt) - 1);
        __m512 dv[2];
        for (int w = 0; w < nw; w++)
            dv[w] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, row + w * row_bytes + 2 * b0));
        for (int g = 0; 2 * g < cnt; g++) {
            const int64_t P = b0 / 2 + g;
            const __mmask64 part = cnt - 2 * g >= 2 ? ~0ull : 0xffffffffull;
            const __m512i lanes = _mm512_loadu_si512(X21_LANES[g]);
            __m512i u[2];
            for (int w = 0; w < nw; w++) {
                const uint8_t *q = row + w * row_bytes + 2 * nb + 64 * P;
                __builtin_prefetch(q + X24_AHEAD);
                u[w] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(part, q), flip);
            }
            for (int m = 0; m < mr; m++) {
                const uint8_t *p = xp + m * stride + P * X21_PAIR;
                const __m512i h = _mm512_loadu_si512(p), mm = _mm512_loadu_si512(p + 64);
                const __m512i l = _mm512_loadu_si512(p + 128), corr = _mm512_loadu_si512(p + 192);
                const __m512 dx = _mm512_loadu_ps((const float *)(p + 256));
                for (int w = 0; w < nw; w++) {
                    __m512i acc = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[w], h), 8);
                    acc = _mm512_slli_epi32(_mm512_dpbusd_epi32(acc, u[w], mm), 8);
                    acc = _mm512_sub_epi32(_mm512_dpbusd_epi32(acc, u[w], l), corr);
                    const __m512 scale = _mm512_mul_ps(_mm512_permutexvar_ps(lanes, dv[w]), dx);
                    a[w * mr + m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), scale, a[w * mr + m]);
                }
            }
        }
    }
    if (nw * mr == 2)
        x24_sum2(a[0], a[1], s);
    else
        for (int i = 0; i < nw * mr; i++) s[i] = _mm512_reduce_add_ps(a[i]);
}

/* out[:, r .. end] of M (1-4) rows of split x (x21_split's) against Q8_0R rows of w */
static void x21_range(const uint8_t *xp, int64_t M, int64_t K, const uint8_t *w, int64_t r,
                      int64_t end, int64_t row_bytes, const float *bias, float *out,
                      int64_t ldo) {
    const int64_t nb = K / 32, stride = (nb + 1) / 2 * X21_PAIR;
    float s[4];
    if (M == 1)
        for (; r + 2 <= end; r += 2) {
            x21_rows(2, 1, xp, stride, nb, w + r * row_bytes, row_bytes, s);
            out[r] = bias ? s[0] + bias[r] : s[0];
            out[r + 1] = bias ? s[1] + bias[r + 1] : s[1];
        }
    for (; r < end; r++) {
        const uint8_t *p = w + r * row_bytes;
        switch (M) {
        case 4: x21_rows(1, 4, xp, stride, nb, p, row_bytes, s); break;
        case 3: x21_rows(1, 3, xp, stride, nb, p, row_bytes, s); break;
        case 2: x21_rows(1, 2, xp, stride, nb, p, row_bytes, s); break;
        default: x21_rows(1, 1, xp, stride, nb, p, row_bytes, s); break;
        }
        for (int64_t m = 0; m < M; m++) out[m * ldo + r] = bias ? s[m] + bias[r] : s[m];
    }
}

/* the parts' bytes, split and range of a type these kernels take (Q4_1R, Q8_0R) */
static inline size_t x24_bytes_of(int qtype, int64_t M, int64_t K) {
    return qtype == Q8_0R ? x21_bytes(M, K) : x24_bytes(M, K);
}
static inline void x24_split_of(int qtype, const float *x, int64_t M, int64_t ldx, int64_t K,
                                uint8_t *out) {
    if (qtype == Q8_0R)
        x21_split(x, M, ldx, K, out);
    else
        x24_split(x, M, ldx, K, out);
}

#pragma GCC pop_options

/* a thread's buffer for x as a team call prepares it (the fixed-point kernels' parts:
 * x24_split's, x24a_split's; the integer row kernels' 8-bit x: qdot_calls.c), grown as needed
 * and kept (the team's calls, one a projection, would otherwise allocate every time); NULL if
 * it cannot grow */
static uint8_t *x24_scratch(size_t bytes) {
    static __thread uint8_t *buf;
    static __thread size_t size;
    if (bytes > size) {
        free(buf);
        buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        size = buf ? bytes : 0;
    }
    return buf;
}

