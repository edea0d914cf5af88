// The Python module of phasewise's CPU kernels: KernelSet (one ISA level's library) and
// DecoderStack. Every call releases the GIL while it runs (none touches a Python object), so a
// server's event-loop thread keeps running while the engine thread computes.
#include "decoder_stack.h"
#include "kernel_set.h"

#include <memory>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using nogil = py::call_guard<py::gil_scoped_release>;
  py::class_<KernelSet, std::shared_ptr<KernelSet>>(m, "KernelSet")
      .def(py::init<std::string>(), py::arg("library"))
      .def_property_readonly("isa", &KernelSet::isa)
      .def("paged_attention", &KernelSet::paged_attention, "attention of query rows over a paged KV cache",
           py::arg("q"), py::arg("kv"), py::arg("block_tables"), py::arg("row_seq"), py::arg("row_len"),
           py::arg("seqs"), py::arg("block_size"), py::arg("scale"), py::arg("fresh") = py::none(),
           py::arg("window") = 0, py::arg("fresh_v") = py::none(), nogil())
      .def("rope_and_cache", &KernelSet::rope_and_cache, "split qkv, rotate q and k, write k and v to the cache",
           py::arg("qkv"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("kv"), py::arg("slots"),
           py::arg("Hq"), py::arg("Hkv"), py::arg("block_tables"), py::arg("seqs"), py::arg("block_size"), nogil())
      .def("write_kv", &KernelSet::write_kv, "write a step's keys and values to the cache", py::arg("k"),
           py::arg("v"), py::arg("kv"), py::arg("slots"), py::arg("block_tables"), py::arg("seqs"),
           py::arg("block_size"), nogil())
      .def("rms_norm", &KernelSet::rms_norm, "optional residual add, then RMSNorm", py::arg("x"),
           py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none(), nogil())
      .def("silu_and_mul", &KernelSet::silu_and_mul, "silu(gate) * up (gelu: GELU-tanh(gate) * up)", py::arg("x"),
           py::arg("gelu") = false, nogil())
      .def("argmax_rows", &KernelSet::argmax_rows, "each row's argmax (the first on ties)", nogil())
      .def("mask_rows", &KernelSet::mask_rows, "-inf where a grammar bitmask refuses the token", nogil())
      .def("quantize_activations", &KernelSet::quantize_activations,
           "per-32 symmetric int8 activations: xq, dx, sx", nogil())
      .def("int8_peak_gops", &KernelSet::int8_peak_gops, "the int8 dot-product peak of all threads, GOP/s",
           py::arg("iters") = 20000000, nogil())
      .def("quant_linear", &KernelSet::quant_linear, "y = x W^T + b with W in a packed block format",
           py::arg("x"), py::arg("fmt"), py::arg("N"), py::arg("blocks"), py::arg("scale") = py::none(),
           py::arg("bias") = py::none(), py::arg("u5_tiles") = 0, py::arg("rest") = std::vector<PartArgs>{}, nogil())
      .def("repack_gguf", &KernelSet::repack_gguf, "GGUF Q4_K / Q6_K rows -> the k4 / q6k layout: blocks, side",
           py::arg("type"), py::arg("raw"), py::arg("N"), py::arg("K"), nogil())
      .def("expert_mlp", &KernelSet::expert_mlp, "a mixture-of-experts MLP over packed, stacked expert weights",
           py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("gate"), py::arg("up"), py::arg("down"),
           py::arg("experts"), py::arg("gelu") = false, nogil())
      .def("float_linear", &KernelSet::float_linear, "x W^T in fp32, each row's bits independent of the others",
           py::arg("x"), py::arg("weight"), nogil())
      .def("moe_route", &KernelSet::moe_route, "each row's top-k experts and their weights from a router's logits",
           py::arg("logits"), py::arg("k"), py::arg("renorm"), py::arg("topk_softmax") = false, nogil())
      .def("dequantize_rows", &KernelSet::dequantize_rows, "rows ids of a packed weight in fp32 (an embedding)",
           py::arg("ids"), py::arg("fmt"), py::arg("N"), py::arg("blocks"), py::arg("scale") = py::none(), nogil())
      .def("delta_net_mix", &KernelSet::delta_net_mix,
           "a Gated DeltaNet's conv, delta rule and gated norm over a step's sequences, states advanced in place",
           py::arg("qkv"), py::arg("a"), py::arg("b"), py::arg("conv_w"), py::arg("neg_A"), py::arg("dt_bias"),
           py::arg("conv_states"), py::arg("states"), py::arg("query_lens"), py::arg("context_lens"), py::arg("slots"),
           py::arg("z") = py::none(), py::arg("norm_w") = py::none(), py::arg("eps") = 1e-6, py::arg("tiled") = false,
           nogil())
      .def("decoder_stack", &DecoderStack::from_specs, "a Llama-family model's decoder layers on these kernels",
           py::arg("layers"), py::arg("final_norm"), py::arg("cos"), py::arg("sin"), py::arg("Hq"), py::arg("Hkv"),
           py::arg("D"), py::arg("eps"), py::arg("scale") = 0.0, py::arg("gelu") = false)
      .def_static("stack_fields", [] { return std::make_tuple(LAYER_SPEC_FIELDS, SPARSE_FIELDS, MIXER_FIELDS); },
                  "the field names of a decoder_stack layer, of its sparse MLP and of its mixer, in order");
  py::class_<DecoderStack>(m, "DecoderStack")
      .def("forward", &DecoderStack::forward, py::arg("x"), py::arg("positions"), py::arg("slots"),
           py::arg("kv"), py::arg("tables"), py::arg("row_seq"), py::arg("row_len"), py::arg("block_size"),
           py::arg("keep") = py::none(), py::arg("expert_counts") = py::none(), py::arg("sequences") = py::none(),
           py::arg("snapshots") = py::none(), py::arg("kv_seqs") = py::none(), nogil());
}
