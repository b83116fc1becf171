// The argmax of a few rows' logits, x @ w.T, bit for bit the argmax of skinny_gemm's float32 logits, at about half
// their cost: a greedy request needs the target's argmax, not its 49,152 logits.
//
// 1. Screen: every logit in bfloat16 arithmetic (AVX512_BF16's dot product of pairs, float32 sums): x and w rounded
//    to bfloat16 (relative error <= u = 2^-8 each), products exact, sums in float32. Half the bytes of the float32
//    weight to stream (one row) and twice the products per instruction (many rows).
// 2. Bound: a screened logit a[j] and the float32 logit r[j] that skinny_gemm computes differ by at most
//        (2u + u^2) S + g'_n (1 + u)^2 S + g_n S,  S = sum_i |x_i| |w[j, i]| <= ||x|| ||w[j]||  (Cauchy-Schwarz),
//    g_n = n 2^-24 / (1 - n 2^-24) the bound of skinny_gemm's round-to-nearest float32 sum of n terms, g'_n the
//    same with 2^-23 for the screen's sums (whatever rounding the CPU's dot product uses, as long as it is
//    faithful), plus what flushing subnormal bfloat16 values (and results) to zero can change: at most
//    2^-126 (sqrt(n) (||x|| + ||w[j]||) + n). The factor of S is taken 2% larger (0.00809 for n = 576), the norms
//    are computed in double and rounded up to float32, and e, a + e and a - e are rounded outward (AVX-512's
//    directed rounding), so the float32 comparisons below hold for the exact values.
// 3. Candidates: the argmax of r has r >= L = max_j (a[j] - e[j]); every j with a[j] + e[j] >= L is a candidate
//    (with the default pair's features a median of 2, at most a few dozen). Each candidate's r[j] is computed
//    exactly as skinny_gemm does (from 0, one fused multiply-add per input, i = 0, 1, ..., in - 1: the same bits),
//    and the first of the largest wins, as torch.argmax picks.
// A row with a value that is not finite, or large enough that a bfloat16 value or a product could overflow (|x| or
// |x| |w| n >= 1e37), gets -1: the caller computes its logits instead. The ids are those of skinny_gemm's logits,
// a row's alone whatever rows share the call (a BLAS GEMM over more than 32 rows may round near-ties otherwise).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace splitspec {

constexpr double kBoundMargin = 1.02;  // on the factor of S
constexpr double kBoundFloor = 1e-30;

bool greedy_head_built() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
namespace {

constexpr int64_t kPanel = 32;  // outputs per screen panel: 2 vectors of 16 float32 lanes
constexpr int kBlockRows = 12;  // 12 x 2 accumulators + 2 weights + 1 broadcast of 32 registers
constexpr int64_t kF32Panel = 32;  // skinny_gemm's float32 panel width (csrc/skinny_gemm.cpp)

uint16_t to_bf16(float v) {  // round to nearest even (finite v)
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// The bound's terms of one row, as float32 rounded up: e[j] = fma(scale, norms[j], floor) >= the bound of step 2.
struct RowBound {
  float scale;
  float floor;
};

constexpr int kUp = _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC;
constexpr int kDown = _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC;

// For MB rows of bfloat16 pairs ``xb`` [rows, pairs] against one screen panel [pairs, 32] (outputs o0 .. o0 + 32):
// hi[m, o] = a + e rounded up, into ``hi``; the largest a - e rounded down of the panel, into ``lo_max[m]``.
// ``norms`` of the panel's outputs (+inf past the last: those get lo = -inf).
// (always inlined, as screen_block: where GCC called them instead, the 22 accumulators of 11 rows went to memory and
// 32 rows took 24 ms instead of 10.4)
template <int MB>
__attribute__((always_inline)) inline void screen_micro(const uint32_t* xb, int64_t pairs, const uint32_t* panel, const float* norms,
                         const RowBound* bounds, float* hi, int64_t ld, float* lo_max, int64_t lo_ld) {
  __m512 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + i * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + i * kPanel + 16);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[m * pairs + i]));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, w1);
    }
  }
  const __m512 n0 = _mm512_loadu_ps(norms), n1 = _mm512_loadu_ps(norms + 16);
  for (int m = 0; m < MB; ++m) {
    const __m512 scale = _mm512_set1_ps(bounds[m].scale), floor_ = _mm512_set1_ps(bounds[m].floor);
    const __m512 e0 = _mm512_fmadd_round_ps(scale, n0, floor_, kUp);
    const __m512 e1 = _mm512_fmadd_round_ps(scale, n1, floor_, kUp);
    _mm512_storeu_ps(hi + m * ld, _mm512_add_round_ps(acc[m][0], e0, kUp));
    _mm512_storeu_ps(hi + m * ld + 16, _mm512_add_round_ps(acc[m][1], e1, kUp));
    const __m512 lo = _mm512_max_ps(_mm512_sub_round_ps(acc[m][0], e0, kDown), _mm512_sub_round_ps(acc[m][1], e1, kDown));
    lo_max[m * lo_ld] = _mm512_reduce_max_ps(lo);  // (a max: exact in any order)
  }
}

template <int MAX>
__attribute__((always_inline)) inline void screen_block(int64_t rows, const uint32_t* xb, int64_t pairs, const uint32_t* panel, const float* norms,
                         const RowBound* bounds, float* hi, int64_t ld, float* lo_max, int64_t lo_ld) {
  if constexpr (MAX >= 1) {
    if (rows == MAX) return screen_micro<MAX>(xb, pairs, panel, norms, bounds, hi, ld, lo_max, lo_ld);
    screen_block<MAX - 1>(rows, xb, pairs, panel, norms, bounds, hi, ld, lo_max, lo_ld);
  }
}

float round_up(double v) {  // the smallest float32 >= v
  const float f = static_cast<float>(v);
  return static_cast<double>(f) >= v ? f : std::nextafter(f, std::numeric_limits<float>::infinity());
}

}  // namespace

// (ids [m] int64, candidates [m] int64): the argmax of x [m, in] @ w.T per row, and how many candidates it took.
// ``screen`` [panels, ceil(in / 2), 32] int32: w as bfloat16 pairs (kernels.pack_screen); ``packed`` the float32
// weight in skinny_gemm's layout; ``norms`` [out] float32: each row's Euclidean norm, rounded up.
std::tuple<at::Tensor, at::Tensor> greedy_head(at::Tensor x, at::Tensor screen, at::Tensor packed, at::Tensor norms,
                                               int64_t out) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2, "x: [m, in] float32");
  const int64_t rows = x.size(0), in = x.size(1), pairs = (in + 1) / 2;
  TORCH_CHECK(screen.dtype() == at::kInt && screen.dim() == 3 && screen.size(1) == pairs && screen.size(2) == kPanel &&
                  screen.size(0) * kPanel >= out,
              "screen [ceil(out / 32), ceil(in / 2), 32] int32 (kernels.pack_screen)");
  TORCH_CHECK(packed.dtype() == at::kFloat && packed.dim() == 3 && packed.size(1) == in &&
                  packed.size(2) == kF32Panel && packed.size(0) * kF32Panel >= out,
              "packed [ceil(out / 32), in, 32] float32 (kernels.pack_weight)");
  TORCH_CHECK(norms.dtype() == at::kFloat && norms.numel() == out, "norms [out] float32");
  const double u = std::ldexp(1.0, -8), gamma = in * std::ldexp(1.0, -24) / (1.0 - in * std::ldexp(1.0, -24));
  const double gamma_screen = in * std::ldexp(1.0, -23) / (1.0 - in * std::ldexp(1.0, -23));
  const double bound_scale = kBoundMargin * (2 * u + u * u + gamma_screen * (1 + u) * (1 + u) + gamma);
  x = x.contiguous();
  screen = screen.contiguous();
  packed = packed.contiguous();
  norms = norms.contiguous();
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* np = norms.data_ptr<float>();
  auto ids = at::full({rows}, -1, x.options().dtype(at::kLong));
  auto counts = at::zeros({rows}, x.options().dtype(at::kLong));
  if (rows == 0 || in == 0 || out == 0) return {ids, counts};  // (nothing to screen: the logits decide)
  // the rows as bfloat16 pairs, which rows are finite, and each row's bound
  std::vector<uint32_t> xb(rows * pairs, 0);
  std::vector<char> finite(rows, 1);
  const double wmax = *std::max_element(np, np + out);  // >= every |w[j, i]| (a row's norm bounds it)
  std::vector<RowBound> bounds(rows);
  const double tiny = std::ldexp(1.0, -126), root_in = std::sqrt(static_cast<double>(in));
  for (int64_t m = 0; m < rows; ++m) {
    double sq = 0.0, xmax = 0.0;
    for (int64_t i = 0; i < in; ++i) {
      const float v = xp[m * in + i];
      if (!std::isfinite(v)) finite[m] = 0;
      sq += static_cast<double>(v) * v;
      xmax = std::max(xmax, static_cast<double>(std::fabs(v)));
      if (finite[m]) xb[m * pairs + i / 2] |= static_cast<uint32_t>(to_bf16(v)) << (16 * (i % 2));
    }
    if (!(xmax < 1e37 && xmax * wmax * in < 1e37)) finite[m] = 0;  // (nothing can overflow in either arithmetic)
    const double xnorm = std::sqrt(sq) * (1.0 + 1e-12);
    bounds[m] = {round_up(bound_scale * xnorm + tiny * root_in), round_up(tiny * (root_in * xnorm + in) + kBoundFloor)};
  }
  // 1.-2. screened logits: per row, hi = a + e for every output and the largest a - e of each panel
  const int64_t panels = screen.size(0), width = panels * kPanel;
  std::vector<float> panel_norms(width, std::numeric_limits<float>::infinity());
  std::memcpy(panel_norms.data(), np, out * sizeof(float));
  // (reused from call to call on this thread: a fresh 6 MB buffer a pass would be zeroed and faulted in each time)
  thread_local std::vector<float> hi, lo_max;
  if (hi.size() < static_cast<size_t>(rows * width)) hi.resize(rows * width);
  if (lo_max.size() < static_cast<size_t>(rows * panels)) lo_max.resize(rows * panels);
  float* const hp = hi.data();  // (the lambda below runs on torch's worker threads too: their thread_locals differ)
  float* const lp = lo_max.data();
  const uint32_t* sp = reinterpret_cast<const uint32_t*>(screen.data_ptr<int32_t>());
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
        const int64_t mb = (rows - m0) / (blocks - b);
        screen_block<kBlockRows>(mb, xb.data() + m0 * pairs, pairs, sp + p * pairs * kPanel,
                                 panel_norms.data() + p * kPanel, bounds.data() + m0, hp + m0 * width + p * kPanel,
                                 width, lp + m0 * panels + p, panels);
        m0 += mb;
      }
  });
  // 3. per row: the candidates (hi >= the largest lo), their exact logits
  int64_t* idp = ids.data_ptr<int64_t>();
  int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t m = 0; m < rows; ++m) {
    if (!finite[m]) continue;
    const float* hm = hp + m * width;
    const float floor_ = *std::max_element(lp + m * panels, lp + (m + 1) * panels);
    if (!std::isfinite(floor_)) continue;  // (not expected: the logits decide)
    const __m512 level = _mm512_set1_ps(floor_);
    const float* xm = xp + m * in;
    auto exact = [&](int64_t j) {  // skinny_gemm's y[m, j]: from 0, one fused multiply-add per input, in order
      const float* w = wp + (j / kF32Panel) * in * kF32Panel + j % kF32Panel;
      float r = 0.0f;
      for (int64_t i = 0; i < in; ++i) r = std::fmaf(xm[i], w[i * kF32Panel], r);
      return r;
    };
    float best = -std::numeric_limits<float>::infinity();
    int64_t best_j = -1, count = 0;
    bool nan = false;  // (torch.argmax takes a NaN as the largest: the caller's logits decide)
    for (int64_t j0 = 0; j0 < out && !nan; j0 += 16) {
      for (__mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(hm + j0), level, _CMP_GE_OQ); above && !nan;
           above &= above - 1) {
        const int64_t j = j0 + __builtin_ctz(above);
        if (j >= out) break;  // (the last panel's padding)
        ++count;
        const float r = exact(j);
        nan = std::isnan(r);
        if (best_j < 0 || r > best) best = r, best_j = j;  // the first of the largest
      }
    }
    if (nan) best_j = -1;
    idp[m] = best_j;
    cp[m] = count;
  }
  return {ids, counts};
}
#else
std::tuple<at::Tensor, at::Tensor> greedy_head(at::Tensor x, at::Tensor, at::Tensor, at::Tensor, int64_t) {
  TORCH_CHECK(false, "greedy_head: built without AVX512_BF16");
  return {x, x};
}
#endif

}  // namespace splitspec
