// Fused elementwise ops of a decoder layer for CPU float32 and bfloat16 inference: RMSNorm (with the
// residual add), the rotary embedding of q and k in one call, and SwiGLU. In torch each is 2-10
// ops, each a pass over memory and a dispatch; at decode shapes (a few rows) the dispatches cost
// more than the arithmetic. Each kernel here is one pass, rows split between torch's threads.
// SwiGLU's silu(gate) * up is two vectorized torch ops, but at prefill shapes they read the fused
// gate/up projection's strided halves and write and re-read a [tokens, I] temporary: the one pass
// here reads each input once.
//
// Roundings follow the torch reference ops (kernels/reference.py): RMSNorm normalises in float32,
// rounds to the input dtype, then multiplies by the weight in that dtype; rotary computes in
// float32 and rounds once. Rows may be strided (views of a fused projection's output); the last
// dimension must be contiguous.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>

namespace {

using baton_simd::narrow;
using baton_simd::widen;

template <typename T>
inline float round_to(float x) { return widen(narrow<T>(x)); }  // x as the dtype would hold it

int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_len, 1)); }

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16),
              name, ": float32 or bfloat16 CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, ": the last dimension must be contiguous");
}

template <typename T>
void rms_rows(const T* x, int64_t sx, const T* r, int64_t sr, const T* w, T* out, T* sum, int64_t rows,
              int64_t n, float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const T* xi = x + i * sx;
      T* oi = out + i * n;
      float ss = 0.f;
      if (r != nullptr) {  // h = x + residual, rounded to the dtype (torch adds in the dtype)
        const T* ri = r + i * sr;
        T* hi_ = sum + i * n;
        for (int64_t d = 0; d < n; ++d) hi_[d] = narrow<T>(widen(xi[d]) + widen(ri[d]));
        xi = hi_;  // two plain loops: one that also summed squares did not vectorize in bf16 (5x slower)
      }
      for (int64_t d = 0; d < n; ++d) ss += widen(xi[d]) * widen(xi[d]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      for (int64_t d = 0; d < n; ++d) oi[d] = narrow<T>(round_to<T>(widen(xi[d]) * inv) * widen(w[d]));
    }
  });
}

template <typename T>
void rotate(const T* x, int64_t st, int64_t sh, const T* cos, const T* sin, int64_t sc, T* out, int64_t tokens,
            int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, grain(heads * dim), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const T* c = cos + t * sc;
      const T* s = sin + t * sc;
      for (int64_t h = 0; h < heads; ++h) {  // each half in a loop of its own: one loop over both did not vectorize
        const T* __restrict x1 = x + t * st + h * sh;
        const T* __restrict x2 = x1 + half;
        T* __restrict o1 = out + (t * heads + h) * dim;
        T* __restrict o2 = o1 + half;
        for (int64_t d = 0; d < half; ++d) o1[d] = narrow<T>(widen(x1[d]) * widen(c[d]) - widen(x2[d]) * widen(s[d]));
        for (int64_t d = 0; d < half; ++d)
          o2[d] = narrow<T>(widen(x2[d]) * widen(c[d + half]) + widen(x1[d]) * widen(s[d + half]));
      }
    }
  });
}

// silu(g) * u = g / (1 + exp(-g)) * u in float32, rounded once (as the reference computes it); the
// exponent is clamped so that -ffast-math's no-infinities assumption holds (silu(g < -88) ~ -0).
// With a vector path (simd_cpu.h) whole vectors take the sigmoid from e = exp(-|g|), which vexp's
// polynomial computes for arguments <= 0 only: 1 / (1 + e) where g >= 0, e / (1 + e) below; the
// library's expf, which the compiler vectorized before, ran bf16 rows at ~0.45 ns an element.
template <typename T>
void swiglu_rows(const T* g, int64_t sg, const T* u, int64_t su, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain(n), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const T* gi = g + i * sg;
      const T* ui = u + i * su;
      T* oi = out + i * n;
      int64_t d = 0;
#if defined(BATON_SIMD)
      using namespace baton_simd;
      if constexpr (std::is_same_v<T, float> || kStoresBf16) {
        for (; d + kW <= n; d += kW) vstore(oi + d, vswiglu(vload(gi + d), vload(ui + d)));
      }
#endif
      for (; d < n; ++d) {
        const float x = widen(gi[d]);
        oi[d] = narrow<T>(x / (1.f + std::exp(std::min(-x, 88.f))) * widen(ui[d]));
      }
    }
  });
}

// [rows, n] view of a tensor whose leading dims collapse into one row stride.
int64_t row_stride(const torch::Tensor& t) {
  const auto flat = t.reshape({-1, t.size(-1)});
  TORCH_CHECK(flat.data_ptr() == t.data_ptr(), "rows must be a strided view");
  return t.dim() > 1 ? flat.stride(0) : t.size(-1);
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  std::optional<torch::Tensor> residual) {
  check(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == x.size(-1),
              "weight: contiguous [hidden] of x's dtype");
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  auto out = torch::empty(x.sizes(), x.options());
  torch::Tensor sum;
  if (residual) {
    check(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(), "residual: x's shape and dtype");
    sum = torch::empty(x.sizes(), x.options());
  }
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
    AT_DISPATCH_CASE(torch::kFloat32, [&] {
      rms_rows<float>(x.data_ptr<float>(), row_stride(x), residual ? residual->data_ptr<float>() : nullptr,
                      residual ? row_stride(*residual) : 0, weight.data_ptr<float>(), out.data_ptr<float>(),
                      residual ? sum.data_ptr<float>() : nullptr, rows, n, static_cast<float>(eps));
    })
    AT_DISPATCH_CASE(torch::kBFloat16, [&] {
      using B = c10::BFloat16;
      rms_rows<B>(x.data_ptr<B>(), row_stride(x), residual ? residual->data_ptr<B>() : nullptr,
                  residual ? row_stride(*residual) : 0, weight.data_ptr<B>(), out.data_ptr<B>(),
                  residual ? sum.data_ptr<B>() : nullptr, rows, n, static_cast<float>(eps));
    }));
  return {out, sum};
}

std::tuple<torch::Tensor, torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                                torch::Tensor sin) {
  check(q, "q");
  check(k, "k");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(2) % 2 == 0 && k.size(2) == q.size(2) && k.size(0) == q.size(0),
              "q/k: [tokens, heads, head_dim] with one even head_dim");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && cos.scalar_type() == q.scalar_type() &&
              sin.scalar_type() == q.scalar_type(), "q, k, cos and sin: one dtype");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == q.size(0) && cos.size(1) == q.size(2) &&
              cos.stride(1) == 1 && sin.strides() == cos.strides(), "cos/sin: [tokens, head_dim], same layout");
  auto qo = torch::empty(q.sizes(), q.options()), ko = torch::empty(k.sizes(), k.options());
  AT_DISPATCH_SWITCH(q.scalar_type(), "rotary",
    AT_DISPATCH_CASE(torch::kFloat32, [&] {
      for (auto [x, o] : {std::pair{q, qo}, std::pair{k, ko}})
        rotate<float>(x.data_ptr<float>(), x.stride(0), x.stride(1), cos.data_ptr<float>(), sin.data_ptr<float>(),
                      cos.stride(0), o.data_ptr<float>(), x.size(0), x.size(1), x.size(2));
    })
    AT_DISPATCH_CASE(torch::kBFloat16, [&] {
      using B = c10::BFloat16;
      for (auto [x, o] : {std::pair{q, qo}, std::pair{k, ko}})
        rotate<B>(x.data_ptr<B>(), x.stride(0), x.stride(1), cos.data_ptr<B>(), sin.data_ptr<B>(), cos.stride(0),
                  o.data_ptr<B>(), x.size(0), x.size(1), x.size(2));
    }));
  return {qo, ko};
}

torch::Tensor swiglu(torch::Tensor gate, torch::Tensor up) {
  check(gate, "gate");
  check(up, "up");
  TORCH_CHECK(up.sizes() == gate.sizes() && up.scalar_type() == gate.scalar_type(), "up: gate's shape and dtype");
  const int64_t n = gate.size(-1), rows = gate.numel() / std::max<int64_t>(n, 1);
  auto out = torch::empty(gate.sizes(), gate.options());
  AT_DISPATCH_SWITCH(gate.scalar_type(), "swiglu",
    AT_DISPATCH_CASE(torch::kFloat32, [&] {
      swiglu_rows<float>(gate.data_ptr<float>(), row_stride(gate), up.data_ptr<float>(), row_stride(up),
                         out.data_ptr<float>(), rows, n);
    })
    AT_DISPATCH_CASE(torch::kBFloat16, [&] {
      using B = c10::BFloat16;
      swiglu_rows<B>(gate.data_ptr<B>(), row_stride(gate), up.data_ptr<B>(), row_stride(up), out.data_ptr<B>(), rows, n);
    }));
  return out;
}
