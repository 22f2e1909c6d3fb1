// The small-row matmul of a CPU decode step: y [M, N] = x [M, K] @ W^T for M = 1..8 rows, with W held packed.
//
// A decode step (or a speculative verify of k + 1 tokens at batch 1) multiplies every weight by a few rows, so
// its cost is the weight's read. CPU BLAS's small-M kernels pay per row instead (on this project's machine two
// rows cost 1.5-2.1x one, bench/small_m_matmul.py). Here the weight is packed once into column blocks of
// BLOCK outputs, each block contiguous over K ([ceil(N / BLOCK), K, BLOCK]), and each block is read once for
// all M rows: the weight streams from memory in one pass per thread whatever M is.
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

#include <cstring>

namespace {

constexpr int64_t BLOCK = 32;  // outputs per packed block: two 16-float vectors
typedef float vec __attribute__((vector_size(64)));
constexpr int LANES = 16;
constexpr int VECS = BLOCK / LANES;
// Rows of the packed block (BLOCK floats each) fetched ahead of the one multiplied: 8 KiB. The hardware prefetcher
// alone left a decode step's weight read at about half the copy bandwidth (bench/small_m_matmul.py).
constexpr int64_t AHEAD = 64;

// w [N, K] (any strides) -> packed [ceil(N / BLOCK), K, BLOCK], the last block zero-padded.
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(), "pack: a 2-d float32 CPU tensor");
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + BLOCK - 1) / BLOCK;
  auto packed = at::zeros({blocks, k, BLOCK}, w.options());
  auto src = w.contiguous();
  const float* s = src.data_ptr<float>();
  float* d = packed.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < BLOCK && b * BLOCK + j < n; ++j)
        for (int64_t i = 0; i < k; ++i) d[(b * k + i) * BLOCK + j] = s[(b * BLOCK + j) * k + i];
  });
  return packed;
}

template <int M>
inline void block(const float* __restrict x, const float* __restrict packed, float* __restrict y, int64_t k,
                  int64_t n, int64_t b) {
  vec acc[VECS][M];
  for (int v = 0; v < VECS; ++v)
    for (int m = 0; m < M; ++m) acc[v][m] = vec{};
  const float* w = packed + b * k * BLOCK;
  for (int64_t i = 0; i < k; ++i) {
    __builtin_prefetch(w + (i + AHEAD) * BLOCK, 0, 0);  // past the block's end it is the next block's (or a no-op)
    __builtin_prefetch(w + (i + AHEAD) * BLOCK + LANES, 0, 0);
    vec wv[VECS];
    for (int v = 0; v < VECS; ++v) std::memcpy(&wv[v], w + i * BLOCK + v * LANES, sizeof(vec));
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

template <int M>
void run(const float* x, const float* packed, float* y, int64_t k, int64_t n) {
  at::parallel_for(0, (n + BLOCK - 1) / BLOCK, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block<M>(x, packed, y, k, n, b);
  });
}

// x [M, K] contiguous float32, packed from pack(W [N, K]) -> y [M, N] = x @ W^T.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "linear: x [M, K] contiguous float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == x.size(1) && packed.size(2) == BLOCK &&
                  packed.size(0) * BLOCK >= n, "linear: packed does not match x or n");
  const int64_t m = x.size(0), k = x.size(1);
  auto y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (m) {
    case 1: run<1>(xp, wp, yp, k, n); break;
    case 2: run<2>(xp, wp, yp, k, n); break;
    case 3: run<3>(xp, wp, yp, k, n); break;
    case 4: run<4>(xp, wp, yp, k, n); break;
    case 5: run<5>(xp, wp, yp, k, n); break;
    case 6: run<6>(xp, wp, yp, k, n); break;
    case 7: run<7>(xp, wp, yp, k, n); break;
    case 8: run<8>(xp, wp, yp, k, n); break;
    default: TORCH_CHECK(false, "linear: 1 to 8 rows, got ", m);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(mtp_small_rows, lib) {
  lib.def("pack(Tensor w) -> Tensor", pack);
  lib.def("linear(Tensor x, Tensor packed, int n) -> Tensor", linear);
}
