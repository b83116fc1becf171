// The decoder layers of a Llama-family model over the rows of short chunks (verify blocks, draft steps), in one
// call made without the GIL.
//
// services/fast_llama.py's ``_layers`` makes some 40 torch calls a layer; each takes the GIL back from whatever
// holds it. In a serving replica that is the event loop, which streams the other sessions' tokens meanwhile, so a
// pass waited for the GIL at every call (and ran 35% slower than alone). Here the same ATen calls, the same
// kernels (skinny_gemm, decode_attention) and the same order run as C++: the same bits as the Python loop, which
// stays for prompts (SDPA), other dtypes and the runs without compiled kernels.
#include <ATen/ATen.h>

#include <vector>

namespace splitspec {

at::Tensor skinny_gemm(at::Tensor x, at::Tensor packed, int64_t out);
void decode_attention(at::Tensor out, at::Tensor q, at::Tensor k, at::Tensor v, std::vector<at::Tensor> caches,
                      std::vector<int64_t> offsets, std::vector<int64_t> sizes, std::vector<int64_t> starts,
                      int64_t layer, double scale, std::vector<std::vector<int64_t>> parents);

namespace {

// FastLlamaRunner._rms_norm
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * h.to(x.scalar_type());
}

// FastLlamaRunner._rotate: x [heads, N, d]
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  return x * cos + at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1) * sin;
}

}  // namespace

// x [N, hidden] -> [N, hidden] after every layer (before the final norm). ``layers``: per layer its input norm's
// weight, the packed q|k|v projection, the packed output projection, the post-attention norm's weight, the packed
// gate|up and down projections (kernels.pack_weight). cos / sin [N, d]: the rows' rotary embedding. The chunks'
// caches, offsets, sizes, starts and parents as decode_attention takes them.
at::Tensor decoder_layers(at::Tensor x, std::vector<std::vector<at::Tensor>> layers, at::Tensor cos, at::Tensor sin,
                          double eps, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
                          std::vector<at::Tensor> caches, std::vector<int64_t> offsets, std::vector<int64_t> sizes,
                          std::vector<int64_t> starts, double scale, std::vector<std::vector<int64_t>> parents) {
  const int64_t rows = x.size(0), hidden = x.size(1), h = heads, h_kv = kv_heads, d = head_dim;
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::vector<at::Tensor>& w = layers[i];
    TORCH_CHECK(w.size() == 6, "a layer: ln1, qkv, o, ln2, gate_up, down");
    at::Tensor qkv = skinny_gemm(rms_norm(x, w[0], eps), w[1], (h + 2 * h_kv) * d);  // [N, (h + 2 h_kv) d]
    at::Tensor q = qkv.slice(1, 0, h * d).view({rows, h, d}).transpose(0, 1);  // [h, N, d]
    at::Tensor k = qkv.slice(1, h * d, (h + h_kv) * d).view({rows, h_kv, d}).transpose(0, 1);  // [h_kv, N, d]
    at::Tensor v = qkv.slice(1, (h + h_kv) * d).view({rows, h_kv, d}).transpose(0, 1);
    q = rotate(q, cos, sin);
    k = rotate(k, cos, sin);
    at::Tensor out = at::empty({rows, h * d}, x.options());  // [N, h d]
    decode_attention(out, q, k, v, caches, offsets, sizes, starts, static_cast<int64_t>(i), scale, parents);
    x = x + skinny_gemm(out, w[2], hidden);
    std::vector<at::Tensor> gate_up = skinny_gemm(rms_norm(x, w[3], eps), w[4], 2 * intermediate).chunk(2, -1);
    x = x + skinny_gemm(at::silu(gate_up[0]) * gate_up[1], w[5], hidden);
  }
  return x;
}

}  // namespace splitspec
