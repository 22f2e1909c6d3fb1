// The attention of a CPU decode or verify step in one call: rotary embedding of the queries and keys, the new keys
// and values stored in their cache slots, and each query's softmax over its sequence's paged keys.
//
// Torch's path does this in about 30 small ops per layer (split, rotate, two cache writes, two page gathers, a
// padded mask, SDPA, transposes): at batch 1 their dispatch costs more than the arithmetic, which is a few
// thousand multiply-adds per head. Here every query row and head is one work item: its scores over the keys
// its causal mask lets it see (read in place from the pages, no gather, no mask), a softmax, and the weighted sum
// of the values. Each row's result depends on its own sequence alone, never on the rest of the batch.
//
// Built into the same library as small_rows.cpp (mtp_train/runtime/small_rows.py), with the same flags.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// x [D] rotated by the half-rotation layout (HF Llama): out[i] = x[i] cos[i] - x[i + D/2] sin[i] for i < D/2,
// x[i] cos[i] + x[i - D/2] sin[i] above; products rounded one by one as torch's x * cos + rotate(x) * sin.
inline void rotate(const float* x, const float* cos, const float* sin, float* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float rot = i < half ? -x[i + half] : x[i - half];
    const float a = x[i] * cos[i];
    const float b = rot * sin[i];
    out[i] = a + b;
  }
}

typedef float vec __attribute__((vector_size(64)));
constexpr int64_t LANES = 16;

// The sum of v's lanes: a tree on AVX-512 (one instruction's worth), pairwise elsewhere; never 16 serial adds.
inline float lane_sum(vec v) {
#if defined(__AVX512F__)
  __m512 m;
  std::memcpy(&m, &v, sizeof(m));
  return _mm512_reduce_add_ps(m);
#else
  float s[LANES];
  std::memcpy(s, &v, sizeof(s));
  for (int64_t width = LANES / 2; width > 0; width /= 2)
    for (int64_t l = 0; l < width; ++l) s[l] += s[l + width];
  return s[0];
#endif
}

inline float dot(const float* a, const float* b, int64_t d) {
  vec acc = {};
  int64_t i = 0;
  for (; i + LANES <= d; i += LANES) {
    vec x, y;
    std::memcpy(&x, a + i, sizeof(vec));
    std::memcpy(&y, b + i, sizeof(vec));
    acc += x * y;
  }
  float s = lane_sum(acc);
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

// Each query row t (of sequence seq_of[t]) and head h: softmax over the keys its causal mask lets it see, read in
// place from the pages, times the values -> out [T, Hq * D]. q [T, Hq, D] is rotated; the cache holds this step's keys.
// A work item is a row and `per` of its heads: all of them where there are rows enough to keep every thread busy,
// so that each page of its sequence is read once, front to back; else one (a decode at batch 1 spreads its heads).
at::Tensor attend_rows(const float* qp, const at::Tensor& like, int64_t t_total, int64_t n_heads, int64_t n_kv_heads,
                       int64_t d, int64_t page_size, const float* kc, const float* vc, const int64_t* qs,
                       const int64_t* kvl, const int64_t* ps, const int64_t* pg, int64_t batch, double scale) {
  const int64_t group = n_heads / n_kv_heads;
  const int64_t per = t_total >= 8 * at::get_num_threads() ? n_heads : 1, items = n_heads / per;
  std::vector<int64_t> seq_of(t_total);
  for (int64_t b = 0; b < batch; ++b) std::fill(seq_of.begin() + qs[b], seq_of.begin() + qs[b + 1], b);

  auto out = at::empty({t_total, n_heads * d}, like.options());
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, t_total * items, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> score;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t t = w / items, h0 = (w % items) * per, b = seq_of[t];
      const int64_t q_len = qs[b + 1] - qs[b], keys = kvl[b] - q_len + (t - qs[b]) + 1;
      const float* q0 = qp + (t * n_heads + h0) * d;
      score.resize(per * keys);
      for (int64_t j = 0; j < keys; ++j) {
        const int64_t flat = pg[ps[b] + j / page_size] * page_size + j % page_size;
        const float* k = kc + flat * n_kv_heads * d;
        for (int64_t g = 0; g < per; ++g) score[g * keys + j] = dot(q0 + g * d, k + (h0 + g) / group * d, d) * sc;
      }
      for (int64_t g = 0; g < per; ++g) {  // each head's softmax, in place
        float* sg = score.data() + g * keys;
        const float top = *std::max_element(sg, sg + keys);
        float total = 0.f;
        for (int64_t j = 0; j < keys; ++j) total += (sg[j] = std::exp(sg[j] - top));
        for (int64_t j = 0; j < keys; ++j) sg[j] /= total;
      }
      float* o0 = op + t * n_heads * d + h0 * d;
      std::fill_n(o0, per * d, 0.f);
      for (int64_t j = 0; j < keys; ++j) {
        const int64_t flat = pg[ps[b] + j / page_size] * page_size + j % page_size;
        const float* v_row = vc + flat * n_kv_heads * d;
        for (int64_t g = 0; g < per; ++g) {
          const float p = score[g * keys + j];
          const float* v = v_row + (h0 + g) / group * d;
          float* o = o0 + g * d;
          for (int64_t i = 0; i < d; ++i) o[i] += p * v[i];
        }
      }
    }
  });
  return out;
}

}  // namespace

namespace mtp_kernels {

// qkv [T, (Hq + 2 Hkv) D] float32: each token's queries, keys and values (the fused projection's output);
// cos, sin [T, D]; k_cache, v_cache [pages, page_size, Hkv, D] (written at ``slots [T]``); ``q_start [B + 1]``,
// ``kv_lens [B]``, ``page_start [B + 1]``, ``pages [N]`` int64: sequence b's new tokens are rows
// q_start[b]..q_start[b + 1] of qkv, it holds kv_lens[b] tokens after this step, in pages
// pages[page_start[b]..page_start[b + 1]]. Query i of b sees keys 0..kv_lens[b] - q_len + i. -> [T, Hq D].
at::Tensor attend(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                  at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& q_start, const at::Tensor& kv_lens,
                  const at::Tensor& page_start, const at::Tensor& pages, int64_t n_heads, int64_t n_kv_heads,
                  double scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat, "attend: qkv [T, C] float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.scalar_type() == at::kFloat && v_cache.sizes() == k_cache.sizes(),
              "attend: k_cache, v_cache [pages, page_size, Hkv, D] float32");
  const int64_t t_total = qkv.size(0), d = k_cache.size(3), page_size = k_cache.size(1);
  TORCH_CHECK(qkv.size(1) == (n_heads + 2 * n_kv_heads) * d && k_cache.size(2) == n_kv_heads &&
                  n_heads % n_kv_heads == 0, "attend: head counts do not match qkv and the cache");
  for (const at::Tensor* t : {&slots, &q_start, &kv_lens, &page_start, &pages})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(), "attend: int64 indexes");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == t_total * d && sin.numel() == t_total * d,
              "attend: cos, sin [T, D] contiguous");
  const int64_t batch = kv_lens.numel(), width = qkv.size(1);
  const float* x = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* kvl = kv_lens.data_ptr<int64_t>();
  const int64_t* ps = page_start.data_ptr<int64_t>();
  const int64_t* pg = pages.data_ptr<int64_t>();
  TORCH_CHECK(q_start.numel() == batch + 1 && page_start.numel() == batch + 1 && qs[batch] == t_total,
              "attend: q_start does not match qkv's rows");

  // Rotated queries; rotated keys and the values go straight into their cache slots.
  auto q = at::empty({t_total, n_heads, d}, qkv.options());
  float* qp = q.data_ptr<float>();
  for (int64_t t = 0; t < t_total; ++t) {
    const float* row = x + t * width;
    for (int64_t h = 0; h < n_heads; ++h) rotate(row + h * d, c + t * d, s + t * d, qp + (t * n_heads + h) * d, d);
    float* k_slot = kc + slot[t] * n_kv_heads * d;
    float* v_slot = vc + slot[t] * n_kv_heads * d;
    for (int64_t h = 0; h < n_kv_heads; ++h) {
      rotate(row + (n_heads + h) * d, c + t * d, s + t * d, k_slot + h * d, d);
      std::copy_n(row + (n_heads + n_kv_heads + h) * d, d, v_slot + h * d);
    }
  }
  return attend_rows(qp, qkv, t_total, n_heads, n_kv_heads, d, page_size, kc, vc, qs, kvl, ps, pg, batch, scale);
}

// The same attention for queries already rotated, whose keys and values are already in the cache (torch wrote them):
// q [T, Hq, D] float32 contiguous, the rest as ``attend`` takes it. A step of many decodes runs its attention so,
// its projections on BLAS. -> [T, Hq D].
at::Tensor attend_paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& q_start, const at::Tensor& kv_lens, const at::Tensor& page_start,
                        const at::Tensor& pages, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kFloat, "attend_paged: q [T, Hq, D] float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.scalar_type() == at::kFloat && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
              "attend_paged: k_cache, v_cache [pages, page_size, Hkv, D] float32, matching q");
  for (const at::Tensor* t : {&q_start, &kv_lens, &page_start, &pages})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "attend_paged: int64 indexes");
  const int64_t batch = kv_lens.numel(), t_total = q.size(0);
  const int64_t* qs = q_start.data_ptr<int64_t>();
  TORCH_CHECK(q_start.numel() == batch + 1 && page_start.numel() == batch + 1 && qs[batch] == t_total,
              "attend_paged: q_start does not match q's rows");
  return attend_rows(q.data_ptr<float>(), q, t_total, q.size(1), k_cache.size(2), q.size(2), k_cache.size(1),
                     k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), qs, kv_lens.data_ptr<int64_t>(),
                     page_start.data_ptr<int64_t>(), pages.data_ptr<int64_t>(), batch, scale);
}

}  // namespace mtp_kernels

TORCH_LIBRARY(mtp_paged_attention, lib) {
  lib.def("attend(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
          "Tensor q_start, Tensor kv_lens, Tensor page_start, Tensor pages, int n_heads, int n_kv_heads, "
          "float scale) -> Tensor", mtp_kernels::attend);
  lib.def("attend_paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor q_start, Tensor kv_lens, Tensor page_start, "
          "Tensor pages, float scale) -> Tensor", mtp_kernels::attend_paged);
}
