// The Python module of Baton's C++ CPU kernels (kernels/cpu_extension.py builds it from every file here).
#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over float32 or bfloat16 pools (CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("window"), py::arg("tail_mask") = py::none(), py::arg("sinks") = py::none(),
        py::arg("softcap") = 0.0);
  m.def("paged_decode_simd", &paged_decode_simd,
        "the vector path paged_decode compiled for head_dim 32/64/128: avx512, avx2 or portable");
  m.def("cache_write", &cache_write, "new K/V rows into the paged pools at slot_mapping (-1 skips)", py::arg("k"),
        py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"));
  m.def("mla_decode", &mla_decode, "paged MLA decode over a float32 or bfloat16 latent pool [blocks, block_size, L + R]",
        py::arg("q"), py::arg("cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("kv_lora_rank"));
  m.def("mla_decode_path", &mla_decode_path, "the path mla_decode takes for a dtype: avx512_bf16, avx512, avx2 or portable",
        py::arg("dtype"));
  m.def("mla_cache_write", &mla_cache_write, "latents [T, L] and rope keys [T, R] into the latent pool at slot_mapping",
        py::arg("latent"), py::arg("k_pe"), py::arg("cache"), py::arg("slot_mapping"));
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally of x + residual: (out, x + residual or an undefined tensor)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("rotary", &rotary, "rotate_half rotary embedding of q and k [tokens, heads, head_dim]", py::arg("q"),
        py::arg("k"), py::arg("cos"), py::arg("sin"));
  m.def("swiglu", &swiglu, "silu(gate) * up over rows that may be strided (the fused gate/up output's halves)",
        py::arg("gate"), py::arg("up"));
  m.def("first_max", &first_max, "(max, index of its first occurrence) of each row; NaN where a row is not all finite",
        py::arg("x"));
  m.def("gemm_available", &gemm_available, "whether this build has the packed GEMM for the dtype (AVX-512 / AVX-512 BF16)",
        py::arg("dtype"));
  m.def("gemm_pack", &gemm_pack, "an [out, in] weight packed for gemm_linear (panels of 64 output columns)",
        py::arg("weight"));
  m.def("gemm_linear", &gemm_linear, "x [rows, in] times a gemm_pack weight, plus bias: [rows, out]", py::arg("x"),
        py::arg("packed"), py::arg("bias"), py::arg("out_features"));
  m.def("gemm_swiglu", &gemm_swiglu,
        "silu(gate) * up from x [rows, in] and a gemm_pack fused gate/up weight [2I, in] (I a multiple of 64)",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("intermediate"));
  bind_decoder(m);
}
