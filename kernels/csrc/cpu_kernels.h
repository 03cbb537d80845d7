// The C++ CPU kernels' entry points, shared by the Python bindings (bindings.cpp) and the decoder
// stack that calls them directly (decoder_cpu.cpp).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale, int64_t window,
                           std::optional<torch::Tensor> tail_mask, std::optional<torch::Tensor> sinks = std::nullopt,
                           double softcap = 0.0);
std::string paged_decode_simd();
void cache_write(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                 torch::Tensor slot_mapping);
torch::Tensor mla_decode(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables, torch::Tensor context_lens,
                         double scale, int64_t kv_lora_rank);
std::string mla_decode_path(c10::ScalarType dtype);
void mla_cache_write(torch::Tensor latent, torch::Tensor k_pe, torch::Tensor cache, torch::Tensor slot_mapping);
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  std::optional<torch::Tensor> residual);
std::tuple<torch::Tensor, torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                                torch::Tensor sin);
torch::Tensor swiglu(torch::Tensor gate, torch::Tensor up);
std::tuple<torch::Tensor, torch::Tensor> first_max(torch::Tensor x);
bool gemm_available(c10::ScalarType dtype);
torch::Tensor gemm_pack(torch::Tensor weight);
torch::Tensor gemm_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias, int64_t out_features);
bool gemm_swiglu_fits(const torch::Tensor& packed, int64_t intermediate);
torch::Tensor gemm_swiglu(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias, int64_t intermediate);
void bind_decoder(py::module_& m);  // decoder_cpu.cpp: CpuLinear, CpuDecoderLayers
