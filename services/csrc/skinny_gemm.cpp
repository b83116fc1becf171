// y[m, o] = sum_i x[m, i] * w[o, i] for a handful of rows m (a decode step, a verify chunk, or the rows of
// several sessions' chunks batched together).
//
// The weight is packed once (``pack_weight`` in services/kernels.py) into panels of ``Layout<W>::panel`` outputs,
// each panel stored input by input: panel p holds w[p * panel + j, i] at [p][i][j]. A pass streams every panel
// once, from start to end — one sequential stream, which the hardware prefetcher keeps up with — and for each
// input i broadcasts x[m, i] of a block of rows against the panel's weights, the accumulators in vector registers
// (the outer-product micro-kernel of BLIS / gpt-fast's CPU path). Unlike dot products along i, this needs no
// horizontal sums, and one loaded weight vector serves every row of the block.
//
// A float32 weight (the target's) is read from memory at about the pace of one block's arithmetic, so every row of
// a pass should meet a weight in the one sweep that reads it from memory. Its panels are 32 outputs wide, and a
// block holds up to 12 rows (AVX-512: 12 x 2 accumulators, 2 weights and a broadcast of 32 registers); up to 6 rows
// take two neighbouring panels at once (6 x 4 accumulators, two sequential streams). With panels of 64 outputs and
// blocks of at most 6 rows, 7-12 rows swept each panel twice, and only the first sweep overlapped its arithmetic
// with the memory stream. Measured here (2-core AMD EPYC, AVX-512, every matmul of the default target and its LM
// head, each kernel in processes of its own, 3 rounds: scripts/gemm_ab.py), ms: 1-6 rows 22.1-24.5 -> 21.8-22.9
// (1.00-1.07x), 7 rows 27.6 -> 24.2, 8 rows 28.6 -> 25.6, 10 rows 32.1 -> 29.4 (1.09-1.14x), 12-32 rows unchanged
// (0.96-1.02x).
// A bfloat16 weight (a drafter's: half the bytes, mostly in cache) keeps panels of 64 outputs and blocks of 6 rows.
//
// Every y[m, o] is summed in one order: i = 0, 1, ..., in - 1, one fused multiply-add each, in one vector lane.
// That order depends on nothing else — not on the rows, the blocking, the panel width, the thread split or the
// vector width — so a row's result is the same bits alone or batched with other sessions' rows, on the AVX-512
// and the AVX2 build.
//
// The packed weight may be float32 or bfloat16 (a drafter's weights). A bfloat16 weight is widened to float32
// exactly as it is loaded, and x, the products and the sums stay float32, so the result is that of the float32
// kernel over the bfloat16-rounded weight, bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "simd.h"

namespace splitspec {
namespace {

// The packed layout and the micro-kernel's shapes, by weight type: ``panel`` outputs per packed panel (the layout),
// ``sub_vecs`` vectors of a panel per micro-kernel call, at most ``block_rows`` rows per block; up to ``pair_rows``
// rows (0: never), two neighbouring panels side by side in one micro-kernel call (two sequential streams), which
// does as much arithmetic per loaded vector as a panel twice as wide.
template <typename W>
struct Layout;
#if defined(__AVX512F__)
template <>
struct Layout<float> {
  static constexpr int64_t panel = 32;
  static constexpr int sub_vecs = 2;  // the whole panel
  static constexpr int block_rows = 12;  // 12 x 2 accumulators + 2 weights + 1 broadcast of 32 registers
  static constexpr int pair_rows = 6;  // 6 x 4 accumulators + 4 weights + 1 broadcast
};
template <>
struct Layout<uint16_t> {
  static constexpr int64_t panel = 64;
  static constexpr int sub_vecs = 4;  // the whole panel
  static constexpr int block_rows = 6;  // 6 x 4 accumulators + 4 weights + 1 broadcast of 32 registers
  static constexpr int pair_rows = 0;
};
#else
template <>
struct Layout<float> {
  static constexpr int64_t panel = 32;
  static constexpr int sub_vecs = 2;  // 2 of the panel's 4 vectors at a time
  static constexpr int block_rows = 4;  // 4 x 2 accumulators + 2 weights + 1 broadcast <= 16 registers
  static constexpr int pair_rows = 0;
};
template <>
struct Layout<uint16_t> {
  static constexpr int64_t panel = 64;
  static constexpr int sub_vecs = 2;  // 2 of the panel's 8 vectors at a time
  static constexpr int block_rows = 4;
  static constexpr int pair_rows = 0;
};
#endif

// dst[m, 0 .. SV * kLanes) = the products of MB rows of x with SV vectors of columns: the first ones of a panel
// (``panel`` points at the sub-panel's first column; consecutive inputs are a panel's width apart), and those
// beyond the panel's width (pairs) of the next panel, ``next``. W: float or uint16_t (bfloat16).
template <int MB, int SV, typename W>
inline void micro(const float* x, int64_t in, const W* panel, const W* next, float* dst, int64_t ld_dst) {
  constexpr int64_t kPanel = Layout<W>::panel;
  constexpr int kPanelVecs = kPanel / kLanes;
  Vec acc[MB][SV];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < SV; ++v) acc[m][v] = vzero();
  for (int64_t i = 0; i < in; ++i) {
    Vec wv[SV];
    for (int v = 0; v < SV; ++v)
      wv[v] = vload((v < kPanelVecs ? panel : next) + i * kPanel + (v % kPanelVecs) * kLanes);
    for (int m = 0; m < MB; ++m) {
      const Vec xb = vset1(x[m * in + i]);
      for (int v = 0; v < SV; ++v) acc[m][v] = vfma(xb, wv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < SV; ++v) vstore(dst + m * ld_dst + v * kLanes, acc[m][v]);
}

template <int MB, int SV, typename W>
inline void sub_panel(const float* x, int64_t in, const W* panel, const W* next, float* y, int64_t out, int64_t o0) {
  constexpr int64_t width = SV * kLanes;
  if (o0 + width <= out) {
    micro<MB, SV>(x, in, panel, next, y + o0, out);
    return;
  }
  float tmp[MB * width];  // the last, partial sub-panel: computed whole (zero-padded), its valid columns kept
  micro<MB, SV>(x, in, panel, next, tmp, width);
  for (int m = 0; m < MB; ++m) std::memcpy(y + m * out + o0, tmp + m * width, (out - o0) * sizeof(float));
}

// A block of ``rows`` (1 .. MAX) rows of x against SV vectors: the micro-kernel for that many rows.
template <int SV, int MAX, typename W>
inline void block(int64_t rows, const float* x, int64_t in, const W* panel, const W* next, float* y, int64_t out,
                  int64_t o0) {
  if constexpr (MAX >= 1) {
    if (rows == MAX) return sub_panel<MAX, SV>(x, in, panel, next, y, out, o0);
    block<SV, MAX - 1>(rows, x, in, panel, next, y, out, o0);
  }
}

// Panel p against every row of x, in as few blocks of at most ``block_rows`` rows as there can be, as even as they
// can be (the panel stays in L2 after the first block).
template <typename W>
void panel_rows(const float* x, const W* packed, float* y, int64_t rows, int64_t in, int64_t out, int64_t p) {
  using L = Layout<W>;
  const W* panel = packed + p * in * L::panel;
  const int64_t blocks = (rows + L::block_rows - 1) / L::block_rows;
  for (int64_t s = 0; s < L::panel && p * L::panel + s < out; s += L::sub_vecs * kLanes) {
    const int64_t o0 = p * L::panel + s;
    for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
      const int64_t mb = (rows - m0) / (blocks - b);  // the rows left, shared evenly by the blocks left
      // (no second panel: sub_vecs lie within one)
      block<L::sub_vecs, L::block_rows>(mb, x + m0 * in, in, panel + s, panel, y + m0 * out, out, o0);
      m0 += mb;
    }
  }
}

// Panels p and p + 1 side by side against every row of x (at most ``pair_rows``), in one sweep.
template <typename W>
void pair_rows(const float* x, const W* packed, float* y, int64_t rows, int64_t in, int64_t out, int64_t p) {
  using L = Layout<W>;
  if constexpr (L::pair_rows > 0) {
    const W* panel = packed + p * in * L::panel;
    block<2 * L::sub_vecs, L::pair_rows>(rows, x, in, panel, panel + in * L::panel, y, out, p * L::panel);
  }
}

}  // namespace

int64_t panel_width(bool bfloat16);

template <typename W>
void run_panels(const float* xp, const W* wp, float* yp, int64_t rows, int64_t in, int64_t out, int64_t panels) {
  if (rows <= Layout<W>::pair_rows) {  // one sweep of pairs of panels; else of single panels, block_rows a sweep
    at::parallel_for(0, (panels + 1) / 2, 2, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) {
        if (2 * q + 1 < panels)
          pair_rows(xp, wp, yp, rows, in, out, 2 * q);
        else
          panel_rows(xp, wp, yp, rows, in, out, 2 * q);
      }
    });
    return;
  }
  at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) panel_rows(xp, wp, yp, rows, in, out, p);
  });
}

at::Tensor skinny_gemm(at::Tensor x, at::Tensor packed, int64_t out) {
  TORCH_CHECK(x.dtype() == at::kFloat, "x: float32 only");
  TORCH_CHECK(packed.dtype() == at::kFloat || packed.dtype() == at::kBFloat16, "packed: float32 or bfloat16");
  const bool bf16 = packed.dtype() == at::kBFloat16;
  const int64_t panel = panel_width(bf16);
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "x [m, in] with at least one row");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == x.size(1) && packed.size(2) == panel &&
                  out > (packed.size(0) - 1) * panel && out <= packed.size(0) * panel,
              "packed [ceil(out / ", panel, "), in, ", panel, "] (kernels.pack_weight for this dtype)");
  x = x.contiguous();
  packed = packed.contiguous();
  const int64_t rows = x.size(0), in = x.size(1), panels = packed.size(0);
  auto y = at::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (bf16)
    run_panels(xp, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), yp, rows, in, out, panels);
  else
    run_panels(xp, packed.data_ptr<float>(), yp, rows, in, out, panels);
  return y;
}

int64_t panel_width(bool bfloat16) { return bfloat16 ? Layout<uint16_t>::panel : Layout<float>::panel; }

}  // namespace splitspec
