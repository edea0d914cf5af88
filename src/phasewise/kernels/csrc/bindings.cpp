// The Python module of phasewise's CPU kernels: every op of ops.h, and DecoderStack.
#include "decoder_stack.h"

// Every op releases the GIL while it runs (none touches a Python object), so a server's
// event-loop thread keeps running while the engine thread computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.attr("has_vnni") = has_vnni();
  m.def("paged_attention", &paged_attention, "attention of query rows over a paged KV cache",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("row_seq"),
        py::arg("row_len"), py::arg("block_size"), py::arg("scale"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), nogil());
  m.def("rope_and_cache", &rope_and_cache, "split qkv, rotate q and k, write k and v to the cache",
        py::arg("qkv"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slots"), py::arg("Hq"), py::arg("Hkv"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), nogil());
  m.def("rms_norm", &rms_norm, "optional residual add, then RMSNorm", nogil());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up", nogil());
  m.def("argmax_rows", &argmax_rows, "each row's argmax (the first on ties)", nogil());
  m.def("quantize_activations", &quantize_activations, "per-32 symmetric int8 activations: xq, dx, sx",
        nogil());
  m.def("int8_peak_gops", &int8_peak_gops, "the int8 dot-product peak of all threads, GOP/s",
        py::arg("iters") = 20000000, nogil());
  m.def("quant_linear", &quant_linear, "y = x W^T + b with W in a packed block format",
        py::arg("x"), py::arg("fmt"), py::arg("N"), py::arg("blocks"),
        py::arg("scale") = py::none(), py::arg("bias") = py::none(), nogil());
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<LayerArgs>, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t,
                    int64_t, double>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("cos"), py::arg("sin"), py::arg("Hq"),
           py::arg("Hkv"), py::arg("D"), py::arg("eps"))
      .def("forward", &DecoderStack::forward, py::arg("x"), py::arg("positions"), py::arg("slots"),
           py::arg("kv"), py::arg("tables"), py::arg("row_seq"), py::arg("row_len"), py::arg("block_size"),
           nogil());
}
