/* Matmul, dequantize and row gather straight from GGUF-style quantized weight blocks, so a
 * quantized model keeps its 0.5-1 byte weights in memory instead of 4-byte fp32 copies, and
 * decode (memory-bound: every weight read once per token) streams 4-8x fewer bytes.
 * Built at first use by kernels/cpu/quant.py and called through ctypes or, from the C++ decode
 * loop, through rf_qlinear's address. The torch reference is kernels/quant.py; the tests
 * (tests/kernels/test_quant.py) hold every path here to it.
 *
 * Modes: rf_qlinear's default (rf_qset_activations) or a flag in its qtype (RF_FP32_ACTS,
 * RF_INT8_ACTS) picks int8 activations (qdot.c's integer dot products, qdot_amx.c's AMX-INT8
 * tiles, quant_amx.c's single bf16 pass; see rf_qlinear) or the exact fp32 paths.
 *
 * Numerics (exact mode): activations stay fp32. A weight block is dequantized to fp32 with
 * the reference's roundings (compiled with -ffp-contract=off, so d * q + m is a product then a
 * sum, as numpy's; rf_qdequantize equals the reference bit for bit), then accumulated in fp32
 * with fma.
 *
 * Layout of the work, two paths, picked by the row count M (rf_qset_panel_rows):
 * - decode (few rows): output rows go in panels of NR = 4; a panel is dequantized into a
 *   per-thread scratch (NR x K floats, L1/L2-resident) and every row of x is dotted against it
 *   (reductions along K), MR rows at a time with MR x NR vector accumulators. Up to a few rows
 *   the types with a fused kernel dot each weight row in place instead.
 * - panel (many rows, AVX2 and AVX-512): panels of PN = 16 or 32 output rows, dequantized a
 *   K-block at a time and transposed to [k][PN], against an outer-product micro-kernel over
 *   PM rows of x (qlinear_rows).
 * Either way each weight row is read from memory once per call and dequantized once, whatever
 * M is.
 *
 * ISA: quant_body.c is included three times below, under `#pragma GCC target` for AVX-512
 * (16-float vectors), AVX2+FMA+F16C (8) and the compiler's baseline (4-float vectors: SSE2 on
 * x86-64, portable C elsewhere), each copy's functions suffixed by its ISA; rf_* pick one at
 * run time (__builtin_cpu_supports), lowered by RADIXFLOW_QUANT_ISA=avx2|scalar or
 * rf_qset_isa. The library is built without -march=native, so the baseline copy runs
 * anywhere.
 *
 * Files: this one holds the type codes, the helpers every copy shares, the copies and the
 * exported rf_* API. A copy (quant_body.c) is quant_simd.h's vector helpers, one file per
 * format family (quant_legacy.c: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_1R; quant_kquants.c: Q4_K,
 * Q5_K, Q6_K; quant_float.c: F16, BF16, I8, Q4G128), each a row's dequantization (deq_*) and
 * any fused few-row kernels, the per-type dispatch, and the paths over any type
 * (quant_gemm.c: gather, fused, decode, panel).
 *
 * Adding a quant type: its code in the enum below (kernels/quant.py's) and its line in
 * block_of; its deq_<type> (and any fused kernel) in its family's file, or a new file included
 * by quant_body.c; its line in quant_body.c's deq_row (and, for a fused kernel, in fused_rows
 * and fused_any). That gives it every exact path; the int8 paths take it where qdot.c's
 * idot_type (and qdot_amx.c's amxi_type) name it. The reference (kernels/quant.py: BLOCK,
 * NAMES, its dequantization) and the tests' type list (tests/kernels/test_quant.py) hold it to
 * the spec. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QUANT_X86 1
#endif

enum {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13,
    Q6_K = 14, BF16 = 30, I8 = 1000, Q4G128 = 1001, Q4_1R = 1002, Q8_0R = 1003,
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
    case Q8_0: case Q8_0R: *size = 32, *bytes = 34; return;
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
    /* their layouts span the row */
    if ((qtype == Q4_1R || qtype == Q8_0R) && row_bytes != K / 32 * bytes) return 0;
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

#ifdef QUANT_X86
/* The int8 paths (not exact by design) flush denormal results to zero and read denormal
 * inputs as zero (MXCSR FTZ and DAZ) on every thread of a call, then restore the caller's
 * mode: a denormal costs a microcode assist per vector instruction (a 7B random-weight
 * model's 16-row decode step took 1.2 s with them, 0.84 s without), and values below 1e-38
 * are far under the 8-bit rounding of the activations. The exact paths keep IEEE denormals. */
static inline unsigned denormals_off(void) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
    return csr;
}
#endif

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

#define TEAM_MAX_K 32768 /* longest row a team call takes (its block sums on the stack) */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUFFIX) /* a copy's names: deq_row_avx512, deq_row_avx2, .. */

#ifdef QUANT_X86
#include "quant_x24.c" /* Q4_1R against x in 24-bit fixed point (AVX512-VNNI), near-exact */
#include "quant_x24_avx2.c" /* the same on AVX2 (maddubs), Q4_1R */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#define SUFFIX _avx512
#define VW 16
#define MR 4
#include "quant_body.c"
#undef SUFFIX
#undef VW
#undef MR
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define SUFFIX _avx2
#define VW 8
#define MR 2
#include "quant_body.c"
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
#include "quant_body.c"
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

/* qtype may carry RF_FP32_ACTS (the exact path: fp32 activations and fp32 sums throughout),
 * RF_TILES_ACTS (fp32 activations; from rf_qset_amx_rows rows the bf16x3 tile products,
 * within a few 1e-6 of the exact sums: `auto`'s choice for the 32-block types) or
 * RF_INT8_ACTS (the integer path where it applies: qdot.c); with none, rf_qset_activations's
 * default (its fp32 mode takes the tiles, as RF_TILES_ACTS). Why two fp32 flags: through a
 * model the tiles' error grows, past 1e-4 of the logits in small random ones, and the
 * explicit exact mode promises that bound. */
#define RF_FP32_ACTS 0x10000
#define RF_INT8_ACTS 0x20000
#define RF_TILES_ACTS 0x40000
#define RF_BATCH_ACTS 0x80000
#define RF_ACTS (RF_FP32_ACTS | RF_INT8_ACTS | RF_TILES_ACTS | RF_BATCH_ACTS)
/* RF_BATCH_ACTS (`auto` for a big model's 32-block types): RF_TILES_ACTS up to the fused
 * kernels' rows (a decode of 2-4 streams: exact, and the integer path measured no faster
 * there), RF_INT8_ACTS above (batches and prefill: 7B Q4_0, 16 streams, 1.9x the exact).
 * One row of Q4_0, Q4_1, Q5_0 or Q5_1 takes the integer path on every instruction set that
 * has one (4096 x 11008, 2 threads: an AMD EPYC, AVX2, Q4_0 0.90-0.99 ms on qdot_row32.c
 * against the exact kernel's 1.56-1.69, Q5_0 or Q5_1 on the row kernels 1.7-1.8 ms against
 * 4.0; an Intel Xeon without AMX, AVX512-VNNI, Q4_0 1.32-1.45 ms on qdot_row32_zmm.c
 * against 1.76-1.88, Q5_0 2.3 against 4.7, Q5_1 3.1 against 5.4). At 2-4 rows AVX512-VNNI
 * takes it for Q5_0 and Q5_1 (the row kernels, 1.1-1.7x the exact at 2 and 4 rows; Q4_0
 * level there), AVX2 from 2 rows for the 4- and 5-bit types' panels (qdot_gemm8_32.c: Q4_0
 * at 2 rows 2.1 ms, the exact 2.3-2.7). Q8_0 stays exact (its row kernel 1.65 ms, the exact
 * 1.63 on the EPYC; 3.15 against 2.75 on the Xeon). qtype without its flags. */
static int acts_for_rows(int acts, int qtype, int64_t M) {
    if (acts != RF_BATCH_ACTS) return acts;
    if (M > FUSED_ROWS) return RF_INT8_ACTS;
#ifdef QUANT_X86
    const int int_isa = rf_qset_int_isa(-1), five = qtype == Q5_0 || qtype == Q5_1;
    if (int_isa >= 0 && (M == 1 ? qtype == Q4_0 || qtype == Q4_1 || five
                         : int_isa == IDOT_VNNI512 ? five
                                                   : g8b_type(qtype) && M >= gemm8_rows(qtype)))
        return RF_INT8_ACTS;
#else
    (void)qtype;
#endif
    return RF_TILES_ACTS;
}
/* quant_x24.c's path: on (1, the default; RADIXFLOW_QUANT_X24=0 starts it off) or off (0)
 * for every caller in this process; a negative value only asks */
static int x24_on = -1;
int rf_qset_x24(int on) {
    if (on >= 0) x24_on = on > 0;
    if (x24_on < 0) {
        const char *env = getenv("RADIXFLOW_QUANT_X24");
        x24_on = !(env && !strcmp(env, "0"));
    }
    return x24_on;
}

/* 1 where a fused call of M rows of a qtype (flags removed) under the resolved activation
 * flag `acts` takes the fixed-point kernels: quant_x24.c's (Q4_1R or Q8_0R, AVX-512 with
 * VNNI) or quant_x24_avx2.c's (Q4_1R, the AVX2 path); 1-4 rows, activations fp32 but not the
 * explicit exact mode (RF_FP32_ACTS, or no flag under the fp32 default) */
static int x24_for(int acts, int qtype, int64_t M) {
#ifdef QUANT_X86
    if ((qtype != Q4_1R && qtype != Q8_0R) || M < 1 || M > FUSED_ROWS || !rf_qset_x24(-1))
        return 0;
    const int avx2 = isa() == ISA_AVX2 && qtype == Q4_1R; /* quant_x24_avx2.c's */
    if (!avx2 && (isa() != ISA_AVX512 || rf_qset_int_isa(-1) != IDOT_VNNI512)) return 0;
    if (acts == RF_FP32_ACTS || acts == RF_INT8_ACTS) return 0;
    return acts ? 1 : rf_qset_activations(-1) == 2;
#else
    (void)acts, (void)qtype, (void)M;
    return 0;
#endif
}

#ifdef QUANT_X86
/* 1 where a call under the resolved activation flag `acts` (0: the process default) has int8
 * activations: --quantized-activations int8, or auto's K types */
static int int8_acts(int acts, int qtype) {
    const int mode = rf_qset_activations(-1); /* 2 (auto): int8 for the K types only */
    const int k_type = qtype == Q4_K || qtype == Q5_K || qtype == Q6_K;
    return acts ? acts == RF_INT8_ACTS : mode == 1 || (mode == 2 && k_type);
}

/* rf_qlinear's int8 path for M rows of qtype (flags removed): 1 bf16 tiles, 2 integer dot
 * products, 3 int8 tiles, 0 an exact path (not int8, or no int8 path for it). Int8 mode (not
 * exact): from rf_qset_amx_bf16_rows rows bf16 tile products alone; up to the integer dot
 * products' row limit those; between, int8 tile products (AMX-INT8). */
static int int8_path(int acts, int qtype, int64_t M, int64_t K) {
    if (!int8_acts(acts, qtype)) return 0;
    const int amx_int = isa() == ISA_AVX512 && amxi_type(qtype) && rf_qset_amx_int_rows(-1) > 0;
    if (isa() == ISA_AVX512 && rf_qset_amx_rows(-1) > 0 && K % 32 == 0 &&
        M >= rf_qset_amx_bf16_rows(-1))
        return 1;
    if (isa() >= ISA_AVX2 && idot_type(qtype) && M <= int_rows_for(qtype, amx_int) &&
        rf_qset_int_isa(-1) >= 0)
        return 2;
    return amx_int && M >= rf_qset_amx_int_rows(-1) ? 3 : 0;
}
#endif

int rf_qlinear(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w, int64_t N,
               int64_t row_bytes, int qtype, const float *scale, const float *bias, float *out,
               int64_t ldo, int threads) {
    const int acts = acts_for_rows(qtype & RF_ACTS, qtype & ~RF_ACTS, M);
    qtype &= ~RF_ACTS;
    if (!valid(qtype, K, row_bytes, scale) || M < 0 || N < 0) return -1;
    if (M == 0 || N == 0) return 0;
    int rows = panel_rows_set ? panel_rows_set : PANEL_ROWS[isa()];
#ifdef QUANT_X86
    const int path = int8_path(acts, qtype, M, K);
    if (path) {
        const unsigned csr = denormals_off(); /* this thread's; each path sets its workers' */
        const int status =
            path == 1 ? qlinear_amx(x, M, ldx, K, w, N, row_bytes, qtype, scale, bias, out, ldo,
                                    threads, 0)
            : path == 2 ? qlinear_int(x, M, ldx, K, w, N, row_bytes, qtype, bias, out, ldo,
                                      threads)
                        : qlinear_amx_int(x, M, ldx, K, w, N, row_bytes, qtype, bias, out, ldo,
                                          threads);
        _mm_setcsr(csr);
        return status;
    }
#else
    (void)acts;
#endif
    const int x24 = x24_for(acts, qtype, M);
    switch (isa()) {
#ifdef QUANT_X86
    case ISA_AVX512:
        if (acts != RF_FP32_ACTS && M >= rf_qset_amx_rows(-1) && rf_qset_amx_rows(-1) > 0 &&
            K % 32 == 0)
            return qlinear_amx(x, M, ldx, K, w, N, row_bytes, qtype, scale, bias, out, ldo,
                               threads, 1);
        if (M >= rows)
            return qlinear_rows_avx512(x, M, ldx, K, w, N, row_bytes, qtype, scale, bias, out,
                                       ldo, threads);
        return qlinear_avx512(x, M, ldx, K, w, N, row_bytes, qtype, scale, bias, out, ldo, threads,
                              x24);
    case ISA_AVX2:
        if (M >= rows)
            return qlinear_rows_avx2(x, M, ldx, K, w, N, row_bytes, qtype, scale, bias, out, ldo,
                                     threads);
        return qlinear_avx2(x, M, ldx, K, w, N, row_bytes, qtype, scale, bias, out, ldo, threads,
                            x24);
#endif
    default:
        (void)x24;
        return qlinear_base(x, M, ldx, K, w, N, row_bytes, qtype, scale, bias, out, ldo, threads,
                            0);
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

/* ---- a team: one OpenMP parallel region around a sequence of small calls ----
 * A decode step of a small model is some 240 calls of 1-20 us each; a parallel region per
 * call costs its fork and join every time (and leaves the calls too small to split on one
 * thread). The C++ decode loop instead runs a whole step in one region (rf_team_run): every
 * thread walks the same layers, shares each projection's rows (rf_qteam_linear), and waits at
 * rf_team_barrier where one output is the next call's input. Without OpenMP a team is the
 * calling thread alone and the barrier does nothing. */

/* fn(ctx) on each of `threads` threads (the caller's OpenMP team), returning when all have */
void rf_team_run(int threads, void (*fn)(void *), void *ctx) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    fn(ctx);
}

/* inside rf_team_run: wait for the team's other threads */
void rf_team_barrier(void) {
#pragma omp barrier
}

/* inside rf_team_run: this thread's number (0 the caller's) and the team's size */
int rf_team_thread(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static int team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* 1 where rf_qteam_linear takes an rf_qlinear call of these arguments (qtype with its
 * activation flags): the exact fused path (fp32 activations, a type with a fused kernel for
 * M rows) or the integer dot products' row kernels (int8 activations, below their panels'
 * rows), whose per-row sums rf_qlinear computes alike; 0 for anything else */
int rf_qteam_takes(int64_t M, int64_t K, int qtype, int64_t row_bytes, const float *scale) {
    const int acts = acts_for_rows(qtype & RF_ACTS, qtype & ~RF_ACTS, M);
    qtype &= ~RF_ACTS;
    if (!valid(qtype, K, row_bytes, scale) || scale || M < 1 || K > TEAM_MAX_K) return 0;
#ifdef QUANT_X86
    if (int8_acts(acts, qtype)) return int8_path(acts, qtype, M, K) == 2 && !int_panels(qtype, M);
    if (x24_for(acts, qtype, M)) return 1; /* Q8_0R has no fused fp32 kernel: x24's only */
    switch (isa()) {
    case ISA_AVX512: return M <= fused_rows_avx512(qtype);
    case ISA_AVX2: return M <= fused_rows_avx2(qtype);
    }
#else
    (void)acts;
#endif
    return M <= fused_rows_base(qtype);
}

/* rf_qlinear(..., threads) of a call rf_qteam_takes, by every thread of an rf_team_run,
 * each computing a share of the N output rows; no wait at the end (rf_team_barrier) */
void rf_qteam_linear(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w,
                     int64_t N, int64_t row_bytes, int qtype, const float *bias, float *out,
                     int64_t ldo) {
    const int acts = acts_for_rows(qtype & RF_ACTS, qtype & ~RF_ACTS, M);
    qtype &= ~RF_ACTS;
    const int x24 = x24_for(acts, qtype, M);
    const int nt = team_size();
#ifdef QUANT_X86
    if (int8_acts(acts, qtype)) { /* the integer row kernels (rf_qteam_takes took it so) */
        qlinear_int_team(x, M, ldx, K, w, N, row_bytes, qtype, bias, out, ldo, nt);
        return;
    }
#endif
    switch (isa()) {
#ifdef QUANT_X86
    case ISA_AVX512:
        qlinear_team_avx512(x, M, ldx, K, w, N, row_bytes, qtype, bias, out, ldo, nt, x24);
        return;
    case ISA_AVX2:
        qlinear_team_avx2(x, M, ldx, K, w, N, row_bytes, qtype, bias, out, ldo, nt, x24);
        return;
#endif
    default: (void)x24, qlinear_team_base(x, M, ldx, K, w, N, row_bytes, qtype, bias, out, ldo, nt, 0);
    }
}
