/* One ISA's copy of the kernels, included three times by quant.c under that ISA's `#pragma
 * GCC target` with SUFFIX (appended to every name here: FN), VW (floats a vector) and MR (rows
 * of x a decode-path tile) set: the vector helpers, each format family's kernels, the
 * per-type dispatch over them, then the matmul paths. */

#include "quant_simd.h"

/* ---- a few rows of x against Q4_0, Q4_1, Q8_0, Q4_1R, Q4_K, Q5_K or Q6_K blocks, fused: no
 * fp32 copy of the weight. A block of 32 contributes d * (q . x) + m * sum(x) (Q4_0: m = -8 d;
 * Q8_0: m = 0), the block sums of x computed once per call. The panel path (and the
 * reference) dequantizes first, d * q + m, and then takes the dot: the same sum reassociated,
 * so the two agree to fp32 rounding, not bit for bit. One pass over the packed bytes instead
 * of unpack, store, reload: at one row and 2 threads, SmolLM2's Q4_1 gate_up and down ran
 * 1.4-1.6x faster. */
#define FUSED_ROWS 4
/* the mr sums of a fused row: vector accumulators a0.. plus scalar terms c0.. */
#define FUSED_SUMS                                                                          \
    s[0] = FN(hsum)(a0) + c0;                                                               \
    if (mr > 1) s[1] = FN(hsum)(a1) + c1;                                                   \
    if (mr > 2) s[2] = FN(hsum)(a2) + c2;                                                   \
    if (mr > 3) s[3] = FN(hsum)(a3) + c3;

#include "quant_legacy.c"  /* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_1R */
#include "quant_kquants.c" /* Q4_K, Q5_K, Q6_K */
#include "quant_float.c"   /* F16, BF16, I8, Q4G128 */
#undef FUSED_SUMS

/* ---- the per-type dispatch: a new type adds its line here ---- */

static void FN(deq_row)(int qtype, const uint8_t *p, int64_t K, float scale, float *out) {
    switch (qtype) {
    case Q4_0: FN(deq_q4_0)(p, K, out); break;
    case Q4_1: FN(deq_q4_1)(p, K, out); break;
    case Q4_1R: FN(deq_q4_1r)(p, K / 32, 0, K / 32, out); break;
    case Q5_0: FN(deq_q5)(p, K, out, 0); break;
    case Q5_1: FN(deq_q5)(p, K, out, 1); break;
    case Q8_0: FN(deq_q8_0)(p, K, out); break;
    case Q8_0R: FN(deq_q8_0r)(p, K / 32, 0, K / 32, out); break;
    case Q4_K: FN(deq_qk)(p, K, out, 0); break;
    case Q5_K: FN(deq_qk)(p, K, out, 1); break;
    case Q6_K: FN(deq_q6_k)(p, K, out); break;
    case Q4G128: FN(deq_q4g128)(p, K, out); break;
    case F16: FN(deq_f16)(p, K, out); break;
    case BF16: FN(deq_bf16)(p, K, out); break;
    case I8: FN(deq_i8)(p, K, scale, out); break;
    }
}

/* the rows up to which a type is fused: the K types' scales cost more per block, and at 3-4
 * rows they measured level with the decode path (4096 x 4096, 2 threads: 0.96-1.06x), at one
 * row 1.2-1.5x faster and at two 1.1x */
static inline int FN(fused_rows)(int qtype) {
    if (qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0 || qtype == Q4_1R) return FUSED_ROWS;
    return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K ? 2 : 0; /* 0: the decode path */
}

/* one weight row against mr rows of x, by the row's type (those fused_rows admits) */
static inline __attribute__((always_inline)) void FN(fused_any)(
    const int mr, const float *x, int64_t ldx, int64_t K, const float *xs, const uint8_t *p,
    int64_t row_bytes, int qtype, float s[FUSED_ROWS]) {
    if (qtype == Q4_K || qtype == Q5_K)
        FN(fused_row_k)(mr, x, ldx, K, xs, p, qtype, s);
    else if (qtype == Q6_K)
        FN(fused_row_q6k)(mr, x, ldx, K, p, s);
    else if (qtype == Q4_1R)
        FN(fused_row_r)(mr, x, ldx, K, xs, p, s);
    else /* Q4_0, Q4_1, Q8_0 */
        FN(fused_row)(mr, x, ldx, K, xs, p, row_bytes, qtype, s);
}

#include "quant_gemm.c" /* row gather and the matmul paths */

#undef vf
#undef vi
#undef ld
#undef st
#undef ldb
#undef tof
#undef splat
#undef half
#undef FMA
