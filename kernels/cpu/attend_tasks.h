/* Decode attention's tasks and their threads (included by native.c after attend() and, on
 * AVX2, attend_avx2.h's attend8()): the plan (which requests and KV heads a task takes), one
 * task's kernel call, rf_decode_attention's own parallel region over them, and
 * rf_team_attention, the same tasks shared out by a team that is already running (the decode
 * loop's team path: kernels/cpu/decode_team.h). A task's sums do not depend on the thread that
 * runs it, so both give the same bits for the same plan, and the plan depends only on the
 * shapes, the keys and the thread count (and on AVX2, whose kernel's sums for a head do not
 * depend on the task's other heads, on whether the threads are already running). */

/* attend() instantiated for a group size and head_dim (and, with SHAPE_HEADS, a task's head
 * count: its loops over heads unroll, and its accumulators and partial scores can live in
 * registers; for SmolLM2-135M's 3 heads a task, 0.85x the hot time). */
#define SHAPE_HEADS(GG, CC, NHH, BF)                                                       \
    if (G == GG && C == CC && (NHH == 0 || nh == NHH)) {                                   \
        attend(qt, kt, vt, kst, vst, D, Hkv * D, a->first + runs, a->count + runs,         \
               num_runs, NHH ? NHH : nh, GG, CC, BF, a->scale, a->cap, ot,                 \
               a->lse + (b * Hkv + h0) * G, next_slot, next_count);                        \
        return;                                                                            \
    }
#define SHAPE(GG, CC, BF) SHAPE_HEADS(GG, CC, 0, BF)
#define SHAPES(BF)                                                                         \
    SHAPE_HEADS(3, 4, 3, BF) SHAPE(1, 4, BF) SHAPE(2, 4, BF) SHAPE(3, 4, BF)               \
    SHAPE(4, 4, BF) SHAPE(1, 8, BF) SHAPE(2, 8, BF) SHAPE(4, 8, BF) SHAPE(7, 4, BF)        \
    SHAPE(7, 8, BF) SHAPE(8, 8, BF)                                                        \
    attend(qt, kt, vt, kst, vst, D, Hkv * D, a->first + runs, a->count + runs, num_runs,   \
           nh, G, C, BF, a->scale, a->cap, ot, a->lse + (b * Hkv + h0) * G, next_slot,     \
           next_count);

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define ATTEND8 /* AVX2's widest vectors: every task on 8-float vectors */
#include "attend_avx2.h"
#endif

typedef struct { int64_t cost, b, h0, nh; } Task;
#define ATTENTION_SPLIT (1 << 19) /* keys x query heads x head_dim: about 30 us of work */
#define TEAM_TASKS 256            /* requests x KV heads rf_team_attention plans on its stack */

/* one call's arguments, as rf_decode_attention takes them */
typedef struct {
    const float *q;
    int64_t q_stride;
    const void *k, *v;
    int kv_type;
    const float *k_scale, *v_scale;
    const int64_t *run_indptr, *first, *count;
    int B, Hkv, G, D;
    float scale, cap;
    float *out, *lse;
} Attention;

static int costlier_first(const void *x, const void *y) {
    int64_t a = ((const Task *)x)->cost, b = ((const Task *)y)->cost;
    return a < b ? 1 : a > b ? -1 : 0;
}

/* The tasks for `threads` threads into `tasks` (room for B x Hkv), costliest first; -> their
 * number. One thread for a small batch (a single stream's few hundred keys: some 20 us of
 * work) unless the threads are `awake` (a running team): a parallel region wakes a sleeping
 * OpenMP worker, which costs about as much. A request is one task (its keys stream through
 * once) unless its keys are more than a thread's even share of the batch's: then one task
 * per KV head, so that one long request beside short ones does not leave the other threads
 * idle. */
static int64_t attention_plan(const Attention *a, int threads, Task *tasks, int awake) {
    const int B = a->B, Hkv = a->Hkv, G = a->G;
    int64_t total = 0;
    for (int64_t r = 0; r < a->run_indptr[B]; r++) total += a->count[r];
    if (!awake && total * Hkv * G * a->D < ATTENTION_SPLIT) threads = 1;
    int64_t num_tasks = 0, share = total / (threads > 0 ? threads : 1);
    int heads_per_task = MAX_ROWS / G < Hkv ? MAX_ROWS / G : Hkv;
    for (int64_t b = 0; b < B; b++) {
        int64_t keys = 0;
        for (int64_t r = a->run_indptr[b]; r < a->run_indptr[b + 1]; r++) keys += a->count[r];
        int per = keys > share || B < threads ? 1 : heads_per_task;
        for (int64_t h0 = 0; h0 < Hkv; h0 += per)
            tasks[num_tasks++] = (Task){keys * (Hkv - h0 < per ? Hkv - h0 : per), b, h0,
                                        Hkv - h0 < per ? Hkv - h0 : per};
    }
    qsort(tasks, num_tasks, sizeof(Task), costlier_first);
    return num_tasks;
}

/* one task: its request's keys against its KV heads' queries (next_slot, next_count: the
 * first keys of the task this thread runs next, prefetched as this one ends; 0, 0: none) */
static void attention_task(const Attention *a, const Task *task, int64_t next_slot,
                           int64_t next_count) {
    const int Hkv = a->Hkv, G = a->G, D = a->D, C = D / VW, kv_type = a->kv_type;
    const int64_t b = task->b, h0 = task->h0;
    const int nh = (int)task->nh;
    const int64_t runs = a->run_indptr[b], num_runs = a->run_indptr[b + 1] - runs;
    const float *qt = a->q + b * a->q_stride + h0 * G * D;
    const int64_t es = KV_BYTES(kv_type); /* the pools' element size */
    const char *kt = (const char *)a->k + h0 * D * es, *vt = (const char *)a->v + h0 * D * es;
    const float *kst = a->k_scale ? a->k_scale + h0 : NULL;
    const float *vst = a->v_scale ? a->v_scale + h0 : NULL;
    float *ot = a->out + (b * Hkv + h0) * G * D;
#ifdef ATTEND8
    attend8(qt, kt, vt, kst, vst, D, Hkv * D, kv_type, a->first + runs, a->count + runs,
            num_runs, nh, G, D, a->scale, a->cap, ot, a->lse + (b * Hkv + h0) * G);
    (void)C, (void)next_slot, (void)next_count;
#else
    if (kv_type == 3) {
        SHAPES(3)
    } else if (kv_type == 2) {
        SHAPES(2)
    } else if (kv_type) {
        SHAPES(1)
    } else {
        SHAPES(0)
    }
#endif
}

static int attention_tasks(const Attention *a, int threads) {
    Task *tasks = malloc(sizeof(Task) * ((size_t)a->B * a->Hkv + 1));
    if (!tasks) return -2;
    const int64_t num_tasks = attention_plan(a, threads, tasks, 0);
    if (num_tasks < 2) threads = 1;
    /* Each thread claims its next task when it starts one (dynamic scheduling, one ahead), so
     * the task whose first keys it prefetches is the one it runs next. With OpenMP's dynamic
     * schedule the next task in the list was mostly the other thread's, already running:
     * 64 requests of 89 keys, 2 threads, pools cold, took 0.9x the time. */
    int64_t claimed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    for (int64_t i = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED), after; i < num_tasks;
         i = after) {
        after = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        int64_t next_slot = 0, next_count = 0; /* the next task's first keys, to prefetch */
        if (after < num_tasks && tasks[after].b != tasks[i].b && tasks[after].h0 == tasks[i].h0) {
            const int64_t nb = tasks[after].b;
            if (a->run_indptr[nb + 1] > a->run_indptr[nb])
                next_slot = a->first[a->run_indptr[nb]], next_count = a->count[a->run_indptr[nb]];
        }
        attention_task(a, &tasks[i], next_slot, next_count);
    }
    free(tasks);
    return 0;
}

/* Decode attention of B requests, one query token each, over keys read where they lie in
 * the pools k, v (num_slots, Hkv, D): request b's keys are the runs run_indptr[b] ..
 * run_indptr[b + 1] - 1 of (first slot, count) (none: zeros, lse -inf). q (B, Hkv, G, D)
 * with rows q_stride floats apart, heads and dims contiguous; out (B, Hkv, G, D) and lse
 * (B, Hkv, G) contiguous; scores scaled by `scale`, then soft-capped to cap * tanh(s / cap)
 * when cap > 0; `threads` OpenMP threads; pools fp32, bf16, fp16 or int8 by kv_type (0, 1,
 * 2, 3), an int8 pool's scales in k_scale, v_scale (num_slots, Hkv; NULL for the others).
 * Returns 0, or -1 for shapes it does not take (D not a multiple of 16 or over 256, G over 8),
 * -2 when out of memory. */
int rf_decode_attention(const float *q, int64_t q_stride, const void *k, const void *v,
                        const int64_t *run_indptr, const int64_t *first, const int64_t *count,
                        int B, int Hkv, int G, int D, float scale, float cap, float *out,
                        float *lse, int threads, int kv_type, const float *k_scale,
                        const float *v_scale) {
    if (D % VW || D / VW > MAX_CHUNKS || G > MAX_GROUP || G < 1) return -1;
    if (kv_type == 3 && !(k_scale && v_scale)) return -1;
    const Attention a = {q,     q_stride, k,     v,   kv_type, k_scale, v_scale, run_indptr,
                         first, count,    B,     Hkv, G,       D,       scale,   cap,
                         out,   lse};
    return attention_tasks(&a, threads);
}

/* rf_decode_attention's work from inside a running parallel region, called by every thread
 * of the team (with the same arguments, after the K/V it reads are stored and a barrier):
 * the tasks rf_decode_attention plans for the team's size (on AVX2 also for a short
 * context, which it leaves to one thread), shared out one at a time; no barrier at the end.
 * Returns 0, or as rf_decode_attention for what it does not take, and -2 where B x Hkv
 * passes TEAM_TASKS (the caller checks that before it starts the team). */
int rf_team_attention(const float *q, int64_t q_stride, const void *k, const void *v,
                      const int64_t *run_indptr, const int64_t *first, const int64_t *count,
                      int B, int Hkv, int G, int D, float scale, float cap, float *out,
                      float *lse, int kv_type, const float *k_scale, const float *v_scale) {
    if (D % VW || D / VW > MAX_CHUNKS || G > MAX_GROUP || G < 1) return -1;
    if (kv_type == 3 && !(k_scale && v_scale)) return -1;
    if ((int64_t)B * Hkv > TEAM_TASKS) return -2;
    const Attention a = {q,     q_stride, k,     v,   kv_type, k_scale, v_scale, run_indptr,
                         first, count,    B,     Hkv, G,       D,       scale,   cap,
                         out,   lse};
    Task tasks[TEAM_TASKS];
#ifdef ATTEND8
    /* the team's threads are running: a short context's KV heads go to both (attend8's sums
     * for a head are the same whatever other heads its task holds: the same bits) */
    const int awake = 1;
#else
    const int awake = 0; /* attend()'s shapes unroll by a task's head count: one plan */
#endif
    const int64_t num_tasks = attention_plan(&a, omp_get_num_threads(), tasks, awake);
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t i = 0; i < num_tasks; i++) attention_task(&a, &tasks[i], 0, 0);
    return 0;
}
