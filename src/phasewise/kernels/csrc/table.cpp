// The one symbol a kernel library exports: its table of functions, for this build's ISA level.
#include "core.h"
#include "vec/vec.h"

extern "C" __attribute__((visibility("default"))) const pw::KernelTable* pw_kernel_table() {
  static const pw::KernelTable table{
      pw::ABI_VERSION,        pw::ISA,          &pw::paged_attention,      &pw::rope_and_cache,      &pw::write_kv,
      &pw::rms_norm,          &pw::silu_and_mul, &pw::argmax_rows,          &pw::mask_rows,          &pw::quantize_activations,
      &pw::quant_linear,      &pw::int8_peak_gops,      &pw::decoder_stack,       &pw::gelu_and_mul,
      &pw::dequantize_rows,   &pw::repack_gguf,      &pw::expert_mlp,      &pw::float_linear,
      &pw::moe_route,        &pw::delta_net_mix};
  return &table;
}
