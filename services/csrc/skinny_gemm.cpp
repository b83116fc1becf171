// y[m, o] = sum_i x[m, i] * w[o, i] for a handful of rows m (a verify chunk).
//
// Reads each weight row once and multiplies it with all m rows of x, so a
// chunk of up to 8 tokens costs about what one token costs: the weight
// stream from memory, not the arithmetic, is the bound. BLAS small-M GEMMs
// on some CPUs (MKL on AMD EPYC, measured) are several times slower.
#include <torch/extension.h>
#include <immintrin.h>

namespace {

constexpr int64_t kMaxRows = 8;

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 shuf = _mm_movehdup_ps(lo);
  __m128 sums = _mm_add_ps(lo, shuf);
  shuf = _mm_movehl_ps(shuf, sums);
  sums = _mm_add_ss(sums, shuf);
  return _mm_cvtss_f32(sums);
}

template <int M>
void rows_kernel(const float* x, const float* w, float* y, int64_t in, int64_t out, int64_t o_begin, int64_t o_end) {
  for (int64_t o = o_begin; o < o_end; ++o) {
    const float* wr = w + o * in;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= in; i += 8) {
      __m256 wv = _mm256_loadu_ps(wr + i);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * in + i), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float s = hsum(acc[m]);
      for (int64_t j = i; j < in; ++j) s += wr[j] * x[m * in + j];
      y[m * out + o] = s;
    }
  }
}

template <int M>
void run(const float* x, const float* w, float* y, int64_t in, int64_t out) {
  at::parallel_for(0, out, 256, [&](int64_t begin, int64_t end) { rows_kernel<M>(x, w, y, in, out, begin, end); });
}

}  // namespace

torch::Tensor skinny_gemm(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [m, in], w [out, in]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "1..8 rows");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t m = x.size(0), in = x.size(1), out = w.size(0);
  auto y = torch::empty({m, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (m) {
    case 1: run<1>(xp, wp, yp, in, out); break;
    case 2: run<2>(xp, wp, yp, in, out); break;
    case 3: run<3>(xp, wp, yp, in, out); break;
    case 4: run<4>(xp, wp, yp, in, out); break;
    case 5: run<5>(xp, wp, yp, in, out); break;
    case 6: run<6>(xp, wp, yp, in, out); break;
    case 7: run<7>(xp, wp, yp, in, out); break;
    default: run<8>(xp, wp, yp, in, out); break;
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_gemm", &skinny_gemm, "x @ w.T for 1..8 rows of x, reading w once");
}
