/* Row kernels (included by native.c, after its vector helpers): RMSNorm with the residual add,
 * SiLU-and-multiply, each row's argmax, and the run table of a decode step's keys. */

/* hidden_out = x + residual (when residual is not NULL; else x is the input), then
 * out = weight * (h * 1 / sqrt(mean(h^2) + eps)), row by row, the mean taken in double (in
 * fp32 it moved SmolLM2's logits 1.2e-4 from float64 transformers on a test prompt, twice
 * as far as torch's cascade sum did). x, residual: rows
 * x_stride / r_stride floats apart; hidden_out, out contiguous (rows x dim). */
static inline void rms_norm_row(const float *x, int64_t x_stride, const float *residual,
                                int64_t r_stride, const float *weight, float eps, int64_t r,
                                int64_t dim, float *hidden_out, float *out) {
    {
        const float *xr = x + r * x_stride;
        float *hr = residual ? hidden_out + r * dim : NULL, *orow = out + r * dim;
        vd sq[2] = {{0}, {0}}; /* the squares summed in double, lane by lane */
        int64_t i = 0;
        for (; i + VW <= dim; i += VW) {
            vf h = loadv(xr + i);
            if (hr) h += loadv(residual + r * r_stride + i), storev(hr + i, h);
            for (int half = 0; half < 2; half++) {
                vf8 part;
                memcpy(&part, (const float *)&h + half * 8, sizeof part);
                vd d = __builtin_convertvector(part, vd);
                sq[half] += d * d; /* exact products: an FMA here rounds as the add alone */
            }
        }
        double total = 0.0;
        for (int l = 0; l < VW; l++) total += sq[l / 8][l % 8];
        for (; i < dim; i++) {
            float h = xr[i] + (hr ? residual[r * r_stride + i] : 0.f);
            if (hr) hr[i] = h;
            total += (double)h * h;
        }
        const float *src = hr ? hr : xr;
        float inv = (float)(1.0 / sqrt(total / (double)dim + eps)); /* summed in double */
        for (i = 0; i + VW <= dim; i += VW) storev(orow + i, loadv(weight + i) * (loadv(src + i) * inv));
        for (; i < dim; i++) orow[i] = weight[i] * (src[i] * inv);
    }
}

/* A parallel construct is entered only where it splits: one whose `if` is false still makes
 * an OpenMP team, and inside another region (the decode loop's team path) a fresh one each
 * time, about 0.6 us a call, 5 calls a layer of a one-row step. */
void rf_rms_norm(const float *x, int64_t x_stride, const float *residual, int64_t r_stride,
                 const float *weight, float eps, int64_t rows, int64_t dim, float *hidden_out,
                 float *out, int threads) {
    if (threads > 1 && rows * dim >= 32768) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t r = 0; r < rows; r++)
            rms_norm_row(x, x_stride, residual, r_stride, weight, eps, r, dim, hidden_out, out);
    } else {
        for (int64_t r = 0; r < rows; r++)
            rms_norm_row(x, x_stride, residual, r_stride, weight, eps, r, dim, hidden_out, out);
    }
}

/* out = silu(gate) * up with gate, up the two halves of each row of gate_up (rows x 2 * inter,
 * rows gu_stride floats apart); out contiguous (rows x inter). silu(g) = g * sigmoid(g), the
 * sigmoid from exp(-|g|). */
static inline void silu_mul_row(const float *gate_up, int64_t gu_stride, int64_t r,
                                int64_t inter, float *out) {
    {
        const float *g = gate_up + r * gu_stride, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + VW <= inter; i += VW) {
            vf x = loadv(g + i);
            /* the sign bit spread over each lane, not a compare: GCC split a 16-lane compare's
             * select into scalar code on AVX2 (38 scalar compares, 2.7 us for 1536 floats) */
            vi neg = (vi)x >> 31, sign = (vi){0} + INT32_MIN;
            vf e = vexp_neg((vf)((vi)x | sign)); /* exp(-|x|): x with its sign bit set */
            vf one = (vf){0} + 1.f;
            vf num = (vf)(((vi)e & neg) | ((vi)one & ~neg)); /* sigmoid: e or 1 over 1 + e */
            storev(o + i, x * (num / (1.f + e)) * loadv(u + i));
        }
        for (; i < inter; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

void rf_silu_mul(const float *gate_up, int64_t gu_stride, int64_t rows, int64_t inter,
                 float *out, int threads) {
    if (threads > 1 && rows * inter >= 32768) { /* a construct only where it splits: rf_rms_norm */
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t r = 0; r < rows; r++) silu_mul_row(gate_up, gu_stride, r, inter, out);
    } else {
        for (int64_t r = 0; r < rows; r++) silu_mul_row(gate_up, gu_stride, r, inter, out);
    }
}

/* Each row's largest value and the index of its first occurrence (NaNs are passed over), for
 * `rows` rows of `cols` floats, rows x_stride floats apart: what torch's max(dim=-1) gives
 * for finite logits. Two passes: the maximum (vmax, NaN lanes keep the old value), then the
 * first index holding it (-inf or an all-NaN row: index 0). One pass that carried the index
 * along compiled to scalar code below AVX-512 (112 us for 49152 logits). */
static inline int64_t first_equal(const float *x, int64_t cols, float m) {
    int64_t i = 0;
#if defined(__AVX__)
    const __m256 mv = _mm256_set1_ps(m);
    for (; i + 8 <= cols; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; i < cols; i++)
        if (x[i] == m) return i;
    return 0;
}

void rf_argmax(const float *x, int64_t x_stride, int64_t rows, int64_t cols, float *top,
               int64_t *index, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        vf best[4] = {(vf){0} - INFINITY, (vf){0} - INFINITY, (vf){0} - INFINITY,
                      (vf){0} - INFINITY};
        int64_t i = 0;
        for (; i + 4 * VW <= cols; i += 4 * VW)
            for (int u = 0; u < 4; u++) best[u] = vmax(loadv(xr + i + u * VW), best[u]);
        for (; i + VW <= cols; i += VW) best[0] = vmax(loadv(xr + i), best[0]);
        best[0] = vmax(vmax(best[0], best[1]), vmax(best[2], best[3]));
        float m = -INFINITY;
        for (int l = 0; l < VW; l++)
            if (best[0][l] > m) m = best[0][l];
        for (; i < cols; i++)
            if (xr[i] > m) m = xr[i];
        top[r] = m, index[r] = m == -INFINITY ? 0 : first_equal(xr, cols, m);
    }
}

/* Each request's keys (kv_indices[kv_indptr[b] .. kv_indptr[b+1]), int32 or int64 by
 * `wide`) as maximal runs of consecutive slots, in order: run_indptr (num + 1), and each
 * run's first slot and length into first, count (room for every key); -> the number of
 * runs. decode_layout.py's run_table in one pass (its numpy took 55 us for one request). */
int64_t rf_run_table(const int64_t *kv_indptr, int64_t num, const void *kv_indices, int wide,
                     int64_t *run_indptr, int64_t *first, int64_t *count) {
    const int32_t *narrow = (const int32_t *)kv_indices;
    const int64_t *full = (const int64_t *)kv_indices;
    int64_t runs = 0;
    run_indptr[0] = 0;
    for (int64_t b = 0; b < num; b++) {
        for (int64_t i = kv_indptr[b]; i < kv_indptr[b + 1]; i++) {
            const int64_t key = wide ? full[i] : narrow[i];
            if (i > kv_indptr[b] && key == first[runs - 1] + count[runs - 1])
                count[runs - 1]++;
            else
                first[runs] = key, count[runs] = 1, runs++;
        }
        run_indptr[b + 1] = runs;
    }
    return runs;
}
