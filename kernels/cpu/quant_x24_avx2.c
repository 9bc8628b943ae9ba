/* quant_x24.c's kernel for the AVX2 path (no AVX-512: AMD Zen 2/3, Intel client cores, or
 * RADIXFLOW_QUANT_ISA=avx2): a few rows of fp32 x against Q4_1R, near-exact. Each block of 32
 * of x goes into the same 24-bit fixed point (x = dx * v, |v| <= V24_MAX, dx = the block's
 * largest |x| / V24_MAX), v split into three signed bytes, v = 65536 h + 256 m + l. AVX2 has
 * no vpdpbusd: `maddubs` multiplies the weights' nibbles (unsigned) by a part's bytes (signed)
 * and adds neighbours into int16 (at most 2 x 15 x 128 a lane: exact, never saturated), the
 * two nibble halves' sums add in int16, and `madd` takes them into int32, where a lane holds
 * sum q v of 8 elements exactly. One conversion and fma scale two blocks. The fp32 kernels
 * convert every weight to float (quant_legacy.c's fused_pair on Q4_1: some 12 vector
 * operations a block on AVX2); this spends about 11 a block and a row, two rows sharing
 * x's loads. Error: v's rounding, 2^-24 of the block's largest |x| an element, as
 * quant_x24.c's. Blocks whose largest |x| is below 1e-30 count as zero, and a block holding
 * an inf or NaN gives a NaN sum, as the fp32 kernels do.
 *
 * rf_qlinear and rf_qteam_linear take it where quant_x24.c's would run but the path is AVX2's,
 * for Q4_1R only (`auto`'s one stream of a small model, which holds Q4_1 as Q4_1R there;
 * rf_qset_x24 turns both off). A team thread keeps x's parts in x24_scratch. Included by
 * quant.c before the ISA copies, under its own target. */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "lanes_avx2.h"

#define X24A_PAIR 224 /* bytes of x's parts a pair of blocks: 6 x 32, 8 floats of dx */

/* bytes of x24a_split's output for M rows of K */
static inline size_t x24a_bytes(int64_t M, int64_t K) {
    return (size_t)(M * ((K / 32 + 1) / 2) * X24A_PAIR);
}

/* 32 int32 (a[0..3], values within a signed byte) as 32 bytes in order */
static inline __m256i x24a_bytes_of(const __m256i a[4]) {
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(a[0], a[1]),
                                         _mm256_packs_epi32(a[2], a[3]));
    return _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* M rows of x into their parts: per row ceil(nb / 2) pairs of blocks, each four 32-byte
 * vectors (h of elements 0-15, h of 16-31, l of 0-15, l of 16-31; bytes 16 j + e of a
 * vector from block j of the pair, as a Q4_1R row's 32 bytes of two blocks hold their low
 * and high nibbles) and 8 floats (dx, lanes 0-3 the first block's, 4-7 the second's); a
 * missing second block zero */
static void x24a_split(const float *x, int64_t M, int64_t ldx, int64_t K, uint8_t *out) {
    const int64_t nb = K / 32, pairs = (nb + 1) / 2;
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i k128 = _mm256_set1_epi32(128), k255 = _mm256_set1_epi32(255);
    memset(out, 0, x24a_bytes(M, K));
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + m * ldx + 32 * b;
            uint8_t *g = out + (m * pairs + b / 2) * X24A_PAIR;
            const int j = (int)(b & 1);
            __m256 xv[4], top = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
            for (int k = 0; k < 4; k++) {
                xv[k] = _mm256_loadu_ps(xb + 8 * k);
                top = _mm256_max_ps(top, _mm256_andnot_ps(sign, xv[k]));
                odd = _mm256_or_ps(odd, _mm256_cmp_ps(xv[k], xv[k], _CMP_UNORD_Q));
            }
            const float amax = hmax8(top);
            float dx = amax / V24_MAX, inv = V24_MAX / amax;
            if (!(amax <= 3.4e38f) || _mm256_movemask_ps(odd)) /* inf or NaN */
                dx = __builtin_nanf(""), inv = 0.f;
            else if (amax < 1e-30f)
                dx = 0.f, inv = 0.f;
            __m256i h[4], md[4], l[4];
            for (int k = 0; k < 4; k++) {
                const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(xv[k], _mm256_set1_ps(inv)));
                l[k] = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(v, k128), k255), k128);
                const __m256i r = _mm256_srai_epi32(_mm256_sub_epi32(v, l[k]), 8);
                md[k] = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(r, k128), k255), k128);
                h[k] = _mm256_srai_epi32(_mm256_sub_epi32(r, md[k]), 8);
            }
            const __m256i parts[3] = {x24a_bytes_of(h), x24a_bytes_of(md), x24a_bytes_of(l)};
            for (int i = 0; i < 3; i++) {
                _mm_storeu_si128((void *)(g + 64 * i + 16 * j), _mm256_castsi256_si128(parts[i]));
                _mm_storeu_si128((void *)(g + 64 * i + 32 + 16 * j),
                                 _mm256_extracti128_si256(parts[i], 1));
            }
            _mm_storeu_ps((float *)(g + 192) + 4 * j, _mm_set1_ps(dx));
        }
}

/* 8 of a row's fp16 values (d's or m's) as floats, the lanes keep leaves out zero: the
 * 16-byte load stays within the row (its d's, m's and 16 nibble bytes a block follow) */
static inline __m256 x24a_halfs(const uint8_t *p, __m256i keep) {
    return _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128((const void *)p)),
                         _mm256_castsi256_ps(keep));
}

/* sum q v of a pair of blocks' lanes (lanes 0-3 the first block's, 4-7 the second's): v the
 * nibbles of 32 bytes of a Q4_1R row, p the pair's parts (h, m, l; each elements 0-15 then
 * 16-31). A part's nibble products add in int16 (at most 2 x 2 x 15 x 128 = 7,680 a lane);
 * `madd` by 256 and by 1 joins h and m into int32, shifted up 8 bits before l's are added. */
static inline __m256i x24a_dot(__m256i v, const uint8_t *p) {
    const __m256i low = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(v, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#define X24A_PART(at)                                                                          \
    _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const void *)(p + (at)))),  \
                     _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const void *)(p + (at) + 32))))
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i hm = _mm256_add_epi32(_mm256_madd_epi16(X24A_PART(0), _mm256_set1_epi16(256)),
                                        _mm256_madd_epi16(X24A_PART(64), ones));
    return _mm256_add_epi32(_mm256_slli_epi32(hm, 8), _mm256_madd_epi16(X24A_PART(128), ones));
#undef X24A_PART
}

/* which of 8 d's a pair's lanes take: lanes 0-3 block 2 g, 4-7 block 2 g + 1 */
static const int32_t X24A_LANES[4][8] = {
    {0, 0, 0, 0, 1, 1, 1, 1}, {2, 2, 2, 2, 3, 3, 3, 3}, {4, 4, 4, 4, 5, 5, 5, 5},
    {6, 6, 6, 6, 7, 7, 7, 7}};

/* nw (1 or 2) Q4_1R rows (row, row + row_bytes) against mr rows of split x (xp, a row's parts
 * every `stride` bytes) and x's block sums xs (xs[m nb + b], the m terms in fp32), nw mr <= 4 */
static inline __attribute__((always_inline)) void x24a_rows(
    const int nw, const int mr, const uint8_t *xp, int64_t stride, int64_t nb, const float *xs,
    const uint8_t *row, int64_t row_bytes, float *s) {
    __m256 a[4];
    for (int i = 0; i < nw * mr; i++) a[i] = _mm256_setzero_ps();
    for (int w = 0; w < nw; w++) __builtin_prefetch(row + w * row_bytes + 4096);
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const int cnt = nb - b0 < 8 ? (int)(nb - b0) : 8;
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 dv[2];
        for (int w = 0; w < nw; w++) {
            const uint8_t *r = row + w * row_bytes;
            dv[w] = x24a_halfs(r + 2 * b0, keep);
            const __m256 mv = x24a_halfs(r + 2 * (nb + b0), keep);
            for (int m = 0; m < mr; m++)
                a[w * mr + m] = _mm256_fmadd_ps(mv, _mm256_maskload_ps(xs + m * nb + b0, keep),
                                                a[w * mr + m]);
        }
        for (int g = 0; 2 * g < cnt; g++) {
            const int64_t P = b0 / 2 + g;
            const __m256i lanes = _mm256_loadu_si256((const void *)X24A_LANES[g]);
            __m256i v[2];
            for (int w = 0; w < nw; w++) {
                const uint8_t *q = row + w * row_bytes + 4 * nb + 32 * P;
                __builtin_prefetch(q + 4096);
                v[w] = cnt - 2 * g >= 2 ? _mm256_loadu_si256((const void *)q)
                                        : _mm256_zextsi128_si256(_mm_loadu_si128((const void *)q));
            }
            for (int m = 0; m < mr; m++) {
                const uint8_t *p = xp + m * stride + P * X24A_PAIR;
                const __m256 dx = _mm256_loadu_ps((const float *)(p + 192));
                for (int w = 0; w < nw; w++) {
                    const __m256 scale = _mm256_mul_ps(_mm256_permutevar8x32_ps(dv[w], lanes), dx);
                    a[w * mr + m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(x24a_dot(v[w], p)), scale,
                                                    a[w * mr + m]);
                }
            }
        }
    }
    for (int i = 0; i < nw * mr; i++) s[i] = hsum8(a[i]);
}

/* out[:, r .. end] of M (1-4) rows of split x (x24a_split's) against Q4_1R rows of w */
static void x24a_range(const uint8_t *xp, int64_t M, int64_t K, const float *xs,
                      const uint8_t *w, int64_t r, int64_t end, int64_t row_bytes,
                      const float *bias, float *out, int64_t ldo) {
    const int64_t nb = K / 32, stride = (nb + 1) / 2 * X24A_PAIR;
    float s[4];
    if (M <= 2)
        for (; r + 2 <= end; r += 2) {
            if (M == 1)
                x24a_rows(2, 1, xp, stride, nb, xs, w + r * row_bytes, row_bytes, s);
            else
                x24a_rows(2, 2, xp, stride, nb, xs, w + r * row_bytes, row_bytes, s);
            for (int64_t m = 0; m < M; m++)
                for (int i = 0; i < 2; i++)
                    out[m * ldo + r + i] = bias ? s[i * M + m] + bias[r + i] : s[i * M + m];
        }
    for (; r < end; r++) {
        const uint8_t *p = w + r * row_bytes;
        switch (M) {
        case 4: x24a_rows(1, 4, xp, stride, nb, xs, p, row_bytes, s); break;
        case 3: x24a_rows(1, 3, xp, stride, nb, xs, p, row_bytes, s); break;
        case 2: x24a_rows(1, 2, xp, stride, nb, xs, p, row_bytes, s); break;
        default: x24a_rows(1, 1, xp, stride, nb, xs, p, row_bytes, s); break;
        }
        for (int64_t m = 0; m < M; m++) out[m * ldo + r] = bias ? s[m] + bias[r] : s[m];
    }
}

#pragma GCC pop_options
