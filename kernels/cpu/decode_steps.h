/* The decode loop's steps path (included by decode_loop.cpp after decode_team.h): several
 * decode steps of 1-4 greedy rows in ONE team, each step's tokens picked inside it.
 *
 * Why: between two one-stream decode steps of a small model the host spends about 0.8 ms
 * (SmolLM2, 2 threads, a 6 ms step): the scheduler's plan, the step's tensors, the embedding,
 * rope, the final norm and the head's call, the sampler, the request's bookkeeping, each
 * run cold after the weights have streamed through the caches. Here a step's tail is the
 * team's too: every thread adds the last residual and normalizes into its own x (as the
 * layers' norms do), the LM head's rows are shared out (rf_qteam_linear), thread 0 takes each
 * row's argmax (rf_argmax, the sampler's greedy pick) and looks up the next tokens'
 * embeddings (rf_qget_rows, or the fp32 table), and the next step starts after a barrier.
 * The same kernels on the same inputs as a step of its own, so the same tokens. */

typedef int (*QGetRows)(const uint8_t *, int64_t, int64_t, int, const float *,
                        const int64_t *, int64_t, float *, int);
typedef void (*Argmax)(const float *, int64_t, int64_t, int64_t, float *, int64_t *, int);

/* What a step needs after the layers, converted once (DecodeLoop.tail): the final norm's
 * weight, the LM head's quantized ranges, and the token embedding (quantized rows of
 * `qtype` with their per-row scales, or an fp32 table: qtype -1). */
struct Tail {
    at::Tensor norm, embed, embed_scale;
    std::vector<at::Tensor> head_parts;
    std::vector<Range> head;
    int64_t vocab = 0, embed_rows = 0, dim = 0, embed_row_bytes = 0;
    int embed_qtype = -1;

    Tail(at::Tensor norm_, std::vector<at::Tensor> parts, const std::vector<int64_t> &meta,
         at::Tensor embed_, at::Tensor scale, int64_t qtype, int64_t rows, int64_t row_bytes)
        : norm(std::move(norm_)), embed(std::move(embed_)), embed_scale(std::move(scale)),
          head_parts(std::move(parts)), embed_rows(rows), embed_row_bytes(row_bytes),
          embed_qtype((int)qtype) {
        TORCH_CHECK(norm.is_contiguous() && norm.scalar_type() == at::kFloat &&
                        embed.is_contiguous(),
                    "decode steps' tail: the norm fp32 and the embedding contiguous");
        head = ranges_of(head_parts, meta);
        vocab = out_rows(head);
        dim = norm.numel();
        TORCH_CHECK(embed_qtype >= 0 || (embed.scalar_type() == at::kFloat && embed.dim() == 2 &&
                                         embed.size(1) == dim && embed.size(0) == rows),
                    "decode steps' tail: an fp32 embedding table (rows, dim)");
    }
};

/* One run of steps: the team's step (its fields set per step by thread 0), the tail, and the
 * per-step inputs and outputs */
struct Steps {
    TeamStep *s;
    const Tail *tail;
    int n;
    const float *cos, *sin;  /* (n * rows, rotary): step j's rows from j * rows */
    const int64_t *slots;    /* (n * rows) */
    std::vector<std::vector<int64_t>> indptr, first, count;  /* each step's runs */
    const float *embed0;     /* step 0's embeddings (rows, dim) */
    float *hidden;           /* the next step's (rows, dim) */
    float *logits, *top;     /* (rows, vocab), (rows) */
    int64_t *tokens;         /* (n, rows) */
    QGetRows get_rows;
    Argmax argmax;
    int done;
    int64_t status;  /* the first failing step's: its attention's, or -6 for a bad token */
};

/* each step's runs: step 0's (the request's keys through its first new slot), then the
 * request's later new slots, a slot continuing the last run joining it */
void step_runs(Steps &st, const int64_t *indptr0, const int64_t *first0, const int64_t *count0,
               int64_t rows) {
    st.indptr.assign(st.n, {0}), st.first.assign(st.n, {}), st.count.assign(st.n, {});
    for (int j = 0; j < st.n; j++)
        for (int64_t r = 0; r < rows; r++) {
            auto &fst = st.first[j], &cnt = st.count[j];
            for (int64_t k = indptr0[r]; k < indptr0[r + 1]; k++)
                fst.push_back(first0[k]), cnt.push_back(count0[k]);
            for (int i = 1; i <= j; i++) {  /* joins only this row's last run */
                const int64_t slot = st.slots[i * rows + r];
                if ((int64_t)fst.size() > st.indptr[j].back() && fst.back() + cnt.back() == slot)
                    cnt.back()++;
                else
                    fst.push_back(slot), cnt.push_back(1);
            }
            st.indptr[j].push_back((int64_t)fst.size());
        }
}

/* one thread of the steps' team */
void team_steps(void *ctx) {
    Steps &st = *static_cast<Steps *>(ctx);
    TeamStep &s = *st.s;
    const Tail &tail = *st.tail;
    const int t = s.thread();
    const int64_t rows = s.rows, dim = s.dim;
    float *x = s.x + t * rows * dim, *sum0 = s.sums + 2 * t * rows * dim, *sum1 = sum0 + rows * dim;
    for (int j = 0; j < st.n; j++) {
        if (t == 0) {
            s.embed = j ? st.hidden : st.embed0;
            s.cos = st.cos + j * rows * s.rotary, s.sin = st.sin + j * rows * s.rotary;
            s.slots = st.slots + j * rows;
            s.run_indptr = st.indptr[j].data(), s.first = st.first[j].data();
            s.count = st.count[j].data();
        }
        s.barrier();
        team_layers(&s);
        if (s.status != 0) {  /* every thread left the layers at the same barrier */
            if (t == 0) st.status = s.status;
            return;
        }
        s.rms_norm(s.down, dim, sum1, dim, f32(tail.norm), s.eps, rows, dim, sum0, x, 1);
        team_project(s, tail.head, x, dim, st.logits, tail.vocab);
        if (t == 0) {
            int64_t *tokens = st.tokens + j * rows;
            st.argmax(st.logits, tail.vocab, rows, tail.vocab, st.top, tokens, 1);
            for (int64_t r = 0; r < rows; r++)
                if (tokens[r] < 0 || tokens[r] >= tail.embed_rows) st.status = -6;
            if (st.status == 0 && j + 1 < st.n) {
                if (tail.embed_qtype >= 0)
                    st.get_rows(static_cast<const uint8_t *>(tail.embed.data_ptr()),
                                tail.embed_row_bytes, dim, tail.embed_qtype,
                                tail.embed_scale.numel() ? f32(tail.embed_scale) : nullptr,
                                tokens, rows, st.hidden, 1);
                else
                    for (int64_t r = 0; r < rows; r++)
                        std::copy_n(f32(tail.embed) + tokens[r] * dim, dim, st.hidden + r * dim);
            }
            if (st.status == 0) st.done = j + 1;
        }
        s.barrier();
        if (st.status != 0) return;
    }
}
