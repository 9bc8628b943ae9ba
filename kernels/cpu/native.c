/* radixflow's native CPU kernels: fp32 loops that torch's eager ops run as several passes
 * (or, for decode attention, as many tiny matmuls). Built at first use by kernels/cpu/native.py
 * with the system C compiler (-O3 -march=native -fopenmp, linked against the OpenMP runtime
 * torch has already loaded, so both share one thread pool) and called through ctypes.
 * Every function here has a torch twin that is the reference (kernels/cpu/native.py says which);
 * tests/kernels/cpu/test_native.py holds each to it.
 *
 * Vectors are GCC vector extensions of 16 floats (one AVX-512 register; the compiler splits
 * them where the machine has narrower ones). Sums run in a fixed order per row, so results
 * do not depend on the thread count.
 *
 * KV pools are fp32, bf16, fp16 or int8 (`kv_type` 0, 1, 2, 3; --kv-cache-dtype): half-precision
 * keys and values are widened to fp32 as they are loaded (bf16 by a 16-bit shift, fp16 by the
 * F16C/AVX-512 conversion) and rounded to nearest even as they are stored, as torch's
 * conversions do; int8 pools carry one fp32 scale per (slot, KV head) in their own arrays
 * (k_scale, v_scale: num_slots x Hkv), loaded as int8 * scale and stored as
 * round(x / scale) with scale = max |x| / 127 over the head's D values
 * (kernels/kv_int8.py is the torch spec). All math stays fp32. */
#include <math.h>
#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads(void) { return 1; }
#endif

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef double vd __attribute__((vector_size(64)));  /* 8 doubles */
#define VW 16
#define BLOCK 64   /* keys per online-softmax block: a multiple of VW */
#define MAX_GROUP 8  /* query heads per KV head */
#define MAX_CHUNKS 16  /* head_dim up to 256 */

static inline vf loadv(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
static inline void storev(float *p, vf x) { memcpy(p, &x, sizeof x); }

typedef uint16_t vh __attribute__((vector_size(32)));  /* 16 bf16 */
typedef uint32_t vu __attribute__((vector_size(64)));
typedef _Float16 vhf __attribute__((vector_size(32)));  /* 16 fp16 */
typedef int8_t vb __attribute__((vector_size(16)));  /* 16 int8 */
#define KV_BYTES(kind) ((kind) == 3 ? 1 : (kind) ? 2 : 4)  /* a pool element's size */

/* 16 fp16 -> fp32: one vcvtph2ps (AVX-512) or two (F16C); GCC's generic conversion of a
 * _Float16 vector ran element by element (4x slower attention than a bf16 pool). */
static inline vf widen_fp16(const _Float16 *p) {
#if defined(__AVX512F__)
    __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    vf out;
    memcpy(&out, &x, sizeof out);
    return out;
#elif defined(__F16C__)
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    vf out;
    memcpy(&out, &lo, sizeof lo);
    memcpy((char *)&out + sizeof lo, &hi, sizeof hi);
    return out;
#else
    vhf f;
    memcpy(&f, p, sizeof f);
    return __builtin_convertvector(f, vf);
#endif
}

/* n fp32 -> fp16 rounded to nearest even (torch's .to(float16)), 16 at a time where the CPU
 * converts in vectors. */
static inline void narrow_fp16(_Float16 *out, const float *in, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) out[i] = (_Float16)in[i];
}

/* 16 pool elements from element index i of an fp32 (kind 0), bf16 (1), fp16 (2) or int8 (3,
 * unscaled: the caller multiplies by the head's scale) pool, in fp32; kind is a constant
 * where this is inlined, so each pool type gets its own loop. */
static inline vf load_kv(const void *pool, int64_t i, const int kind) {
    if (!kind) return loadv((const float *)pool + i);
    if (kind == 2) return widen_fp16((const _Float16 *)pool + i);
    if (kind == 3) {
        vb b;
        memcpy(&b, (const int8_t *)pool + i, sizeof b);
        return __builtin_convertvector(b, vf);
    }
    vh h;
    memcpy(&h, (const uint16_t *)pool + i, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

/* fp32 -> bf16 rounded to nearest even, NaN to 0xffff (a NaN), as torch's vectorized CPU
 * .to(bfloat16) gives them. */
static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* `heads` heads of D floats -> int8 with one scale each: scale = max |x| / 127, q =
 * round-half-even(x / scale) (0 where the head is all zeros), as kv_int8.quantize computes
 * them bit for bit (a division, not a multiply by 127 / max: the same rounding as torch). */
static inline void quantize_int8(int8_t *out, float *scale, const float *in, int64_t heads,
                                 int64_t D) {
    for (int64_t h = 0; h < heads; h++) {
        const float *x = in + h * D;
        float amax = 0.f;
        for (int64_t i = 0; i < D; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        const float s = amax / 127.f;
        scale[h] = s;
        for (int64_t i = 0; i < D; i++) {
            float r = s > 0.f ? nearbyintf(x[i] / s) : 0.f;
            out[h * D + i] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
        }
    }
}

/* a > b ? a : b lane by lane (b where either is NaN). Below AVX-512 GCC split the 16-lane
 * compare and select into 16 scalar compares where b is a constant (vexp_neg's clamp), so
 * there it is two vmaxps, which compute exactly this. */
static inline vf vmax(vf a, vf b) {
#if defined(__AVX__) && !defined(__AVX512F__)
    __m256 a2[2], b2[2];
    memcpy(a2, &a, sizeof a), memcpy(b2, &b, sizeof b);
    a2[0] = _mm256_max_ps(a2[0], b2[0]), a2[1] = _mm256_max_ps(a2[1], b2[1]);
    memcpy(&a, a2, sizeof a);
    return a;
#else
    vi gt = a > b;
    return (vf)(((vi)a & gt) | ((vi)b & ~gt));
#endif
}

static inline float hsum(vf x) {  /* in tree order: 4 shuffles and adds */
    x += __builtin_shuffle(x, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    x += __builtin_shuffle(x, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    x += __builtin_shuffle(x, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return x[0];
}

/* r[j] = the sum of a[j]'s lanes, for 16 vectors at once (15 two-source shuffle pairs). */
static inline vf reduce16(const vf a[VW]) {
    vf b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1],
                                 (vi){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
               __builtin_shuffle(a[2 * i], a[2 * i + 1],
                                 (vi){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1],
                                 (vi){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
               __builtin_shuffle(b[2 * i], b[2 * i + 1],
                                 (vi){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
    for (int i = 0; i < 2; i++)
        d[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1],
                                 (vi){0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
               __builtin_shuffle(c[2 * i], c[2 * i + 1],
                                 (vi){2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
    return __builtin_shuffle(d[0], d[1], (vi){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
           __builtin_shuffle(d[0], d[1], (vi){1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

/* exp(x) lane by lane for x <= 0 (clamped at -87), as Cephes' expf computes it: n the
 * nearest integer to x / ln 2, f = x - n ln 2 in two parts (exact products), then
 * 2^n * (1 + f + f^2 p(f)) with its degree-5 minimax p: within 2 ulp of exp. */
static inline vf vexp_neg(vf x) {
    x = vmax(x, (vf){0} - 87.f);
    vi n = __builtin_convertvector(x * 1.44269504f - 0.5f, vi); /* <= 0: truncation rounds up */
    vf nf = __builtin_convertvector(n, vf);
    vf f = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * (f * f) + f + 1.f;
    return (vf)((vi)p + (n << 23));
}

/* tanh lane by lane: sign(x) (1 - e) / (1 + e), e = exp(-2 |x|) */
static inline vf vtanh(vf x) {
    vi sign = (vi){0} + INT32_MIN;
    vf e = vexp_neg((vf)((vi)(x + x) | sign));
    return (vf)((vi)((1.f - e) / (1.f + e)) | ((vi)x & sign));
}

static inline float exp_neg(float x) { return vexp_neg((vf){0} + x)[0]; }

#define MAX_ROWS 64  /* query rows (heads x group) one task keeps state for */

/* A prefetch cursor over slots [row, end) of the k and v pools, `width` floats of each:
 * `advance` asks for the next cache line of both. The attention below advances it once per
 * (key, head) it scores or weighs, so the next block's loads spread over this block's work.
 * On this project's AMD EPYC (2 threads, 64 requests of 89 keys, pools cold), attention
 * took 0.68-0.75x the time of prefetching each next block in one burst at its start, and
 * 0.8x at 400 keys. */
typedef struct { const char *k, *v; int64_t ks, row, end, width, off, es; } Prefetch;

static inline void advance(Prefetch *p, int lines) {
    for (int i = 0; i < lines && p->row < p->end; i++) {
        __builtin_prefetch(p->k + (p->row * p->ks + p->off) * p->es);
        __builtin_prefetch(p->v + (p->row * p->ks + p->off) * p->es);
        p->off += 64 / p->es; /* one cache line of elements */
        if (p->off >= p->width) p->off = 0, p->row++;
    }
}

/* Query rows of NH KV heads (G rows each: q + (h * G + g) * D) over the keys of `num_runs`
 * runs of consecutive slots (run i: slots first[i] .. first[i] + count[i] - 1; slot j of
 * head h at element j * ks + h * hs of k, fp32 or, with BF, bf16), by online softmax -> out
 * (NH * G x D), lse (NH * G).
 * Keys and values are read in memory order, block by block: each slot's heads side by side,
 * every query row of a head scored (or weighted) at once; the next block, or the next run's
 * or task's first one, is prefetched meanwhile (they lie elsewhere in the pool). */
static inline __attribute__((always_inline)) void attend(
    const float *q, const void *k, const void *v, const float *ksc, const float *vsc, int64_t hs,
    int64_t ks, const int64_t *first, const int64_t *count, int64_t num_runs, int NH, const int G,
    const int C, const int BF, float scale, float cap, float *out, float *lse, int64_t next_slot,
    int64_t next_count) {
    const int R = NH * G;
    vf qs[MAX_ROWS][MAX_CHUNKS], acc[MAX_ROWS][MAX_CHUNKS], part[MAX_ROWS][VW];
    float m[MAX_ROWS], s[MAX_ROWS], p[MAX_ROWS][BLOCK] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++) {
        m[r] = -INFINITY, s[r] = 0.f;
        for (int c = 0; c < C; c++)
            acc[r][c] = (vf){0}, qs[r][c] = loadv(q + (r * C + c) * VW) * scale;
    }
    const int64_t width = (NH - 1) * hs + C * VW; /* floats of one slot's heads */
    const int64_t sks = ks / hs; /* an int8 pool's scales per slot (its KV heads) */
    for (int64_t i = 0, j0 = 0, end = 0; i < num_runs; i++)
    for (j0 = first[i], end = first[i] + count[i]; j0 < end; j0 += BLOCK) {
        int n = (int)(end - j0 < BLOCK ? end - j0 : BLOCK), nv = (n + VW - 1) / VW;
        Prefetch pf = {k, v, ks, 0, 0, width, 0, KV_BYTES(BF)};
        if (j0 + BLOCK < end)
            pf.row = j0 + BLOCK, pf.end = end - j0 - BLOCK < BLOCK ? end : j0 + 2 * BLOCK;
        else if (i + 1 < num_runs)
            pf.row = first[i + 1],
            pf.end = first[i + 1] + (count[i + 1] < BLOCK ? count[i + 1] : BLOCK);
        else if (next_count > 0)
            pf.row = next_slot, pf.end = next_slot + (next_count < BLOCK ? next_count : BLOCK);
        for (int j1 = 0; j1 < n; j1 += VW) { /* 16 keys' partial dot products, reduced */
            int nj = n - j1 < VW ? n - j1 : VW;
            for (int j = 0; j < VW; j++) {
                const int64_t slot = j0 + j1 + (j < nj ? j : 0), kj = slot * ks;
                for (int h = 0; h < NH; h++) {
                    advance(&pf, 1);
                    vf kv[MAX_CHUNKS];
                    for (int c = 0; c < C; c++) kv[c] = load_kv(k, kj + h * hs + c * VW, BF);
                    if (BF == 3) /* int8: dequantized in registers, the pool never copied */
                        for (int c = 0; c < C; c++) kv[c] *= ksc[slot * sks + h];
                    for (int g = 0; g < G; g++) {
                        const int r = h * G + g;
                        vf a = qs[r][0] * kv[0];
                        for (int c = 1; c < C; c++) a += qs[r][c] * kv[c];
                        part[r][j] = a;
                    }
                }
            }
            for (int r = 0; r < R; r++) {
                vf x = reduce16(part[r]);
                if (cap > 0.f) x = cap * vtanh(x * (1.f / cap)); /* soft-capped (Gemma 2) */
                for (int j = nj; j < VW; j++) x[j] = -INFINITY;
                storev(&p[r][j1], x);
            }
        }
        for (int r = 0; r < R; r++) {
            vf mv = loadv(p[r]);
            for (int b = 1; b < nv; b++) mv = vmax(mv, loadv(p[r] + b * VW));
            float mx = m[r];
            for (int l = 0; l < VW; l++) mx = mv[l] > mx ? mv[l] : mx;
            float corr = exp_neg(m[r] - mx);
            vf sv = {0};
            for (int b = 0; b < nv; b++) {
                vf e = vexp_neg(loadv(p[r] + b * VW) - mx);
                storev(p[r] + b * VW, e);
                sv += e;
            }
            s[r] = s[r] * corr + hsum(sv), m[r] = mx;
            if (corr != 1.f)
                for (int c = 0; c < C; c++) acc[r][c] *= corr;
        }
        for (int j = 0; j < n; j++) {
            const int64_t vj = (j0 + j) * ks;
            for (int h = 0; h < NH; h++) {
                advance(&pf, 1);
                vf vv[MAX_CHUNKS];
                for (int c = 0; c < C; c++) vv[c] = load_kv(v, vj + h * hs + c * VW, BF);
                if (BF == 3)
                    for (int c = 0; c < C; c++) vv[c] *= vsc[(j0 + j) * sks + h];
                for (int g = 0; g < G; g++) {
                    const int r = h * G + g;
                    for (int c = 0; c < C; c++) acc[r][c] += p[r][j] * vv[c];
                }
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float inv = s[r] > 0.f ? 1.f / s[r] : 0.f;
        for (int c = 0; c < C; c++) storev(out + (r * C + c) * VW, acc[r][c] * inv);
        lse[r] = s[r] > 0.f ? m[r] + logf(s[r]) : -INFINITY;
    }
}

#include "attend_tasks.h" /* decode attention: its tasks, their threads (and a team's) */

#include "rows.h" /* row ops: RMSNorm, SiLU-and-multiply, argmax; run tables */

/* One row's `heads` heads of D floats (x, out: heads D apart; out may be x): the first
 * `rotary` dims rotate by c/s (rotary floats whose halves repeat), the rest are copied. */
static inline void rope_row(const float *x, float *out, const float *c, const float *s,
                            int64_t heads, int64_t D, int64_t rotary) {
    const int64_t half = rotary / 2;
    for (int64_t h = 0; h < heads; h++) {
        const float *xh = x + h * D;
        float *oh = out + h * D;
        for (int64_t i = 0; i < half; i++) {
            const float a = xh[i], b = xh[half + i];
            oh[i] = a * c[i] - b * s[i];
            oh[half + i] = b * c[i] + a * s[i];
        }
        if (oh != xh)
            for (int64_t i = rotary; i < D; i++) oh[i] = xh[i];
    }
}

/* One row's keys and values (`width` floats each) into slot `slot` of the pools (fp32, or
 * half precision by kv_type: rounded to nearest even, or int8 with one scale per head of D
 * floats into k_scale, v_scale); returns 1 (nothing stored) when the slot is outside
 * [0, num_slots). */
static inline int64_t store_row(void *k_pool, void *v_pool, float *k_scale, float *v_scale,
                                int64_t num_slots, int64_t slot, const float *k, const float *v,
                                int64_t width, int64_t D, int kv_type) {
    if (slot < 0 || slot >= num_slots) return 1;
    if (kv_type == 3) {
        const int64_t heads = width / D;
        quantize_int8((int8_t *)k_pool + slot * width, k_scale + slot * heads, k, heads, D);
        quantize_int8((int8_t *)v_pool + slot * width, v_scale + slot * heads, v, heads, D);
        return 0;
    }
    if (!kv_type) {
        memcpy((float *)k_pool + slot * width, k, width * sizeof(float));
        memcpy((float *)v_pool + slot * width, v, width * sizeof(float));
        return 0;
    }
    if (kv_type == 2) {
        narrow_fp16((_Float16 *)k_pool + slot * width, k, width);
        narrow_fp16((_Float16 *)v_pool + slot * width, v, width);
        return 0;
    }
    uint16_t *kd = (uint16_t *)k_pool + slot * width, *vd = (uint16_t *)v_pool + slot * width;
    for (int64_t i = 0; i < width; i++) kd[i] = to_bf16(k[i]), vd[i] = to_bf16(v[i]);
    return 0;
}

/* Rotary embedding of T rows of `heads` heads (x: rows x_stride floats apart, heads D apart)
 * into out (T, heads, D) contiguous: the first `rotary` dims of each head rotate by
 * cos/sin (T, rotary) whose halves repeat (the rotate-half layout), the rest are copied.
 * With k_pool (not NULL), row t's last kv_heads heads of out (its keys, rotated) and its
 * values (v: rows v_stride floats apart, kv_heads * D floats) are also stored at slot
 * slots[t] of k_pool and v_pool (num_slots rows each; fp32, bf16, fp16 or int8 by kv_type, an
 * int8 pool's scales in k_scale, v_scale), as rf_store_kv does: one pass where rope and the
 * store were two calls. Returns the number of rows whose slot was out of range (those are not
 * stored). */
int64_t rf_rope(const float *x, int64_t x_stride, const float *cos, const float *sin, int64_t T,
                int64_t heads, int64_t D, int64_t rotary, float *out, void *k_pool,
                void *v_pool, int64_t num_slots, const int64_t *slots, int64_t kv_heads,
                const float *v, int64_t v_stride, int threads, int kv_type, float *k_scale,
                float *v_scale) {
    int64_t bad = 0, width = kv_heads * D;
#pragma omp parallel for schedule(static) num_threads(threads) if (T * heads * D >= 32768) \
    reduction(+ : bad)
    for (int64_t t = 0; t < T; t++) {
        float *row = out + t * heads * D;
        rope_row(x + t * x_stride, row, cos + t * rotary, sin + t * rotary, heads, D, rotary);
        if (k_pool)
            bad += store_row(k_pool, v_pool, k_scale, v_scale, num_slots, slots[t],
                             row + (heads - kv_heads) * D, v + t * v_stride, width, D, kv_type);
    }
    return bad;
}

/* one row of a decode step's qkv (Hkv * G query heads, then Hkv key and Hkv value heads of
 * D): q and k rotated in place, k and v stored at `slot` of the pools; -> 1 where the slot is
 * out of range (nothing stored), else 0 */
static inline int64_t rope_store_row(float *row, const float *cos, const float *sin,
                                     int64_t rotary, void *k_pool, void *v_pool,
                                     int64_t num_slots, int64_t slot, int Hkv, int G, int D,
                                     int kv_type, float *k_scale, float *v_scale) {
    const int64_t heads = (int64_t)Hkv * (G + 1);
    rope_row(row, row, cos, sin, heads, D, rotary);
    return store_row(k_pool, v_pool, k_scale, v_scale, num_slots, slot, row + (heads - Hkv) * D,
                     row + heads * D, (int64_t)Hkv * D, D, kv_type);
}

/* rf_rope_decode_attention's first half on one thread: each of the B rows of qkv (rows
 * qkv_stride floats apart) rotated and its K/V stored at slots[b]; -> the rows whose slot was
 * out of range. The decode loop's team runs it on one thread, then rf_team_attention on all. */
int64_t rf_rope_store(float *qkv, int64_t qkv_stride, const float *cos, const float *sin,
                      int64_t rotary, void *k_pool, void *v_pool, int64_t num_slots,
                      const int64_t *slots, int B, int Hkv, int G, int D, int kv_type,
                      float *k_scale, float *v_scale) {
    int64_t bad = 0;
    for (int64_t b = 0; b < B; b++)
        bad += rope_store_row(qkv + b * qkv_stride, cos + b * rotary, sin + b * rotary, rotary,
                              k_pool, v_pool, num_slots, slots[b], Hkv, G, D, kv_type, k_scale,
                              v_scale);
    return bad;
}

/* One decode step's attention of a layer from its fused qkv projection, in one call: qkv
 * (B rows qkv_stride floats apart: Hkv * G query heads, Hkv key heads, Hkv value heads of D
 * floats) has its query and key heads rotated in place by cos/sin (B, rotary), as rf_rope
 * does; each row's keys and values are stored at slots[b] of the pools (num_slots, Hkv, D),
 * as rf_store_kv does; then the rotated queries attend as rf_decode_attention does (runs,
 * scale, cap, out, lse, kv_type, k_scale, v_scale the same). Returns 0; -1 for shapes the
 * attention does not
 * take (nothing is touched then); -2 out of memory; else the number of rows whose slot was
 * out of range (nothing is attended then). */
int64_t rf_rope_decode_attention(float *qkv, int64_t qkv_stride, const float *cos,
                                 const float *sin, int64_t rotary, void *k_pool, void *v_pool,
                                 int64_t num_slots, const int64_t *slots,
                                 const int64_t *run_indptr, const int64_t *first,
                                 const int64_t *count, int B, int Hkv, int G, int D, float scale,
                                 float cap, float *out, float *lse, int threads, int kv_type,
                                 float *k_scale, float *v_scale) {
    if (D % VW || D / VW > MAX_CHUNKS || G > MAX_GROUP || G < 1) return -1;
    if (kv_type == 3 && !(k_scale && v_scale)) return -1;
    const int64_t heads = (int64_t)Hkv * (G + 1);
    int64_t bad = 0;
    if (threads > 1 && B * heads * D >= 32768) { /* a construct only where it splits */
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : bad)
        for (int64_t b = 0; b < B; b++)
            bad += rope_store_row(qkv + b * qkv_stride, cos + b * rotary, sin + b * rotary,
                                  rotary, k_pool, v_pool, num_slots, slots[b], Hkv, G, D, kv_type,
                                  k_scale, v_scale);
    } else {
        bad = rf_rope_store(qkv, qkv_stride, cos, sin, rotary, k_pool, v_pool, num_slots, slots,
                            B, Hkv, G, D, kv_type, k_scale, v_scale);
    }
    if (bad) return bad;
    const Attention a = {qkv,   qkv_stride, k_pool, v_pool, kv_type, k_scale, v_scale,
                         run_indptr, first, count, B, Hkv, G, D, scale, cap, out, lse};
    return attention_tasks(&a, threads);
}

/* pool[slots[i]] = rows[i] for n rows of `width` floats (rows row_stride floats apart), into
 * k and v pools of `num_slots` rows each (of kv_type; an int8 pool's scales, one per head of
 * D floats, in k_scale, v_scale); a slot out of range is skipped and counted. */
int64_t rf_store_kv(void *k_pool, void *v_pool, int64_t num_slots, const int64_t *slots,
                    const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t n,
                    int64_t width, int kv_type, float *k_scale, float *v_scale, int64_t D) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad += store_row(k_pool, v_pool, k_scale, v_scale, num_slots, slots[i], k + i * k_stride,
                         v + i * v_stride, width, D, kv_type);
    return bad;
}
