/* The vector helpers of one ISA copy (quant_body.c, included once a copy, so no include guard):
 * VW-float vector types and their loads, stores, conversions, broadcast, fma and horizontal
 * sum, suffixed by SUFFIX, with short names (ld, st, ldb, tof, splat, half, FMA, vf, vi) that
 * quant_body.c undefines after the copy. */

typedef float FN(vf) __attribute__((vector_size(VW * 4)));
typedef int32_t FN(vi) __attribute__((vector_size(VW * 4)));
typedef uint8_t FN(vb) __attribute__((vector_size(VW)));
typedef uint16_t FN(vh) __attribute__((vector_size(VW * 2)));
#define vf FN(vf)
#define vi FN(vi)

static inline vf FN(ld)(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void FN(st)(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vi FN(ldi)(const int32_t *p) { vi v; memcpy(&v, p, sizeof v); return v; }
/* VW bytes (ldb) or uint16s (ldw) zero-extended to int32 lanes; GCC 12 scalarizes
 * __builtin_convertvector for these, hence the intrinsics */
#if VW == 16
static inline vi FN(ldb)(const uint8_t *p) {
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)p));
}
static inline vi FN(ldw)(const uint8_t *p) {
    return (vi)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p));
}
#elif VW == 8
static inline vi FN(ldb)(const uint8_t *p) {
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)p));
}
static inline vi FN(ldw)(const uint8_t *p) {
    return (vi)_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p));
}
#elif defined(QUANT_X86)
static inline vi FN(ldb)(const uint8_t *p) {
    __m128i z = _mm_setzero_si128(), b = _mm_cvtsi32_si128((int)rd32(p));
    return (vi)_mm_unpacklo_epi16(_mm_unpacklo_epi8(b, z), z);
}
static inline vi FN(ldw)(const uint8_t *p) {
    return (vi)_mm_unpacklo_epi16(_mm_loadl_epi64((const void *)p), _mm_setzero_si128());
}
#else
static inline vi FN(ldb)(const uint8_t *p) {
    FN(vb) b; memcpy(&b, p, sizeof b); return __builtin_convertvector(b, vi);
}
static inline vi FN(ldw)(const uint8_t *p) {
    FN(vh) h; memcpy(&h, p, sizeof h); return __builtin_convertvector(h, vi);
}
#endif
#if VW == 16 /* the same, sign-extended */
static inline vi FN(ldsb)(const uint8_t *p) {
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)p));
}
#elif VW == 8
static inline vi FN(ldsb)(const uint8_t *p) {
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)p));
}
#else
static inline vi FN(ldsb)(const uint8_t *p) { return (FN(ldb)(p) ^ 128) - 128; }
#endif
static inline vf FN(tof)(vi q) { return __builtin_convertvector(q, vf); }
/* a broadcast; not (vf){} + a, which turns -0 into +0 */
static inline vf FN(splat)(float a) { return a - (vf){}; }

#if VW == 16
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
static inline float FN(half)(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }
static inline vf FN(ldh)(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const void *)p)); }
static inline float FN(hsum)(vf x) {
    x += __builtin_shuffle(x, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    x += __builtin_shuffle(x, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    return x[0] + x[1];
}
#elif VW == 8
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float FN(half)(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }
static inline vf FN(ldh)(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const void *)p)); }
static inline float FN(hsum)(vf x) {
    x += __builtin_shuffle(x, (vi){4, 5, 6, 7, 0, 1, 2, 3});
    x += __builtin_shuffle(x, (vi){2, 3, 0, 1, 6, 7, 4, 5});
    return x[0] + x[1];
}
#else
#define FMA(a, b, c) ((a) * (b) + (c))
static inline float FN(half)(const uint8_t *p) { return half_sw(rd16(p)); }
static inline vf FN(ldh)(const uint8_t *p) {
    vf v;
    for (int i = 0; i < VW; i++) v[i] = half_sw(rd16(p + 2 * i));
    return v;
}
static inline float FN(hsum)(vf x) { return (x[0] + x[2]) + (x[1] + x[3]); }
#endif
#define ld FN(ld)
#define st FN(st)
#define ldb FN(ldb)
#define tof FN(tof)
#define splat FN(splat)
#define half FN(half)
