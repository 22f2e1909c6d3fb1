// The small-row matmul of a CPU decode step: y [M, N] = x [M, K] @ W^T for a few rows M, with W held packed.
//
// A decode step (or a speculative verify of k + 1 tokens at batch 1) multiplies every weight by a few rows, so
// its cost is the weight's read. CPU BLAS's small-M kernels pay per row instead (on this project's machine two
// rows cost 1.5-2.1x one, bench/small_m_matmul.py). Here the weight is packed once into column blocks of
// BLOCK outputs, each block contiguous over K ([ceil(N / BLOCK), K, BLOCK]), and each block is read once for
// all M rows: the weight streams from memory in one pass per thread whatever M is.
//
// The packed weight is float32, or bfloat16 where every value of the weight is a bfloat16 (a checkpoint stored in
// bf16, as most are): each bf16 value widens to the float32 it stands for exactly (a 16-bit shift), and the
// products and sums are float32 as before, so the result is the float32 kernel's bit for bit with half the bytes
// read. x and y are float32 either way.
//
// Written with GCC's vector extensions, built with -march=native (AVX-512, AVX2 or NEON by machine) and -fopenmp
// (torch's at::parallel_for is OpenMP inline in its headers: without the flag it runs on one thread); loaded by
// mtp_train/runtime/small_rows.py. Sums run over K in order with fused multiply-adds: the products equal BLAS's
// up to rounding.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t BLOCK = 32;  // outputs per packed block: two 16-float vectors
typedef float vec __attribute__((vector_size(64)));
typedef uint16_t half_vec __attribute__((vector_size(32)));  // 16 bfloat16 values
typedef int32_t int_vec __attribute__((vector_size(64)));
constexpr int LANES = 16;
constexpr int64_t CHUNK = 8;  // rows multiplied together per read of a block
constexpr int VECS = BLOCK / LANES;
// Rows of the packed block (BLOCK values each) fetched ahead of the one multiplied, into L2 (prefetcht1): 8 KiB of
// float32. The hardware prefetcher alone left a decode step's weight read at about half the copy bandwidth on one
// machine; a non-temporal prefetch (prefetchnta), which an earlier version used, read at 40% of it on an Intel
// Xeon with AVX-512, where prefetcht1 reads at the bandwidth a sum reads (bench/RESULTS.md, "Decode at the
// memory-bandwidth limit").
constexpr int64_t AHEAD = 64;
constexpr int PREFETCH_LOCALITY = 2;  // __builtin_prefetch's: 2 is prefetcht1

// w [N, K] float32 (any strides) -> packed [ceil(N / BLOCK), K, BLOCK] float32, or bfloat16 when ``bf16`` (the
// caller has checked that every value is one), the last block zero-padded.
template <typename W>
void pack_into(const float* s, W* d, int64_t n, int64_t k, int64_t blocks) {
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < BLOCK && b * BLOCK + j < n; ++j)
        for (int64_t i = 0; i < k; ++i) {
          const float v = s[(b * BLOCK + j) * k + i];
          if constexpr (std::is_same_v<W, float>) {
            d[(b * k + i) * BLOCK + j] = v;
          } else {
            uint32_t bits;
            std::memcpy(&bits, &v, sizeof(bits));
            d[(b * k + i) * BLOCK + j] = static_cast<uint16_t>(bits >> 16);  // exact: the low half is zero
          }
        }
  });
}

}  // namespace

namespace mtp_kernels {

at::Tensor pack(const at::Tensor& w, bool bf16) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(), "pack: a 2-d float32 CPU tensor");
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + BLOCK - 1) / BLOCK;
  auto packed = at::zeros({blocks, k, BLOCK}, w.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  auto src = w.contiguous();
  if (bf16)
    pack_into(src.data_ptr<float>(), reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>()), n, k, blocks);
  else
    pack_into(src.data_ptr<float>(), packed.data_ptr<float>(), n, k, blocks);
  return packed;
}

}  // namespace mtp_kernels

namespace {

// LANES stored values at p as float32 (bfloat16 widened exactly).
inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}

inline vec load(const uint16_t* p) {
  half_vec h;
  std::memcpy(&h, p, sizeof(half_vec));
  const int_vec bits = __builtin_convertvector(h, int_vec) << 16;
  vec v;
  std::memcpy(&v, &bits, sizeof(vec));
  return v;
}

template <int M, typename W>
inline void block(const float* __restrict x, const W* __restrict packed, float* __restrict y, int64_t k,
                  int64_t n, int64_t b) {
  constexpr int64_t LINE = 64 / sizeof(W);  // stored values per cache line
  vec acc[VECS][M];
  for (int v = 0; v < VECS; ++v)
    for (int m = 0; m < M; ++m) acc[v][m] = vec{};
  const W* w = packed + b * k * BLOCK;
  for (int64_t i = 0; i < k; ++i) {
    // past the block's end it is the next block's (or a no-op)
    for (int64_t line = 0; line < BLOCK; line += LINE)
      __builtin_prefetch(w + (i + AHEAD) * BLOCK + line, 0, PREFETCH_LOCALITY);
    vec wv[VECS];
    for (int v = 0; v < VECS; ++v) wv[v] = load(w + i * BLOCK + v * LANES);
    for (int m = 0; m < M; ++m) {
      const float xi = x[m * k + i];
      for (int v = 0; v < VECS; ++v) acc[v][m] += wv[v] * xi;
    }
  }
  const int64_t n0 = b * BLOCK, width = n - n0 < BLOCK ? n - n0 : BLOCK;
  for (int m = 0; m < M; ++m) {
    float out[BLOCK];
    for (int v = 0; v < VECS; ++v) std::memcpy(out + v * LANES, &acc[v][m], sizeof(vec));
    std::memcpy(y + m * n + n0, out, width * sizeof(float));
  }
}

// Rows r0..r0 + rows of y for block b (rows <= CHUNK: the accumulators of CHUNK rows fill the vector registers).
template <typename W>
inline void chunk(int64_t rows, const float* x, const W* w, float* y, int64_t k, int64_t n, int64_t b) {
  switch (rows) {
    case 1: block<1>(x, w, y, k, n, b); break;
    case 2: block<2>(x, w, y, k, n, b); break;
    case 3: block<3>(x, w, y, k, n, b); break;
    case 4: block<4>(x, w, y, k, n, b); break;
    case 5: block<5>(x, w, y, k, n, b); break;
    case 6: block<6>(x, w, y, k, n, b); break;
    case 7: block<7>(x, w, y, k, n, b); break;
    default: block<CHUNK>(x, w, y, k, n, b); break;
  }
}

// Every row of x through each block in turn: past CHUNK rows a block is multiplied once per CHUNK rows, its
// later passes read from L2 (a block is K x BLOCK values: 72 KiB of float32 at K = 576), so the weight still
// streams from memory once.
template <typename W>
void run_rows(int64_t m, const float* x, const W* w, float* y, int64_t k, int64_t n) {
  at::parallel_for(0, (n + BLOCK - 1) / BLOCK, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r0 = 0; r0 < m; r0 += CHUNK) chunk(std::min(CHUNK, m - r0), x + r0 * k, w, y + r0 * n, k, n, b);
  });
}

}  // namespace

namespace mtp_kernels {

// x [M, K] contiguous float32, packed from pack(W [N, K]) -> y [M, N] = x @ W^T.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "linear: x [M, K] contiguous float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == x.size(1) && packed.size(2) == BLOCK &&
                  packed.size(0) * BLOCK >= n, "linear: packed does not match x or n");
  const int64_t m = x.size(0), k = x.size(1);
  auto y = at::empty({m, n}, x.options());
  if (packed.scalar_type() == at::kBFloat16)
    run_rows(m, x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
             y.data_ptr<float>(), k, n);
  else
    run_rows(m, x.data_ptr<float>(), packed.data_ptr<float>(), y.data_ptr<float>(), k, n);
  return y;
}

}  // namespace mtp_kernels

TORCH_LIBRARY(mtp_small_rows, lib) {
  lib.def("pack(Tensor w, bool bf16=False) -> Tensor", mtp_kernels::pack);
  lib.def("linear(Tensor x, Tensor packed, int n) -> Tensor", mtp_kernels::linear);
}
