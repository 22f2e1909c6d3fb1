// The attention of a CPU decode or verify step in one call: rotary embedding of the queries and keys, the new keys
// and values stored in their cache slots, and each query's softmax over its sequence's paged keys.
//
// Torch's path does this in about 30 small ops per layer (split, rotate, two cache writes, two page gathers, a
// padded mask, SDPA, transposes): at batch 1 their dispatch costs more than the arithmetic, which is a few
// thousand multiply-adds per head. Here every query row and head is one work item: its scores over the keys
// its causal mask lets it see (read in place from the pages, no gather, no mask), a softmax, and the weighted sum
// of the values. Each row's result depends on its own sequence alone, never on the rest of the batch. On AVX-512
// (a head dimension that is a multiple of 16) a work item's scores are 16 keys at a time with no horizontal sum per
// key, the heads that share a key-value head read each key once, and the softmax's exp is vectorised.
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

// attend_rows on any CPU: each query row t (of sequence seq_of[t]) and head h, its scores one dot product at a time.
// A work item is a row and `per` of its heads: all of them where there are rows enough to keep every thread busy,
// so that each page of its sequence is read once, front to back; else one (a decode at batch 1 spreads its heads).
void attend_rows_generic(const float* qp, float* op, int64_t t_total, int64_t n_heads, int64_t n_kv_heads, int64_t d,
                         int64_t page_size, const float* kc, const float* vc, const int64_t* qs, const int64_t* kvl,
                         const int64_t* ps, const int64_t* pg, const int64_t* seq_of, double scale, int64_t window) {
  const int64_t group = n_heads / n_kv_heads;
  const int64_t per = t_total >= 8 * at::get_num_threads() ? n_heads : 1, items = n_heads / per;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, t_total * items, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> score;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t t = w / items, h0 = (w % items) * per, b = seq_of[t];
      const int64_t q_len = qs[b + 1] - qs[b], last = kvl[b] - q_len + (t - qs[b]);
      const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0, keys = last - first + 1;
      const float* q0 = qp + (t * n_heads + h0) * d;
      score.resize(per * keys);
      for (int64_t j = 0; j < keys; ++j) {
        const int64_t flat = pg[ps[b] + (first + j) / page_size] * page_size + (first + j) % page_size;
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
        const int64_t flat = pg[ps[b] + (first + j) / page_size] * page_size + (first + j) % page_size;
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
}

#if defined(__AVX512F__)
// exp(x) for x <= 0 (scores less their maximum), 16 lanes: 2^n e^r with |r| <= ln 2 / 2, e^r by Cephes' degree-6
// polynomial (about 1 ulp from std::exp); below -87 the result is flushed to 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 tiny = _mm512_set1_ps(-87.f);
  const __mmask16 live = _mm512_cmp_ps_mask(x, tiny, _CMP_GE_OQ);
  x = _mm512_max_ps(x, tiny);
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

// Per 128-bit lane k: the sums of a's, b's, c's and d's four lanes in that block -> [a_k, b_k, c_k, d_k].
inline __m512 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512d ab = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)));
  const __m512d cd = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d)));
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)), _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)));
}

// Four sum4 results (of vectors 0-3, 4-7, 8-11, 12-15) -> lane j: the sum of vector j's 16 lanes.
inline __m512 sum16(__m512 u0, __m512 u1, __m512 u2, __m512 u3) {
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u2, u3, 0x88), _mm512_shuffle_f32x4(u2, u3, 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

// One query row's heads h0..h0 + G - 1, which share a key-value head: their softmax over the row's `keys` keys,
// times the values -> out [G, D]. A key is read once for all G heads as D / 16 vectors, and the products of 16 keys
// are summed across lanes together (sum4, sum16: 15 adds per 16 scores, not 16 horizontal sums); `off` maps a key
// to its first float in the cache (its slot times Hkv D plus the head's D). score: G * keys rounded up to 16.
template <int G>
void attend_group(const float* q, const float* kc, const float* vc, const int32_t* off, int64_t keys, int64_t d,
                  float sc, float* score, float* out) {
  const int64_t padded = (keys + 15) / 16 * 16;
  __m512 top[G];
  for (int g = 0; g < G; ++g) top[g] = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < keys; j += 16) {
    __m512 u[G][4];
    for (int64_t quad = 0; quad < 4; ++quad) {
      __m512 a[4][G];
      for (int64_t r = 0; r < 4; ++r) {
        for (int g = 0; g < G; ++g) a[r][g] = _mm512_setzero_ps();
        const int64_t l = j + quad * 4 + r;
        if (l >= keys) continue;
        for (int64_t c = 0; c < d; c += 16) {
          const __m512 k = _mm512_loadu_ps(kc + off[l] + c);
          for (int g = 0; g < G; ++g) a[r][g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + c), k, a[r][g]);
        }
      }
      for (int g = 0; g < G; ++g) u[g][quad] = sum4(a[0][g], a[1][g], a[2][g], a[3][g]);
    }
    const __mmask16 m = keys - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (keys - j)) - 1);
    for (int g = 0; g < G; ++g) {
      const __m512 s = sum16(u[g][0], u[g][1], u[g][2], u[g][3]);
      const __m512 scaled = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m, _mm512_mul_ps(s, _mm512_set1_ps(sc)));
      _mm512_storeu_ps(score + g * padded + j, scaled);
      top[g] = _mm512_max_ps(top[g], scaled);
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {
    const __m512 t = _mm512_set1_ps(_mm512_reduce_max_ps(top[g]));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < padded; j += 16) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(score + g * padded + j), t));
      _mm512_storeu_ps(score + g * padded + j, e);
      total = _mm512_add_ps(total, e);
    }
    inv[g] = 1.f / _mm512_reduce_add_ps(total);
  }
  for (int64_t c = 0; c < d; c += 16) {  // the weighted values, 16 of each head's D at a time
    __m512 o[G];
    for (int g = 0; g < G; ++g) o[g] = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; ++j) {
      const __m512 v = _mm512_loadu_ps(vc + off[j] + c);
      for (int g = 0; g < G; ++g) o[g] = _mm512_fmadd_ps(_mm512_set1_ps(score[g * padded + j]), v, o[g]);
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(out + g * d + c, _mm512_mul_ps(o[g], _mm512_set1_ps(inv[g])));
  }
}

using GroupFn = void (*)(const float*, const float*, const float*, const int32_t*, int64_t, int64_t, float, float*,
                         float*);
constexpr GroupFn GROUPS[] = {attend_group<1>, attend_group<2>, attend_group<3>, attend_group<4>,
                              attend_group<5>, attend_group<6>, attend_group<7>, attend_group<8>};

// attend_rows_generic's attention on AVX-512, for D a multiple of 16 and a cache of under 2^31 floats: a work item
// is a row and up to 8 query heads of one key-value head where rows are many (each key read once for them), else
// a row and one head.
void attend_rows_avx512(const float* qp, float* op, int64_t t_total, int64_t n_heads, int64_t n_kv_heads, int64_t d,
                        int64_t page_size, const float* kc, const float* vc, const int64_t* qs, const int64_t* kvl,
                        const int64_t* ps, const int64_t* pg, const int64_t* seq_of, double scale, int64_t window) {
  const int64_t group = n_heads / n_kv_heads;
  const int64_t per = t_total >= 8 * at::get_num_threads() ? std::min<int64_t>(group, 8) : 1;
  const int64_t chunks = (group + per - 1) / per, items = n_kv_heads * chunks;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, t_total * items, 1, [&](int64_t w0, int64_t w1) {
    std::vector<int32_t> off;
    std::vector<float> score;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t t = w / items, kvh = w % items / chunks, h0 = kvh * group + w % chunks * per, b = seq_of[t];
      const int64_t gn = std::min(per, (kvh + 1) * group - h0);
      const int64_t q_len = qs[b + 1] - qs[b], last = kvl[b] - q_len + (t - qs[b]);
      const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0, keys = last - first + 1;
      off.resize((keys + 15) / 16 * 16);
      for (int64_t j = 0, p = first; j < keys; ++j, ++p)
        off[j] = static_cast<int32_t>((pg[ps[b] + p / page_size] * page_size + p % page_size) * n_kv_heads * d +
                                      kvh * d);
      score.resize(gn * off.size());
      GROUPS[gn - 1](qp + (t * n_heads + h0) * d, kc, vc, off.data(), keys, d, sc, score.data(),
                     op + (t * n_heads + h0) * d);
    }
  });
}
#endif

// Each query row t (of sequence seq_of[t]) and head h: softmax over the keys its causal mask lets it see (with a
// `window` > 0, the last `window` of them: its sliding window), read in place from the pages, times the values
// -> [T, Hq * D]. q [T, Hq, D] is rotated; the cache [pages, page_size, Hkv, D] of cache_floats floats holds this
// step's keys; pages below a window may have been given back: no key is read there.
at::Tensor attend_rows(const float* qp, const at::Tensor& like, int64_t t_total, int64_t n_heads, int64_t n_kv_heads,
                       int64_t d, int64_t page_size, const float* kc, const float* vc, const int64_t* qs,
                       const int64_t* kvl, const int64_t* ps, const int64_t* pg, int64_t batch, int64_t cache_floats,
                       double scale, int64_t window) {
  std::vector<int64_t> seq_of(t_total);
  for (int64_t b = 0; b < batch; ++b) std::fill(seq_of.begin() + qs[b], seq_of.begin() + qs[b + 1], b);
  auto out = at::empty({t_total, n_heads * d}, like.options());
  float* op = out.data_ptr<float>();
#if defined(__AVX512F__)
  if (d % 16 == 0 && cache_floats < (int64_t{1} << 31)) {
    attend_rows_avx512(qp, op, t_total, n_heads, n_kv_heads, d, page_size, kc, vc, qs, kvl, ps, pg, seq_of.data(),
                       scale, window);
    return out;
  }
#endif
  attend_rows_generic(qp, op, t_total, n_heads, n_kv_heads, d, page_size, kc, vc, qs, kvl, ps, pg, seq_of.data(),
                      scale, window);
  return out;
}

}  // namespace

namespace mtp_kernels {

// qkv [T, (Hq + 2 Hkv) D] float32: each token's queries, keys and values (the fused projection's output);
// cos, sin [T, D]; k_cache, v_cache [pages, page_size, Hkv, D] (written at ``slots [T]``); ``q_start [B + 1]``,
// ``kv_lens [B]``, ``page_start [B + 1]``, ``pages [N]`` int64: sequence b's new tokens are rows
// q_start[b]..q_start[b + 1] of qkv, it holds kv_lens[b] tokens after this step, in pages
// pages[page_start[b]..page_start[b + 1]]. Query i of b sees keys 0..kv_lens[b] - q_len + i (with a `window` > 0,
// the last `window` of them). -> [T, Hq D].
at::Tensor attend(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                  at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& q_start, const at::Tensor& kv_lens,
                  const at::Tensor& page_start, const at::Tensor& pages, int64_t n_heads, int64_t n_kv_heads,
                  double scale, int64_t window) {
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
  return attend_rows(qp, qkv, t_total, n_heads, n_kv_heads, d, page_size, kc, vc, qs, kvl, ps, pg, batch,
                     k_cache.numel(), scale, window);
}

// The same attention for queries already rotated, whose keys and values are already in the cache (torch wrote them):
// q [T, Hq, D] float32 contiguous, the rest as ``attend`` takes it. A step of many decodes runs its attention so,
// its projections on BLAS. -> [T, Hq D].
at::Tensor attend_paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& q_start, const at::Tensor& kv_lens, const at::Tensor& page_start,
                        const at::Tensor& pages, double scale, int64_t window) {
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
                     page_start.data_ptr<int64_t>(), pages.data_ptr<int64_t>(), batch, k_cache.numel(),
                     scale, window);
}

}  // namespace mtp_kernels

TORCH_LIBRARY(mtp_paged_attention, lib) {
  lib.def("attend(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
          "Tensor q_start, Tensor kv_lens, Tensor page_start, Tensor pages, int n_heads, int n_kv_heads, "
          "float scale, int window=0) -> Tensor", mtp_kernels::attend);
  lib.def("attend_paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor q_start, Tensor kv_lens, Tensor page_start, "
          "Tensor pages, float scale, int window=0) -> Tensor", mtp_kernels::attend_paged);
}
