/* GGUF's 32-weight block types, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, and Q4_1R and Q8_0R (Q4_1
 * and Q8_0 with a row's d's (m's) and quants apart: kernels/quant.py's repack), in one ISA copy
 * (quant_body.c): each type's dequantization of a row (the reference's formulas), then the
 * fused few-row kernels of Q4_0, Q4_1, Q8_0 (fused_row, fused_pair) and Q4_1R (fused_row_r).
 * Q5_0 and Q5_1 have none: a few rows of them take the decode path (quant_gemm.c). */

/* ---- one row of K weights (K / 32 blocks) -> fp32 ---- */

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

/* Q8_0R (kernels/quant.py): blocks b0 .. b0 + count of a row of nb, its d's then its bytes */
static inline void FN(deq_q8_0r)(const uint8_t *row, int64_t nb, int64_t b0, int64_t count,
                                 float *out) {
    for (int64_t b = b0; b < b0 + count; b++, out += 32) {
        const float d = half(row + 2 * b);
        for (int c = 0; c < 32; c += VW) st(out + c, tof(FN(ldsb)(row + 2 * nb + 32 * b + c)) * d);
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

/* ---- fused: a few rows of x against one weight row (quant_body.c's FUSED_ROWS) ---- */

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
