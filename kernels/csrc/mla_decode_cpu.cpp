// Paged decode for multi-head latent attention (DeepSeek-V2/V3, weight absorption) on CPU float32 and
// bfloat16 latent pools [num_blocks, block_size, L + R]. Every head of a row attends to the same cached
// rows (the latent, then the rope key), whose first L values are also the value:
// out[t, h] = softmax_s(scale * q[t, h] . c_s) @ c_s[:L]. So a row is a small GEMM, not H dot products:
// each chunk of kChunk cached tokens is read once for all heads - S [H, chunk] = Q [H, L + R] x C^T, the
// online-softmax update of each head's max, denominator and unnormalised output, then O [H, L] += P x
// C[:, :L] while the chunk is still in L1/L2: one pass over the row's cache, whatever H.
//
// Register tiles: scores are dot products along L + R of kW/4 heads x 4 tokens (kW sums reduced across
// lanes at once by vsum_each); P x C keeps kW/4 heads x 4 vectors of output columns in registers and
// broadcasts p. bfloat16 pools are widened chunk by chunk for that float32 path, except on a CPU with
// AVX-512 BF16: there both products run through vdpbf16ps (4x the float32 FMA rate, float32 sums), the
// scores from the cached rows as they are, P x C from the chunk repacked as token pairs (c_j[l],
// c_j+1[l]) with p rounded to bfloat16 (as the Triton kernel and FlashAttention round p for P x V).
// Without AVX2 or AVX-512, portable loops. mla_decode_path(dtype) names what a dtype takes in this build.
//
// Threads: the batch's tokens are cut into one contiguous range per thread (pieces of at least
// kMinPiece tokens where a range cuts a row), so a long row is shared by the threads rather than re-read
// by each (as head groups would); a cut row's pieces' (max, denominator, output) are merged at the end.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_kernels.h"
#include "simd_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace baton_simd;
using bf16 = c10::BFloat16;

// On the loops over a register tile's accumulators: unrolled early, GCC keeps them in registers.
#define UNROLL _Pragma("GCC unroll 16")

constexpr int64_t kChunk = 32;  // tokens per online-softmax step (even: bfloat16 P x C takes token pairs)
constexpr int64_t kMinPiece = 64;  // a row is cut between threads only into pieces of this many tokens or more
constexpr float kNone = -1e30f;  // the running max before any token, and the score of a missing one

template <typename T>
struct Mla {
  const T* q; const T* cache; T* out; const int32_t* tables; const int32_t* lens;
  int64_t table_row, blk_stride, tok_stride, heads, dim, lora, page;
  float scale;
};

struct Piece {  // a thread's range of one row's tokens; slot >= 0: the row is cut, the piece's state is that slot
  int64_t row, start, end, slot;
};

// The online-softmax step of a chunk: s [hp, kChunk] of scaled scores (kNone: no token) becomes p = exp(s -
// m_new); each head's max m and denominator l are updated, its output o (ocols) rescaled where m rose.
inline void softmax_step(float* s, int64_t hp, float* m, float* l, float* o, int64_t ostride, int64_t ocols) {
  for (int64_t h = 0; h < hp; ++h) {
    float* sh = s + h * kChunk;
    float mx = m[h];
    for (int64_t i = 0; i < kChunk; ++i) mx = std::max(mx, sh[i]);
    const float alpha = std::exp(m[h] - mx);
    if (alpha != 1.f)
      for (int64_t c = 0; c < ocols; ++c) o[h * ostride + c] *= alpha;
    float sum = 0.f;
#if defined(BATON_SIMD)
    vec acc = vzero();
    for (int64_t i = 0; i < kChunk; i += kW) {
      const vec e = vexp(vsub(vload(sh + i), vset1(mx)));
      vstore(sh + i, e);
      acc = vadd(acc, e);
    }
    sum = vsum(acc);
#else
    for (int64_t i = 0; i < kChunk; ++i) sum += (sh[i] = std::exp(sh[i] - mx));
#endif
    l[h] = l[h] * alpha + sum;
    m[h] = mx;
  }
}

// The portable loops: scores and P x C straight from rows of any element type.
template <typename T>
void scores_scalar(const float* q, int64_t hp, int64_t dim, const T* const* rows, int64_t cnt, float scale, float* s) {
  for (int64_t j = 0; j < cnt; ++j)
    for (int64_t h = 0; h < hp; ++h) {
      float acc = 0.f;
      for (int64_t d = 0; d < dim; ++d) acc += q[h * dim + d] * widen(rows[j][d]);
      s[h * kChunk + j] = acc * scale;
    }
}

template <typename T>
void values_scalar(const T* const* rows, int64_t cnt, const float* p, int64_t hp, float* o, int64_t ostride,
                   int64_t c0, int64_t c1) {
  for (int64_t j = 0; j < cnt; ++j)
    for (int64_t h = 0; h < hp; ++h) {
      const float pj = p[h * kChunk + j];
      for (int64_t c = c0; c < c1; ++c) o[h * ostride + c] += pj * widen(rows[j][c]);
    }
}

// Scaled scores s[h][j] of a chunk's cnt tokens, tile by tile: tile(h, r, out) fills out[hh * 4 + t] for TH
// heads from h and the 4 tokens r (a missing one repeats the last, its score unstored).
template <int TH, typename R, typename Tile>
void scores(int64_t hp, const R* const* rows, int64_t cnt, float scale, float* s, Tile&& tile) {
  for (int64_t j = 0; j < cnt; j += 4) {
    const R* r[4];
    for (int t = 0; t < 4; ++t) r[t] = rows[std::min<int64_t>(j + t, cnt - 1)];
    for (int64_t h = 0; h < hp; h += TH) {
      float out[TH * 4];
      tile(h, r, out);
      for (int hh = 0; hh < TH; ++hh)
        for (int t = 0; t < 4 && j + t < cnt; ++t) s[(h + hh) * kChunk + j + t] = out[hh * 4 + t] * scale;
    }
  }
}

// O += P x C: tiles of 4 column vectors (then single ones) outer, so their rows stay in L1 while every
// tile of TH heads runs; tile(cols, h, c) does TH heads from h x cols vectors from vector c.
template <int TH, typename Tile>
void values(int64_t hp, int64_t vecs, Tile&& tile) {
  int64_t c = 0;
  for (; c + 4 <= vecs; c += 4)
    for (int64_t h = 0; h < hp; h += TH) tile(std::integral_constant<int, 4>{}, h, c);
  for (; c < vecs; ++c)
    for (int64_t h = 0; h < hp; h += TH) tile(std::integral_constant<int, 1>{}, h, c);
}

#if defined(BATON_SIMD)
constexpr int kTH = kW / 4;  // heads of a register tile (x 4 tokens: kW dot products, one vsum_each)

// vsum_each of a copy: handing it the accumulators themselves made GCC 12 keep them on the stack,
// storing all of them every step of the loop that sums into them.
inline vec sum_each(const vec* acc) {
  vec v[kW];
  UNROLL for (int i = 0; i < kW; ++i) v[i] = acc[i];
  return vsum_each(v);
}

// Scaled scores of heads [0, kTH) x tokens [0, 4) of float rows (a missing token repeats one, unstored).
inline void score_tile(const float* q, int64_t dim, const float* const* r, float* out) {
  vec acc[kW];
  UNROLL for (int i = 0; i < kW; ++i) acc[i] = vzero();
  const int64_t whole = dim / kW * kW;
  for (int64_t d = 0; d < whole; d += kW) {
    vec qv[kTH];
    UNROLL for (int h = 0; h < kTH; ++h) qv[h] = vload(q + h * dim + d);
    UNROLL for (int t = 0; t < 4; ++t) {
      const vec c = vload(r[t] + d);
      UNROLL for (int h = 0; h < kTH; ++h) acc[h * 4 + t] = vfmadd(qv[h], c, acc[h * 4 + t]);
    }
  }
  vstore(out, sum_each(acc));
  for (int64_t d = whole; d < dim; ++d)
    for (int h = 0; h < kTH; ++h)
      for (int t = 0; t < 4; ++t) out[h * 4 + t] += q[h * dim + d] * r[t][d];
}

// o[g][c0 + c*kW ..] += sum_j p[g][j] * row_j[..] for GT heads x NC vectors of columns, in registers.
template <int GT, int NC>
inline void value_tile(const float* const* rows, int64_t cnt, const float* p, float* o, int64_t ostride, int64_t c0) {
  vec acc[GT][NC];
  UNROLL for (int g = 0; g < GT; ++g)
    UNROLL for (int c = 0; c < NC; ++c) acc[g][c] = vload(o + g * ostride + c0 + c * kW);
  for (int64_t j = 0; j < cnt; ++j) {
    vec v[NC];
    UNROLL for (int c = 0; c < NC; ++c) v[c] = vload(rows[j] + c0 + c * kW);
    UNROLL for (int g = 0; g < GT; ++g) {
      const vec pg = vset1(p[g * kChunk + j]);
      UNROLL for (int c = 0; c < NC; ++c) acc[g][c] = vfmadd(pg, v[c], acc[g][c]);
    }
  }
  UNROLL for (int g = 0; g < GT; ++g)
    UNROLL for (int c = 0; c < NC; ++c) vstore(o + g * ostride + c0 + c * kW, acc[g][c]);
}

#endif

#if defined(__AVX512BF16__)
inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// Scores of 4 heads x 4 tokens by vdpbf16ps; q is zero-padded to dpad (a multiple of 32), rows are
// read with a mask past dim.
inline void score_tile_bf16(const bf16* q, int64_t dpad, const bf16* const* r, int64_t dim, float* out) {
  vec acc[16];
  UNROLL for (int i = 0; i < 16; ++i) acc[i] = vzero();
  for (int64_t d = 0; d < dim; d += 32) {
    const __mmask32 mask = dim - d >= 32 ? ~0u : (1u << (dim - d)) - 1;
    __m512bh qv[4];
    UNROLL for (int h = 0; h < 4; ++h) qv[h] = as_bh(_mm512_loadu_si512(q + h * dpad + d));
    UNROLL for (int t = 0; t < 4; ++t) {
      const __m512bh c = as_bh(_mm512_maskz_loadu_epi16(mask, r[t] + d));
      UNROLL for (int h = 0; h < 4; ++h) acc[h * 4 + t] = _mm512_dpbf16_ps(acc[h * 4 + t], qv[h], c);
    }
  }
  vstore(out, sum_each(acc));
}

// The chunk's first `lora` columns as token pairs: packed[i][2c + k] = row_{2i+k}[c] (zero past cnt and
// past lora, up to lpad, a multiple of 16), the layout vdpbf16ps multiplies with (p_2i, p_2i+1).
void pack_pairs(const bf16* const* rows, int64_t cnt, int64_t lora, int64_t lpad, bf16* packed) {
  alignas(64) static constexpr uint16_t lo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i idx_lo = _mm512_load_si512(lo), idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
  for (int64_t i = 0; 2 * i < cnt; ++i) {
    bf16* dst = packed + i * lpad * 2;
    for (int64_t c = 0; c < lpad; c += 32) {
      const __mmask32 mask = lora - c >= 32 ? ~0u : (1u << (lora - c)) - 1;
      const __m512i a = _mm512_maskz_loadu_epi16(mask, rows[2 * i] + c);
      const __m512i b = 2 * i + 1 < cnt ? _mm512_maskz_loadu_epi16(mask, rows[2 * i + 1] + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(a, idx_lo, b));
      if (c + 16 < lpad) _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(a, idx_hi, b));
    }
  }
}

// o[h + g][c0 + c*16 ..] += sum_j p[h + g][j] * c_j[..] for 4 heads x NC vectors, from the packed pairs.
template <int NC>
inline void value_tile_bf16(const bf16* packed, int64_t lpad, int64_t pairs, const bf16* p, float* o, int64_t h,
                            int64_t c0) {
  p += h * kChunk, o += h * lpad;
  vec acc[4][NC];
  UNROLL for (int g = 0; g < 4; ++g)
    UNROLL for (int c = 0; c < NC; ++c) acc[g][c] = vload(o + g * lpad + c0 + c * 16);
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh v[NC];
    UNROLL for (int c = 0; c < NC; ++c) v[c] = as_bh(_mm512_loadu_si512(packed + i * lpad * 2 + 2 * (c0 + c * 16)));
    UNROLL for (int g = 0; g < 4; ++g) {
      int32_t pair;
      std::memcpy(&pair, p + g * kChunk + 2 * i, sizeof pair);
      const __m512bh pg = as_bh(_mm512_set1_epi32(pair));
      UNROLL for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], pg, v[c]);
    }
  }
  UNROLL for (int g = 0; g < 4; ++g)
    UNROLL for (int c = 0; c < NC; ++c) vstore(o + g * lpad + c0 + c * 16, acc[g][c]);
}

#endif

#if defined(__AVX512BF16__)
template <typename T> constexpr bool kDotBf16 = std::is_same_v<T, bf16>;  // bfloat16 takes vdpbf16ps
#else
template <typename T> constexpr bool kDotBf16 = false;
#endif

// One thread's buffers, sized once per call: the piece's queries (widened, or bfloat16 for vdpbf16ps,
// heads padded to a multiple of 4 with zeros), scores, the chunk widened or packed, a whole row's state.
template <typename T>
struct Work {
  int64_t hp, dpad, ostride;
  std::vector<float> f;
  std::vector<bf16> h;
  float *q, *s, *wide, *m, *l, *o;
  bf16 *qb, *pb, *packed;
  std::vector<const T*> rows;
  explicit Work(const Mla<T>& a)
      : hp((a.heads + 3) / 4 * 4), dpad((a.dim + 31) / 32 * 32),
        ostride(kDotBf16<T> ? (a.lora + 15) / 16 * 16 : a.lora), rows(kChunk) {
    f.assign(hp * a.dim + hp * kChunk + kChunk * a.dim + 2 * hp + hp * ostride, 0.f);
    q = f.data(), s = q + hp * a.dim, wide = s + hp * kChunk, m = wide + kChunk * a.dim, l = m + hp, o = l + hp;
    if constexpr (kDotBf16<T>) {
      h.assign(hp * dpad + hp * kChunk + kChunk * ostride, bf16(0.f));
      qb = h.data(), pb = qb + hp * dpad, packed = pb + hp * kChunk;
    }
  }
};

// Tokens [start, end) of row b into the state (m, l, o): running max, denominator, unnormalised output.
template <typename T>
void attend(const Mla<T>& a, Work<T>& w, int64_t b, int64_t start, int64_t end, float* m, float* l, float* o) {
  const int64_t hp = w.hp, dim = a.dim, lora = a.lora;
  std::fill(m, m + hp, kNone);
  std::fill(l, l + hp, 0.f);
  std::fill(o, o + hp * w.ostride, 0.f);
  const T* qt = a.q + b * a.heads * dim;
  if constexpr (kDotBf16<T>) {
    for (int64_t h = 0; h < a.heads; ++h) std::copy(qt + h * dim, qt + (h + 1) * dim, w.qb + h * w.dpad);
  } else {
    for (int64_t i = 0; i < a.heads * dim; ++i) w.q[i] = widen(qt[i]);
  }
  const int32_t* table = a.tables + b * a.table_row;
  const auto row = [&](int64_t t) { return a.cache + table[t / a.page] * a.blk_stride + t % a.page * a.tok_stride; };
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));
  for (int64_t t0 = start; t0 < end; t0 += kChunk) {
    const int64_t cnt = std::min(kChunk, end - t0);
    for (int64_t j = 0; j < cnt; ++j) w.rows[j] = row(t0 + j);
    // The next chunk's rows, requested now: its blocks lie anywhere in the pool, where the hardware
    // prefetcher would only find each block after a few misses of it.
    for (int64_t t = t0 + kChunk; t < std::min(end, t0 + 2 * kChunk); ++t) {
      const char* p = reinterpret_cast<const char*>(row(t));
      for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
    }
    if (cnt < kChunk) std::fill(w.s, w.s + hp * kChunk, kNone);
#if defined(__AVX512BF16__)
    if constexpr (kDotBf16<T>) {
      scores<4>(hp, w.rows.data(), cnt, a.scale, w.s, [&](int64_t h, const bf16* const* r, float* out) {
        score_tile_bf16(w.qb + h * w.dpad, w.dpad, r, dim, out);
      });
      softmax_step(w.s, hp, m, l, o, w.ostride, w.ostride);
      for (int64_t i = 0; i < hp * kChunk; i += 32)  // p to bfloat16, rounded to nearest even
        _mm512_storeu_si512(w.pb + i, (__m512i)_mm512_cvtne2ps_pbh(vload(w.s + i + 16), vload(w.s + i)));
      pack_pairs(w.rows.data(), cnt, lora, w.ostride, w.packed);
      values<4>(hp, w.ostride / 16, [&](auto cols, int64_t h, int64_t c) {
        value_tile_bf16<decltype(cols)::value>(w.packed, w.ostride, (cnt + 1) / 2, w.pb, o, h, c * 16);
      });
      continue;
    }
#endif
#if defined(BATON_SIMD)
    const float* rows[kChunk];
    for (int64_t j = 0; j < cnt; ++j) {
      if constexpr (std::is_same_v<T, float>) {
        rows[j] = w.rows[j];
      } else {  // widened once here, not by every tile that reads it (widen's bit shift vectorizes)
        float* dst = w.wide + j * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = widen(w.rows[j][d]);
        rows[j] = dst;
      }
    }
    scores<kTH>(hp, rows, cnt, a.scale, w.s, [&](int64_t h, const float* const* r, float* out) {
      score_tile(w.q + h * dim, dim, r, out);
    });
    softmax_step(w.s, hp, m, l, o, w.ostride, lora);
    values<kTH>(hp, lora / kW, [&](auto cols, int64_t h, int64_t c) {
      value_tile<kTH, decltype(cols)::value>(rows, cnt, w.s + h * kChunk, o + h * w.ostride, w.ostride, c * kW);
    });
    values_scalar(rows, cnt, w.s, hp, o, w.ostride, lora / kW * kW, lora);
#else
    scores_scalar(w.q, hp, dim, w.rows.data(), cnt, a.scale, w.s);
    softmax_step(w.s, hp, m, l, o, w.ostride, lora);
    values_scalar(w.rows.data(), cnt, w.s, hp, o, w.ostride, int64_t{0}, lora);
#endif
  }
}

struct Cut {  // a row cut between threads: its pieces' partial states are slots [slot, slot + n)
  int64_t row, slot, n;
};

struct Plan {
  std::vector<std::vector<Piece>> work;  // per thread
  std::vector<Cut> cuts;
  int64_t slots = 0;
};

// One contiguous range of the batch's tokens per thread, its cuts moved to a row's edge where they
// would leave a piece shorter than kMinPiece.
Plan plan(const int32_t* lens, int64_t batch, int64_t threads) {
  std::vector<int64_t> first(batch + 1, 0);  // row r's tokens are [first[r], first[r + 1]) of the batch's
  for (int64_t r = 0; r < batch; ++r) first[r + 1] = first[r] + lens[r];
  const int64_t total = first[batch];
  const int64_t parts = std::max<int64_t>(1, std::min(threads, total / kMinPiece));
  std::vector<int64_t> cut(parts + 1, total);
  cut[0] = 0;
  for (int64_t t = 1, r = 0; t < parts; ++t) {
    const int64_t c = total * t / parts;
    while (first[r + 1] <= c && r + 1 < batch) ++r;
    const int64_t lo = first[r], hi = first[r + 1];
    cut[t] = std::max(c - lo < kMinPiece ? lo : hi - c < kMinPiece ? hi : c, cut[t - 1]);
  }
  Plan p;
  p.work.resize(parts);
  for (int64_t t = 0, r = 0; t < parts; ++t)
    for (; r < batch && first[r] < cut[t + 1]; ++r) {
      const int64_t s = std::max(first[r], cut[t]) - first[r], e = std::min(first[r + 1], cut[t + 1]) - first[r];
      if (e > s) {
        int64_t slot = -1;
        if (e - s < lens[r]) {
          slot = p.slots++;
          if (p.cuts.empty() || p.cuts.back().row != r) p.cuts.push_back({r, slot, 0});
          ++p.cuts.back().n;
        }
        p.work[t].push_back({r, s, e, slot});
      }
      if (first[r + 1] > cut[t + 1]) break;  // the row goes on in the next thread's range
    }
  return p;
}

template <typename T>
void run(const Mla<T>& a, int64_t batch) {
  const Plan p = plan(a.lens, batch, std::max<int64_t>(1, at::get_num_threads()));
  const int64_t hp = (a.heads + 3) / 4 * 4;
  const int64_t ostride = kDotBf16<T> ? (a.lora + 15) / 16 * 16 : a.lora, state = 2 * hp + hp * ostride;
  std::vector<float> partial(p.slots * state);  // per slot: m [hp], l [hp], o [hp, ostride]
  const auto store = [&](int64_t b, const float* l, const float* o) {
    T* out = a.out + b * a.heads * a.lora;
    for (int64_t h = 0; h < a.heads; ++h) {
      const float inv = 1.f / l[h];
      for (int64_t c = 0; c < a.lora; ++c) out[h * a.lora + c] = narrow<T>(o[h * ostride + c] * inv);
    }
  };
  at::parallel_for(0, static_cast<int64_t>(p.work.size()), 1, [&](int64_t lo, int64_t hi) {
    Work<T> w(a);
    for (int64_t t = lo; t < hi; ++t)
      for (const Piece& pc : p.work[t]) {
        if (pc.slot < 0) {
          attend(a, w, pc.row, pc.start, pc.end, w.m, w.l, w.o);
          store(pc.row, w.l, w.o);
        } else {
          float* st = partial.data() + pc.slot * state;
          attend(a, w, pc.row, pc.start, pc.end, st, st + hp, st + 2 * hp);
        }
      }
  });
  for (const Cut& c : p.cuts) {  // a cut row's pieces folded into its first: o = sum_i o_i e^(m_i - m) / ...
    float* into = partial.data() + c.slot * state;
    for (int64_t i = 1; i < c.n; ++i) {
      const float* from = into + i * state;
      for (int64_t h = 0; h < a.heads; ++h) {
        const float mx = std::max(into[h], from[h]), wa = std::exp(into[h] - mx), wb = std::exp(from[h] - mx);
        into[h] = mx;
        into[hp + h] = into[hp + h] * wa + from[hp + h] * wb;
        for (int64_t k = 0; k < a.lora; ++k)
          into[2 * hp + h * ostride + k] = into[2 * hp + h * ostride + k] * wa + from[2 * hp + h * ostride + k] * wb;
      }
    }
    store(c.row, into + hp, into + 2 * hp);
  }
  for (int64_t b = 0; b < batch; ++b)  // rows with no token attend to nothing
    if (a.lens[b] == 0) std::fill(a.out + b * a.heads * a.lora, a.out + (b + 1) * a.heads * a.lora, T(0.f));
}

}  // namespace

std::string mla_decode_path(c10::ScalarType dtype) {
#if defined(__AVX512BF16__)
  if (dtype == torch::kBFloat16) return "avx512_bf16";
#endif
  return paged_decode_simd();  // this build's vector path: avx512, avx2 or portable
}

torch::Tensor mla_decode(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables, torch::Tensor context_lens,
                         double scale, int64_t kv_lora_rank) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kBFloat16) && cache.scalar_type() == dtype,
              "mla_decode (CPU): float32 or bfloat16, the same for q and the latent pool");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32,
              "mla_decode (CPU): int32 block tables and context lengths");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "mla_decode (CPU): q must be a contiguous [T, H, L + R]");
  TORCH_CHECK(cache.dim() == 3 && cache.stride(2) == 1 && cache.size(2) == q.size(2),
              "mla_decode (CPU): the pool must be [blocks, block_size, L + R] with rows contiguous, as wide as q");
  TORCH_CHECK(kv_lora_rank > 0 && kv_lora_rank <= q.size(2), "mla_decode (CPU): kv_lora_rank ", kv_lora_rank,
              " is not in [1, ", q.size(2), "]");
  const int64_t batch = q.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch && block_tables.stride(1) == 1 &&
              context_lens.numel() == batch && context_lens.is_contiguous(), "one block table and length per row");
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t page = cache.size(1), num_blocks = cache.size(0);
  for (int64_t b = 0; b < batch; ++b) {  // a bad block table must fail loudly, not read outside the pool
    const int64_t pages = (static_cast<int64_t>(lens[b]) + page - 1) / page;
    TORCH_CHECK(lens[b] >= 0 && pages <= block_tables.size(1), "row ", b, ": context length ", lens[b], " needs ",
                pages, " blocks, its block table has ", block_tables.size(1));
    for (int64_t i = 0; i < pages; ++i) {
      const int32_t id = tables[b * block_tables.stride(0) + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "row ", b, ": block table entry ", i, " is ", id,
                  ", outside the pool of ", num_blocks, " blocks");
    }
  }
  auto out = torch::empty({batch, q.size(1), kv_lora_rank}, q.options());
  const auto go = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const Mla<T> a{q.data_ptr<T>(), cache.data_ptr<T>(), out.data_ptr<T>(), tables, lens,
                   block_tables.stride(0), cache.stride(0), cache.stride(1),
                   q.size(1), q.size(2), kv_lora_rank, page, static_cast<float>(scale)};
    run(a, batch);
  };
  dtype == torch::kBFloat16 ? go(static_cast<bf16*>(nullptr)) : go(static_cast<float*>(nullptr));
  return out;
}

// The new tokens' latents [T, L] and rope keys [T, R] into the pool at slot_mapping (-1 skips): row copies.
void mla_cache_write(torch::Tensor latent, torch::Tensor k_pe, torch::Tensor cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(latent.scalar_type() == cache.scalar_type() && k_pe.scalar_type() == cache.scalar_type(),
              "mla_cache_write (CPU): latent, k_pe and the pool share one dtype");
  TORCH_CHECK(latent.dim() == 2 && k_pe.dim() == 2 && k_pe.size(0) == latent.size(0) && latent.stride(1) == 1 &&
              k_pe.stride(1) == 1, "latent [T, L] and k_pe [T, R] with contiguous rows");
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && cache.size(2) == latent.size(1) + k_pe.size(1),
              "the pool must be a contiguous [blocks, block_size, L + R]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == latent.size(0), "slot_mapping: contiguous int64 [T]");
  const int64_t tokens = latent.size(0), slots = cache.size(0) * cache.size(1), es = cache.element_size();
  const int64_t lbytes = latent.size(1) * es, rbytes = k_pe.size(1) * es, row = lbytes + rbytes;
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= -1 && slot[t] < slots, "token ", t, ": slot ", slot[t], " is outside the pool of ", slots);
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* ls = static_cast<const char*>(latent.data_ptr());
  const auto* rs = static_cast<const char*>(k_pe.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0) continue;
    std::memcpy(dst + slot[t] * row, ls + t * latent.stride(0) * es, lbytes);
    std::memcpy(dst + slot[t] * row + lbytes, rs + t * k_pe.stride(0) * es, rbytes);
  }
}
