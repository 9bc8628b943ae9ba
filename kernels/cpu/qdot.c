/* Rows of x against quantized weight blocks with 8-bit integer dot products: x is
 * quantized per block to int8 (once a call), each weight block's integers are multiplied
 * against it in int32 (AVX512-VNNI or AVX-VNNI `vpdpbusd`, AVX2 `maddubs`), and only a block's
 * sum is scaled in fp32. Included by quant.c on x86 (rf_qlinear takes it for up to
 * rf_qset_int_rows rows unless rf_qset_activations(0) asks for the exact fp32 path).
 *
 * Why: a 7B decode step is bound by the instructions a weight costs, not only by the bytes.
 * The fp32 path converts every weight to a float and spends one fma on it per row of x; here
 * 32 weights cost one unpack and one integer dot (plus one fp32 fma a block), as in llama.cpp's
 * Q8 paths, so the step runs at the memory's speed.
 *
 * Numerics: the activations as the reference `radixflow.kernels.quant.quantize_activations`
 * rounds them (blocks of 32 for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, as llama.cpp's Q8_0; blocks of 256
 * with sums over 16 for Q4_K/Q5_K/Q6_K, as its Q8_K): d = max|x| / 127, q = round-to-even(x / d).
 * Every integer product and sum is exact, so the result is the exact product of the
 * dequantized weights with the dequantized activations up to the fp32 roundings of the block
 * scales and the sums (`linear_int8_reference` in the reference, held to ~1e-5 relative).
 *
 * ISA: qdot_body.c is included three times below, for AVX512-VNNI (256-bit `vpdpbusd` from
 * AVX512-VL), AVX-VNNI and plain AVX2 (`maddubs` + `madd`, exact here: a pair of weight x
 * activation products stays below 2^15 for every type, |w| <= 128 after Q8_0's sign trick). */

enum { IDOT_AVX2 = 0, IDOT_AVXVNNI = 1, IDOT_VNNI512 = 2 };
#define IDOT_ROWS 4  /* rows of x a weight block is unpacked for */
/* rows of x up to which rf_qlinear takes this path by default. Against the fp32 paths
 * (fused rows, then panel path from 16 rows) the K types' row kernels (an fp32 fma a
 * 256-block and row) gain up to 16 rows (1.2-1.4x at 16, 2.5-3x at one row; the panels
 * take them further, below and on AVX512-VNNI); where AMX-INT8 takes the rows
 * above, its tiles win from 8 rows (at 8: 1.1x this path's time). The 32-block types pay an
 * fp32 fma a block: level with the fused fp32 kernels at one to four rows (Q4_0 0.83 against
 * 0.81 ms, Q8_0 0.74 against 0.75, Q4_1 1.40 against 0.78 on Q4_1R: 4096 x 4096, 2 threads
 * of this project's Xeon), 0.65x at 16; so int8 mode takes them here up to 4 rows, and
 * --quantized-activations auto keeps them on the exact paths.
 * On AVX512-VNNI the K types take qdot_gemm.c's panels from INT_GEMM_ROWS, and stay here:
 * without AMX-INT8 (AMD Zen 4; RADIXFLOW_QUANT_AMX=0) at every row count (7B's layer shapes,
 * one thread of this project's Xeon, AMX off: 2.1x the row kernels' speed at 16 rows, 2.8x /
 * 2.6x / 2.5x the fp32 panel path's at 32 / 64 / 256); with it up to 63 rows, below the bf16
 * pass (AMX on: 1.55x AMX-INT8's speed at 9 rows, 1.2x at 16, 1.1x at 32 and 63).
 * The 32-block types take qdot_gemm32.c's panels from INT_GEMM_ROWS on AVX512-VNNI too:
 * without AMX-INT8 at every row count, with it up to 63 rows for the types with a minimum
 * (Q4_1, Q4_1R, Q5_1) and up to 40 for the others (Q4_0, Q5_0, Q8_0), whose tiles are
 * cheaper. 7B's shapes (K x N = 4096 x 4096, 4096 x 11008, 11008 x 4096), one thread of
 * this project's Xeon, thread CPU time, medians of 7 interleaved runs, panels against:
 * the exact paths (what int8 mode ran above 4 rows without AMX), Q4_0: 2.5-2.9x at 5 rows,
 * 2.6-3.1x at 16, 2.5-2.7x at 40, 2.5-2.7x at 63; the row kernels 3x at 5; AMX-INT8 tiles,
 * Q4_0: 1.9-2.1x at 5, 1.6-1.8x at 8, 1.1-1.2x at 16 and 24, 0.95-1.04x at 32, 1.03-1.14x
 * at 40, 0.89-0.98x at 48, 0.84-0.87x at 63; Q8_0: 2.1-2.3x at 5, 1.06-1.21x at 40,
 * 0.92-1.06x at 48, 0.88-0.93x at 63; Q5_0: 1.01-1.05x at 40, 0.83-0.85x at 63; Q4_1R:
 * 1.8-2.0x at 5, 1.28-1.36x at 40, 1.04-1.11x at 63; Q4_1: 1.05-1.08x at 63; Q5_1:
 * 1.05-1.11x at 63 (`python -m radixflow.bench.qdot_panels Q4_0 7`, 2026-12-06). */
#define INT_ROWS_K_AMX 8
#define INT_ROWS_K_GEMM (1 << 30)
#define INT_ROWS_K_GEMM_AMX 63
#define INT_ROWS_32 4
#define INT_ROWS_32_GEMM (1 << 30)
#define INT_ROWS_32_GEMM_AMX 40  /* Q4_0, Q5_0, Q8_0 */
#define INT_ROWS_32M_GEMM_AMX 63 /* Q4_1, Q4_1R, Q5_1 */
/* rows from which AVX512-VNNI takes the panels (qdot_gemm.c, qdot_gemm32.c) instead of the
 * row kernels (which unpack a weight row per 4 rows of x): K types level at 5 rows, 1.3-1.5x
 * at 8; 32-block types 3x at 5 */
#define INT_GEMM_ROWS 5
/* AVX2 (and AVX-VNNI) take qdot_gemm8.c's panels for the K types from these rows, the row
 * kernels below; and the K types on the integer path at every row count (no AMX there):
 * the panels ran 1.7-2x the row kernels' speed at 256 rows, which level with the fp32
 * panels at about 128. 4096 x 11008, 2 threads of an AMD EPYC (Zen 3), panels against the
 * row kernels, Q4_K: 0.6x at 1 row, 1.1x at 8, 1.3x at 16, 1.4x at 32, 1.8x at 256; Q6_K:
 * 0.6x, 1.0x, 1.3x, 1.4x, 2.0x. */
#define INT_GEMM8_ROWS 8
/* and the 32-block types with 4- or 5-bit quants (qdot_gemm8_32.c) from 2 rows, the int8
 * mode's row kernels below (Q4_0, 4096 x 11008, the same machine: panels 1.3x the row kernels
 * at 2 rows, 1.4x at 3, 1.5x at 4, 1.9x at 8, 2.3x at 16, 2.9x at 256; Q4_1 1.1x, 1.3x at 2,
 * 3 rows; Q5_0, Q5_1 1.1x, 1.3x; Q4_1R 1.2x at 4, 1.6x at 8, 2.1x, 2.7x; at one row the row
 * kernels win: 0.6-0.95x); Q8_0 keeps its row kernels (above 4 rows the exact paths) */
#define INT_GEMM8_ROWS_32 2
static int gemm_rows_set = 0;
/* Rows from which the integer path runs the panels (qdot_gemm.c, qdot_gemm32.c on
 * AVX512-VNNI; qdot_gemm8.c for the K types below it) instead of the row kernels: rows > 0
 * sets it, 0 restores the defaults (then returns AVX512-VNNI's), a negative value only asks. */
int rf_qset_int_gemm_rows(int rows) {
    if (rows >= 0) gemm_rows_set = rows;
    return gemm_rows_set ? gemm_rows_set : INT_GEMM_ROWS;
}
static int act_mode = -1;  /* 0 fp32 activations (exact), 1 int8, 2 auto */
static int idot_level = -1;
static int int_rows_set = 0;

/* x quantized: per row, K int8 (q), then per block d (float) and, for 32-blocks, s = d * sum(q)
 * (floats), for 256-blocks the sums of q over 16 (int16) */
typedef struct {
    int8_t *q;
    float *d, *s;
    int16_t *bs;
    int64_t K, nb; /* nb blocks a row */
} acts_t;

static inline int idot_type(int qtype) {
    return qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1 ||
           qtype == Q8_0 || qtype == Q4_1R || qtype == Q4_K || qtype == Q5_K ||
           qtype == Q6_K;
}
static inline int idot_block(int qtype) {
    return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K ? 256 : 32;
}

/* the offset subtracted from the u8 values (Q4_0, Q5_0, Q8_0), else 0 (m * sum instead) */
static inline int g32_offset(int qtype) {
    return qtype == Q4_0 ? 8 : qtype == Q5_0 ? 16 : qtype == Q8_0 ? 128 : 0;
}

static inline int gemm8_rows(int qtype) {
    return gemm_rows_set ? gemm_rows_set : idot_block(qtype) == 256 ? INT_GEMM8_ROWS : INT_GEMM8_ROWS_32;
}

/* Q4_K / Q5_K: a block's 12 bytes of 6-bit scales and mins (at s) as 8 bytes each. As words
 * a, b, c: sc 0..3 = a & 63, mn 0..3 = b & 63, sc 4..7 = low nibbles of c with a's top 2 bits
 * above, mn 4..7 = high nibbles of c with b's top 2 bits. */
static inline void k4_packed(const uint8_t *s, uint64_t *scales, uint64_t *mins) {
    const uint32_t wa = rd32(s), wb = rd32(s + 4), wc = rd32(s + 8);
    *scales = (uint64_t)(wa & 0x3f3f3f3f) |
              (uint64_t)((wc & 0x0f0f0f0f) | ((wa >> 2) & 0x30303030)) << 32;
    *mins = (uint64_t)(wb & 0x3f3f3f3f) |
            (uint64_t)(((wc >> 4) & 0x0f0f0f0f) | ((wb >> 2) & 0x30303030)) << 32;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#define IDOT_SUFFIX _vnni512
#define IDOT(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#define IDOT_ZMM 1 /* Q4_K and Q5_K on 512-bit vectors (vpdpwssd) */
#include "qdot_body.c"
#undef IDOT_ZMM
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avxvnni,avx2,fma,f16c")
#define IDOT_SUFFIX _avxvnni
#define IDOT(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#include "qdot_body.c"
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define IDOT_SUFFIX _avx2i
#define IDOT(acc, u, s)                                                                    \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#include "qdot_body.c"
#pragma GCC pop_options

/* The best integer instructions the CPU has; probed once (CPUID traps to the hypervisor in
 * a VM, tens of microseconds, and this is asked on every integer call). */
static int idot_best(void) {
    static int best = -1;
    if (best >= 0) return best;
    __builtin_cpu_init();
    unsigned a, b, c, d;
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw"))
        best = IDOT_VNNI512;
    else if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 4)))
        best = IDOT_AVXVNNI;
    else
        best = IDOT_AVX2;
    return best;
}

/* The integer path's instructions: 2 AVX512-VNNI, 1 AVX-VNNI, 0 AVX2 maddubs; `want` >= 0
 * lowers it (to the best the CPU has at most), a negative want only asks. -1 where the CPU
 * has no AVX2 (then the path is never taken). */
int rf_qset_int_isa(int want) {
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return -1;
    int best = idot_best();
    if (want >= 0 || idot_level < 0) idot_level = want >= 0 && want < best ? want : best;
    return idot_level;
}

/* The default of a call that names no mode: 2 auto (int8 for the K types, fp32 for the
 * others: --quantized-activations auto; the default), 1 int8, 0 fp32 (exact), or
 * RADIXFLOW_QUANT_ACTIVATIONS=auto|int8|fp32; a negative mode only asks. */
int rf_qset_activations(int mode) {
    if (mode >= 0) act_mode = mode > 2 ? 2 : mode;
    if (act_mode < 0) {
        const char *env = getenv("RADIXFLOW_QUANT_ACTIVATIONS");
        act_mode = !env ? 2 : !strcmp(env, "fp32") ? 0 : !strcmp(env, "int8") ? 1 : 2;
    }
    return act_mode;
}

/* Rows of x up to which rf_qlinear takes the integer path, for every type: rows > 0 sets it,
 * 0 restores the per-type defaults (then returns the K types'), a negative value only asks. */
int rf_qset_int_rows(int rows) {
    if (rows >= 0) int_rows_set = rows;
    return int_rows_set ? int_rows_set : INT_ROWS_K_GEMM;
}

static inline int int_rows_for(int qtype, int amx_int) {
    if (int_rows_set) return int_rows_set;
    const int gemm = rf_qset_int_isa(-1) == IDOT_VNNI512;
    if (idot_block(qtype) != 256)
        return !gemm      ? (amx_int || !g8b_type(qtype) ? INT_ROWS_32 : INT_ROWS_32_GEMM)
               : !amx_int ? INT_ROWS_32_GEMM
               : qtype == Q4_1 || qtype == Q4_1R || qtype == Q5_1 ? INT_ROWS_32M_GEMM_AMX
                                                                   : INT_ROWS_32_GEMM_AMX;
    if (amx_int) return gemm ? INT_ROWS_K_GEMM_AMX : INT_ROWS_K_AMX;
    return INT_ROWS_K_GEMM; /* the panels of every ISA */
}

static int qlinear_int(const float *x, int64_t M, int64_t ldx, int64_t K, const uint8_t *w,
                       int64_t N, int64_t row_bytes, int qtype, const float *bias, float *out,
                       int64_t ldo, int threads) {
    switch (rf_qset_int_isa(-1)) {
    case IDOT_VNNI512:
        return qlinear_int_vnni512(x, M, ldx, K, w, N, row_bytes, qtype, bias, out, ldo, threads);
    case IDOT_AVXVNNI:
        return qlinear_int_avxvnni(x, M, ldx, K, w, N, row_bytes, qtype, bias, out, ldo, threads);
    default:
        return qlinear_int_avx2i(x, M, ldx, K, w, N, row_bytes, qtype, bias, out, ldo, threads);
    }
}

/* qlinear_int's row kernels by every thread of a team (qdot_body.c: qlinear_int_team) */
static void qlinear_int_team(const float *x, int64_t M, int64_t ldx, int64_t K,
                             const uint8_t *w, int64_t N, int64_t row_bytes, int qtype,
                             const float *bias, float *out, int64_t ldo, int nt) {
    switch (rf_qset_int_isa(-1)) {
    case IDOT_VNNI512:
        qlinear_int_team_vnni512(x, M, ldx, K, w, N, row_bytes, qtype, bias, out, ldo, nt);
        return;
    case IDOT_AVXVNNI:
        qlinear_int_team_avxvnni(x, M, ldx, K, w, N, row_bytes, qtype, bias, out, ldo, nt);
        return;
    default: qlinear_int_team_avx2i(x, M, ldx, K, w, N, row_bytes, qtype, bias, out, ldo, nt);
    }
}

/* 1 where qlinear_int takes its panels for M rows of qtype (not the row kernels) */
static int int_panels(int qtype, int64_t M) {
    switch (rf_qset_int_isa(-1)) {
    case IDOT_VNNI512: return int_panels_vnni512(qtype, M);
    case IDOT_AVXVNNI: return int_panels_avxvnni(qtype, M);
    default: return int_panels_avx2i(qtype, M);
    }
}

/* x quantized as the integer path does (for the tests: q (M, K) int8, d (M, K / block) fp32);
 * block 32 or 256 */
int rf_qquantize_acts(const float *x, int64_t M, int64_t ldx, int64_t K, int block, int8_t *q,
                      float *d) {
    if ((block != 32 && block != 256) || K % block || rf_qset_int_isa(-1) < 0) return -1;
    acts_t a;
    if (acts_avx2i(x, M, ldx, K, block, &a)) return -2;
    memcpy(q, a.q, (size_t)(M * K));
    memcpy(d, a.d, (size_t)(M * (K / block)) * sizeof(float));
    free(a.q);
    return 0;
}
