/* Decode attention on 8-float vectors, for a build whose widest vectors are AVX2's (native.c
 * includes this where __AVX2__ and __FMA__ are defined and __AVX512F__ is not; its
 * attention_tasks then runs every task here).
 *
 * native.c's attend() is written on 16-float vectors, one AVX-512 register each. Built for
 * AVX2 each is two registers, its state for a task (a query row's 16-float chunks, its
 * accumulators, 16 keys' partial products) is twice the register file and more, and GCC
 * kept it on the stack and moved lanes one at a time: on an AMD EPYC (Zen 3) a 64-request
 * decode of 100 keys (SmolLM2: 3 KV heads, 3 query heads each, head_dim 64) took 2.2 ms a
 * layer on 2 threads, some 2,000 cycles a key and request. Here one KV head at a time:
 *   - scores, 8 keys at a time: each key's D values loaded once for the head's G query rows
 *     (fmas with the scaled query from L1), the 8 keys' partial vectors of a row summed
 *     into one vector of 8 scores by hadds;
 *   - online softmax over a block of BLOCK8 keys, exponentials 8 at a time;
 *   - values: for each 8-float chunk of the head's D, the G accumulators in registers while
 *     the block's keys stream by (one load and G fmas a key).
 * Same arguments, layout and results (up to summation order) as attend(). */

#include "lanes_avx2.h"

#define BLOCK8 64 /* keys per online-softmax block */

/* 8 pool elements at element `at` of a pool of kind 0 fp32, 1 bf16, 2 fp16, 3 int8 (its
 * scale applied by the caller) as floats */
static inline __m256 kv8(const void *pool, int64_t at, int kind) {
    switch (kind) {
    case 0: return _mm256_loadu_ps((const float *)pool + at);
    case 1:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)pool + at))),
            16));
    case 2: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)pool + at)));
    default:
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)((const int8_t *)pool + at))));
    }
}

/* lane j = the sum of v[j]'s lanes */
static inline __m256 sum8x8(const __m256 v[8]) {
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* exp(x) lane by lane for x <= 0, as vexp_neg */
static inline __m256 exp8_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256i n = _mm256_cvttps_epi32(
        _mm256_sub_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _mm256_set1_ps(0.5f)));
    const __m256 nf = _mm256_cvtepi32_ps(n);
    const __m256 f = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(nf, _mm256_set1_ps(0.693359375f))),
                                   _mm256_mul_ps(nf, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(f, f)), f), _mm256_set1_ps(1.f));
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(n, 23)));
}

/* tanh lane by lane, as vtanh */
static inline __m256 tanh8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256 e = exp8_neg(_mm256_or_ps(_mm256_add_ps(x, x), sign));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.f), e),
                                   _mm256_add_ps(_mm256_set1_ps(1.f), e));
    return _mm256_or_ps(t, _mm256_and_ps(x, sign));
}

/* attend() for NH KV heads of G rows each: q + (h G + g) D, heads hs elements apart in a
 * slot of ks elements; out (NH G x D), lse (NH G). D a multiple of 8, at most 256; G <= 8,
 * a constant where inlined (attend8's switch), so that a key's G partial sums and a chunk's
 * G accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend8_g(
    const float *q, const void *k, const void *v, const float *ksc, const float *vsc,
    int64_t hs, int64_t ks, int kind, const int64_t *first, const int64_t *count,
    int64_t num_runs, int NH, const int G, int D, float scale, float cap, float *out,
    float *lse) {
    const int C = D / 8, es = KV_BYTES(kind);
    const int64_t sks = ks / hs; /* an int8 pool's scales per slot */
    float qs[MAX_GROUP][256] __attribute__((aligned(32)));
    float acc[MAX_GROUP][256] __attribute__((aligned(32)));
    float p[MAX_GROUP][BLOCK8] __attribute__((aligned(32)));
    for (int h = 0; h < NH; h++) {
        const char *kh = (const char *)k + h * hs * es, *vh = (const char *)v + h * hs * es;
        float m[MAX_GROUP], s[MAX_GROUP];
        for (int g = 0; g < G; g++) {
            m[g] = -INFINITY, s[g] = 0.f;
            for (int c = 0; c < C; c++) {
                const __m256 x = _mm256_loadu_ps(q + (h * G + g) * D + 8 * c);
                _mm256_store_ps(qs[g] + 8 * c, _mm256_mul_ps(x, _mm256_set1_ps(scale)));
                _mm256_store_ps(acc[g] + 8 * c, _mm256_setzero_ps());
            }
        }
        for (int64_t i = 0; i < num_runs; i++)
            for (int64_t j0 = first[i], end = first[i] + count[i]; j0 < end; j0 += BLOCK8) {
                const int n = (int)(end - j0 < BLOCK8 ? end - j0 : BLOCK8);
                for (int j1 = 0; j1 < n; j1 += 8) { /* 8 keys' scores of every row */
                    const int nj = n - j1 < 8 ? n - j1 : 8;
                    __m256 part[MAX_GROUP][8];
                    for (int j = 0; j < 8; j++) {
                        const int64_t slot = j0 + j1 + (j < nj ? j : 0);
                        const int64_t at = slot * ks;
                        const int64_t ahead = slot + BLOCK8 < end ? slot + BLOCK8 : slot;
                        for (int line = 0; line < D * es; line += 64) {
                            __builtin_prefetch(kh + ahead * ks * es + line);
                            __builtin_prefetch(vh + ahead * ks * es + line);
                        }
                        const __m256 sk = _mm256_set1_ps(kind == 3 ? ksc[slot * sks + h] : 1.f);
                        __m256 t[MAX_GROUP];
                        for (int g = 0; g < G; g++) t[g] = _mm256_setzero_ps();
                        for (int c = 0; c < C; c++) {
                            __m256 kv = kv8(kh, at + 8 * c, kind);
                            if (kind == 3) kv = _mm256_mul_ps(kv, sk);
                            for (int g = 0; g < G; g++)
                                t[g] = _mm256_fmadd_ps(_mm256_load_ps(qs[g] + 8 * c), kv, t[g]);
                        }
                        for (int g = 0; g < G; g++) part[g][j] = t[g];
                    }
                    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                        _mm256_set1_epi32(nj), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
                    for (int g = 0; g < G; g++) {
                        __m256 x = sum8x8(part[g]);
                        if (cap > 0.f)
                            x = _mm256_mul_ps(_mm256_set1_ps(cap),
                                              tanh8(_mm256_mul_ps(x, _mm256_set1_ps(1.f / cap))));
                        _mm256_store_ps(p[g] + j1,
                                        _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, valid));
                    }
                }
                const int nv = (n + 7) / 8;
                for (int g = 0; g < G; g++) { /* online softmax over the block */
                    __m256 mv = _mm256_load_ps(p[g]);
                    for (int b = 1; b < nv; b++) mv = _mm256_max_ps(mv, _mm256_load_ps(p[g] + 8 * b));
                    const float mx = fmaxf(m[g], hmax8(mv));
                    if (mx == -INFINITY) { /* nothing finite yet: these keys weigh nothing */
                        for (int b = 0; b < nv; b++) _mm256_store_ps(p[g] + 8 * b, _mm256_setzero_ps());
                        continue;
                    }
                    const float corr = m[g] == -INFINITY ? 0.f : exp8_neg(_mm256_set1_ps(m[g] - mx))[0];
                    __m256 sv = _mm256_setzero_ps();
                    for (int b = 0; b < nv; b++) {
                        const __m256 e = exp8_neg(_mm256_sub_ps(_mm256_load_ps(p[g] + 8 * b),
                                                                _mm256_set1_ps(mx)));
                        _mm256_store_ps(p[g] + 8 * b, e);
                        sv = _mm256_add_ps(sv, e);
                    }
                    s[g] = s[g] * corr + hsum8(sv), m[g] = mx;
                    if (corr != 1.f)
                        for (int c = 0; c < C; c++)
                            _mm256_store_ps(acc[g] + 8 * c, _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * c),
                                                                          _mm256_set1_ps(corr)));
                }
                for (int c = 0; c < C; c++) { /* the values: G accumulators in registers */
                    __m256 a[MAX_GROUP];
                    for (int g = 0; g < G; g++) a[g] = _mm256_load_ps(acc[g] + 8 * c);
                    for (int j = 0; j < n; j++) {
                        const int64_t slot = j0 + j;
                        __m256 vv = kv8(vh, slot * ks + 8 * c, kind);
                        if (kind == 3) vv = _mm256_mul_ps(vv, _mm256_set1_ps(vsc[slot * sks + h]));
                        for (int g = 0; g < G; g++)
                            a[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(p[g] + j), vv, a[g]);
                    }
                    for (int g = 0; g < G; g++) _mm256_store_ps(acc[g] + 8 * c, a[g]);
                }
            }
        for (int g = 0; g < G; g++) {
            const float inv = s[g] > 0.f ? 1.f / s[g] : 0.f;
            for (int c = 0; c < C; c++)
                _mm256_storeu_ps(out + (h * G + g) * D + 8 * c,
                                 _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * c), _mm256_set1_ps(inv)));
            lse[h * G + g] = s[g] > 0.f ? m[g] + logf(s[g]) : -INFINITY;
        }
    }
}

static void attend8(const float *q, const void *k, const void *v, const float *ksc,
                    const float *vsc, int64_t hs, int64_t ks, int kind, const int64_t *first,
                    const int64_t *count, int64_t num_runs, int NH, int G, int D, float scale,
                    float cap, float *out, float *lse) {
#define ATTEND8_G(GG)                                                                          \
    case GG:                                                                                   \
        attend8_g(q, k, v, ksc, vsc, hs, ks, kind, first, count, num_runs, NH, GG, D, scale,   \
                  cap, out, lse);                                                              \
        return;
    switch (G) {
        ATTEND8_G(1) ATTEND8_G(2) ATTEND8_G(3) ATTEND8_G(4) ATTEND8_G(5) ATTEND8_G(6)
        ATTEND8_G(7) ATTEND8_G(8)
    }
#undef ATTEND8_G
}
