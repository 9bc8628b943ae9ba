/* The decode loop's team path (included by decode_loop.cpp): the layers of a step of 1-4
 * rows in ONE OpenMP parallel region (quant.c's rf_team_run) instead of a region per call.
 *
 * Why: at one row a SmolLM2 layer is 8 calls of 1-20 us, and a parallel region per call pays
 * its fork and join each time, so the small projections (qkv, o) were left on one thread. In
 * the team every thread walks the same layers: the projections' output rows are shared out
 * (rf_qteam_linear), thread 0 rotates q and k and stores the step's K/V (rf_rope_store), then
 * the attention's tasks are shared out as rf_decode_attention plans them for the team's size
 * (rf_team_attention: one thread's work for a short context, a KV head a task for a long
 * one), and the norms and SiLU, a few hundred floats, run on every thread into its own
 * buffers, so that no barrier is spent on them. Same kernels, same sums per output: the same
 * bits as the per-call path. */

typedef void (*TeamRun)(int, void (*)(void *), void *);
typedef void (*TeamBarrier)();
typedef int (*TeamThread)();
typedef int (*QTeamTakes)(int64_t, int64_t, int, int64_t, const float *);
typedef void (*QTeamLinear)(const float *, int64_t, int64_t, int64_t, const uint8_t *, int64_t,
                            int64_t, int, const float *, float *, int64_t);
typedef int64_t (*RopeStore)(float *, int64_t, const float *, const float *, int64_t, void *,
                             void *, int64_t, const int64_t *, int, int, int, int, int, float *,
                             float *);
typedef int (*TeamAttention)(const float *, int64_t, const void *, const void *, const int64_t *,
                             const int64_t *, const int64_t *, int, int, int, int, float, float,
                             float *, float *, int, const float *, const float *);

/* native.c's TEAM_TASKS: requests x KV heads rf_team_attention plans (on its stack) */
constexpr int64_t kTeamTasks = 256;

struct Range {  /* one quantized row range of a projection: rf_qlinear's arguments */
    const uint8_t *w;
    const float *scale;  /* per-row scales, or none (the team takes only ranges without) */
    int64_t rows, row_bytes;
    int qtype;
};

struct TeamStep {
    TeamRun run;
    TeamBarrier barrier;
    TeamThread thread;
    QTeamTakes takes;
    QTeamLinear linear;
    RmsNorm rms_norm;
    SiluMul silu_mul;
    RopeStore rope_store;
    TeamAttention attention;
    int64_t rows, dim, q_size, inter, qkv_n, num_heads, num_kv_heads, head_dim;
    float eps, scale;
    int kv_kind;
    const float *embed, *cos, *sin;
    int64_t rotary;
    const int64_t *slots, *run_indptr, *first, *count;
    std::vector<const float *> in_norms, post_norms;
    std::vector<const std::vector<Range> *> projs;  /* 4 a layer: qkv, o, gate_up, down */
    std::vector<void *> k_pools, v_pools;
    std::vector<float *> k_scales, v_scales;  /* empty but for int8 pools */
    int64_t num_slots;
    /* shared: the projections' outputs and the attention's; per thread: x, 2 sums, act */
    float *qkv, *attn, *lse, *o, *gate_up, *down, *x, *sums, *act;
    int64_t status;  /* the attention's, written by thread 0 before a barrier */
};

/* x @ W^T of one projection's ranges (each its own columns of out), by the whole team */
void team_project(const TeamStep &s, const std::vector<Range> &ranges, const float *in,
                  int64_t k, float *out, int64_t ldo) {
    int64_t offset = 0;
    for (const Range &r : ranges) {
        s.linear(in, s.rows, k, k, r.w, r.rows, r.row_bytes, r.qtype, nullptr, out + offset,
                 ldo);
        offset += r.rows;
    }
    s.barrier();
}

/* layer i's attention: thread 0 its rope and K/V store, then every thread its share of the
 * tasks; -> the store's status (nonzero: a slot out of range, no attention run), on every
 * thread */
int64_t team_attention(TeamStep &s, size_t i) {
    const bool scaled = s.kv_kind == 3;
    const int G = (int)(s.num_heads / s.num_kv_heads);
    float *k_scale = scaled ? s.k_scales[i] : nullptr, *v_scale = scaled ? s.v_scales[i] : nullptr;
    if (s.thread() == 0)
        s.status = s.rope_store(s.qkv, s.qkv_n, s.cos, s.sin, s.rotary, s.k_pools[i],
                                s.v_pools[i], s.num_slots, s.slots, (int)s.rows,
                                (int)s.num_kv_heads, G, (int)s.head_dim, s.kv_kind, k_scale,
                                v_scale);
    s.barrier();
    const int64_t status = s.status;
    if (status == 0)  /* the shapes were checked as the loop started: it takes these */
        s.attention(s.qkv, s.qkv_n, s.k_pools[i], s.v_pools[i], s.run_indptr, s.first, s.count,
                    (int)s.rows, (int)s.num_kv_heads, G, (int)s.head_dim, s.scale, 0.f, s.attn,
                    s.lse, s.kv_kind, k_scale, v_scale);
    s.barrier();
    return status;
}

/* one thread of the team: every layer, as decode_layers' per-call loop does them */
void team_layers(void *ctx) {
    TeamStep &s = *static_cast<TeamStep *>(ctx);
    const int t = s.thread();
    const int64_t rows = s.rows, dim = s.dim;
    float *x = s.x + t * rows * dim, *act = s.act + t * rows * s.inter;
    float *sum0 = s.sums + 2 * t * rows * dim, *sum1 = sum0 + rows * dim;
    const float *hidden = s.embed;
    for (size_t i = 0; i < s.in_norms.size(); i++) {
        if (i == 0)
            s.rms_norm(hidden, dim, nullptr, 0, s.in_norms[i], s.eps, rows, dim, nullptr, x, 1);
        else  /* the previous layer's residual add, in the norm's pass */
            s.rms_norm(s.down, dim, sum1, dim, s.in_norms[i], s.eps, rows, dim, sum0, x, 1);
        if (i > 0) hidden = sum0;
        team_project(s, *s.projs[4 * i], x, dim, s.qkv, s.qkv_n);
        if (team_attention(s, i) != 0) return;
        team_project(s, *s.projs[4 * i + 1], s.attn, s.q_size, s.o, dim);
        s.rms_norm(s.o, dim, hidden, dim, s.post_norms[i], s.eps, rows, dim, sum1, x, 1);
        team_project(s, *s.projs[4 * i + 2], x, dim, s.gate_up, 2 * s.inter);
        s.silu_mul(s.gate_up, 2 * s.inter, rows, s.inter, act, 1);
        team_project(s, *s.projs[4 * i + 3], act, s.inter, s.down, dim);
    }
}

/* the quantized ranges of one projection from its (parts, meta): each range's blocks and
 * per-row scale (empty for none) in parts, its (qtype, rows, row_bytes) in meta; none for a
 * oneDNN pack (meta empty) */
std::vector<Range> ranges_of(const std::vector<at::Tensor> &parts,
                             const std::vector<int64_t> &meta) {
    std::vector<Range> ranges;
    for (size_t j = 0; j + 2 < meta.size(); j += 3) {
        const at::Tensor &scale = parts[2 * (j / 3) + 1];
        ranges.push_back({parts[2 * (j / 3)].data_ptr<uint8_t>(),
                          scale.numel() ? scale.data_ptr<float>() : nullptr, meta[j + 1],
                          meta[j + 2], (int)meta[j]});
    }
    return ranges;
}

/* whether rf_qteam_linear takes every range of a projection at `rows` rows of `k` */
bool team_takes(const std::vector<Range> &ranges, int64_t rows, int64_t k, QTeamTakes takes) {
    for (const Range &r : ranges)
        if (!takes(rows, k, r.qtype, r.row_bytes, r.scale)) return false;
    return !ranges.empty();
}

int64_t out_rows(const std::vector<Range> &ranges) {
    int64_t n = 0;
    for (const Range &r : ranges) n += r.rows;
    return n;
}
