/* radixflow's CPU decode loop: every decoder layer of a decode-only step in one call, as a
 * torch C++ extension built at first use by kernels/cpu/decode_loop.py. The Python layer loop
 * (runtime/models/layers.py, DecoderLayer.forward) is the reference and does the same calls
 * in the same order on the same buffers' contents, so the logits are the same bits:
 *
 *   x = RMSNorm(hidden + residual)                  rf_rms_norm            (native.c)
 *   qkv = x @ Wqkv                                  mkldnn::_linear_pointwise (oneDNN pack)
 *   rope q, k; store k, v; attend                   rf_rope_decode_attention (native.c)
 *   hidden, x = hidden + attn @ Wo, RMSNorm(...)    oneDNN, rf_rms_norm
 *   out = silu(gate) * up of x @ Wgate_up, @ Wdown  oneDNN, rf_silu_mul, oneDNN
 *
 * What it saves is Python between the kernels: about 300 us a layer of interpreter work,
 * wrappers and tensor bookkeeping, run cold after each matmul has streamed its weights
 * through the caches (SmolLM2, 64 streams, 2 threads: a decode step 130 -> 124 ms). The
 * native kernels are called through the addresses kernels/cpu/native.py loaded (no second
 * copy), and the GIL is released for the whole loop. */
/* ATen's tensor and the one op used, and pybind's tensor casters: not torch/extension.h,
 * whose whole C++ frontend (autograd, nn) took a third more time to compile. */
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <tuple>
#include <vector>

namespace {

typedef void (*RmsNorm)(const float *, int64_t, const float *, int64_t, const float *, float,
                        int64_t, int64_t, float *, float *, int);
typedef void (*SiluMul)(const float *, int64_t, int64_t, int64_t, float *, int);
typedef int64_t (*RopeDecodeAttention)(float *, int64_t, const float *, const float *, int64_t,
                                       void *, void *, int64_t, const int64_t *,
                                       const int64_t *, const int64_t *, const int64_t *, int,
                                       int, int, int, float, float, float *, float *, int, int,
                                       float *, float *);

typedef int (*QLinear)(const float *, int64_t, int64_t, int64_t, const uint8_t *, int64_t,
                       int64_t, int, const float *, const float *, float *, int64_t, int);

#include "decode_team.h"

/* x @ W^T from W's oneDNN pack, as runtime/models/prepack.py's `linear` does. */
at::Tensor packed_linear(const at::Tensor &x, const at::Tensor &packed) {
    static auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
            .typed<at::Tensor(const at::Tensor &, const at::Tensor &,
                              const std::optional<at::Tensor> &, c10::string_view,
                              c10::List<std::optional<at::Scalar>>,
                              std::optional<c10::string_view>)>();
    return op.call(x, packed, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(),
                   c10::string_view(""));
}

/* x @ W^T from W's quantized row ranges (runtime/models/quantized.py's QuantLinear) into
 * `out` (rows, out_rows(ranges)), contiguous. Each range writes its own columns of the
 * output, as the Python module does; -> `out`, or an undefined tensor where the kernel
 * refuses a range. */
at::Tensor quant_linear(const at::Tensor &x, const std::vector<Range> &ranges, QLinear qlinear,
                        int threads, at::Tensor out) {
    const int64_t rows = x.size(0), k = x.size(1), out_features = out.size(1);
    int64_t offset = 0;
    for (const Range &r : ranges) {
        if (qlinear(x.data_ptr<float>(), rows, x.stride(0), k, r.w, r.rows, r.row_bytes,
                    r.qtype, r.scale, nullptr, out.data_ptr<float>() + offset, out_features,
                    threads) != 0)
            return at::Tensor();
        offset += r.rows;
    }
    return out;
}

float *f32(const at::Tensor &t) { return t.data_ptr<float>(); }
const int64_t *i64(const at::Tensor &t) { return t.data_ptr<int64_t>(); }

/* the step's inputs: embeddings, rope tables, slots and the attention's runs */
void team_inputs(TeamStep &s, const at::Tensor &hidden, const at::Tensor &cos,
                 const at::Tensor &sin, const at::Tensor &slots, const at::Tensor &run_indptr,
                 const at::Tensor &first, const at::Tensor &count) {
    s.embed = f32(hidden), s.cos = f32(cos), s.sin = f32(sin), s.rotary = cos.size(-1);
    s.slots = i64(slots), s.run_indptr = i64(run_indptr), s.first = i64(first);
    s.count = i64(count);
}

/* A model's layer weights, converted from Python's lists once (DecodeLoop.prepared), with the
 * team path's raw pointers taken then: per layer the two norm weights, per projection (4 a
 * layer) its oneDNN pack or quantized ranges' tensors with their metas. Converting the lists
 * and reading each tensor's pointer on every call took 170 us of a SmolLM2 step. */
struct Weights {
    std::vector<at::Tensor> input_norms, post_norms;
    std::vector<std::vector<at::Tensor>> projs;
    std::vector<const float *> in_ptrs, post_ptrs;
    std::vector<std::vector<Range>> ranges;  /* per projection; empty for a oneDNN pack */

    Weights(std::vector<at::Tensor> in, std::vector<at::Tensor> post,
            std::vector<std::vector<at::Tensor>> p, const std::vector<std::vector<int64_t>> &metas)
        : input_norms(std::move(in)), post_norms(std::move(post)), projs(std::move(p)) {
        TORCH_CHECK(input_norms.size() == post_norms.size() && projs.size() == metas.size(),
                    "decode loop weights: mismatched lists");
        for (size_t i = 0; i < input_norms.size(); i++)
            in_ptrs.push_back(f32(input_norms[i])), post_ptrs.push_back(f32(post_norms[i]));
        for (size_t j = 0; j < projs.size(); j++) ranges.push_back(ranges_of(projs[j], metas[j]));
    }
};

/* The runner's KV pools per layer, converted once per pool list (DecodeLoop._pools), checked
 * then: data (num_slots, Hkv, D) contiguous, all fp32, bf16, fp16 or int8 (kind 0-3; -1
 * where not taken), an int8 pool with its fp32 scales (num_slots, Hkv), empty scale lists
 * for the other dtypes. */
struct Pools {
    std::vector<at::Tensor> k, v, k_scales, v_scales;
    std::vector<void *> k_ptrs, v_ptrs;
    std::vector<float *> ks_ptrs, vs_ptrs;
    int kind = -1;
    int64_t num_slots = 0;

    Pools(std::vector<at::Tensor> k_, std::vector<at::Tensor> v_, std::vector<at::Tensor> ks,
          std::vector<at::Tensor> vs)
        : k(std::move(k_)), v(std::move(v_)), k_scales(std::move(ks)), v_scales(std::move(vs)) {
        const auto type = k.empty() ? at::kFloat : k[0].scalar_type();
        const int found = type == at::kFloat      ? 0
                          : type == at::kBFloat16 ? 1
                          : type == at::kHalf     ? 2
                          : type == at::kChar     ? 3
                                                  : -1;
        const bool scaled = found == 3;
        if (found < 0 || k.size() != v.size() ||
            (scaled && (k_scales.size() != k.size() || v_scales.size() != v.size())))
            return;
        for (size_t i = 0; i < k.size(); i++)
            if (!k[i].is_contiguous() || !v[i].is_contiguous() || k[i].scalar_type() != type ||
                v[i].scalar_type() != type ||
                (scaled && (!k_scales[i].is_contiguous() || !v_scales[i].is_contiguous() ||
                            k_scales[i].scalar_type() != at::kFloat ||
                            v_scales[i].scalar_type() != at::kFloat)))
                return;
        for (size_t i = 0; i < k.size(); i++) {
            k_ptrs.push_back(k[i].data_ptr()), v_ptrs.push_back(v[i].data_ptr());
            if (scaled) ks_ptrs.push_back(f32(k_scales[i])), vs_ptrs.push_back(f32(v_scales[i]));
        }
        num_slots = k.empty() ? 0 : k[0].size(0);
        kind = found;
    }
};

/* every layer's norm weights and KV pools (and an int8 pool's scales) */
void team_layer_weights(TeamStep &s, const Weights &w, const Pools &pools) {
    s.num_slots = pools.num_slots;
    s.in_norms = w.in_ptrs, s.post_norms = w.post_ptrs;
    s.k_pools = pools.k_ptrs, s.v_pools = pools.v_ptrs;
    s.k_scales = pools.ks_ptrs, s.v_scales = pools.vs_ptrs;
}

/* The team's buffers, alive while the returned tensors are */
struct TeamBuffers {
    at::Tensor qkv, attn, lse, o, gate_up, down, x, sums, act;
};

/* Whether the team path takes the step, its fields and buffers set where it does: rows <= 4
 * on more than one thread, every projection quantized ranges rf_qteam_linear takes, the
 * layers' shapes alike, an attention shape the native kernels take (head_dim a multiple of
 * 16 up to 256, 1-8 query heads a KV head, rows x KV heads within kTeamTasks); fns[4..8]
 * quant.c's rf_team_run, rf_team_barrier, rf_team_thread, rf_qteam_takes, rf_qteam_linear,
 * fns[9..10] native.c's rf_rope_store, rf_team_attention. */
bool team_prepare(TeamStep &s, const at::Tensor &hidden, const Weights &w,
                  const std::vector<int64_t> &fns, int n, TeamBuffers &b) {
    const int64_t G = s.num_kv_heads > 0 ? s.num_heads / s.num_kv_heads : 0;
    const auto &ranges = w.ranges;
    if (fns.size() < 11 || n < 2 || s.rows > 4 || ranges.size() < 4 || ranges[0].empty() ||
        ranges[2].empty() || s.head_dim % 16 || s.head_dim > 256 || G < 1 || G > 8 ||
        s.rows * s.num_kv_heads > kTeamTasks)
        return false;
    s.run = reinterpret_cast<TeamRun>(fns[4]);
    s.barrier = reinterpret_cast<TeamBarrier>(fns[5]);
    s.thread = reinterpret_cast<TeamThread>(fns[6]);
    s.takes = reinterpret_cast<QTeamTakes>(fns[7]);
    s.linear = reinterpret_cast<QTeamLinear>(fns[8]);
    s.rope_store = reinterpret_cast<RopeStore>(fns[9]);
    s.attention = reinterpret_cast<TeamAttention>(fns[10]);
    s.qkv_n = out_rows(ranges[0]);
    s.inter = out_rows(ranges[2]) / 2;
    const int64_t ks[4] = {s.dim, s.q_size, s.dim, s.inter};
    const int64_t ns[4] = {s.qkv_n, s.dim, 2 * s.inter, s.dim};
    s.projs.clear();
    for (size_t j = 0; j < ranges.size(); j++) {
        const int p = j % 4;
        if (out_rows(ranges[j]) != ns[p] || !team_takes(ranges[j], s.rows, ks[p], s.takes))
            return false;
        s.projs.push_back(&ranges[j]);
    }
    const auto options = hidden.options();
    const int64_t rows = s.rows, dim = s.dim;
    b.qkv = at::empty({rows, s.qkv_n}, options), b.attn = at::empty({rows, s.q_size}, options);
    b.lse = at::empty({rows, s.num_heads}, options), b.o = at::empty({rows, dim}, options);
    b.gate_up = at::empty({rows, 2 * s.inter}, options);
    b.down = at::empty({rows, dim}, options), b.x = at::empty({n, rows, dim}, options);
    b.sums = at::empty({n, 2, rows, dim}, options);
    b.act = at::empty({n, rows, s.inter}, options);
    s.qkv = f32(b.qkv), s.attn = f32(b.attn), s.lse = f32(b.lse), s.o = f32(b.o);
    s.gate_up = f32(b.gate_up), s.down = f32(b.down), s.x = f32(b.x), s.sums = f32(b.sums);
    s.act = f32(b.act), s.status = 0;
    return true;
}

/* The step on the team path (decode_team.h) when team_prepare takes it. -> (mlp, residual,
 * status) as decode_layers; status -5, nothing touched, where it does not take the step. */
std::tuple<at::Tensor, at::Tensor, int64_t> decode_team(TeamStep &s, const at::Tensor &hidden,
                                                        const Weights &w,
                                                        const std::vector<int64_t> &fns, int n) {
    TeamBuffers b;
    if (!team_prepare(s, hidden, w, fns, n, b)) return {hidden, at::Tensor(), -5};
    s.run(n, team_layers, &s);
    if (s.status != 0) return {hidden, at::Tensor(), s.status};
    return {b.down, b.sums[0][1], 0};  /* thread 0's residual: every thread's is the same */
}

#include "decode_steps.h"

}  // namespace

/* The layers of a decode-only step. hidden (B, hidden) the embeddings; the layers' Weights
 * and Pools; cos/sin (B, rotary) contiguous; slots (B,) this step's KV slots; runs
 * the native kernel's (run_indptr, first, count); fns the addresses of rf_rms_norm,
 * rf_silu_mul, rf_rope_decode_attention (then rf_qlinear and decode_team's). -> (mlp,
 * residual, status, team): the last layer's output and residual (their sum is the final
 * norm's input), rf_rope_decode_attention's status (0, or the layer's nonzero status: the
 * loop stops there), and whether the team path ran the step; -3, with nothing touched, for
 * inputs it does not take (hidden not contiguous fp32, pools not contiguous and all fp32 or
 * all bf16 or all fp16 or all int8 with k_scales, v_scales: --kv-cache-dtype's pools are
 * read and written by the native attention; the scale lists are empty for the others). */
std::tuple<at::Tensor, at::Tensor, int64_t, bool> decode_layers(
    at::Tensor hidden, const Weights &weights, const Pools &pools, const at::Tensor &cos,
    const at::Tensor &sin, const at::Tensor &slots, const at::Tensor &run_indptr,
    const at::Tensor &first, const at::Tensor &count, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, double scale, double eps, const std::vector<int64_t> &fns,
    int64_t threads) {
    pybind11::gil_scoped_release no_gil;
    const auto &input_norms = weights.input_norms, &post_norms = weights.post_norms;
    const auto &projs = weights.projs;
    const auto &ranges = weights.ranges;
    const auto &k_pools = pools.k;
    const int kv_kind = pools.kind;
    const bool scaled = kv_kind == 3; /* int8: each layer's scales (num_slots, Hkv) fp32 */
    const bool plain = hidden.is_contiguous() && hidden.scalar_type() == at::kFloat;
    if (!plain || kv_kind < 0 || 4 * k_pools.size() != projs.size() ||
        input_norms.size() != k_pools.size())
        return {hidden, at::Tensor(), -3, false};
    auto rms_norm = reinterpret_cast<RmsNorm>(fns.at(0));
    auto silu_mul = reinterpret_cast<SiluMul>(fns.at(1));
    auto attention = reinterpret_cast<RopeDecodeAttention>(fns.at(2));
    auto qlinear = fns.size() > 3 ? reinterpret_cast<QLinear>(fns[3]) : nullptr;
    const int64_t rows = hidden.size(0), dim = hidden.size(1), q_size = num_heads * head_dim;
    const auto options = hidden.options();
    const int n = static_cast<int>(threads);
    TeamStep team{};
    team.rms_norm = rms_norm, team.silu_mul = silu_mul;
    team.rows = rows, team.dim = dim, team.q_size = q_size, team.num_heads = num_heads;
    team.num_kv_heads = num_kv_heads, team.head_dim = head_dim, team.eps = (float)eps;
    team.scale = (float)scale, team.kv_kind = kv_kind;
    team_inputs(team, hidden, cos, sin, slots, run_indptr, first, count);
    team_layer_weights(team, weights, pools);
    auto teamed = decode_team(team, hidden, weights, fns, n);
    if (std::get<2>(teamed) != -5) return {std::get<0>(teamed), std::get<1>(teamed),
                                           std::get<2>(teamed), true};
    at::Tensor residual;
    /* The step's buffers, made once and reused by every layer (a layer's 11 allocations cost
     * about 2% of a single-stream step): the norms' outputs, the two residual sums (the one
     * a layer starts from is read while the other is written), and each quantized
     * projection's output, its layers' shapes being the same (the oneDNN packs return their
     * own). The last layer's output and residual, returned, are two of them. */
    const at::Tensor x = at::empty({rows, dim}, options), attn = at::empty({rows, q_size}, options);
    const at::Tensor lse = at::empty({rows, num_heads}, options);
    const at::Tensor sums[2] = {at::empty({rows, dim}, options), at::empty({rows, dim}, options)};
    std::vector<at::Tensor> outs(4);
    at::Tensor act; /* SiLU's output, made at the first layer */
    for (int p = 0; p < 4 && !ranges.empty(); p++)
        if (!ranges[p].empty()) outs[p] = at::empty({rows, out_rows(ranges[p])}, options);
    /* projection p of layer i: its oneDNN pack, or its quantized ranges (non-empty) */
    auto project = [&](const at::Tensor &in, size_t i, int p) {
        const size_t j = 4 * i + p;
        if (ranges[j].empty()) return packed_linear(in, projs[j][0]);
        at::Tensor out = outs[p];
        if (!out.defined() || out.size(1) != out_rows(ranges[j]))
            out = at::empty({rows, out_rows(ranges[j])}, options);
        return qlinear ? quant_linear(in, ranges[j], qlinear, n, out) : at::Tensor();
    };
    for (size_t i = 0; i < k_pools.size(); i++) {
        if (residual.defined()) {  /* the previous layer's residual add, in the norm's pass */
            const at::Tensor &sum = sums[0];
            rms_norm(f32(hidden), dim, f32(residual), dim, f32(input_norms[i]), (float)eps, rows,
                     dim, f32(sum), f32(x), n);
            hidden = sum;
        } else {
            rms_norm(f32(hidden), dim, nullptr, 0, f32(input_norms[i]), (float)eps, rows, dim,
                     nullptr, f32(x), n);
        }
        at::Tensor qkv = project(x, i, 0);
        if (!qkv.defined()) return {hidden, residual, -4, false};
        int64_t status = attention(
            f32(qkv), qkv.stride(0), f32(cos), f32(sin), cos.size(-1), pools.k_ptrs[i],
            pools.v_ptrs[i], pools.num_slots, i64(slots), i64(run_indptr), i64(first),
            i64(count), (int)rows, (int)num_kv_heads, (int)(num_heads / num_kv_heads),
            (int)head_dim, (float)scale, 0.f, f32(attn), f32(lse), n, kv_kind,
            scaled ? pools.ks_ptrs[i] : nullptr, scaled ? pools.vs_ptrs[i] : nullptr);
        if (status != 0) return {hidden, residual, status, false};
        at::Tensor projected = project(attn, i, 1);
        if (!projected.defined()) return {hidden, residual, -4, false};
        const at::Tensor &sum = sums[1];
        rms_norm(f32(projected), dim, f32(hidden), dim, f32(post_norms[i]), (float)eps, rows, dim,
                 f32(sum), f32(x), n);
        at::Tensor gate_up = project(x, i, 2);
        if (!gate_up.defined()) return {hidden, residual, -4, false};
        const int64_t inter = gate_up.size(1) / 2;
        if (!act.defined() || act.size(1) != inter) act = at::empty({rows, inter}, options);
        silu_mul(f32(gate_up), gate_up.stride(0), rows, inter, f32(act), n);
        residual = sum;
        hidden = project(act, i, 3);
        if (!hidden.defined()) return {hidden, residual, -4, false};
    }
    return {hidden, residual, 0, false};
}

/* Up to `steps` greedy decode steps of a decode-only batch on the team path, each step's
 * tokens picked in the loop (decode_steps.h): as decode_layers for step 0's inputs (hidden,
 * slots' first row, runs), with cos/sin (steps x B, rotary) and slots (steps x B) for every
 * step, the Tail, and fns[11..12] quant.c's rf_qget_rows and native.c's rf_argmax. ->
 * (tokens (steps, B) int64, steps done, status): 0; the attention's status of the step that
 * stopped (nonzero: a slot out of range), -6 for a token outside the embedding; -5 with
 * nothing touched where the team path or the tail does not take the batch, -3 for inputs
 * decode_layers refuses. */
std::tuple<at::Tensor, int64_t, int64_t> decode_steps(
    const at::Tensor &hidden, const Weights &weights, const Pools &pools, const Tail &tail,
    const at::Tensor &cos, const at::Tensor &sin, const at::Tensor &slots,
    const at::Tensor &run_indptr, const at::Tensor &first, const at::Tensor &count,
    int64_t steps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
    double eps, const std::vector<int64_t> &fns, int64_t threads) {
    pybind11::gil_scoped_release no_gil;
    const int64_t rows = hidden.size(0), dim = hidden.size(1);
    at::Tensor tokens = at::empty({steps, rows}, hidden.options().dtype(at::kLong));
    const bool plain = hidden.is_contiguous() && hidden.scalar_type() == at::kFloat &&
                       cos.is_contiguous() && sin.is_contiguous() && slots.is_contiguous() &&
                       slots.scalar_type() == at::kLong && steps >= 1 &&
                       cos.size(0) >= steps * rows && sin.size(0) >= steps * rows &&
                       slots.numel() >= steps * rows && dim == tail.dim;
    if (!plain || pools.kind < 0 || 4 * pools.k.size() != weights.projs.size() ||
        weights.input_norms.size() != pools.k.size())
        return {tokens, 0, -3};
    const int n = static_cast<int>(threads);
    TeamStep team{};
    team.rms_norm = reinterpret_cast<RmsNorm>(fns.at(0));
    team.silu_mul = reinterpret_cast<SiluMul>(fns.at(1));
    team.rows = rows, team.dim = dim, team.q_size = num_heads * head_dim;
    team.num_heads = num_heads, team.num_kv_heads = num_kv_heads, team.head_dim = head_dim;
    team.eps = (float)eps, team.scale = (float)scale, team.kv_kind = pools.kind;
    team_inputs(team, hidden, cos, sin, slots, run_indptr, first, count);
    team_layer_weights(team, weights, pools);
    TeamBuffers b;
    if (fns.size() < 13 || !team_prepare(team, hidden, weights, fns, n, b) ||
        !team_takes(tail.head, rows, dim, team.takes))
        return {tokens, 0, -5};
    at::Tensor next = at::empty({rows, dim}, hidden.options());
    at::Tensor logits = at::empty({rows, tail.vocab}, hidden.options());
    at::Tensor top = at::empty({rows}, hidden.options());
    Steps st{};
    st.s = &team, st.tail = &tail, st.n = (int)steps, st.cos = f32(cos), st.sin = f32(sin);
    st.slots = i64(slots), st.embed0 = f32(hidden), st.hidden = f32(next);
    st.logits = f32(logits), st.top = f32(top), st.tokens = tokens.data_ptr<int64_t>();
    st.get_rows = reinterpret_cast<QGetRows>(fns[11]);
    st.argmax = reinterpret_cast<Argmax>(fns[12]);
    step_runs(st, i64(run_indptr), i64(first), i64(count), rows);
    team.run(n, team_steps, &st);
    return {tokens, st.done, st.status};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    pybind11::class_<Weights>(m, "Weights")
        .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>,
                            std::vector<std::vector<at::Tensor>>,
                            std::vector<std::vector<int64_t>>>());
    pybind11::class_<Pools>(m, "Pools")
        .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>,
                            std::vector<at::Tensor>, std::vector<at::Tensor>>());
    pybind11::class_<Tail>(m, "Tail")
        .def(pybind11::init<at::Tensor, std::vector<at::Tensor>, std::vector<int64_t>,
                            at::Tensor, at::Tensor, int64_t, int64_t, int64_t>());
    m.def("decode_layers", &decode_layers, "every decoder layer of a decode-only step");
    m.def("decode_steps", &decode_steps, "greedy decode steps of a decode-only batch");
}
