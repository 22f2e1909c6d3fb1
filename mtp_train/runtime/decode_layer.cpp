// A whole decoder layer of a CPU decode or verify step in one call: RMSNorm, the fused q/k/v projection (with its
// bias, where the family has one), the per-head q/k norms (Qwen3, Gemma 3), the paged attention (over a sliding
// window, where the layer has one), the output projection, its norm (Gemma's sandwich norms) and its residual,
// RMSNorm, the gated MLP (SiLU, or Gemma's tanh-approximated GELU), its norm and its residual. Gemma's (1 + w)
// norms come with the offset already added to their weights.
//
// At batch 1 the layer's arithmetic is its weights' read; what torch's path adds on top is about 40 dispatched
// ops per layer, 1,200 per SmolLM2 step, which cost a third of the step once the weights stream at the memory's
// bandwidth (bench/RESULTS.md, "Decode at the memory-bandwidth limit"). The products are the small-row kernel's
// (small_rows.cpp) and the attention paged_attention.cpp's; the norms and the activation round as torch's do, up
// to the order of a sum.
//
// Built into the same library as small_rows.cpp (mtp_train/runtime/small_rows.py), with the same flags.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "kernels.h"

namespace {

// x [T, H] -> x * rsqrt(mean(x^2) + eps) * w, row by row.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t t = x.size(0), h = x.size(1);
  auto y = at::empty({t, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < t; ++r) {
    const float* row = xp + r * h;
    float squares = 0.f;
    for (int64_t i = 0; i < h; ++i) squares += row[i] * row[i];
    const float scale = 1.f / std::sqrt(squares / static_cast<float>(h) + static_cast<float>(eps));
    for (int64_t i = 0; i < h; ++i) yp[r * h + i] = row[i] * scale * wp[i];
  }
  return y;
}

// qkv [T, (Hq + 2 Hkv) D]: each query head and key head RMS-normed by q_norm [D] and k_norm [D] in place.
void head_norms(at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm, int64_t n_heads,
                int64_t n_kv_heads, int64_t d, double eps) {
  float* x = qkv.data_ptr<float>();
  const float* qw = q_norm.data_ptr<float>();
  const float* kw = k_norm.data_ptr<float>();
  const int64_t width = qkv.size(1);
  for (int64_t r = 0; r < qkv.size(0); ++r) {
    for (int64_t h = 0; h < n_heads + n_kv_heads; ++h) {
      float* head = x + r * width + h * d;
      const float* w = h < n_heads ? qw : kw;
      float squares = 0.f;
      for (int64_t i = 0; i < d; ++i) squares += head[i] * head[i];
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(d) + static_cast<float>(eps));
      for (int64_t i = 0; i < d; ++i) head[i] = head[i] * scale * w[i];
    }
  }
}

// gate_up [T, 2I] ([gate | up] per row) -> act(gate) * up [T, I]: SiLU, or with `gelu` tanh-approximated GELU.
at::Tensor gated(const at::Tensor& gate_up, bool gelu) {
  const int64_t t = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto y = at::empty({t, inter}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, t * inter, 4096, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) {
      const int64_t r = j / inter, i = j % inter;
      const float gate = g[r * 2 * inter + i];
      const float act = gelu ? 0.5f * gate * (1.f + std::tanh(0.7978845608f * (gate + 0.044715f * gate * gate * gate)))
                             : gate / (1.f + std::exp(-gate));
      yp[j] = act * g[r * 2 * inter + inter + i];
    }
  });
  return y;
}

// x += y, both [T, H].
void add_into(at::Tensor& x, const at::Tensor& y) {
  float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  for (int64_t i = 0, n = x.numel(); i < n; ++i) xp[i] += yp[i];
}

// x [T, H] float32 -> the layer's output [T, H]; the weights are packed by small_rows.cpp's pack (qkv
// [(Hq + 2 Hkv) D, H], o [H, Hq D], gate_up [2I, H], down [H, I]); norms [H] float32 (no attention norm: an EAGLE
// layer's; q/k norms [D] and the norms after attention and MLP where the family has them); the attention's arguments
// as paged_attention.cpp's attend takes them. With attention_input [T, K] (an EAGLE-3 layer's, K = 2H, normed
// already), the q/k/v projection reads it in place of the normed x, and x is the residual.
at::Tensor decode_layer(const at::Tensor& x, const std::optional<at::Tensor>& attention_norm, const at::Tensor& wqkv,
                        const std::optional<at::Tensor>& qkv_bias, const at::Tensor& wo, const at::Tensor& ffn_norm,
                        const at::Tensor& w_gate_up, const at::Tensor& w_down, double eps, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                        const at::Tensor& q_start, const at::Tensor& kv_lens, const at::Tensor& page_start,
                        const at::Tensor& pages, int64_t n_heads, int64_t n_kv_heads, double scale,
                        const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                        const std::optional<at::Tensor>& post_attention_norm,
                        const std::optional<at::Tensor>& post_ffn_norm, bool gelu, int64_t window,
                        const std::optional<at::Tensor>& attention_input) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "decode_layer: x [T, H] float32");
  const int64_t hidden = x.size(1), head_dim = k_cache.size(3), inter = w_down.size(1);
  for (const auto* norm : {&attention_norm, &post_attention_norm, &post_ffn_norm, &q_norm, &k_norm}) {
    const int64_t size = norm == &q_norm || norm == &k_norm ? head_dim : hidden;
    TORCH_CHECK(!norm->has_value() || ((*norm)->is_contiguous() && (*norm)->scalar_type() == at::kFloat &&
                                       (*norm)->numel() == size),
                "decode_layer: norm weights [H] (q/k norms [D]) float32");
  }
  TORCH_CHECK(ffn_norm.is_contiguous() && ffn_norm.scalar_type() == at::kFloat && ffn_norm.numel() == hidden,
              "decode_layer: norm weights [H] float32");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value() && post_attention_norm.has_value() == post_ffn_norm.has_value(),
              "decode_layer: q and k norms together, the norms after attention and MLP together");
  TORCH_CHECK(!attention_input.has_value() || (attention_input->dim() == 2 && attention_input->size(0) == x.size(0) &&
                                               attention_input->is_contiguous() &&
                                               attention_input->scalar_type() == at::kFloat),
              "decode_layer: attention_input [T, K] float32");
  const at::Tensor normed = attention_input.has_value() ? *attention_input  // EAGLE-3's [norm(embeds) | norm(g)]
                            : attention_norm.has_value() ? rms_norm(x, *attention_norm, eps) : x;  // EAGLE's: none
  at::Tensor qkv = mtp_kernels::linear(normed, wqkv, (n_heads + 2 * n_kv_heads) * head_dim);
  if (qkv_bias.has_value()) qkv.add_(*qkv_bias);
  if (q_norm.has_value()) head_norms(qkv, *q_norm, *k_norm, n_heads, n_kv_heads, head_dim, eps);
  const at::Tensor attended = mtp_kernels::attend(qkv, cos, sin, k_cache, v_cache, slots, q_start, kv_lens,
                                                  page_start, pages, n_heads, n_kv_heads, scale, window);
  at::Tensor h = x.clone();
  const at::Tensor out = mtp_kernels::linear(attended, wo, hidden);
  add_into(h, post_attention_norm.has_value() ? rms_norm(out, *post_attention_norm, eps) : out);
  const at::Tensor act = gated(mtp_kernels::linear(rms_norm(h, ffn_norm, eps), w_gate_up, 2 * inter), gelu);
  const at::Tensor down = mtp_kernels::linear(act, w_down, hidden);
  add_into(h, post_ffn_norm.has_value() ? rms_norm(down, *post_ffn_norm, eps) : down);
  return h;
}

}  // namespace

TORCH_LIBRARY(mtp_decode_layer, lib) {
  lib.def("decode_layer(Tensor x, Tensor? attention_norm, Tensor wqkv, Tensor? qkv_bias, Tensor wo, Tensor ffn_norm, "
          "Tensor w_gate_up, Tensor w_down, float eps, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
          "Tensor(b!) v_cache, Tensor slots, Tensor q_start, Tensor kv_lens, Tensor page_start, Tensor pages, "
          "int n_heads, int n_kv_heads, float scale, Tensor? q_norm=None, Tensor? k_norm=None, "
          "Tensor? post_attention_norm=None, Tensor? post_ffn_norm=None, bool gelu=False, int window=0, "
          "Tensor? attention_input=None) -> Tensor",
          decode_layer);
}
