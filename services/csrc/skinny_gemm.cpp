// y[m, o] = sum_i x[m, i] * w[o, i] for a handful of rows m (a verify chunk,
// or the rows of several sessions' verify chunks batched together).
//
// Decoding is bound by the weight stream from memory, so the kernel reads
// each weight row once for all m rows of x. One row streams the weights
// row by row; more rows take tiles: a tile of kTileOut weight rows
// stays in L1 while blocks of up to kBlockRows rows of x pass over it, with
// the accumulators in vector registers (a register-blocked micro-kernel, as
// in BLIS), and the weights further on are prefetched into L2. BLAS small-M GEMMs on some CPUs
// (MKL on AMD EPYC, measured) are several times slower.
//
// Every y[m, o] is summed in the same order whatever m and the blocking are
// (vector lanes over i in steps of kLanes, one horizontal sum, then the tail),
// so a row's result does not depend on which other rows share the call:
// batching rows from different requests leaves each one's logits bit-identical.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "simd.h"

namespace splitspec {
namespace {

#if defined(__AVX512F__)
constexpr int kTileOut = 4;    // weight rows per tile
constexpr int kBlockRows = 4;  // x rows per register block: 4 x 4 accumulators + 4 weights + 1 x of 32 registers
#else
constexpr int kTileOut = 3;    // 3 x 3 accumulators + 3 weights + 1 x <= 16 registers
constexpr int kBlockRows = 3;
#endif
// How far ahead of its loads each weight row is prefetched into L2, in floats (16 KB: several tiles ahead). The
// tiles read kTileOut weight rows side by side, a pattern the hardware prefetcher follows poorly; without this
// a pass over 3-16 rows ran at half the memory bandwidth of one row (measured on a 2-core AMD EPYC, AVX-512).
constexpr int64_t kPrefetchAhead = 4096;

// One row (a decode step): one weight row at a time, so the weights are read as one sequential stream, which
// the hardware prefetcher keeps up with (memory bandwidth).
void stream_row(const float* x, const float* w, float* y, int64_t in, int64_t o_begin, int64_t o_end) {
  for (int64_t o = o_begin; o < o_end; ++o) y[o] = dot(w + o * in, x, in);
}

// y[m0 .. m0+MB, o0 .. o0+NO] for NO weight rows and MB x rows, the accumulators in registers. With ``prefetch``
// (on a tile's first block of x rows) the weights kPrefetchAhead floats further on are fetched into L2, so the
// weight stream from DRAM runs ahead of the arithmetic instead of stalling it. Prefetching changes no arithmetic.
template <int NO, int MB>
inline void micro(const float* x, const float* w, float* y, int64_t in, int64_t out, int64_t m0, int64_t o0,
                  bool prefetch) {
  Vec acc[NO][MB];
  for (int n = 0; n < NO; ++n)
    for (int m = 0; m < MB; ++m) acc[n][m] = vzero();
  const float* wr[NO];
  for (int n = 0; n < NO; ++n) wr[n] = w + (o0 + n) * in;
  const float* xr = x + m0 * in;
  int64_t i = 0;
  for (; i + kLanes <= in; i += kLanes) {
    if (prefetch) {
      for (int n = 0; n < NO; ++n) _mm_prefetch(reinterpret_cast<const char*>(wr[n] + i + kPrefetchAhead), _MM_HINT_T1);
    }
    Vec wv[NO];
    for (int n = 0; n < NO; ++n) wv[n] = vload(wr[n] + i);
    for (int m = 0; m < MB; ++m) {
      Vec xv = vload(xr + m * in + i);
      for (int n = 0; n < NO; ++n) acc[n][m] = vfma(wv[n], xv, acc[n][m]);
    }
  }
  for (int n = 0; n < NO; ++n)
    for (int m = 0; m < MB; ++m) {
      float s = vsum(acc[n][m]);
      for (int64_t j = i; j < in; ++j) s += wr[n][j] * xr[m * in + j];
      y[(m0 + m) * out + o0 + n] = s;
    }
}

// Every block of x rows against one tile of NO weight rows, which stays in L1 after the first block.
template <int NO>
inline void tile(const float* x, const float* w, float* y, int64_t rows, int64_t in, int64_t out, int64_t o0) {
  int64_t m0 = 0;
  for (; m0 + kBlockRows <= rows; m0 += kBlockRows) micro<NO, kBlockRows>(x, w, y, in, out, m0, o0, m0 == 0);
  const bool first = m0 == 0;
  switch (rows - m0) {  // the last, partial block of x rows
    case 0: break;
    case 1: micro<NO, 1>(x, w, y, in, out, m0, o0, first); break;
    case 2: micro<NO, 2>(x, w, y, in, out, m0, o0, first); break;
#if defined(__AVX512F__)
    default: micro<NO, 3>(x, w, y, in, out, m0, o0, first); break;
#endif
  }
}

void run(const float* x, const float* w, float* y, int64_t rows, int64_t in, int64_t out) {
  if (rows <= 1) {
    at::parallel_for(0, out, 256, [&](int64_t begin, int64_t end) {
      stream_row(x, w, y, in, begin, end);
    });
    return;
  }
  // more rows (a verify block, or sessions batched): tiles of kTileOut weight rows, each load shared by a block
  const int64_t tiles = (out + kTileOut - 1) / kTileOut;
  at::parallel_for(0, tiles, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o0 = t * kTileOut;
      const int64_t left = out - o0;
      if (left >= kTileOut) {
        tile<kTileOut>(x, w, y, rows, in, out, o0);
      } else if (left == 1) {
        tile<1>(x, w, y, rows, in, out, o0);
      } else if (left == 2) {
        tile<2>(x, w, y, rows, in, out, o0);
      } else {
        tile<3>(x, w, y, rows, in, out, o0);  // only reached with kTileOut == 4
      }
    }
  });
}

}  // namespace

at::Tensor skinny_gemm(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dtype() == at::kFloat && w.dtype() == at::kFloat, "float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [m, in], w [out, in]");
  TORCH_CHECK(x.size(0) >= 1, "at least one row");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t rows = x.size(0), in = x.size(1), out = w.size(0);
  auto y = at::empty({rows, out}, x.options());
  run(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, in, out);
  return y;
}

}  // namespace splitspec
