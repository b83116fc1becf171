// The Python module of the compiled kernels (services/kernels.py builds it on first use).
#include <torch/extension.h>

#include <tuple>
#include <vector>

namespace splitspec {
at::Tensor skinny_gemm(at::Tensor x, at::Tensor packed, int64_t out);
int64_t panel_width(bool bfloat16);
void decode_attention(at::Tensor out, at::Tensor q, at::Tensor k, at::Tensor v, std::vector<at::Tensor> caches,
                      std::vector<int64_t> offsets, std::vector<int64_t> sizes, std::vector<int64_t> starts,
                      int64_t layer, double scale, std::vector<std::vector<int64_t>> parents);
at::Tensor decoder_layers(at::Tensor x, std::vector<std::vector<at::Tensor>> layers, at::Tensor cos, at::Tensor sin,
                          double eps, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
                          std::vector<at::Tensor> caches, std::vector<int64_t> offsets, std::vector<int64_t> sizes,
                          std::vector<int64_t> starts, double scale, std::vector<std::vector<int64_t>> parents);
bool greedy_head_built();
std::tuple<at::Tensor, at::Tensor> greedy_head(at::Tensor x, at::Tensor screen, at::Tensor packed, at::Tensor norms,
                                               int64_t out);
}  // namespace splitspec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // without the GIL: the replica's event loop keeps taking and answering calls while a pass runs
  m.def("skinny_gemm", &splitspec::skinny_gemm, "x @ w.T for a few rows of x, reading w (packed) once",
        py::call_guard<py::gil_scoped_release>());
  m.def("panel_width", &splitspec::panel_width,
        "outputs per packed panel of skinny_gemm's weight (float32, or bfloat16)", py::arg("bfloat16") = false);
  m.def("decode_attention", &splitspec::decode_attention,
        "append short chunks' K/V to their caches and attend, every sequence alone, in one call",
        py::arg("out"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("caches"), py::arg("offsets"),
        py::arg("sizes"), py::arg("starts"), py::arg("layer"), py::arg("scale"),
        py::arg("parents") = std::vector<std::vector<int64_t>>(), py::call_guard<py::gil_scoped_release>());
  m.def("decoder_layers", &splitspec::decoder_layers,
        "every decoder layer over short chunks' rows: FastLlamaRunner._layers' calls, in C++",
        py::call_guard<py::gil_scoped_release>());
  m.def("greedy_head_built", &splitspec::greedy_head_built, "whether greedy_head was built (AVX512_BF16)");
  m.def("greedy_head", &splitspec::greedy_head,
        "the argmax of x @ w.T per row, that of skinny_gemm's logits, through a bfloat16 screen",
        py::call_guard<py::gil_scoped_release>());
}
