// Attention for short chunks (verify blocks, draft steps, short prompts) of several sequences in one call:
// appends each chunk's K/V to its own cache, then for every row and head computes
// softmax(scale * q . K[:keys]) @ V[:keys] over the keys the row may see (every cached position and the chunk's
// rows up to its own: causal; in a draft tree's chunk, its ancestors and itself). torch's SDPA does the same per sequence, but on a CPU each call costs about
// 100 us of setup for microseconds of arithmetic, and a batched verify pass over 16 sessions makes 480 of them.
//
// Each (row, head) is computed alone, in a fixed order (scores, then the maximum, exp and sum, then the
// weighted values), so its result does not depend on the other rows or sequences in the call: batching leaves
// each sequence's attention bit-identical, as the skinny GEMM does for the matmuls.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "simd.h"

namespace splitspec {
namespace {

// out[0, V * kLanes) = the sum over keys s of scores[s] * V(s), divided by ``total``: the V vectors of the output
// at once, key by key — V independent chains of fused multiply-adds where one vector at a time would wait on one
// chain's latency at every key. Each output lane still sums s = 0, 1, ... in order, one FMA each: the same bits as
// a vector at a time. Returns V * kLanes (the outputs done).
template <int V, typename ValueAt>
int64_t weigh_values(const float* scores, ValueAt value, int64_t keys, Vec total, float* out) {
  Vec acc[V];
  for (int j = 0; j < V; ++j) acc[j] = vzero();
  for (int64_t s = 0; s < keys; ++s) {
    const Vec weight = vset1(scores[s]);
    const float* row = value(s);
    for (int j = 0; j < V; ++j) acc[j] = vfma(weight, vload(row + j * kLanes), acc[j]);
  }
  for (int j = 0; j < V; ++j) vstore(out + j * kLanes, vdiv(acc[j], total));
  return V * kLanes;
}

// out[0, d) = softmax(scale * q . K(t)) weighted sum of V(t), t < keys, with K(t) = key(t) and V(t) = value(t)
// (pointers to d floats); scores: scratch of at least keys floats. One body for every layout of the keys, so that a
// row whose keys are gathered (a draft tree's) computes exactly what a row with the same keys in sequence does.
template <typename KeyAt, typename ValueAt>
void attend(const float* q, KeyAt key, ValueAt value, int64_t keys, int64_t d, float scale, float* scores,
            float* out) {
  float top = -INFINITY;
  for (int64_t t = 0; t < keys; ++t) {
    scores[t] = dot(q, key(t), d) * scale;
    top = std::max(top, scores[t]);
  }
  const Vec vtop = vset1(top);
  Vec vtotal = vzero();
  int64_t t = 0;
  for (; t + kLanes <= keys; t += kLanes) {
    Vec e = vexp(vsub(vload(scores + t), vtop));
    vstore(scores + t, e);
    vtotal = vadd(vtotal, e);
  }
  float total = vsum(vtotal);
  if (t < keys) {  // the tail through the same vector exp, padded
    float tail[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) tail[j] = t + j < keys ? scores[t + j] - top : -INFINITY;
    vstore(tail, vexp(vload(tail)));
    for (int64_t j = 0; t + j < keys; ++j) {
      scores[t + j] = tail[j];
      total += tail[j];
    }
  }
  const Vec vtotal_all = vset1(total);
  int64_t i = 0;
  switch (d / kLanes) {  // every vector of a head at once (up to 8: d <= 128 with AVX-512), else one at a time
    case 1: i = weigh_values<1>(scores, value, keys, vtotal_all, out); break;
    case 2: i = weigh_values<2>(scores, value, keys, vtotal_all, out); break;
    case 3: i = weigh_values<3>(scores, value, keys, vtotal_all, out); break;
    case 4: i = weigh_values<4>(scores, value, keys, vtotal_all, out); break;
    case 5: i = weigh_values<5>(scores, value, keys, vtotal_all, out); break;
    case 6: i = weigh_values<6>(scores, value, keys, vtotal_all, out); break;
    case 7: i = weigh_values<7>(scores, value, keys, vtotal_all, out); break;
    case 8: i = weigh_values<8>(scores, value, keys, vtotal_all, out); break;
    default: break;
  }
  for (; i + kLanes <= d; i += kLanes) {
    Vec acc = vzero();
    for (int64_t s = 0; s < keys; ++s) acc = vfma(vset1(scores[s]), vload(value(s) + i), acc);
    vstore(out + i, vdiv(acc, vtotal_all));
  }
  for (; i < d; ++i) {
    float acc = 0.f;
    for (int64_t s = 0; s < keys; ++s) acc += scores[s] * value(s)[i];
    out[i] = acc / total;
  }
}

// A row of a causal chunk: the keys are positions [0, keys) of the cache.
void attend_row(const float* q, const float* keys_base, const float* values_base, int64_t keys, int64_t d,
                float scale, float* scores, float* out) {
  attend(q, [&](int64_t t) { return keys_base + t * d; }, [&](int64_t t) { return values_base + t * d; }, keys, d,
         scale, scores, out);
}

// A draft tree's row: the keys are the cached prefix [0, start) and then the row's ancestors in the chunk and
// itself, ``path`` (chunk rows, shallowest first) — the keys it would have, in the same order, had its path been
// decoded as a sequence; so its result is that sequence's, bit for bit.
void attend_tree_row(const float* q, const float* keys_base, const float* values_base, int64_t start,
                     const std::vector<int64_t>& path, int64_t d, float scale, float* scores, float* out) {
  auto at = [&](const float* base) {
    return [&, base](int64_t t) { return t < start ? base + t * d : base + (start + path[t - start]) * d; };
  };
  attend(q, at(keys_base), at(values_base), start + static_cast<int64_t>(path.size()), d, scale, scores, out);
}

}  // namespace

void decode_attention(at::Tensor out, at::Tensor q, at::Tensor k, at::Tensor v, std::vector<at::Tensor> caches,
                      std::vector<int64_t> offsets, std::vector<int64_t> sizes, std::vector<int64_t> starts,
                      int64_t layer, double scale, std::vector<std::vector<int64_t>> parents) {
  TORCH_CHECK(out.dtype() == at::kFloat && q.dtype() == at::kFloat && k.dtype() == at::kFloat &&
                  v.dtype() == at::kFloat, "float32 only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [h, N, d], k and v [h_kv, N, d]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "the last dimension must be contiguous");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2, "out [N, h * d], contiguous");
  const int64_t heads = q.size(0), kv_heads = k.size(0), d = q.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(out.size(1) == heads * d, "out [N, h * d]");
  const size_t chunks = caches.size();
  TORCH_CHECK(offsets.size() == chunks && sizes.size() == chunks && starts.size() == chunks, "one entry per chunk");
  const int64_t group = heads / kv_heads;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();

  // append each chunk's K/V rows to its cache: buffer [layers, 2, h_kv, capacity, d]
  std::vector<float*> key_bases(chunks), value_bases(chunks);
  int64_t max_keys = 0;
  for (size_t c = 0; c < chunks; ++c) {
    at::Tensor& buf = caches[c];
    TORCH_CHECK(buf.is_contiguous() && buf.dtype() == at::kFloat && buf.dim() == 5 && buf.size(2) == kv_heads &&
                    buf.size(4) == d, "cache [layers, 2, h_kv, capacity, d], contiguous float32");
    TORCH_CHECK(starts[c] + sizes[c] <= buf.size(3), "cache too small for the chunk");
    float* base = buf.data_ptr<float>() + layer * buf.stride(0);
    key_bases[c] = base;
    value_bases[c] = base + buf.stride(1);
    for (int64_t g = 0; g < kv_heads; ++g)
      for (int64_t r = 0; r < sizes[c]; ++r) {
        const int64_t row = offsets[c] + r, pos = starts[c] + r;
        std::memcpy(key_bases[c] + g * buf.stride(2) + pos * d, kp + g * k.stride(0) + row * k.stride(1),
                    d * sizeof(float));
        std::memcpy(value_bases[c] + g * buf.stride(2) + pos * d, vp + g * v.stride(0) + row * v.stride(1),
                    d * sizeof(float));
      }
    max_keys = std::max(max_keys, starts[c] + sizes[c]);
  }

  // a draft tree's chunk (parents[c] non-empty: each row's parent row, -1 for the first): each row's path
  TORCH_CHECK(parents.empty() || parents.size() == chunks, "parents: none, or one entry per chunk");
  std::vector<std::vector<std::vector<int64_t>>> paths(chunks);
  for (size_t c = 0; c < parents.size(); ++c) {
    if (parents[c].empty()) continue;
    TORCH_CHECK(static_cast<int64_t>(parents[c].size()) == sizes[c], "parents: one per row of the chunk");
    paths[c].resize(sizes[c]);
    for (int64_t r = 0; r < sizes[c]; ++r) {
      const int64_t p = parents[c][r];
      TORCH_CHECK(p < r && (p >= 0 || r == 0), "a row's parent precedes it; only the first row has none");
      if (p >= 0) paths[c][r] = paths[c][p];
      paths[c][r].push_back(r);
    }
  }

  // one work item per (chunk row, head)
  std::vector<std::pair<size_t, int64_t>> rows;  // (chunk, row within it)
  for (size_t c = 0; c < chunks; ++c)
    for (int64_t r = 0; r < sizes[c]; ++r) rows.emplace_back(c, r);
  const int64_t items = static_cast<int64_t>(rows.size()) * heads;
  at::parallel_for(0, items, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(max_keys);
    for (int64_t item = begin; item < end; ++item) {
      const auto [c, r] = rows[item / heads];
      const int64_t h = item % heads, g = h / group, row = offsets[c] + r;
      const int64_t kv_stride = caches[c].stride(2);
      if (!paths[c].empty()) {
        attend_tree_row(qp + h * q.stride(0) + row * q.stride(1), key_bases[c] + g * kv_stride,
                        value_bases[c] + g * kv_stride, starts[c], paths[c][r], d, static_cast<float>(scale),
                        scores.data(), op + row * out.stride(0) + h * d);
        continue;
      }
      attend_row(qp + h * q.stride(0) + row * q.stride(1), key_bases[c] + g * kv_stride,
                 value_bases[c] + g * kv_stride, starts[c] + r + 1, d, static_cast<float>(scale), scores.data(),
                 op + row * out.stride(0) + h * d);
    }
  });
}

}  // namespace splitspec
