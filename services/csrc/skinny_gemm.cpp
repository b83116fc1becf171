// y[m, o] = sum_i x[m, i] * w[o, i] for a handful of rows m (a decode step, a verify chunk, or the rows of
// several sessions' chunks batched together).
//
// The weight is packed once (``pack_weight`` in services/kernels.py) into panels of kPanel outputs, each panel
// stored input by input: panel p holds w[p * kPanel + j, i] at [p][i][j]. A pass streams every panel once, from
// start to end — one sequential stream, which the hardware prefetcher keeps up with — and for each input i
// broadcasts x[m, i] of a block of rows against the panel's kPanel weights, the accumulators in vector registers
// (the outer-product micro-kernel of BLIS / gpt-fast's CPU path). Unlike dot products along i, this needs no
// horizontal sums, and one loaded weight vector serves every row of the block. Measured here (2-core AMD EPYC,
// AVX-512, the default target's matmuls): 8 rows 54 -> 37 ms, 4 rows 37 -> 27 ms, 1 row unchanged.
//
// Every y[m, o] is summed in one order: i = 0, 1, ..., in - 1, one fused multiply-add each, in one vector lane.
// That order depends on nothing else — not on the rows, the blocking, the thread split or the vector width — so
// a row's result is the same bits alone or batched with other sessions' rows, on the AVX-512 and the AVX2 build.
//
// The packed weight may be float32 or bfloat16 (a drafter's weights: half the bytes a step streams). A bfloat16
// weight is widened to float32 exactly as it is loaded, and x, the products and the sums stay float32, so the
// result is that of the float32 kernel over the bfloat16-rounded weight, bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "simd.h"

namespace splitspec {
namespace {

constexpr int64_t kPanel = 64;  // outputs per packed panel (the layout; the same for every build)
#if defined(__AVX512F__)
constexpr int kSubVecs = 4;  // vectors of a panel one micro-kernel holds: all 4 (64 outputs)
constexpr int kBlockRows = 6;  // rows per block: 6 x 4 accumulators + 4 weights + 1 broadcast of 32 registers
#else
constexpr int kSubVecs = 2;  // 2 of the panel's 8 vectors at a time
constexpr int kBlockRows = 4;  // 4 x 2 accumulators + 2 weights + 1 broadcast <= 16 registers
#endif
constexpr int64_t kSubWidth = kSubVecs * kLanes;  // outputs per micro-kernel call

// dst[m, 0 .. kSubWidth) = the products of MB rows of x with kSubWidth columns of one panel (``panel`` points at
// the sub-panel's first column; consecutive inputs are kPanel weights apart). W: float or uint16_t (bfloat16).
template <int MB, typename W>
inline void micro(const float* x, int64_t in, const W* panel, float* dst, int64_t ld_dst) {
  Vec acc[MB][kSubVecs];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < kSubVecs; ++v) acc[m][v] = vzero();
  for (int64_t i = 0; i < in; ++i) {
    const W* w = panel + i * kPanel;
    Vec wv[kSubVecs];
    for (int v = 0; v < kSubVecs; ++v) wv[v] = vload(w + v * kLanes);
    for (int m = 0; m < MB; ++m) {
      const Vec xb = vset1(x[m * in + i]);
      for (int v = 0; v < kSubVecs; ++v) acc[m][v] = vfma(xb, wv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < kSubVecs; ++v) vstore(dst + m * ld_dst + v * kLanes, acc[m][v]);
}

template <int MB, typename W>
inline void sub_panel(const float* x, int64_t in, const W* panel, float* y, int64_t out, int64_t o0) {
  if (o0 + kSubWidth <= out) {
    micro<MB>(x, in, panel, y + o0, out);
    return;
  }
  float tmp[MB * kSubWidth];  // the last, partial sub-panel: computed whole (zero-padded), its valid columns kept
  micro<MB>(x, in, panel, tmp, kSubWidth);
  for (int m = 0; m < MB; ++m) std::memcpy(y + m * out + o0, tmp + m * kSubWidth, (out - o0) * sizeof(float));
}

// One panel against every row of x, block by block (the panel stays in L2 after the first block).
template <typename W>
void panel_rows(const float* x, const W* packed, float* y, int64_t rows, int64_t in, int64_t out, int64_t p) {
  const W* panel = packed + p * in * kPanel;
  for (int64_t s = 0; s < kPanel && p * kPanel + s < out; s += kSubWidth) {
    const int64_t o0 = p * kPanel + s;
    int64_t m0 = 0;
    for (; m0 + kBlockRows <= rows; m0 += kBlockRows)
      sub_panel<kBlockRows>(x + m0 * in, in, panel + s, y + m0 * out, out, o0);
    const float* xm = x + m0 * in;
    float* ym = y + m0 * out;
    switch (rows - m0) {  // the last, partial block of rows
      case 0: break;
      case 1: sub_panel<1>(xm, in, panel + s, ym, out, o0); break;
      case 2: sub_panel<2>(xm, in, panel + s, ym, out, o0); break;
      case 3: sub_panel<3>(xm, in, panel + s, ym, out, o0); break;
#if defined(__AVX512F__)
      case 4: sub_panel<4>(xm, in, panel + s, ym, out, o0); break;
      default: sub_panel<5>(xm, in, panel + s, ym, out, o0); break;
#endif
    }
  }
}

}  // namespace

template <typename W>
void run_panels(const float* xp, const W* wp, float* yp, int64_t rows, int64_t in, int64_t out, int64_t panels) {
  at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) panel_rows(xp, wp, yp, rows, in, out, p);
  });
}

at::Tensor skinny_gemm(at::Tensor x, at::Tensor packed, int64_t out) {
  TORCH_CHECK(x.dtype() == at::kFloat, "x: float32 only");
  TORCH_CHECK(packed.dtype() == at::kFloat || packed.dtype() == at::kBFloat16, "packed: float32 or bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "x [m, in] with at least one row");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == x.size(1) && packed.size(2) == kPanel &&
                  out > (packed.size(0) - 1) * kPanel && out <= packed.size(0) * kPanel,
              "packed [ceil(out / 64), in, 64] (kernels.pack_weight)");
  x = x.contiguous();
  packed = packed.contiguous();
  const int64_t rows = x.size(0), in = x.size(1), panels = packed.size(0);
  auto y = at::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (packed.dtype() == at::kBFloat16)
    run_panels(xp, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), yp, rows, in, out, panels);
  else
    run_panels(xp, packed.data_ptr<float>(), yp, rows, in, out, panels);
  return y;
}

int64_t panel_width() { return kPanel; }

}  // namespace splitspec
