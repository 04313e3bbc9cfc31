// The element types a CPU attention call runs on, read from its tensors once, for the
// decode (cpu_decode.cpp) and prefill (cpu_prefill.cpp) kernels alike: the query's (and
// out's), the KV cache's and the block table's index. The pairs are fp32 or bf16 query
// and caches alike, or an fp32 query over bf16 caches (an fp32 model's opt-in bf16 KV
// cache); int32 or int64 tables. The Python wrappers check the tensors; a kernel's typed
// body is instantiated only for the pairs listed here.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

namespace pagoda_cpu_attention {

// fn(Q{}, T{}, I{}): Q and T float or uint16_t (bf16 bits), I int32_t or int64_t.
template <class Fn>
void with_attention_types(const at::Tensor& query, const at::Tensor& k_cache,
                          const at::Tensor& block_tables, Fn&& fn) {
  auto with_index = [&](auto q, auto t) {
    if (block_tables.scalar_type() == at::kInt) fn(q, t, int32_t{});
    else fn(q, t, int64_t{});
  };
  if (query.scalar_type() != at::kFloat) with_index(uint16_t{}, uint16_t{});
  else if (k_cache.scalar_type() == at::kBFloat16) with_index(float{}, uint16_t{});
  else with_index(float{}, float{});
}

}  // namespace pagoda_cpu_attention
