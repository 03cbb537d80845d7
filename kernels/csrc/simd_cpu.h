// The SIMD layer of the CPU kernels: one vector type `vec` of kW floats and the few operations the
// kernels need, for whichever of AVX-512 and AVX2+FMA the build (-march=native) targets, so that a
// kernel is written once for both widths; BATON_SIMD names the one compiled (undefined: neither,
// the kernels' portable loops run). bfloat16 widens to float by a 16-bit shift.
#pragma once

#include <c10/util/BFloat16.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace baton_simd {

// Scalar conversions, written as bit operations so that the loops around them vectorize (c10's
// own, called element by element, kept them scalar): bfloat16 widens by a 16-bit shift; narrow()
// rounds to nearest even, as c10 does, and keeps a NaN a NaN.
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <typename T>
inline T narrow(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;  // an integer test: -ffast-math keeps it
    return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
  }
}

#if defined(__AVX512F__)
#define BATON_SIMD "avx512"
using vec = __m512;
using vmask = __mmask16;  // the first n lanes
constexpr int kW = 16;
constexpr int kAccRegs = 16;  // accumulators of a p*v register tile (of 32 registers)
constexpr int kTileCols = 8;  // at most this many vectors of head_dim per tile
constexpr bool kQueryInRegisters = true;  // score_chunk's order
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
constexpr bool kStoresBf16 = true;  // vstore rounds to bfloat16 (the AVX2 path has no such store)
inline void vstore(c10::BFloat16* p, vec v) {  // narrow()'s rounding, lane by lane: nearest even, NaN kept
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd), 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec vpick_nonneg(vec x, vec a, vec b) {  // a where x >= 0, else b
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), b, a);
}
inline vec vfmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }   // a * b + c
inline vec vfnmadd(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline vec vround(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vscale2(vec y, vec n) { return _mm512_scalef_ps(y, n); }  // y * 2^n, n integral
inline vec vzero_below(vec x, float lo, vec y) {  // y where x >= lo, else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_GE_OQ), y);
}
inline vmask vfirst(int64_t n) { return static_cast<vmask>((1u << n) - 1); }
inline vec vload_first(const float* p, vmask m, float fill) { return _mm512_mask_loadu_ps(vset1(fill), m, p); }
inline void vstore_first(float* p, vmask m, vec v) { _mm512_mask_storeu_ps(p, m, v); }
inline vec vkeep(vmask m, vec v) { return _mm512_maskz_mov_ps(m, v); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
inline float vmaxof(vec v) { return _mm512_reduce_max_ps(v); }
inline vec vunpacklo(vec a, vec b) { return _mm512_unpacklo_ps(a, b); }
inline vec vunpackhi(vec a, vec b) { return _mm512_unpackhi_ps(a, b); }
inline vec vpairs_lo(vec a, vec b) { return _mm512_shuffle_ps(a, b, 0x44); }  // per 128 bits: a0 a1 b0 b1
inline vec vpairs_hi(vec a, vec b) { return _mm512_shuffle_ps(a, b, 0xEE); }  // per 128 bits: a2 a3 b2 b3
// b[0..3]: 128-bit lane k of b[j] holds lane k's sums of inputs 4j..4j+3 -> their totals, in order.
inline vec vfold_lanes(const vec* b) {
  vec c[2];
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define BATON_SIMD "avx2"
using vec = __m256;
using vmask = __m256i;  // all ones in the first n lanes
constexpr int kW = 8;
constexpr int kAccRegs = 8;  // of 16 registers: the rest hold the V row's vectors and the broadcast p
// Narrow tiles, so that 4 query heads share each V row load: 0-7% faster on Zen 2 than tiles of a
// whole 64-dim row and one head (8 accumulators either way).
constexpr int kTileCols = 2;
constexpr bool kQueryInRegisters = false;
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
constexpr bool kStoresBf16 = false;
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec vpick_nonneg(vec x, vec a, vec b) {  // a where x >= 0, else b
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
}
inline vec vfmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vfnmadd(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline vec vround(vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vscale2(vec y, vec n) {  // y * 2^n for integral n in [-126, 0]: 2^n built in the exponent bits
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
inline vec vzero_below(vec x, float lo, vec y) { return _mm256_and_ps(_mm256_cmp_ps(x, vset1(lo), _CMP_GE_OQ), y); }
inline vmask vfirst(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vec vload_first(const float* p, vmask m, float fill) {
  return _mm256_blendv_ps(vset1(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}
inline void vstore_first(float* p, vmask m, vec v) { _mm256_maskstore_ps(p, m, v); }
inline vec vkeep(vmask m, vec v) { return _mm256_and_ps(_mm256_castsi256_ps(m), v); }
inline float vsum(vec v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float vmaxof(vec v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline vec vunpacklo(vec a, vec b) { return _mm256_unpacklo_ps(a, b); }
inline vec vunpackhi(vec a, vec b) { return _mm256_unpackhi_ps(a, b); }
inline vec vpairs_lo(vec a, vec b) { return _mm256_shuffle_ps(a, b, 0x44); }
inline vec vpairs_hi(vec a, vec b) { return _mm256_shuffle_ps(a, b, 0xEE); }
inline vec vfold_lanes(const vec* b) {
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}
#endif

#if defined(BATON_SIMD)
// v[0..kW-1] -> one vector whose lane i is the sum of v[i]'s lanes: for 16 inputs 15 adds and 30
// shuffles (8 inputs: 7 and 12), against ~log2(kW) dependent steps each for a horizontal sum.
inline vec vsum_each(const vec* v) {
  vec a[kW / 2], b[kW / 4];
  for (int i = 0; i < kW / 2; ++i)  // per 128 bits: (x0+x2, y0+y2, x1+x3, y1+y3)
    a[i] = vadd(vunpacklo(v[2 * i], v[2 * i + 1]), vunpackhi(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < kW / 4; ++i)  // per 128 bits: the sums of 4 inputs' lanes
    b[i] = vadd(vpairs_lo(a[2 * i], a[2 * i + 1]), vpairs_hi(a[2 * i], a[2 * i + 1]));
  return vfold_lanes(b);
}

// exp(x) for x <= 0 (a score minus its row's max), Cephes' polynomial (~1 ulp); below -87 (where
// float's exp underflows anyway, and every hidden token's score) exactly 0.
inline vec vexp(vec x0) {
  const vec x = vmax(x0, vset1(-87.f));
  const vec n = vround(vmul(x, vset1(1.44269504088896341f)));
  vec r = vfnmadd(n, vset1(0.693359375f), x);
  r = vfnmadd(n, vset1(-2.12194440e-4f), r);
  vec y = vset1(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = vfmadd(y, r, vset1(c));
  y = vfmadd(y, vmul(r, r), vadd(r, vset1(1.f)));
  return vzero_below(x0, -87.f, vscale2(y, n));
}

// silu(x) * u in float32: the sigmoid from e = exp(-|x|) (vexp's polynomial takes arguments <= 0
// only): 1 / (1 + e) where x >= 0, e / (1 + e) below. One definition for swiglu() and the GEMM's
// fused epilogue (gemm_cpu.cpp), so the two round alike.
inline vec vswiglu(vec x, vec u) {
  const vec e = vexp(vmin(x, vsub(vzero(), x)));
  return vdiv(vmul(vmul(x, u), vpick_nonneg(x, vset1(1.f), e)), vadd(vset1(1.f), e));
}
#endif

}  // namespace baton_simd
