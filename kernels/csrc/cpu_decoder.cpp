// A step through every decoder layer of a plain Llama-family model in one call, for the
// worker's CPU path: the same kernels, in the same order, as the model's Python loop
// (services/worker/models/llama.py with the CPU attention backend), so a step pays no
// Python per layer (at batch 1 about a fifth of a SmolLM2 step).
//
// The linears (cpu_gemm; or oneDNN's, with cpu_gemv and cpu_fused's silu_mul, where the
// weights were packed for oneDNN) and the attention (cpu_decode, cpu_prefill) are called
// through the dispatcher, by the namespaces the caller names (and has loaded); they check
// their own inputs. The norms, the rotary and the KV-cache writes are the row kernels the
// cpu_fused ops wrap (cpu_rows.h), called here directly on buffers allocated once a
// step, their inputs checked once a step: per layer, the dispatch, allocation and views
// of those five op calls cost ~15 us, ~0.5 ms of a ~10 ms batch-1 step. A bad argument
// raises ValueError, as from Python.
//
// Built at runtime by kernels/cpu_decoder.py (with -ffp-contract=off, as cpu_fused, so
// the row kernels round alike) and registered as torch.ops.<PAGODA_OP_NS>.decode_layers.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_rows.h"

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

  Ops(const std::string& gemm, const std::string& attn, const std::string& prefill_ns)
      : linear(Typed<decltype(linear)>::find(gemm, "linear")),
        linear_silu(Typed<decltype(linear_silu)>::find(gemm, "linear_silu")),
        decode(Typed<decltype(decode)>::find(attn, "decode")),
        prefill(Typed<decltype(prefill)>::find(prefill_ns, "prefill")) {}
};

// The linears of a model whose weights oneDNN packed (services/worker/layers/linear.py:
// bf16 on an AMX CPU, or where cpu_gemm has no vector path), as linear.py's linear() runs
// them: mkldnn::_linear_pointwise on the packed weight; at up to gemv_max_rows rows (0:
// never) cpu_gemv's linear_bf16 on the plain one; the SwiGLU as that linear of gate_up,
// then cpu_fused's silu_mul.
class OneDnnLinears {
 public:
  OneDnnLinears(at::TensorList plain, int64_t gemv_max_rows, const std::string& gemv_ns,
                const std::string& fused_ns)
      : plain_(plain), gemv_max_rows_(gemv_max_rows),
        pointwise_(c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise",
                                                                  "")),
        silu_mul_(Typed<decltype(silu_mul_)>::find(fused_ns, "silu_mul")) {
    if (gemv_max_rows_ > 0) gemv_ = Typed<Gemv>::find(gemv_ns, "linear_bf16");
  }

  // x W^T + bias of weight `which` (0 qkv, 1 o, 2 gate_up, 3 down) of layer l
  Tensor linear(const Tensor& x, const Tensor& packed, int64_t l, int which,
                const std::optional<Tensor>& bias) const {
    if (gemv_ && x.size(0) <= gemv_max_rows_)
      return gemv_->call(x, plain_[4 * l + which], bias);
    torch::jit::Stack stack{x, packed, bias, c10::IValue(std::string("none")),
                            c10::IValue(c10::List<std::optional<at::Scalar>>()),
                            c10::IValue()};
    pointwise_.callBoxed(&stack);
    return stack[0].toTensor();
  }

  Tensor silu_mul(const Tensor& gate_up) const { return silu_mul_.call(gate_up); }

 private:
  using Gemv = c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&,
                                               const std::optional<Tensor>&)>;
  at::TensorList plain_;  // 4 a layer: qkv, o, gate_up, down
  int64_t gemv_max_rows_;
  c10::OperatorHandle pointwise_;
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_mul_;
  std::optional<Gemv> gemv_;
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

using pagoda_cpu_rows::check_cpu;
using pagoda_cpu_rows::check_positions;
using pagoda_cpu_rows::check_rotary_tables;
using pagoda_cpu_rows::check_slot_mapping;
using pagoda_cpu_rows::check_slots;

// The per-step tensors the row kernels (cpu_rows.h) read, checked once a step as the
// cpu_fused ops check them once a call, and made contiguous where they were not.
struct RowInputs {
  std::vector<Tensor> input_norm, post_norm;
  std::vector<std::optional<Tensor>> q_norm, k_norm;
  Tensor positions, cos, sin, slots;
  bool bf16_cache = false;  // bf16 caches under fp32 rows: the K/V rows are rounded as written
};

Tensor dense(const Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// A norm weight of layer l: [n] of the activations' dtype.
Tensor norm_weight(const Tensor& w, int64_t n, at::ScalarType dtype, const char* what,
                   int64_t l) {
  check_cpu(w, what);
  TORCH_CHECK_VALUE(w.dim() == 1 && w.size(0) == n, "layer ", l, ": ", what, " must be [", n,
                    "], got ", w.sizes());
  TORCH_CHECK_VALUE(w.scalar_type() == dtype, "layer ", l, ": ", what, " dtype ",
                    w.scalar_type(), " != hidden dtype ", dtype);
  return dense(w);
}

RowInputs check_rows(const Tensor& hidden, const Tensor& positions, at::TensorList input_norm,
                     at::TensorList post_norm, const OptTensors& q_norm,
                     const OptTensors& k_norm, at::TensorList k_caches, at::TensorList v_caches,
                     const Tensor& cos, const Tensor& sin, const Tensor& slot_mapping,
                     const Dims& d) {
  const int64_t T = hidden.size(0), H = hidden.size(1), L = static_cast<int64_t>(input_norm.size());
  const auto dtype = hidden.scalar_type();
  check_cpu(hidden, "hidden");
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16,
                    "hidden must be float32 or bfloat16, got ", dtype);
  RowInputs in;
  for (int64_t l = 0; l < L; ++l) {
    in.input_norm.push_back(norm_weight(input_norm[l], H, dtype, "input_norm", l));
    in.post_norm.push_back(norm_weight(post_norm[l], H, dtype, "post_norm", l));
    const std::optional<Tensor> qn = q_norm.get(l), kn = k_norm.get(l);
    TORCH_CHECK_VALUE(qn.has_value() == kn.has_value(), "layer ", l,
                      ": a q norm without a k norm, or the reverse");
    in.q_norm.push_back(qn ? std::optional(norm_weight(*qn, d.head_dim, dtype, "q_norm", l))
                           : std::nullopt);
    in.k_norm.push_back(kn ? std::optional(norm_weight(*kn, d.head_dim, dtype, "k_norm", l))
                           : std::nullopt);
  }
  // the rotary's inputs (cpu_fused's check_rotary)
  for (const auto* t : {&positions, &cos, &sin, &slot_mapping}) check_cpu(*t, "every tensor");
  TORCH_CHECK_VALUE(d.head_dim % 2 == 0, "head_dim must be even, got ", d.head_dim);
  check_rotary_tables(positions, cos, sin, T, d.head_dim);
  in.positions = dense(positions);
  in.cos = dense(cos);
  in.sin = dense(sin);
  if (in.positions.scalar_type() == at::kLong)
    check_positions(in.positions.const_data_ptr<int64_t>(), T, cos.size(0));
  else
    check_positions(in.positions.const_data_ptr<int32_t>(), T, cos.size(0));
  // the caches and the slots (cpu_fused's write_kv_cache), every layer's before any write
  check_slot_mapping(slot_mapping, T);
  int64_t num_slots = std::numeric_limits<int64_t>::max();
  // the hidden dtype, or bf16 under fp32 (an fp32 model's bf16 KV cache), as layer 0's
  const auto cache_dtype = L > 0 ? k_caches[0].scalar_type() : dtype;
  in.bf16_cache = cache_dtype != dtype;
  for (int64_t l = 0; l < L; ++l) {
    const Tensor &k = k_caches[l], &v = v_caches[l];
    check_cpu(k, "k_cache");
    check_cpu(v, "v_cache");
    TORCH_CHECK_VALUE(k.dim() == 4 && v.sizes() == k.sizes() && k.size(2) == d.num_kv_heads &&
                          k.size(3) == d.head_dim,
                      "layer ", l, ": k_cache and v_cache must be [num_blocks, block_size, ",
                      d.num_kv_heads, ", ", d.head_dim, "], got ", k.sizes(), " and ",
                      v.sizes());
    TORCH_CHECK_VALUE((cache_dtype == dtype || cache_dtype == at::kBFloat16) &&
                          k.scalar_type() == cache_dtype && v.scalar_type() == cache_dtype,
                      "layer ", l, ": k_cache and v_cache must be ", dtype,
                      " (or bfloat16 under float32, in every layer alike), got ",
                      k.scalar_type(), " and ", v.scalar_type());
    // a copy of a cache would take the writes and be dropped
    TORCH_CHECK_VALUE(k.is_contiguous() && v.is_contiguous(),
                      "k_cache and v_cache must be contiguous");
    num_slots = std::min(num_slots, k.size(0) * k.size(1));
  }
  in.slots = dense(slot_mapping);
  check_slots(in.slots.const_data_ptr<int64_t>(), T, num_slots);
  return in;
}

// The attention ops' views of the step's buffers, taken once a step: the decodes' rows
// and the prefill chunks' (none of a kind: undefined).
struct AttentionViews {
  Tensor dec_out, dec_q, dec_tables, dec_lens;
  Tensor pre_out, pre_q, pre_lens, pre_tables;
};

AttentionViews attention_views(const Tensor& attn, const Tensor& q_rot, const Tensor& tables,
                               const Tensor& lens, const Split& split) {
  const int64_t T = attn.size(0), S = lens.size(0), nd = split.num_decodes;
  AttentionViews v;
  if (nd > 0) {  // slices as the backend's: the rows of the decodes (all of them: no slice)
    const bool all_tokens = nd == T, all_seqs = nd == S;
    v.dec_out = all_tokens ? attn : attn.narrow(0, 0, nd);
    v.dec_q = all_tokens ? q_rot : q_rot.narrow(0, 0, nd);
    v.dec_tables = all_seqs ? tables : tables.narrow(0, 0, nd);
    v.dec_lens = all_seqs ? lens : lens.narrow(0, 0, nd);
  }
  if (nd < S) {
    const int64_t first = split.prefill_first;
    v.pre_out = attn.narrow(0, first, T - first);
    v.pre_q = q_rot.narrow(0, first, T - first);
    v.pre_lens = lens.narrow(0, nd, S - nd);
    v.pre_tables = tables.narrow(0, nd, S - nd);
  }
  return v;
}

// The rows the caller keeps of the last layer's output (the sampled tokens'): int64 [R]
// within [0, T), in any order; the other rows' attention output goes no further (their
// K and V are written, as every layer's).
std::optional<Tensor> checked_output_rows(const std::optional<Tensor>& rows, int64_t T) {
  if (!rows.has_value()) return std::nullopt;
  check_cpu(*rows, "output_rows");
  TORCH_CHECK_VALUE(rows->dim() == 1 && rows->scalar_type() == at::kLong,
                    "output_rows must be a 1-D int64 tensor, got ", rows->sizes(), " ",
                    rows->scalar_type());
  const Tensor r = dense(*rows);
  const int64_t* p = r.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < r.size(0); ++i)
    TORCH_CHECK_VALUE(p[i] >= 0 && p[i] < T, "output_rows[", i, "] = ", p[i], " outside [0, ",
                      T, ")");
  return r;
}

template <typename T>
T* mut(const Tensor& t) { return static_cast<T*>(t.mutable_data_ptr()); }
template <typename T>
const T* cptr(const Tensor& t) { return static_cast<const T*>(t.const_data_ptr()); }

// hidden [T, H] (the embedded tokens) -> (the last layer's MLP output, the residual
// stream before it): what the Python loop hands the final norm. The norms, rotary and
// cache writes run the row kernels on buffers allocated here once a step (the residual
// stream updated in place); the linears and the attention are the registered ops.
// output_rows (int64 [R]): only those rows of both, in that order, the last layer's o
// projection and MLP run for them alone (a prefill's other tokens need only their K/V).
std::tuple<Tensor, Tensor> decode_layers(
    const Tensor& hidden_in, const Tensor& positions, at::TensorList input_norm,
    at::TensorList post_norm, at::TensorList qkv, const OptTensors& qkv_bias,
    const OptTensors& q_norm, const OptTensors& k_norm, at::TensorList o,
    const OptTensors& o_bias, at::TensorList gate_up, const OptTensors& gate_up_bias,
    at::TensorList down, const OptTensors& down_bias, at::TensorList k_caches,
    at::TensorList v_caches, const Tensor& cos_cache, const Tensor& sin_cache,
    const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& seq_lens,
    int64_t num_decodes, int64_t prefill_first, const std::optional<Tensor>& prefill_starts,
    at::IntArrayRef dims_in, double eps_in, double scale, const std::string& gemm_ns,
    const std::string& decode_ns, const std::string& prefill_ns,
    const std::optional<Tensor>& output_rows_in, at::TensorList onednn_plain,
    int64_t gemv_max_rows, const std::string& gemv_ns, const std::string& fused_ns) {
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
  const int64_t T = hidden_in.size(0), H = hidden_in.size(1), S = seq_lens.size(0);
  TORCH_CHECK_VALUE(d.down_n == H && d.o_n == H, "o and down must map back to the hidden size ",
                    H, ", got ", d.o_n, " and ", d.down_n);
  const Split split{num_decodes, prefill_first, prefill_starts};
  TORCH_CHECK_VALUE(split.num_decodes >= 0 && split.num_decodes <= S, "num_decodes ",
                    split.num_decodes, " outside [0, ", S, "]");
  const bool prefills = split.num_decodes < S;
  TORCH_CHECK_VALUE(!prefills || (prefill_starts.has_value() && split.prefill_first >= 0 &&
                                  split.prefill_first <= T),
                    "a step with prefills needs prefill_starts and a prefill_first in [0, ", T,
                    "]");
  const Tensor hidden0 = dense(hidden_in);
  const RowInputs in = check_rows(hidden0, positions, input_norm, post_norm, q_norm, k_norm,
                                  k_caches, v_caches, cos_cache, sin_cache, slot_mapping, d);
  const std::optional<Tensor> output_rows = checked_output_rows(output_rows_in, T);
  const Ops ops(gemm_ns, decode_ns, prefill_ns);
  // oneDNN-packed linears: the plain weights come along, 4 a layer (cpu_gemm's: none)
  std::optional<OneDnnLinears> onednn;
  if (!onednn_plain.empty()) {
    TORCH_CHECK_VALUE(static_cast<int64_t>(onednn_plain.size()) == 4 * L,
                      "onednn_plain must hold 4 weights a layer (qkv, o, gate_up, down), got ",
                      onednn_plain.size(), " for ", L, " layers");
    onednn.emplace(onednn_plain, gemv_max_rows, gemv_ns, fused_ns);
  }
  // x W^T + bias of the layer's weight `which` (0 qkv, 1 o, 3 down), packed as `packed`
  const auto linear = [&](const Tensor& x, const Tensor& packed, int64_t n, int64_t l,
                          int which, const std::optional<Tensor>& bias) {
    return onednn ? onednn->linear(x, packed, l, which, bias) : ops.linear.call(x, packed, n, bias);
  };
  // the SwiGLU's silu(gate) * up
  const auto swiglu = [&](const Tensor& x, const Tensor& packed, int64_t n, int64_t l,
                          const std::optional<Tensor>& bias) {
    return onednn ? onednn->silu_mul(onednn->linear(x, packed, l, 2, bias))
                  : ops.linear_silu.call(x, packed, n, bias);
  };
  const float eps = static_cast<float>(eps_in);
  // per layer, as the Python loop: a layer's q / k norms are its own
  const bool qk_norms = std::any_of(in.q_norm.begin(), in.q_norm.end(),
                                    [](const std::optional<Tensor>& n) { return n.has_value(); });

  const auto opts = hidden0.options();
  const Tensor normed = at::empty({T, H}, opts), residual = at::empty({T, H}, opts);
  const Tensor q_rot = at::empty({T, d.num_heads, d.head_dim}, opts);
  const Tensor k_rot = at::empty({T, d.num_kv_heads, d.head_dim}, opts);
  const Tensor attn = at::empty({T, d.num_heads, d.head_dim}, opts);
  const Tensor attn_rows = attn.view({T, q_size});
  Tensor q_normed, k_normed;  // the per-head q / k norms' outputs (Qwen3)
  if (qk_norms) {
    q_normed = at::empty({T, d.num_heads, d.head_dim}, opts);
    k_normed = at::empty({T, d.num_kv_heads, d.head_dim}, opts);
  }
  const AttentionViews views = attention_views(attn, q_rot, block_tables, seq_lens, split);
  Tensor kept_residual;  // the residual stream of the kept rows (output_rows), when given

  auto run = [&](auto element, auto position) {
    using E = decltype(element);  // float, or uint16_t for bf16 bits
    using P = decltype(position);
    using pagoda_cpu_rows::RowLayout;
    E* res = mut<E>(residual);
    // the residual stream: layer 0's is its input (the caller's, not written); each sum
    // goes to `residual`, updated in place from then on
    const E* stream = cptr<E>(hidden0);
    Tensor hidden = hidden0;
    for (int64_t l = 0; l < L; ++l) {
      pagoda_cpu_rows::rms_norm_rows<E>(mut<E>(normed), res, cptr<E>(hidden), RowLayout{1, H},
                                     l == 0 ? nullptr : stream, cptr<E>(in.input_norm[l]), T, H,
                                     eps);
      const Tensor qkv_out = linear(normed, qkv[l], d.qkv_n, l, 0, qkv_bias.get(l));
      const E* q = cptr<E>(qkv_out);
      const E* k = q + q_size;
      const E* v = k + kv_size;
      int64_t qs = d.qkv_n, ks = d.qkv_n;
      if (in.q_norm[l].has_value()) {  // Qwen3: per-head RMSNorm of q and k before the rotation
        pagoda_cpu_rows::rms_norm_rows<E>(mut<E>(q_normed), nullptr, q,
                                       RowLayout{d.num_heads, d.qkv_n}, nullptr,
                                       cptr<E>(*in.q_norm[l]), T * d.num_heads, d.head_dim, eps);
        pagoda_cpu_rows::rms_norm_rows<E>(mut<E>(k_normed), nullptr, k,
                                       RowLayout{d.num_kv_heads, d.qkv_n}, nullptr,
                                       cptr<E>(*in.k_norm[l]), T * d.num_kv_heads, d.head_dim,
                                       eps);
        q = cptr<E>(q_normed);
        k = cptr<E>(k_normed);
        qs = q_size;
        ks = kv_size;
      }
      pagoda_cpu_rows::rotary_rows(mut<E>(q_rot), mut<E>(k_rot), q, qs, k, ks, T, d.num_heads,
                                   d.num_kv_heads, d.head_dim, cptr<P>(in.positions),
                                   cptr<float>(in.cos), cptr<float>(in.sin));
      pagoda_cpu_rows::write_kv_rows_as(k_caches[l].mutable_data_ptr(),
                                        v_caches[l].mutable_data_ptr(), in.bf16_cache,
                                        cptr<E>(k_rot), kv_size, v, d.qkv_n,
                                        cptr<int64_t>(in.slots), T, kv_size);
      if (views.dec_out.defined())
        ops.decode.call(views.dec_out, views.dec_q, k_caches[l], v_caches[l], views.dec_tables,
                        views.dec_lens, scale, 0, 0, 0.0);
      if (views.pre_out.defined())
        ops.prefill.call(views.pre_out, views.pre_q, k_caches[l], v_caches[l], *prefill_starts,
                         views.pre_lens, views.pre_tables, scale, 0, 0.0);
      // from the o projection on, the rows that go on: all of them, or in the last layer
      // the kept ones (the rest of its output is never read)
      Tensor o_in = attn_rows, o_normed = normed, kept_stream;
      E* o_res = res;
      int64_t rows = T;
      if (l == L - 1 && output_rows.has_value()) {
        rows = output_rows->size(0);
        o_in = attn_rows.index_select(0, *output_rows);
        kept_stream = (l == 0 ? hidden0 : residual).index_select(0, *output_rows);
        stream = cptr<E>(kept_stream);
        o_normed = at::empty({rows, H}, opts);
        kept_residual = at::empty({rows, H}, opts);
        o_res = mut<E>(kept_residual);
      }
      const Tensor o_out = linear(o_in, o[l], d.o_n, l, 1, o_bias.get(l));
      pagoda_cpu_rows::rms_norm_rows<E>(mut<E>(o_normed), o_res, cptr<E>(o_out),
                                     RowLayout{1, H}, stream, cptr<E>(in.post_norm[l]), rows,
                                     H, eps);
      stream = res;
      const Tensor act = swiglu(o_normed, gate_up[l], d.act_n, l, gate_up_bias.get(l));
      hidden = linear(act, down[l], d.down_n, l, 3, down_bias.get(l));
    }
    return hidden;
  };
  const bool bf16 = hidden0.scalar_type() == at::kBFloat16;
  const bool pos64 = in.positions.scalar_type() == at::kLong;
  Tensor hidden;
  if (bf16) hidden = pos64 ? run(uint16_t{}, int64_t{}) : run(uint16_t{}, int32_t{});
  else hidden = pos64 ? run(float{}, int64_t{}) : run(float{}, int32_t{});
  return {hidden, output_rows.has_value() ? kept_residual : residual};
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
        "str gemm_ns, str decode_ns, str prefill_ns, Tensor? output_rows, "
        "Tensor[] onednn_plain, int gemv_max_rows, str gemv_ns, str fused_ns) "
        "-> (Tensor, Tensor)",
        &decode_layers);
}
