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
 * `out` (rows, out_features(meta)), contiguous: `parts` holds each range's blocks and its
 * per-row scale (empty for none), `meta` each range's (qtype, rows, row_bytes). Each range
 * writes its own columns of the output, as the Python module does; -> `out`, or an undefined
 * tensor where the kernel refuses a range. */
int64_t out_features(const std::vector<int64_t> &meta) {
    int64_t n = 0;
    for (size_t j = 0; j + 2 < meta.size(); j += 3) n += meta[j + 1];
    return n;
}

at::Tensor quant_linear(const at::Tensor &x, const std::vector<at::Tensor> &parts,
                        const std::vector<int64_t> &meta, QLinear qlinear, int threads,
                        at::Tensor out) {
    const int64_t rows = x.size(0), k = x.size(1), out_features = out.size(1);
    int64_t offset = 0;
    for (size_t j = 0; j + 2 < meta.size(); j += 3) {
        const at::Tensor &data = parts[2 * (j / 3)], &scale = parts[2 * (j / 3) + 1];
        const float *s = scale.numel() ? scale.data_ptr<float>() : nullptr;
        if (qlinear(x.data_ptr<float>(), rows, x.stride(0), k, data.data_ptr<uint8_t>(),
                    meta[j + 1], meta[j + 2], (int)meta[j], s, nullptr,
                    out.data_ptr<float>() + offset, out_features, threads) != 0)
            return at::Tensor();
        offset += meta[j + 1];
    }
    return out;
}

float *f32(const at::Tensor &t) { return t.data_ptr<float>(); }
const int64_t *i64(const at::Tensor &t) { return t.data_ptr<int64_t>(); }

}  // namespace

/* The layers of a decode-only step. hidden (B, hidden) the embeddings; per layer (lists of
 * num_layers): the two norm weights, the four projections' oneDNN packs, the KV pools
 * (num_slots, Hkv, D); cos/sin (B, rotary) contiguous; slots (B,) this step's KV slots; runs
 * the native kernel's (run_indptr, first, count); fns the addresses of rf_rms_norm,
 * rf_silu_mul, rf_rope_decode_attention. -> (mlp, residual, status): the last layer's output
 * and residual (their sum is the final norm's input), and rf_rope_decode_attention's status
 * (0, or the layer's nonzero status: the loop stops there); -3, with nothing touched, for
 * inputs it does not take (hidden not contiguous fp32, pools not contiguous and all fp32 or
 * all bf16 or all fp16 or all int8 with k_scales, v_scales: --kv-cache-dtype's pools are
 * read and written by the native attention; the scale lists are empty for the others). */
std::tuple<at::Tensor, at::Tensor, int64_t> decode_layers(
    at::Tensor hidden, const std::vector<at::Tensor> &input_norms,
    const std::vector<at::Tensor> &post_norms, const std::vector<std::vector<at::Tensor>> &projs,
    const std::vector<std::vector<int64_t>> &metas, const std::vector<at::Tensor> &k_pools,
    const std::vector<at::Tensor> &v_pools, const at::Tensor &cos, const at::Tensor &sin,
    const at::Tensor &slots, const at::Tensor &run_indptr, const at::Tensor &first,
    const at::Tensor &count, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    double scale, double eps, const std::vector<int64_t> &fns, int64_t threads,
    const std::vector<at::Tensor> &k_scales, const std::vector<at::Tensor> &v_scales) {
    pybind11::gil_scoped_release no_gil;
    const bool plain = hidden.is_contiguous() && hidden.scalar_type() == at::kFloat;
    const auto kv_type = k_pools.empty() ? at::kFloat : k_pools[0].scalar_type();
    if (kv_type != at::kFloat && kv_type != at::kBFloat16 && kv_type != at::kHalf &&
        kv_type != at::kChar)
        return {hidden, at::Tensor(), -3};
    const int kv_kind = kv_type == at::kChar       ? 3
                        : kv_type == at::kBFloat16 ? 1
                        : kv_type == at::kHalf     ? 2
                                                   : 0;
    const bool scaled = kv_kind == 3;  /* int8: each layer's scales (num_slots, Hkv) fp32 */
    if (scaled && (k_scales.size() != k_pools.size() || v_scales.size() != v_pools.size()))
        return {hidden, at::Tensor(), -3};
    for (size_t i = 0; plain && i < k_pools.size(); i++)
        if (!k_pools[i].is_contiguous() || !v_pools[i].is_contiguous() ||
            k_pools[i].scalar_type() != kv_type || v_pools[i].scalar_type() != kv_type ||
            (scaled && (!k_scales[i].is_contiguous() || !v_scales[i].is_contiguous() ||
                        k_scales[i].scalar_type() != at::kFloat ||
                        v_scales[i].scalar_type() != at::kFloat)))
            return {hidden, at::Tensor(), -3};
    if (!plain || 4 * k_pools.size() != projs.size() || projs.size() != metas.size())
        return {hidden, at::Tensor(), -3};
    auto rms_norm = reinterpret_cast<RmsNorm>(fns.at(0));
    auto silu_mul = reinterpret_cast<SiluMul>(fns.at(1));
    auto attention = reinterpret_cast<RopeDecodeAttention>(fns.at(2));
    auto qlinear = fns.size() > 3 ? reinterpret_cast<QLinear>(fns[3]) : nullptr;
    const int64_t rows = hidden.size(0), dim = hidden.size(1), q_size = num_heads * head_dim;
    const auto options = hidden.options();
    const int n = static_cast<int>(threads);
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
    for (int p = 0; p < 4 && !metas.empty(); p++)
        if (!metas[p].empty()) outs[p] = at::empty({rows, out_features(metas[p])}, options);
    /* projection p of layer i: its oneDNN pack, or its quantized ranges (metas non-empty) */
    auto project = [&](const at::Tensor &in, size_t i, int p) {
        const size_t j = 4 * i + p;
        if (metas[j].empty()) return packed_linear(in, projs[j][0]);
        at::Tensor out = outs[p];
        if (!out.defined() || out.size(1) != out_features(metas[j]))
            out = at::empty({rows, out_features(metas[j])}, options);
        return qlinear ? quant_linear(in, projs[j], metas[j], qlinear, n, out) : at::Tensor();
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
        if (!qkv.defined()) return {hidden, residual, -4};
        int64_t status = attention(
            f32(qkv), qkv.stride(0), f32(cos), f32(sin), cos.size(-1), k_pools[i].data_ptr(),
            v_pools[i].data_ptr(), k_pools[i].size(0), i64(slots), i64(run_indptr), i64(first),
            i64(count), (int)rows, (int)num_kv_heads, (int)(num_heads / num_kv_heads),
            (int)head_dim, (float)scale, 0.f, f32(attn), f32(lse), n, kv_kind,
            scaled ? f32(k_scales[i]) : nullptr, scaled ? f32(v_scales[i]) : nullptr);
        if (status != 0) return {hidden, residual, status};
        at::Tensor projected = project(attn, i, 1);
        if (!projected.defined()) return {hidden, residual, -4};
        const at::Tensor &sum = sums[1];
        rms_norm(f32(projected), dim, f32(hidden), dim, f32(post_norms[i]), (float)eps, rows, dim,
                 f32(sum), f32(x), n);
        at::Tensor gate_up = project(x, i, 2);
        if (!gate_up.defined()) return {hidden, residual, -4};
        const int64_t inter = gate_up.size(1) / 2;
        if (!act.defined() || act.size(1) != inter) act = at::empty({rows, inter}, options);
        silu_mul(f32(gate_up), gate_up.stride(0), rows, inter, f32(act), n);
        residual = sum;
        hidden = project(act, i, 3);
        if (!hidden.defined()) return {hidden, residual, -4};
    }
    return {hidden, residual, 0};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("decode_layers", &decode_layers, "every decoder layer of a decode-only step");
}
