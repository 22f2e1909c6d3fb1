// The runtime's CPU kernels, as one library (mtp_train/runtime/small_rows.py builds it): what each source file
// offers the others. Shapes are in the definitions.
#pragma once

#include <ATen/core/Tensor.h>

namespace mtp_kernels {

// small_rows.cpp: a weight packed once, multiplied by 1 to 8 rows in one read of it.
at::Tensor pack(const at::Tensor& w, bool bf16);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n);

// paged_attention.cpp: a decode or verify step's RoPE, cache writes and attention over the pages.
at::Tensor attend(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                  at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& q_start, const at::Tensor& kv_lens,
                  const at::Tensor& page_start, const at::Tensor& pages, int64_t n_heads, int64_t n_kv_heads,
                  double scale, int64_t window);

}  // namespace mtp_kernels
