// y[m, o] = sum_i x[m, i] * w[o, i] for a handful of rows m (a verify chunk,
// or the rows of several sessions' verify chunks batched together).
//
// Decoding is bound by the weight stream from memory, so the kernel reads
// each weight row once for all m rows of x. Up to kStreamRows rows it streams
// the weights row by row (one sequential stream that the prefetcher keeps up
// with: memory bandwidth); with more rows the arithmetic dominates, and a tile
// of kTileOut weight rows stays in L1 while blocks of up to kBlockRows rows of
// x pass over it, with the accumulators in vector registers (a
// register-blocked micro-kernel, as in BLIS). BLAS small-M GEMMs on some CPUs
// (MKL on AMD EPYC, measured) are several times slower.
//
// Every y[m, o] is summed in the same order whatever m and the blocking are
// (vector lanes over i in steps of kLanes, one horizontal sum, then the tail),
// so a row's result does not depend on which other rows share the call:
// batching rows from different requests leaves each one's logits bit-identical.
#include <torch/extension.h>
#include <immintrin.h>

namespace {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kLanes = 16;
constexpr int kTileOut = 4;    // weight rows per tile
constexpr int kBlockRows = 6;  // x rows per register block: 4 x 6 accumulators + 4 weights + 1 x <= 32 registers
constexpr int64_t kStreamRows = 4;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  // Fixed pairwise order (not _mm512_reduce_add_ps, whose order the compiler chooses).
  __m256 lo = _mm512_castps512_ps256(v);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  __m256 s8 = _mm256_add_ps(lo, hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}
#else
using Vec = __m256;
constexpr int64_t kLanes = 8;
constexpr int kTileOut = 3;    // 3 x 3 accumulators + 3 weights + 1 x <= 16 registers
constexpr int kBlockRows = 3;
constexpr int64_t kStreamRows = 4;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}
#endif

// Few rows: one weight row at a time, so the weights are read as one sequential stream.
template <int M>
void stream_rows(const float* x, const float* w, float* y, int64_t in, int64_t out, int64_t o_begin, int64_t o_end) {
  for (int64_t o = o_begin; o < o_end; ++o) {
    const float* wr = w + o * in;
    Vec acc[M];
    for (int m = 0; m < M; ++m) acc[m] = vzero();
    int64_t i = 0;
    for (; i + kLanes <= in; i += kLanes) {
      Vec wv = vload(wr + i);
      for (int m = 0; m < M; ++m) acc[m] = vfma(wv, vload(x + m * in + i), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float s = vsum(acc[m]);
      for (int64_t j = i; j < in; ++j) s += wr[j] * x[m * in + j];
      y[m * out + o] = s;
    }
  }
}

// y[m0 .. m0+MB, o0 .. o0+NO] for NO <= kTileOut weight rows and MB <= kBlockRows x rows. With ``prefetch`` (the
// next tile's first weight row, on the tile's first block of x rows), the next kTileOut weight rows are fetched
// from memory while this block computes: the weights stream from DRAM behind the arithmetic instead of stalling
// it at every tile. Prefetching changes no arithmetic.
template <int NO, int MB>
inline void micro(const float* x, const float* w, float* y, int64_t in, int64_t out, int64_t m0, int64_t o0,
                  const float* prefetch = nullptr) {
  Vec acc[NO][MB];
  for (int n = 0; n < NO; ++n)
    for (int m = 0; m < MB; ++m) acc[n][m] = vzero();
  const float* wr[NO];
  for (int n = 0; n < NO; ++n) wr[n] = w + (o0 + n) * in;
  const float* xr = x + m0 * in;
  int64_t i = 0;
  for (; i + kLanes <= in; i += kLanes) {
    if (prefetch != nullptr) {
      for (int n = 0; n < kTileOut; ++n) _mm_prefetch(reinterpret_cast<const char*>(prefetch + n * in + i), _MM_HINT_T0);
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

template <int NO>
inline void tile(const float* x, const float* w, float* y, int64_t rows, int64_t in, int64_t out, int64_t o0) {
  // the next full tile's weight rows, fetched during this tile's first block of x rows
  const float* next = (o0 + 2 * kTileOut <= out && rows >= kBlockRows) ? w + (o0 + kTileOut) * in : nullptr;
  int64_t m0 = 0;
  for (; m0 + kBlockRows <= rows; m0 += kBlockRows) micro<NO, kBlockRows>(x, w, y, in, out, m0, o0, m0 == 0 ? next : nullptr);
  switch (rows - m0) {  // the last, partial block of x rows
    case 0: break;
    case 1: micro<NO, 1>(x, w, y, in, out, m0, o0); break;
    case 2: micro<NO, 2>(x, w, y, in, out, m0, o0); break;
#if defined(__AVX512F__)
    case 3: micro<NO, 3>(x, w, y, in, out, m0, o0); break;
    case 4: micro<NO, 4>(x, w, y, in, out, m0, o0); break;
    default: micro<NO, 5>(x, w, y, in, out, m0, o0); break;
#endif
  }
}

void run(const float* x, const float* w, float* y, int64_t rows, int64_t in, int64_t out) {
  if (rows <= kStreamRows) {
    at::parallel_for(0, out, 256, [&](int64_t begin, int64_t end) {
      switch (rows) {
        case 1: stream_rows<1>(x, w, y, in, out, begin, end); break;
        case 2: stream_rows<2>(x, w, y, in, out, begin, end); break;
        case 3: stream_rows<3>(x, w, y, in, out, begin, end); break;
        default: stream_rows<4>(x, w, y, in, out, begin, end); break;
      }
    });
    return;
  }
  // more rows (sessions batched): tiles of kTileOut weight rows, each load shared by a block of x rows
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

torch::Tensor skinny_gemm(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [m, in], w [out, in]");
  TORCH_CHECK(x.size(0) >= 1, "at least one row");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t rows = x.size(0), in = x.size(1), out = w.size(0);
  auto y = torch::empty({rows, out}, x.options());
  run(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, in, out);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // without the GIL: the replica's event loop keeps taking and answering calls while a pass runs
  m.def("skinny_gemm", &skinny_gemm, "x @ w.T for a few rows of x, reading w once",
        py::call_guard<py::gil_scoped_release>());
}
