// A step through every decoder layer of a plain Llama-family model in one call, for the
// worker's CPU path: the same ops, in the same order and on the same tensors, as
// the model's Python loop (services/worker/models/llama.py with the CPU attention
// backend), called through the dispatcher instead of from Python, so a step pays no
// Python per layer (at batch 1 about a fifth of a SmolLM2 step).
//
// Built at runtime by kernels/cpu_decoder.py and registered as
// torch.ops.<PAGODA_OP_NS>.decode_layers. The ops it calls belong to the cpu_fused,
// cpu_gemm, cpu_decode and cpu_prefill extensions, whose namespaces the caller names (and
// has loaded);
// they check their own inputs, so a bad argument raises as it would from Python.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#ifndef PAGODA_OP_NS
#define PAGODA_OP_NS pagoda_cpu_decoder
#endif

namespace {

using at::Tensor;
using OptTensors = c10::List<std::optional<Tensor>>;

// The registered op ns::name, as the handle type H it is stored in.
template <typename H>
struct Typed;
template <typename Sig>
struct Typed<c10::TypedOperatorHandle<Sig>> {
  static c10::TypedOperatorHandle<Sig> find(const std::string& ns, const char* name) {
    return c10::Dispatcher::singleton()
        .findSchemaOrThrow((ns + "::" + name).c_str(), "")
        .typed<Sig>();
  }
};

// The per-layer ops, as their extensions register them.
struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                      double)> add_rms_norm;
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                      const Tensor&, const Tensor&)> rotary;
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&)> write_kv_cache;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t,
                                  const std::optional<Tensor>&)> linear;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t,
                                  const std::optional<Tensor>&)> linear_silu;
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, double, int64_t, int64_t, double)>
      decode;
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, const Tensor&, double, int64_t,
                                double)>
      prefill;

  Ops(const std::string& fused, const std::string& gemm, const std::string& attn,
      const std::string& prefill_ns)
      : rms_norm(Typed<decltype(rms_norm)>::find(fused, "rms_norm")),
        add_rms_norm(Typed<decltype(add_rms_norm)>::find(fused, "add_rms_norm")),
        rotary(Typed<decltype(rotary)>::find(fused, "rotary")),
        write_kv_cache(Typed<decltype(write_kv_cache)>::find(fused, "write_kv_cache")),
        linear(Typed<decltype(linear)>::find(gemm, "linear")),
        linear_silu(Typed<decltype(linear_silu)>::find(gemm, "linear_silu")),
        decode(Typed<decltype(decode)>::find(attn, "decode")),
        prefill(Typed<decltype(prefill)>::find(prefill_ns, "prefill")) {}
};

// The model's shapes: heads and head_dim of the attention, and the output width of each
// packed weight (qkv, o, the SwiGLU's act, down), as the Python layers pass them.
struct Dims {
  int64_t num_heads, num_kv_heads, head_dim, qkv_n, o_n, act_n, down_n;
};

// The step's sequences as the attention backend splits them: the first num_decodes
// sequences decode (one token each); the rest are prefill chunks from token
// prefill_first on, prefill_starts their query_start_loc shifted to start at 0.
struct Split {
  int64_t num_decodes, prefill_first;
  const std::optional<Tensor>& prefill_starts;
};

// hidden [T, H] (the embedded tokens) -> (the last layer's MLP output, the residual
// stream before it): what the Python loop hands the final norm.
std::tuple<Tensor, Tensor> decode_layers(
    const Tensor& hidden_in, const Tensor& positions, at::TensorList input_norm,
    at::TensorList post_norm, at::TensorList qkv, const OptTensors& qkv_bias,
    const OptTensors& q_norm, const OptTensors& k_norm, at::TensorList o,
    const OptTensors& o_bias, at::TensorList gate_up, const OptTensors& gate_up_bias,
    at::TensorList down, const OptTensors& down_bias, at::TensorList k_caches,
    at::TensorList v_caches, const Tensor& cos_cache, const Tensor& sin_cache,
    const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& seq_lens,
    int64_t num_decodes, int64_t prefill_first, const std::optional<Tensor>& prefill_starts,
    at::IntArrayRef dims_in, double eps, double scale, const std::string& fused_ns,
    const std::string& gemm_ns, const std::string& decode_ns, const std::string& prefill_ns) {
  const int64_t L = static_cast<int64_t>(qkv.size());
  for (const size_t n : {input_norm.size(), post_norm.size(), qkv_bias.size(), q_norm.size(),
                         k_norm.size(), o.size(),
                         o_bias.size(), gate_up.size(), gate_up_bias.size(), down.size(),
                         down_bias.size(), k_caches.size(), v_caches.size()})
    TORCH_CHECK_VALUE(static_cast<int64_t>(n) == L, "every per-layer list must hold ", L,
                      " entries, one holds ", n);
  TORCH_CHECK_VALUE(L > 0, "no layers");
  TORCH_CHECK_VALUE(dims_in.size() == 7, "dims: 7 sizes, got ", dims_in.size());
  TORCH_CHECK_VALUE(hidden_in.dim() == 2, "hidden must be [tokens, hidden]");
  const Dims d{dims_in[0], dims_in[1], dims_in[2], dims_in[3], dims_in[4], dims_in[5], dims_in[6]};
  const int64_t q_size = d.num_heads * d.head_dim, kv_size = d.num_kv_heads * d.head_dim;
  TORCH_CHECK_VALUE(d.qkv_n == q_size + 2 * kv_size, "qkv width ", d.qkv_n, " != ", q_size,
                    " + 2 * ", kv_size);
  const int64_t T = hidden_in.size(0), S = seq_lens.size(0);
  const Split split{num_decodes, prefill_first, prefill_starts};
  TORCH_CHECK_VALUE(split.num_decodes >= 0 && split.num_decodes <= S, "num_decodes ",
                    split.num_decodes, " outside [0, ", S, "]");
  const bool prefills = split.num_decodes < S;
  TORCH_CHECK_VALUE(!prefills || (prefill_starts.has_value() && split.prefill_first >= 0 &&
                                  split.prefill_first <= T),
                    "a step with prefills needs prefill_starts and a prefill_first in [0, ", T,
                    "]");
  const Ops ops(fused_ns, gemm_ns, decode_ns, prefill_ns);

  Tensor hidden = hidden_in, residual, normed;
  for (int64_t l = 0; l < L; ++l) {
    if (l == 0) {  // the first layer's residual stream is its input
      normed = ops.rms_norm.call(hidden, input_norm[l], eps);
      residual = hidden;
    } else {
      std::tie(normed, residual) = ops.add_rms_norm.call(hidden, residual, input_norm[l], eps);
    }
    const Tensor qkv_out = ops.linear.call(normed, qkv[l], d.qkv_n, qkv_bias.get(l));
    // the projection's q / k / v, as the Python layer's split and reshapes
    Tensor q = qkv_out.narrow(1, 0, q_size), k = qkv_out.narrow(1, q_size, kv_size);
    const std::optional<Tensor> qn = q_norm.get(l), kn = k_norm.get(l);
    TORCH_CHECK_VALUE(qn.has_value() == kn.has_value(), "layer ", l,
                      ": a q norm without a k norm, or the reverse");
    if (qn.has_value()) {  // Qwen3: per-head RMSNorm of q and k before the rotation
      q = ops.rms_norm.call(q.reshape({T * d.num_heads, d.head_dim}), *qn, eps);
      k = ops.rms_norm.call(k.reshape({T * d.num_kv_heads, d.head_dim}), *kn, eps);
    }
    q = q.reshape({T, d.num_heads, d.head_dim});
    k = k.reshape({T, d.num_kv_heads, d.head_dim});
    const Tensor v =
        qkv_out.narrow(1, q_size + kv_size, kv_size).view({T, d.num_kv_heads, d.head_dim});
    const auto [q_rot, k_rot] = ops.rotary.call(q, k, positions, cos_cache, sin_cache);
    ops.write_kv_cache.call(k_rot, v, k_caches[l], v_caches[l], slot_mapping);
    const Tensor attn = at::empty_like(q_rot);
    if (split.num_decodes > 0) {  // slices as the backend's: the rows of the decodes
      const int64_t nd = split.num_decodes;
      ops.decode.call(attn.narrow(0, 0, nd), q_rot.narrow(0, 0, nd), k_caches[l], v_caches[l],
                      block_tables.narrow(0, 0, nd), seq_lens.narrow(0, 0, nd), scale, 0, 0,
                      0.0);
    }
    if (prefills) {
      const int64_t first = split.prefill_first, nd = split.num_decodes;
      ops.prefill.call(attn.narrow(0, first, T - first), q_rot.narrow(0, first, T - first),
                       k_caches[l], v_caches[l], *split.prefill_starts,
                       seq_lens.narrow(0, nd, S - nd), block_tables.narrow(0, nd, S - nd),
                       scale, 0, 0.0);
    }
    const Tensor o_out = ops.linear.call(attn.view({T, q_size}), o[l], d.o_n, o_bias.get(l));
    std::tie(normed, residual) = ops.add_rms_norm.call(o_out, residual, post_norm[l], eps);
    const Tensor act = ops.linear_silu.call(normed, gate_up[l], d.act_n, gate_up_bias.get(l));
    hidden = ops.linear.call(act, down[l], d.down_n, down_bias.get(l));
  }
  return {hidden, residual};
}

}  // namespace

// The namespace is a macro, as in the other CPU extensions.
#define PAGODA_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
PAGODA_LIBRARY(PAGODA_OP_NS, m) {
  m.def("decode_layers(Tensor hidden, Tensor positions, Tensor[] input_norm, "
        "Tensor[] post_norm, Tensor[] qkv, Tensor?[] qkv_bias, Tensor?[] q_norm, "
        "Tensor?[] k_norm, Tensor[] o, Tensor?[] o_bias, "
        "Tensor[] gate_up, Tensor?[] gate_up_bias, Tensor[] down, Tensor?[] down_bias, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor cos_cache, Tensor sin_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int num_decodes, "
        "int prefill_first, Tensor? prefill_starts, int[] dims, float eps, float scale, "
        "str fused_ns, str gemm_ns, str decode_ns, str prefill_ns) -> (Tensor, Tensor)",
        &decode_layers);
}
