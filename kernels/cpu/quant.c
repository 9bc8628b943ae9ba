/* Matmul, dequantize and row gather straight from GGUF-style quantized weight blocks, so a
 * quantized model keeps its 0.5-1 byte weights in memory instead of 4-byte fp32 copies, and
 * decode (memory-bound: every weight read once per token) streams 4-8x fewer bytes.
 * Built at first use by kernels/cpu/quant.py and called through ctypes or, from the C++ decode
 * loop, through rf_qlinear's address. The torch reference is kernels/quant.py; the tests
 * (tests/kernels/test_quant.py) hold every path here to it.
 *
 * Modes: rf_qlinear's default (rf_qset_activations) or a flag in its qtype (RF_FP32_ACTS,
 * RF_INT8_ACTS) picks int8 activations (qdot.c's integer dot products, qdot_amx.c's AMX-INT8
 * tiles, quant_amx.c's single bf16 pass; see rf_qlinear) or the exact fp32 paths below.
 *
 * Numerics (exact mode): activations stay fp32. A weight block is dequantized to fp32 with
 * the reference's roundings (compiled with -ffp-contract=off, so d * q + m is a product then a sum, as numpy's;
 * rf_qdequantize equals the reference bit for bit), then accumulated in fp32 with fma.
 *
 * Layout of the work, two paths, picked by the row count M (rf_qset_panel_rows):
 * - decode (few rows): output rows go in panels of NR = 4; a panel is dequantized into a
 *   per-thread scratch (NR x K floats, L1/L2-resident) and every row of x is dotted against it
 *   (reductions along K), MR rows at a time with MR x NR vector accumulators.
 * - panel (many rows, AVX2 and AVX-512): panels of PN = 16 or 32 output rows, dequantized a
 *   K-block at a time and transposed to [k][PN], against an outer-product micro-kernel over
 *   PM rows of x (qlinear_rows).
 * Either way each weight row is read from memory once per call and dequantized once, whatever
 * M is.
 *
 * ISA: this file includes itself three times below, under `#pragma GCC target` for AVX-512
 * (16-float vectors), AVX2+FMA+F16C (8) and the compiler's baseline (4-float vectors: SSE2 on
 * x86-64, portable C elsewhere), each copy's functions suffixed by its ISA; rf_* pick one at
 * run time (__builtin_cpu_supports), lowered by RADIXFLOW_QUANT_ISA=avx2|scalar or
 * rf_qset_isa. The library is built without -march=native, so the baseline copy runs
 * anywhere. */
#ifndef QUANT_BODY
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QUANT_X86 1
#endif

enum {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13,
    Q6_K = 14, BF16 = 30, I8 = 1000, Q4G128 = 1001, Q4_1R = 1002,
};
#define NR 4 /* output rows per panel */

/* (block size, bytes per block) of a qtype; block size 0 for one not handled here */
static void block_of(int qtype, int64_t *size, int64_t *bytes) {
    switch (qtype) {
    case F16: case BF16: *size = 1, *bytes = 2; return;
    case I8: *size = 1, *bytes = 1; return;
    case Q4_0: *size = 32, *bytes = 18; return;
    case Q4_1: case Q4_1R: *size = 32, *bytes = 20; return;
    case Q5_0: *size = 32, *bytes = 22; return;
    case Q5_1: *size = 32, *bytes = 24; return;
    case Q8_0: *size = 32, *bytes = 34; return;
    case Q4_K: *size = 256, *bytes = 144; return;
    case Q5_K: *size = 256, *bytes = 176; return;
    case Q6_K: *size = 256, *bytes = 210; return;
    case Q4G128: *size = 128, *bytes = 72; return;
    default: *size = 0, *bytes = 0;
    }
}

static int valid(int qtype, int64_t K, int64_t row_bytes, const float *scale) {
    int64_t size, bytes;
    block_of(qtype, &size, &bytes);
    if (qtype == Q4_1R && row_bytes != K / 32 * 20) return 0; /* its layout spans the row */
    return size > 0 && K > 0 && K % size == 0 && row_bytes >= K / size * bytes &&
           (qtype != I8 || scale != NULL);
}

/* IEEE half -> float, exact (subnormals as m * 2^-24, exact in fp32) */
static inline float half_sw(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, bits;
    float f;
    if (e == 31)
        bits = 0x7f800000u | (m << 13);
    else if (e)
        bits = ((e + 112) << 23) | (m << 13);
    else {
        f = (float)m * 0x1p-24f;
        memcpy(&bits, &f, 4);
    }
    bits |= sign;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline float rdf(const uint8_t *p) { float v; memcpy(&v, p, 4); return v; }

static const int32_t IOTA[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* Q4_K / Q5_K: the 8 six-bit scales and mins of a block, packed in 12 bytes */
static inline void scale_min_k4(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63, mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
}

/* N * K * (M + 4) a thread from which a fused call (1-4 rows) splits over threads, as
 * rf_qset_fused_split set it; 0 for FUSED_SPLIT */
#define FUSED_SPLIT (1 << 22) /* about 50 us of work */
static int64_t fused_split_set = 0;

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUFFIX)
#define QUANT_BODY

#ifdef QUANT_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#define SUFFIX _avx512
#define VW 16
#define MR 4
#include __FILE__
#undef SUFFIX
#undef VW
#undef MR
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define SUFFIX _avx2
#define VW 8
#define MR 2
#include __FILE__
#undef SUFFIX
#undef VW
#undef MR
#pragma GCC pop_options
#include "quant_amx.c" /* many rows on AMX tiles, where the CPU has them */
#include "qdot.c"      /* few rows with 8-bit integer dot products (AVX2, AVX-VNNI, AVX512-VNNI) */
#include "qdot_amx.c"  /* many rows with 8-bit integer tile products (AMX-INT8) */
#endif

#define SUFFIX _base
#define VW 4
#define MR 2
#include __FILE__
#undef SUFFIX
#undef VW
#undef MR

/* ---- dispatch ---- */
enum { ISA_BASE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static int isa_level = -1;

static int best_isa(void) {
#ifdef QUANT_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return ISA_AVX2; /* every AVX2 CPU made has F16C */
#endif
    return ISA_BASE;
}

/* The path used: the best the CPU has, lowered by `want` (0 base, 1 avx2, 2 avx512) when
 * want >= 0; a negative want keeps the current choice (first: RADIXFLOW_QUANT_ISA's). */
int rf_qset_isa(int want) {
    int best = best_isa();
    if (want < 0 && isa_level >= 0) return isa_level;
    if (want < 0) {
        const char *env = getenv("RADIXFLOW_QUANT_ISA");
        want = !env ? ISA_AVX512 : !strcmp(env, "avx2") ? ISA_AVX2
             : !strcmp(env, "scalar") ? ISA_BASE : ISA_AVX512;
    }
    isa_level = want < best ? want : best;
    return isa_level;
}

static inline int isa(void) { return isa_level >= 0 ? isa_level : rf_qset_isa(-1); }

/* Rows of x from which rf_qlinear takes the panel path (per ISA; the baseline has none);
 * fewer take the decode path. The crossovers measured on SmolLM2's shapes (Q4_1, Q8_0, one
 * thread of this project's AMD EPYC): AVX-512 about 16 rows (par at 16, 0.8-0.95x at 24-32
 * for K = 576, still 1.05-1.15x at 32 for K = 1536), AVX2 about 12. */
static const int PANEL_ROWS[3] = {0, 12, 16};
static int panel_rows_set = 0; /* rf_qset_panel_rows's, 0 for PANEL_ROWS */

/* The row count from which the current ISA takes the panel path: `rows` when rows > 0 (for
 * every ISA with one), the measured default again when rows == 0, unchanged when rows < 0;
 * 0 where the ISA has no panel path. */
int rf_qset_panel_rows(int rows) {
    if (rows >= 0) panel_rows_set = rows;
    return isa() == ISA_BASE ? 0 : panel_rows_set ? panel_rows_set : PANEL_ROWS[isa()];
}

/* The work a thread (N * K * (M + 4)) from which a call of 1-4 rows splits over threads:
 * `work` when work > 0, the default (FUSED_SPLIT) when 0, unchanged when < 0; returns the
 * current one. Splitting wakes the other OpenMP threads, which pays where they are still
 * spinning from the last call and costs where they sleep (runtime/model_executor/split.py
 * chooses from the first decode steps' times). */
int64_t rf_qset_fused_split(int64_t work) {
    if (work >= 0) fused_split_set = work;
    return fused_split_set ? fused_split_set : FUSED_SPLIT;
}

/* qtype may carry RF_FP32_ACTS (the exact path: fp32 activations) or RF_INT8_ACTS (the
 * integer path where it applies: qdot.c); with neither, rf_qset_activations's default. */
#define RF_FP32_ACTS 0x10000
#define RF_INT8_ACTS 0x20000
int rf_qlinear(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w, int64_t N,
               int64_t row_bytes, int qtype, const float *scale, const float *bias, float *out,
               int64_t ldo, int threads) {
    const int acts = qtype & (RF_FP32_ACTS | RF_INT8_ACTS);
    qtype &= ~(RF_FP32_ACTS | RF_INT8_ACTS);
    if (!valid(qtype, K, row_bytes, scale) || M < 0 || N < 0) return -1;
    if (M == 0 || N == 0) return 0;
    int rows = panel_rows_set ? panel_rows_set : PANEL_ROWS[isa()];
#ifdef QUANT_X86
    const int mode = rf_qset_activations(-1); /* 2 (auto): int8 for the K types only */
    const int k_type = qtype == Q4_K || qtype == Q5_K || qtype == Q6_K;
    const int int8 = acts ? acts == RF_INT8_ACTS : mode == 1 || (mode == 2 && k_type);
    /* int8 mode (not exact): from rf_qset_amx_bf16_rows rows bf16 tile products alone; up to
     * the integer dot products' row limit those; between, int8 tile products (AMX-INT8) */
    if (int8 && isa() == ISA_AVX512 && rf_qset_amx_rows(-1) > 0 && K % 32 == 0 &&
        M >= rf_qset_amx_bf16_rows(-1))
        return qlinear_amx(x, M, ldx, K, w, N, row_bytes, qtype, scale, bias, out, ldo, threads,
                           0);
    const int amx_int = int8 && isa() == ISA_AVX512 && amxi_type(qtype) &&
                        rf_qset_amx_int_rows(-1) > 0;
    if (int8 && isa() >= ISA_AVX2 && idot_type(qtype) && M <= int_rows_for(qtype, amx_int) &&
        rf_qset_int_isa(-1) >= 0)
        return qlinear_int(x, M, ldx, K, w, N, row_bytes, qtype, bias, out, ldo, threads);
    if (amx_int && M >= rf_qset_amx_int_rows(-1))
        return qlinear_amx_int(x, M, ldx, K, w, N, row_bytes, qtype, bias, out, ldo, threads);
#else
    (void)acts;
#endif
    switch (isa()) {
#ifdef QUANT_X86
    case ISA_AVX512:
        if (M >= rf_qset_amx_rows(-1) && rf_qset_amx_rows(-1) > 0 && K % 32 == 0)
            return qlinear_amx(x, M, ldx, K, w, N, row_bytes, qtype, scale, bias, out, ldo,
                               threads, 1);
        if (M >= rows)
            return qlinear_rows_avx512(x, M, ldx, K, w, N, row_bytes, qtype, scale, bias, out,
                                       ldo, threads);
        return qlinear_avx512(x, M, ldx, K, w, N, row_bytes, qtype, scale, bias, out, ldo, threads);
    case ISA_AVX2:
        if (M >= rows)
            return qlinear_rows_avx2(x, M, ldx, K, w, N, row_bytes, qtype, scale, bias, out, ldo,
                                     threads);
        return qlinear_avx2(x, M, ldx, K, w, N, row_bytes, qtype, scale, bias, out, ldo, threads);
#endif
    default:
        return qlinear_base(x, M, ldx, K, w, N, row_bytes, qtype, scale, bias, out, ldo, threads);
    }
}

int rf_qdequantize(const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t K, int qtype,
                   const float *scale, float *out, int threads) {
    if (!valid(qtype, K, row_bytes, scale) || rows < 0) return -1;
    switch (isa()) {
#ifdef QUANT_X86
    case ISA_AVX512: gather_avx512(w, row_bytes, K, qtype, scale, NULL, rows, out, threads); break;
    case ISA_AVX2: gather_avx2(w, row_bytes, K, qtype, scale, NULL, rows, out, threads); break;
#endif
    default: gather_base(w, row_bytes, K, qtype, scale, NULL, rows, out, threads);
    }
    return 0;
}

int rf_qget_rows(const uint8_t *w, int64_t row_bytes, int64_t K, int qtype, const float *scale,
                 const int64_t *ids, int64_t n, float *out, int threads) {
    if (!valid(qtype, K, row_bytes, scale) || n < 0) return -1;
    switch (isa()) {
#ifdef QUANT_X86
    case ISA_AVX512: gather_avx512(w, row_bytes, K, qtype, scale, ids, n, out, threads); break;
    case ISA_AVX2: gather_avx2(w, row_bytes, K, qtype, scale, ids, n, out, threads); break;
#endif
    default: gather_base(w, row_bytes, K, qtype, scale, ids, n, out, threads);
    }
    return 0;
}

#else /* ---- QUANT_BODY: one ISA's copy, names suffixed by SUFFIX, VW floats a vector ---- */

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

/* ---- one row of K weights (K / block blocks) -> fp32, the reference's formulas ---- */

static inline void FN(deq_q4_0)(const uint8_t *p, int64_t K, float *out) {
    for (int64_t b = 0; b < K; b += 32, p += 18, out += 32) {
        float d = half(p);
        for (int c = 0; c < 16; c += VW) {
            vi q = ldb(p + 2 + c);
            st(out + c, d * (tof(q & 15) - 8.f));
            st(out + 16 + c, d * (tof(q >> 4) - 8.f));
        }
    }
}

/* Q4_1R (kernels/quant.py): blocks b0 .. b0 + count of a row of nb, its d's, m's and nibble
 * groups apart; the same formula as Q4_1's */
static inline void FN(deq_q4_1r)(const uint8_t *row, int64_t nb, int64_t b0, int64_t count,
                                 float *out) {
    for (int64_t b = b0; b < b0 + count; b++, out += 32) {
        vf vd = splat(half(row + 2 * b)), vm = splat(half(row + 2 * (nb + b)));
        const uint8_t *q = row + 4 * nb + 16 * b;
        for (int c = 0; c < 16; c += VW) {
            vi v = ldb(q + c);
            st(out + c, FMA(vd, tof(v & 15), vm));
            st(out + 16 + c, FMA(vd, tof(v >> 4), vm));
        }
    }
}

static inline void FN(deq_q4_1)(const uint8_t *p, int64_t K, float *out) {
    for (int64_t b = 0; b < K; b += 32, p += 20, out += 32) {
        vf vd = splat(half(p)), vm = splat(half(p + 2)); /* d * q is exact: fma */
        for (int c = 0; c < 16; c += VW) {
            vi q = ldb(p + 4 + c);
            st(out + c, FMA(vd, tof(q & 15), vm));
            st(out + 16 + c, FMA(vd, tof(q >> 4), vm));
        }
    }
}

/* Q5_0 and Q5_1: the fifth bit of element j is bit j of the 32-bit qh */
static inline void FN(deq_q5)(const uint8_t *p, int64_t K, float *out, int has_min) {
    const int stride = has_min ? 24 : 22;
    for (int64_t b = 0; b < K; b += 32, p += stride, out += 32) {
        float d = half(p);
        vf vd = splat(d), vm = splat(has_min ? half(p + 2) : 0.f);
        const uint8_t *h = p + (has_min ? 4 : 2), *qs = h + 4;
        vi qh = (vi){} + (int32_t)rd32(h);
        for (int c = 0; c < 16; c += VW) {
            vi q = ldb(qs + c), j = FN(ldi)(IOTA + c);
            vi lo = (q & 15) | (((qh >> j) & 1) << 4), hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4);
            if (has_min) {
                st(out + c, FMA(vd, tof(lo), vm)); /* d * q is exact */
                st(out + 16 + c, FMA(vd, tof(hi), vm));
            } else {
                st(out + c, d * tof(lo - 16));
                st(out + 16 + c, d * tof(hi - 16));
            }
        }
    }
}

static inline void FN(deq_q8_0)(const uint8_t *p, int64_t K, float *out) {
    for (int64_t b = 0; b < K; b += 32, p += 34, out += 32) {
        float d = half(p);
        for (int c = 0; c < 32; c += VW) st(out + c, tof(FN(ldsb)(p + 2 + c)) * d);
    }
}

/* Q4_K and Q5_K: 8 sub-blocks of 32, each (d * sc) * q - dmin * mn; sub-block j's nibbles are
 * the low (j even) or high (j odd) halves of bytes 32 * (j / 2) ..; Q5_K's fifth bit of
 * element l of sub-block j is bit j of qh[l]. */
static inline void FN(deq_qk)(const uint8_t *p, int64_t K, float *out, int five) {
    const int stride = five ? 176 : 144;
    for (int64_t b = 0; b < K; b += 256, p += stride, out += 256) {
        float d = half(p), dmin = half(p + 2);
        uint8_t sc[8], mn[8];
        scale_min_k4(p + 4, sc, mn);
        const uint8_t *qh = p + 16, *qs = p + (five ? 48 : 16);
        for (int j = 0; j < 8; j++) {
            /* ds * q - dm as fma(ds, q, -dm): the product is exact, so one rounding either way */
            vf vds = splat(d * (float)sc[j]), vdm = splat(-(dmin * (float)mn[j]));
            const uint8_t *q = qs + 32 * (j / 2);
            const int shift = 4 * (j & 1);
            for (int c = 0; c < 32; c += VW) {
                vi v = (ldb(q + c) >> shift) & 15;
                if (five) v |= ((ldb(qh + c) >> j) & 1) << 4;
                st(out + 32 * j + c, FMA(vds, tof(v), vdm)); /* exact product */
            }
        }
    }
}

/* Q6_K: halves of 128; in half h, element r takes its low 4 bits from ql[64 h + r % 64]
 * (low nibble for r < 64, else high) and its top 2 from qh[32 h + r % 32] >> 2 (r / 32);
 * (d * scales[e / 16]) * (q - 32). */
static inline void FN(deq_q6_k)(const uint8_t *p, int64_t K, float *out) {
    for (int64_t b = 0; b < K; b += 256, p += 210, out += 256) {
        const uint8_t *ql = p, *qh = p + 128;
        const int8_t *scales = (const int8_t *)(p + 192);
        float d = half(p + 208);
        for (int e = 0; e < 256; e += VW) {
            int h = e / 128, r = e % 128;
            vi lo = ldb(ql + 64 * h + r % 64);
            lo = r < 64 ? lo & 15 : lo >> 4;
            vi hi = (ldb(qh + 32 * h + r % 32) >> (2 * (r / 32))) & 3;
            st(out + e, (d * (float)scales[e / 16]) * (tof(lo | (hi << 4)) - 32.f));
        }
    }
}

/* Q4G128: f32 d, f32 m, 64 bytes; byte j holds element j (low nibble) and j + 64 (high) */
static inline void FN(deq_q4g128)(const uint8_t *p, int64_t K, float *out) {
    for (int64_t b = 0; b < K; b += 128, p += 72, out += 128) {
        float d = rdf(p), m = rdf(p + 4);
        for (int c = 0; c < 64; c += VW) {
            vi q = ldb(p + 8 + c);
            st(out + c, d * tof(q & 15) + m);
            st(out + 64 + c, d * tof(q >> 4) + m);
        }
    }
}

/* F16, BF16, I8: any K, so a vector body and a scalar tail */
static inline void FN(deq_f16)(const uint8_t *p, int64_t K, float *out) {
    int64_t k = 0;
    for (; k + VW <= K; k += VW) st(out + k, FN(ldh)(p + 2 * k));
    for (; k < K; k++) out[k] = half_sw(rd16(p + 2 * k));
}

static inline void FN(deq_bf16)(const uint8_t *p, int64_t K, float *out) {
    int64_t k = 0;
    for (; k + VW <= K; k += VW) {
        st(out + k, (vf)(FN(ldw)(p + 2 * k) << 16));
    }
    for (uint32_t bits; k < K; k++) bits = (uint32_t)rd16(p + 2 * k) << 16, memcpy(out + k, &bits, 4);
}

static inline void FN(deq_i8)(const uint8_t *p, int64_t K, float scale, float *out) {
    int64_t k = 0;
    for (; k + VW <= K; k += VW) st(out + k, scale * tof(FN(ldsb)(p + k)));
    for (; k < K; k++) out[k] = scale * (float)(int8_t)p[k];
}

static void FN(deq_row)(int qtype, const uint8_t *p, int64_t K, float scale, float *out) {
    switch (qtype) {
    case Q4_0: FN(deq_q4_0)(p, K, out); break;
    case Q4_1: FN(deq_q4_1)(p, K, out); break;
    case Q4_1R: FN(deq_q4_1r)(p, K / 32, 0, K / 32, out); break;
    case Q5_0: FN(deq_q5)(p, K, out, 0); break;
    case Q5_1: FN(deq_q5)(p, K, out, 1); break;
    case Q8_0: FN(deq_q8_0)(p, K, out); break;
    case Q4_K: FN(deq_qk)(p, K, out, 0); break;
    case Q5_K: FN(deq_qk)(p, K, out, 1); break;
    case Q6_K: FN(deq_q6_k)(p, K, out); break;
    case Q4G128: FN(deq_q4g128)(p, K, out); break;
    case F16: FN(deq_f16)(p, K, out); break;
    case BF16: FN(deq_bf16)(p, K, out); break;
    case I8: FN(deq_i8)(p, K, scale, out); break;
    }
}

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

/* ---- a few rows of x against Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K blocks, fused: no fp32
 * copy of the weight. A block of 32 contributes d * (q . x) + m * sum(x) (Q4_0: m = -8 d;
 * Q8_0: m = 0), the block sums of x computed once per call. The panel path (and the reference) dequantizes first,
 * d * q + m, and then takes the dot: the same sum reassociated, so the two agree to fp32
 * rounding, not bit for bit. One pass over the packed bytes instead of unpack, store, reload:
 * at one row and 2 threads, SmolLM2's Q4_1 gate_up and down ran 1.4-1.6x faster. */
#define FUSED_ROWS 4
/* the mr sums of a fused row: vector accumulators a0.. plus scalar terms c0.. */
#define FUSED_SUMS                                                                          \
    s[0] = FN(hsum)(a0) + c0;                                                               \
    if (mr > 1) s[1] = FN(hsum)(a1) + c1;                                                   \
    if (mr > 2) s[2] = FN(hsum)(a2) + c2;                                                   \
    if (mr > 3) s[3] = FN(hsum)(a3) + c3;
/* the rows up to which a type is fused: the K types' scales cost more per block, and at 3-4
 * rows they measured level with the decode path (4096 x 4096, 2 threads: 0.96-1.06x), at one
 * row 1.2-1.5x faster and at two 1.1x */
static inline int FN(fused_rows)(int qtype) {
    if (qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0 || qtype == Q4_1R) return FUSED_ROWS;
    return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K ? 2 : 0;
}

/* A block's fp16 d (and m, where `two`) as lanes 0 (and 1) of a 4-float vector, the rest 0,
 * and the blocks' scalar terms summed in such a vector: d * (-8 sum x) for Q4_0, m * sum x
 * for Q4_1, against the pairs xp of x's block sums (qlinear_fused). On x86 one conversion and
 * one fma a block instead of two scalar conversions, a product and a sum: the block loop of
 * SmolLM2's Q4_1 shapes ran 1.4x faster (one thread of this project's Xeon, 8.2 -> 11.4 GB/s). */
typedef float FN(v4) __attribute__((vector_size(16)));
#if VW >= 8
static inline FN(v4) FN(dm)(const uint8_t *p, int two) {
    return (FN(v4))_mm_cvtph_ps(_mm_cvtsi32_si128(two ? (int)rd32(p) : (int)rd16(p)));
}
static inline FN(v4) FN(cfma)(FN(v4) a, const float *xp, FN(v4) c) {
    __m128 x2 = _mm_castpd_ps(_mm_load_sd((const double *)xp));
    return (FN(v4))_mm_fmadd_ps((__m128)a, x2, (__m128)c);
}
#if VW == 16
static inline vf FN(lane0)(FN(v4) a) { return _mm512_broadcastss_ps((__m128)a); }
/* the low nibbles of v's lanes as floats: a permute of 0..15 reads only an index's low 4
 * bits, so no mask, and it runs beside the conversions (another 4% on the loop above) */
static inline vf FN(low4)(vi v) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_permutexvar_ps((__m512i)v, iota);
}
#else
static inline vf FN(lane0)(FN(v4) a) { return _mm256_broadcastss_ps((__m128)a); }
static inline vf FN(low4)(vi v) { return tof(v & 15); }
#endif
#else
static inline FN(v4) FN(dm)(const uint8_t *p, int two) {
    return (FN(v4)){half(p), two ? half(p + 2) : 0.f, 0.f, 0.f};
}
static inline FN(v4) FN(cfma)(FN(v4) a, const float *xp, FN(v4) c) {
    return c + a * (FN(v4)){xp[0], xp[1], 0.f, 0.f};
}
static inline vf FN(lane0)(FN(v4) a) { return splat(a[0]); }
static inline vf FN(low4)(vi v) { return tof(v & 15); }
#endif

#define FSTEP(m, w, off)                                                                    \
    if (mr > m) t##m = FMA(w, ld(xb + m * ldx + (off)), t##m);
#define FEND(m)                                                                             \
    if (mr > m) {                                                                           \
        a##m = FMA(vd, t##m, a##m);                                                         \
        if (qtype != Q8_0) e##m = FN(cfma)(dm, xp + 2 * (m * nb + b), e##m);                \
    }
static inline __attribute__((always_inline)) void FN(fused_row)(
    const int mr, const float *x, int64_t ldx, int64_t K, const float *xp, const uint8_t *p,
    int64_t row_bytes, int qtype, float s[FUSED_ROWS]) {
    vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
    FN(v4) e0 = {}, e1 = {}, e2 = {}, e3 = {};
    const int64_t nb = K / 32, bytes = row_bytes / nb;
    for (int64_t b = 0; b < nb; b++, p += bytes) {
        __builtin_prefetch(p + 4096); /* the rows ahead: cold weights at two threads */
        const FN(v4) dm = FN(dm)(p, qtype == Q4_1);
        const float *xb = x + b * 32;
        vf t0 = {}, t1 = {}, t2 = {}, t3 = {};
        if (qtype == Q8_0) {
            for (int c = 0; c < 32; c += VW) {
                vf w = tof(FN(ldsb)(p + 2 + c));
                FSTEP(0, w, c) FSTEP(1, w, c) FSTEP(2, w, c) FSTEP(3, w, c)
            }
        } else {
            const uint8_t *q = p + (qtype == Q4_1 ? 4 : 2);
            for (int c = 0; c < 16; c += VW) {
                vi v = ldb(q + c);
                vf lo = FN(low4)(v), hi = tof(v >> 4);
                FSTEP(0, lo, c) FSTEP(1, lo, c) FSTEP(2, lo, c) FSTEP(3, lo, c)
                FSTEP(0, hi, 16 + c) FSTEP(1, hi, 16 + c) FSTEP(2, hi, 16 + c) FSTEP(3, hi, 16 + c)
            }
        }
        vf vd = FN(lane0)(dm);
        FEND(0) FEND(1) FEND(2) FEND(3)
    }
    const float c0 = e0[0] + e0[1], c1 = e1[0] + e1[1], c2 = e2[0] + e2[1], c3 = e3[0] + e3[1];
    FUSED_SUMS
}
#undef FSTEP
#undef FEND

/* One row of x against two weight rows of Q4_0, Q4_1 or Q8_0 (the same sums as fused_row's
 * at mr = 1, in the same order): two independent chains a block, x loaded once for both.
 * SmolLM2's Q4_1 shapes at one row, one thread: 1.04x fused_row's speed. */
static inline __attribute__((always_inline)) void FN(fused_pair)(
    const float *x, int64_t K, const float *xp, const uint8_t *p, int64_t row_bytes,
    int qtype, float s[2]) {
    vf a0 = {}, a1 = {};
    FN(v4) e0 = {}, e1 = {};
    const int64_t nb = K / 32, bytes = row_bytes / nb;
    const uint8_t *p1 = p + row_bytes;
    for (int64_t b = 0; b < nb; b++, p += bytes, p1 += bytes) {
        __builtin_prefetch(p + 4096), __builtin_prefetch(p1 + 4096);
        const FN(v4) dm0 = FN(dm)(p, qtype == Q4_1), dm1 = FN(dm)(p1, qtype == Q4_1);
        const float *xb = x + b * 32;
        vf t0 = {}, t1 = {};
        if (qtype == Q8_0) {
            for (int c = 0; c < 32; c += VW) {
                vf xv = ld(xb + c);
                t0 = FMA(tof(FN(ldsb)(p + 2 + c)), xv, t0);
                t1 = FMA(tof(FN(ldsb)(p1 + 2 + c)), xv, t1);
            }
        } else {
            const int off = qtype == Q4_1 ? 4 : 2;
            for (int c = 0; c < 16; c += VW) {
                vf xl = ld(xb + c), xh = ld(xb + 16 + c);
                vi v0 = ldb(p + off + c), v1 = ldb(p1 + off + c);
                t0 = FMA(FN(low4)(v0), xl, t0), t1 = FMA(FN(low4)(v1), xl, t1);
                t0 = FMA(tof(v0 >> 4), xh, t0), t1 = FMA(tof(v1 >> 4), xh, t1);
            }
            e0 = FN(cfma)(dm0, xp + 2 * b, e0), e1 = FN(cfma)(dm1, xp + 2 * b, e1);
        }
        a0 = FMA(FN(lane0)(dm0), t0, a0), a1 = FMA(FN(lane0)(dm1), t1, a1);
    }
    s[0] = FN(hsum)(a0) + (e0[0] + e0[1]), s[1] = FN(hsum)(a1) + (e1[0] + e1[1]);
}

/* Q4_1R, fused: VW blocks' d's and m's converted at once (d read back as a broadcast, the m
 * terms one fma against x's block sums), the nibble groups 16 bytes apart. SmolLM2's Q4_1
 * shapes at one row, one thread of this project's Xeon: 13.7 against 12.1 GB/s. */
#define RSTEP(m, w, off)                                                                    \
    if (mr > m) t##m = FMA(w, ld(xb + m * ldx + (off)), t##m);
#define REND(m)                                                                             \
    if (mr > m) a##m = FMA(vd, t##m, a##m);
#define RMIN(m)                                                                             \
    if (mr > m) e##m = FMA(ld(mv), ld(xs + m * nb + b0), e##m);
static inline __attribute__((always_inline)) void FN(fused_row_r)(
    const int mr, const float *x, int64_t ldx, int64_t K, const float *xs, const uint8_t *row,
    float s[FUSED_ROWS]) {
    vf a0 = {}, a1 = {}, a2 = {}, a3 = {}, e0 = {}, e1 = {}, e2 = {}, e3 = {};
    const int64_t nb = K / 32;
    const uint8_t *qs = row + 4 * nb;
    float dv[VW] __attribute__((aligned(64))), mv[VW] __attribute__((aligned(64)));
    __builtin_prefetch(row + 4096), __builtin_prefetch(row + 4096 + 64);
    for (int64_t b0 = 0; b0 < nb; b0 += VW) {
        const int cnt = nb - b0 < VW ? (int)(nb - b0) : VW;
#if VW == 16
        const __mmask16 keep = (__mmask16)((1u << cnt) - 1);
        _mm512_store_ps(dv, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, row + 2 * b0)));
        _mm512_store_ps(mv, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, row + 2 * (nb + b0))));
#else
        for (int j = 0; j < VW; j++) {
            dv[j] = j < cnt ? half(row + 2 * (b0 + j)) : 0.f;
            mv[j] = j < cnt ? half(row + 2 * (nb + b0 + j)) : 0.f;
        }
#endif
        if (cnt == VW) {
            RMIN(0) RMIN(1) RMIN(2) RMIN(3)
        } else { /* the last blocks: x's sums past nb are not there */
            for (int m = 0; m < mr; m++) {
                float c = 0.f;
                for (int j = 0; j < cnt; j++) c += mv[j] * xs[m * nb + b0 + j];
                vf *e = m == 0 ? &e0 : m == 1 ? &e1 : m == 2 ? &e2 : &e3;
                (*e)[0] += c;
            }
        }
        for (int j = 0; j < cnt; j++) {
            const int64_t b = b0 + j;
            const uint8_t *q = qs + 16 * b;
            if ((j & 3) == 0) __builtin_prefetch(q + 4096);
            const float *xb = x + b * 32;
            vf t0 = {}, t1 = {}, t2 = {}, t3 = {};
            for (int c = 0; c < 16; c += VW) {
                vi v = ldb(q + c);
                vf lo = FN(low4)(v), hi = tof(v >> 4);
                RSTEP(0, lo, c) RSTEP(1, lo, c) RSTEP(2, lo, c) RSTEP(3, lo, c)
                RSTEP(0, hi, 16 + c) RSTEP(1, hi, 16 + c) RSTEP(2, hi, 16 + c) RSTEP(3, hi, 16 + c)
            }
            const vf vd = splat(dv[j]);
            REND(0) REND(1) REND(2) REND(3)
        }
    }
    const float c0 = FN(hsum)(e0), c1 = FN(hsum)(e1), c2 = FN(hsum)(e2), c3 = FN(hsum)(e3);
    FUSED_SUMS
}
#undef RSTEP
#undef REND
#undef RMIN

/* Q4_K and Q5_K, fused: sub-block j (32 weights) contributes (d sc_j) (q . x) - (dmin mn_j)
 * sum(x), xs holding x's sums over 32; sub-blocks 2i and 2i + 1 share their bytes (low and
 * high nibbles), so they are taken together. */
#define KSTEP(m)                                                                            \
    if (mr > m) {                                                                           \
        l##m = FMA(wl, ld(xb + m * ldx + c), l##m);                                         \
        h##m = FMA(wh, ld(xb + m * ldx + 32 + c), h##m);                                    \
    }
#define KEND(m)                                                                             \
    if (mr > m) {                                                                           \
        a##m = FMA(splat(dl), l##m, a##m), a##m = FMA(splat(dh), h##m, a##m);               \
        c##m -= ml * xs[m * nb + sb] + mh * xs[m * nb + sb + 1];                            \
    }
static inline __attribute__((always_inline)) void FN(fused_row_k)(
    const int mr, const float *x, int64_t ldx, int64_t K, const float *xs, const uint8_t *p,
    int qtype, float s[FUSED_ROWS]) {
    vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
    float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
    const int five = qtype == Q5_K, stride = five ? 176 : 144;
    const int64_t nb = K / 32;
    for (int64_t b = 0; b < K / 256; b++, p += stride) {
        __builtin_prefetch(p + 4096), __builtin_prefetch(p + 4096 + 64);
        const float d = half(p), dmin = half(p + 2);
        uint8_t sc[8], mn[8];
        scale_min_k4(p + 4, sc, mn);
        const uint8_t *qh = p + 16, *qs = p + (five ? 48 : 16);
        for (int j = 0; j < 8; j += 2) {
            const uint8_t *q = qs + 16 * j;
            const float *xb = x + b * 256 + 32 * j;
            const int64_t sb = b * 8 + j;
            vf l0 = {}, l1 = {}, l2 = {}, l3 = {}, h0 = {}, h1 = {}, h2 = {}, h3 = {};
            for (int c = 0; c < 32; c += VW) {
                vi v = ldb(q + c), lo = v & 15, hi = v >> 4;
                if (five) {
                    vi vh = ldb(qh + c);
                    lo |= ((vh >> j) & 1) << 4, hi |= ((vh >> (j + 1)) & 1) << 4;
                }
                vf wl = tof(lo), wh = tof(hi);
                KSTEP(0) KSTEP(1) KSTEP(2) KSTEP(3)
            }
            const float dl = d * (float)sc[j], dh = d * (float)sc[j + 1];
            const float ml = dmin * (float)mn[j], mh = dmin * (float)mn[j + 1];
            KEND(0) KEND(1) KEND(2) KEND(3)
        }
    }
    FUSED_SUMS
}
#undef KSTEP
#undef KEND

/* Q6_K, fused: each group of 16 weights contributes (d sc_g) ((q - 32) . x) */
#define QSTEP(m)                                                                            \
    if (mr > m) t##m = FMA(w, ld(xb + m * ldx + c), t##m);
#define QEND(m)                                                                             \
    if (mr > m) a##m = FMA(ds, t##m, a##m);
static inline __attribute__((always_inline)) void FN(fused_row_q6k)(
    const int mr, const float *x, int64_t ldx, int64_t K, const uint8_t *p,
    float s[FUSED_ROWS]) {
    vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t b = 0; b < K / 256; b++, p += 210) {
        __builtin_prefetch(p + 4096), __builtin_prefetch(p + 4096 + 64);
        __builtin_prefetch(p + 4096 + 128), __builtin_prefetch(p + 4096 + 192);
        const uint8_t *ql = p, *qh = p + 128;
        const int8_t *scales = (const int8_t *)(p + 192);
        const float d = half(p + 208);
        for (int g = 0; g < 16; g++) {
            const int h = g / 8, r0 = 16 * (g % 8);
            const float *xb = x + b * 256 + 16 * g;
            vf t0 = {}, t1 = {}, t2 = {}, t3 = {};
            for (int c = 0; c < 16; c += VW) {
                const int r = r0 + c;
                vi lo = ldb(ql + 64 * h + r % 64);
                lo = r < 64 ? lo & 15 : lo >> 4;
                vi hi = (ldb(qh + 32 * h + r % 32) >> (2 * (r / 32))) & 3;
                vf w = tof((lo | (hi << 4)) - 32);
                QSTEP(0) QSTEP(1) QSTEP(2) QSTEP(3)
            }
            vf ds = splat(d * (float)scales[g]);
            QEND(0) QEND(1) QEND(2) QEND(3)
        }
    }
    const float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f; /* no scalar terms: Q6_K has no mins */
    FUSED_SUMS
}
#undef QSTEP
#undef QEND
#undef FUSED_SUMS

/* one weight row against mr rows of x, by the row's type */
static inline __attribute__((always_inline)) void FN(fused_any)(
    const int mr, const float *x, int64_t ldx, int64_t K, const float *xs, const uint8_t *p,
    int64_t row_bytes, int qtype, float s[FUSED_ROWS]) {
    if (qtype == Q4_K || qtype == Q5_K)
        FN(fused_row_k)(mr, x, ldx, K, xs, p, qtype, s);
    else if (qtype == Q6_K)
        FN(fused_row_q6k)(mr, x, ldx, K, p, s);
    else if (qtype == Q4_1R)
        FN(fused_row_r)(mr, x, ldx, K, xs, p, s);
    else
        FN(fused_row)(mr, x, ldx, K, xs, p, row_bytes, qtype, s);
}

static int FN(qlinear_fused)(const float *x, int64_t M, int64_t ldx, int64_t K,
                             const uint8_t *w, int64_t N, int64_t row_bytes, int qtype,
                             const float *bias, float *out, int64_t ldo, int threads) {
    const int64_t nb = K / 32;
    /* x's sums over 32: xs[m nb + b] for the K types, and for Q4_0 and Q4_1 as pairs
     * (-8 sum, 0) and (0, sum) at xs[2 (m nb + b)], fused_row's against a block's (d, m) */
    const int pairs = qtype == Q4_0 || qtype == Q4_1;
    float *xs = malloc((size_t)(M * nb * (pairs ? 2 : 1)) * sizeof(float) + 8);
    if (!xs) return -2;
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
    /* split only a call of about 50 us or more: each split call wakes the sleeping OpenMP
     * worker, which costs tens of us. At one row this leaves SmolLM2's qkv and o projections
     * on one thread and splits gate_up, down and the head. With every call split a step took
     * 12.4-14.1 ms against 10.3-10.9 ms from 100 us; from 50 us (and the prefetch above) the
     * step measured 5% faster than from 100 us without it (2026-12-03, 2 runs each). */
    int64_t work = N * K * (M + 4) / (fused_split_set ? fused_split_set : FUSED_SPLIT) + 1;
    int nt = threads < 1 ? 1 : work < threads ? (int)work : threads;
    int64_t chunk = N / (8 * nt) > 4 ? N / (8 * nt) : 4; /* dynamic: a preempted thread's
                                                              share goes to the others */
    int64_t chunks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (int64_t c = 0; c < chunks; c++) {
        float s[FUSED_ROWS];
        int64_t r = c * chunk;
        const int64_t end = (c + 1) * chunk < N ? (c + 1) * chunk : N;
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
    free(xs);
    return 0;
}

static int FN(qlinear)(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w,
                       int64_t N, int64_t row_bytes, int qtype, const float *scale,
                       const float *bias, float *out, int64_t ldo, int threads) {
    if (M <= FN(fused_rows)(qtype))
        return FN(qlinear_fused)(x, M, ldx, K, w, N, row_bytes, qtype, bias, out, ldo, threads);
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

#undef vf
#undef vi
#undef ld
#undef st
#undef ldb
#undef tof
#undef splat
#undef half
#undef FMA
#endif
