/* The formats with no fused kernel, in one ISA copy (quant_body.c): F16, BF16, I8 (int8
 * with a per-row scale) and Q4G128 (AWQ/GPTQ-style 4-bit groups of 128, fp32 d and m:
 * kernels/quant.py's from_groups). Each is a row's dequantization only; the decode and panel
 * paths (quant_gemm.c) do the rest. */

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
