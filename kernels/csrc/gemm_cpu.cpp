// Baton's own GEMM for CPU inference: y = x W^T (+ bias) over a weight packed once, in float32
// (AVX-512) and bfloat16 (AVX-512 BF16's vdpbf16ps), for the serving linears (kernels/linear_cpu.py).
//
// Why not oneDNN's: at decode (x has 1-64 rows) a step streams every weight from DRAM once, and the
// time is the larger of that stream and the FMAs. oneDNN's small-M kernels reach neither on AMD
// Zen 4 (2 cores, the 110M serving model's linears cycling through 8 layers, docs/benchmarks.md):
// 22 GB/s at M = 1 where the memory gives ~50, 140-200 GFLOP/s fp32 at M = 16-64 where the FMAs
// give ~220. The kernel here is the plain outer-product loop that does reach them: the weight is
// packed as panels of 64 output columns, each panel [K][64] contiguous (bf16: [K/2][64][2], the
// pairs vdpbf16ps multiplies), so a panel is one sequential stream the hardware prefetcher follows;
// a 6-row block of x is multiplied into 6 x 4 zmm accumulators, each k a broadcast of x and four
// weight vectors. Threads split the panels; a panel's K is walked in chunks of KC so the chunk
// stays in L2 while every 6-row block of x passes over it; x is taken 256 rows at a time so its
// rows stay in cache across the panels (a prefill chunk of 2,048 rows).
//
// Every output is summed the same way whatever M, the row's place in x or the thread count: runs of
// kSum k values, each FMA after FMA in registers (bf16: vdpbf16ps pairs, k and k+1 then the next),
// added one after another into the row's fp32 sum. So a row's result is the same bit for bit
// alone or in any batch (batch invariance), which oneDNN's blocking does not promise; the runs keep
// the rounding error of K = 2,816 at F.linear's size (one FMA chain over all of K was 5x it).
// bf16: products are exact in fp32 (vdpbf16ps treats bf16 subnormals as zero), the bias is added
// in fp32 and the sum is rounded to bf16 once (round to nearest even).
//
// gemm_swiglu: the fused gate/up projection of an MLP (gate: the first I outputs, up: the next I,
// I a multiple of 64) with SwiGLU in the epilogue: each thread multiplies a gate panel and the
// matching up panel into two tiles and stores silu(gate) * up, so [rows, 2I] is never written to
// memory and read back by a separate pass (110M serving model: prefill 1.7%, decode 2.9% faster in
// bf16). The tiles are rounded as gemm_linear would store them first, so the result is
// gemm_linear then swiglu() bit for bit.
#include "cpu_kernels.h"
#include "simd_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kPanel = 64;  // output columns a panel: 4 zmm of 16 floats
constexpr int64_t kRows = 6;    // rows of x a micro-kernel: 6 x 4 = 24 accumulators of the 32 zmm
constexpr int64_t kChunkK = 512;  // k values a chunk: 128 KB of an fp32 panel (64 KB bf16), in L2
constexpr int64_t kRowBlock = 256;  // rows of x a pass over the weight
constexpr int64_t kSum = 128;  // k values summed in registers before they join the row's sum (divides kChunkK)

#if defined(__AVX512F__)
constexpr int kVecs = kPanel / 16;

// C[r][0:64] (+)= sum over k of A[r][k] * B[k][0:64], r < MR; C is a tile of 64 floats a row.
// The accumulators of a run of kSum k steps into the tile: C = c on a row's first run, else C += c.
template <int MR>
inline void flush(__m512 (&c)[MR][kVecs], float* C, bool first) {
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVecs; ++v) {
      float* t = C + r * kPanel + 16 * v;
      _mm512_storeu_ps(t, first ? c[r][v] : _mm512_add_ps(_mm512_loadu_ps(t), c[r][v]));
      c[r][v] = _mm512_setzero_ps();
    }
}

template <int MR>
void micro_f32(const float* A, int64_t lda, const float* B, int64_t kc, float* C, bool first) {
  __m512 c[MR][kVecs];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVecs; ++v) c[r][v] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < kc; k0 += kSum) {
    for (int64_t k = k0; k < std::min(kc, k0 + kSum); ++k) {
      __m512 b[kVecs];
      for (int v = 0; v < kVecs; ++v) b[v] = _mm512_loadu_ps(B + k * kPanel + 16 * v);
      for (int r = 0; r < MR; ++r) {
        const __m512 a = _mm512_set1_ps(A[r * lda + k]);
        for (int v = 0; v < kVecs; ++v) c[r][v] = _mm512_fmadd_ps(a, b[v], c[r][v]);
      }
    }
    flush(c, C, first && k0 == 0);
  }
}
#endif

#if defined(__AVX512BF16__)
// As micro_f32 over k pairs: A's rows are bf16 (two a 32-bit broadcast), B is [k/2][64][2].
template <int MR>
void micro_bf16(const uint16_t* A, int64_t lda, const uint16_t* B, int64_t pairs, float* C, bool first) {
  __m512 c[MR][kVecs];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVecs; ++v) c[r][v] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < pairs; k0 += kSum / 2) {
    for (int64_t k = k0; k < std::min(pairs, k0 + kSum / 2); ++k) {
      __m512i b[kVecs];
      for (int v = 0; v < kVecs; ++v) b[v] = _mm512_loadu_si512(B + (k * kPanel + 16 * v) * 2);
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, A + r * lda + 2 * k, sizeof pair);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < kVecs; ++v) c[r][v] = _mm512_dpbf16_ps(c[r][v], a, (__m512bh)b[v]);
      }
    }
    flush(c, C, first && k0 == 0);
  }
}
#endif

// The tile's rows (fp32 sums) plus the bias into y's columns [col, col + cols).
void store_rows(const float* tile, int64_t rows, int64_t cols, const float* bias, float* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) y[r * ldy + j] = tile[r * kPanel + j] + (bias ? bias[j] : 0.f);
}
#if defined(__AVX512BF16__)
void store_rows(const float* tile, int64_t rows, int64_t cols, const float* bias, uint16_t* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; j += 16) {
      const __mmask16 m = cols - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (cols - j)) - 1);
      __m512 v = _mm512_maskz_loadu_ps(m, tile + r * kPanel + j);
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + j));
      _mm256_mask_storeu_epi16(y + r * ldy + j, m, (__m256i)_mm512_cvtneps_pbh(v));
    }
}
#endif

#if defined(__AVX512F__)
// The fused gate/up projection's epilogue: silu(gate) * up of a gate tile and its up tile, each
// first made what store_rows would have stored (bias added; bf16: rounded to bf16 as
// _mm512_cvtneps_pbh rounds), then as swiglu() computes it (baton_simd::vswiglu, one rounding).
// So the result is the unfused pair's bit for bit, without writing and re-reading [rows, 2I].
template <typename T>
void store_swiglu(const float* gate, const float* up, int64_t rows, const float* bg, const float* bu, T* y, int64_t ldy) {
  using namespace baton_simd;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < kPanel; j += 16) {
      vec g = _mm512_loadu_ps(gate + r * kPanel + j), u = _mm512_loadu_ps(up + r * kPanel + j);
      if (bg) g = _mm512_add_ps(g, _mm512_loadu_ps(bg + j)), u = _mm512_add_ps(u, _mm512_loadu_ps(bu + j));
      if constexpr (std::is_same_v<T, float>) {
        vstore(y + r * ldy + j, vswiglu(g, u));
      } else {
#if defined(__AVX512BF16__)
        const auto bf16 = [](__m512 v) {  // v rounded to bf16 and widened back (the stored gate_up values)
          return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
        };
        vstore(reinterpret_cast<c10::BFloat16*>(y + r * ldy + j), vswiglu(bf16(g), bf16(u)));
#endif
      }
    }
}
#endif

// y[rows, n] = x W^T + bias for one dtype: `micro[mr]` multiplies mr rows into a tile. With `up`
// > 0 the weight is a fused gate/up projection (gate: panels [0, up), up: [up, 2 up)) and y is
// silu(gate) * up, n = up * kPanel columns wide (store_swiglu).
template <typename T, typename Micro>
void gemm(const T* x, int64_t lda, const T* packed, int64_t m, int64_t n, int64_t k_steps, int64_t panel_stride,
          const float* bias, T* y, const Micro* micro, int64_t up) {
  const int64_t panels = (n + kPanel - 1) / kPanel, chunk = std::is_same_v<T, float> ? kChunkK : kChunkK / 2;
  const int64_t k_elems = std::is_same_v<T, float> ? 1 : 2;  // x elements a k step
  for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
    const int64_t mb = std::min(kRowBlock, m - m0);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      alignas(64) float tile[64 * kPanel];
      alignas(64) float up_tile[64 * kPanel];  // the up half's, where fused
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t cols = std::min(kPanel, n - p * kPanel);
        for (int64_t r0 = 0; r0 < mb; r0 += 64) {
          const int64_t rows = std::min<int64_t>(64, mb - r0);
          for (int64_t k0 = 0; k0 < k_steps; k0 += chunk) {
            const int64_t kc = std::min(chunk, k_steps - k0);
            const auto pass = [&](int64_t q, float* t) {  // panel q's chunk into tile t, 6 rows at a time
              const T* panel = packed + q * panel_stride + k0 * kPanel * k_elems;
              for (int64_t i = 0; i < rows; i += kRows)
                micro[std::min(kRows, rows - i)](x + (m0 + r0 + i) * lda + k0 * k_elems, lda, panel, kc,
                                                 t + i * kPanel, k0 == 0);
            };
            pass(p, tile);
            if (up) pass(p + up, up_tile);
          }
          T* out = y + (m0 + r0) * n + p * kPanel;
#if defined(__AVX512F__)
          if (up) {
            store_swiglu(tile, up_tile, rows, bias ? bias + p * kPanel : nullptr,
                         bias ? bias + (up + p) * kPanel : nullptr, out, n);
            continue;
          }
#endif
          store_rows(tile, rows, cols, bias ? bias + p * kPanel : nullptr, out, n);
        }
      }
    });
  }
}

}  // namespace

bool gemm_available(c10::ScalarType dtype) {
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return true;
#endif
  return false;
}

torch::Tensor gemm_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() && gemm_available(weight.scalar_type()),
              "gemm_pack: a 2-D CPU weight of a dtype this build's GEMM has (gemm_available), got ",
              weight.sizes(), " ", weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  // [panels, n padded, k padded] with zeros, then each panel's columns interleaved by k (fp32)
  // or by k pair (bf16): the strided copy is torch's.
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  const int64_t kp = bf16 ? (k + 1) / 2 * 2 : k;
  auto padded = weight.new_zeros({panels * kPanel, kp});
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  auto v = padded.view({panels, kPanel, kp});
  if (!bf16) return v.permute({0, 2, 1}).contiguous();                       // [P][K][64]
  return v.view({panels, kPanel, kp / 2, 2}).permute({0, 2, 1, 3}).contiguous();  // [P][K/2][64][2]
}

namespace {

// gemm_linear's and gemm_swiglu's body: y [rows, out_features] from x and the packed weight, plain
// (up = 0) or the fused gate/up projection's silu(gate) * up (up: the gate half's panels).
torch::Tensor run_gemm(torch::Tensor x, const torch::Tensor& packed, const std::optional<torch::Tensor>& bias,
                       int64_t out_features, int64_t up) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t m = x.size(0), k = x.size(1);
  [[maybe_unused]] const int64_t k_steps = packed.size(1);  // unused where nothing is built
  if (bf16 && k % 2) x = at::constant_pad_nd(x, {0, 1});  // the last pair's second value: a zero
  if (x.stride(1) != 1 || (m > 1 && x.stride(0) < x.size(1))) x = x.contiguous();
  auto y = torch::empty({m, out_features}, x.options());
  if (m == 0) return y;
  RECORD_FUNCTION("baton::gemm", std::vector<c10::IValue>());  // a profile's name for it (free when none records)
  torch::Tensor b;  // fp32, as the sums are
  if (bias) b = bias->to(at::kFloat).contiguous();
  [[maybe_unused]] const float* bp = bias ? b.data_ptr<float>() : nullptr;  // unused where nothing is built
  [[maybe_unused]] const int64_t lda = m > 1 ? x.stride(0) : x.size(1);
#if defined(__AVX512F__)
  if (!bf16) {
    using Micro = void (*)(const float*, int64_t, const float*, int64_t, float*, bool);
    static constexpr Micro micro[] = {nullptr, micro_f32<1>, micro_f32<2>, micro_f32<3>, micro_f32<4>, micro_f32<5>, micro_f32<6>};
    gemm(x.data_ptr<float>(), lda, packed.data_ptr<float>(), m, out_features, k_steps, k_steps * kPanel, bp,
         y.data_ptr<float>(), micro, up);
    return y;
  }
#endif
#if defined(__AVX512BF16__)
  using Micro = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, bool);
  static constexpr Micro micro[] = {nullptr, micro_bf16<1>, micro_bf16<2>, micro_bf16<3>, micro_bf16<4>, micro_bf16<5>, micro_bf16<6>};
  gemm(reinterpret_cast<const uint16_t*>(x.data_ptr()), lda, reinterpret_cast<const uint16_t*>(packed.data_ptr()), m,
       out_features, k_steps, k_steps * kPanel * 2, bp, reinterpret_cast<uint16_t*>(y.data_ptr()), micro, up);
  return y;
#endif
  TORCH_CHECK(false, "gemm_linear: this build has no ", x.scalar_type(), " GEMM (gemm_available)");
}

void check_x(const torch::Tensor& x, const torch::Tensor& packed, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == packed.scalar_type() && x.device().is_cpu(), name,
              ": 2-D CPU x of the packed weight's dtype, got ", x.sizes(), " ", x.scalar_type());
  const int64_t k = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.dim() == (bf16 ? 4 : 3) && packed.size(1) == (bf16 ? (k + 1) / 2 : k), name,
              ": x ", x.sizes(), " does not fit the packed weight ", packed.sizes());
}

}  // namespace

torch::Tensor gemm_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias, int64_t out_features) {
  check_x(x, packed, "gemm_linear");
  TORCH_CHECK(packed.size(0) * kPanel >= out_features, "gemm_linear: ", out_features,
              " outputs from a packed weight of ", packed.size(0), " panels of ", kPanel);
  TORCH_CHECK(!bias || bias->numel() == out_features, "gemm_linear: a bias of ", out_features, " values, got ",
              bias ? bias->numel() : 0);
  return run_gemm(std::move(x), packed, bias, out_features, 0);
}

bool gemm_swiglu_fits(const torch::Tensor& packed, int64_t intermediate) {
#if defined(__AVX512F__)
  return intermediate > 0 && intermediate % kPanel == 0 && packed.dim() >= 3 &&
         packed.size(0) == 2 * intermediate / kPanel;
#else
  return false;
#endif
}

torch::Tensor gemm_swiglu(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias, int64_t intermediate) {
  check_x(x, packed, "gemm_swiglu");
  TORCH_CHECK(gemm_swiglu_fits(packed, intermediate), "gemm_swiglu: a fused gate/up weight of 2 x ", intermediate,
              " outputs, intermediate a multiple of ", kPanel, " (AVX-512), got ", packed.size(0), " panels of ", kPanel);
  TORCH_CHECK(!bias || bias->numel() == 2 * intermediate, "gemm_swiglu: a bias of ", 2 * intermediate,
              " values, got ", bias ? bias->numel() : 0);
  return run_gemm(std::move(x), packed, bias, intermediate, intermediate / kPanel);
}
