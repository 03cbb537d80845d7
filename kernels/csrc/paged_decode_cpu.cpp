// Paged decode attention for CPU float32 and bfloat16: reads K/V straight from the paged pools (no
// gather copy). bfloat16 pools and queries are widened to float as they are read; scores, softmax
// and the weighted sum of values are float32, and the output is rounded to bfloat16 once at the end.
//
// A work item is a sequence (or, when there are fewer sequences than 4 per thread, one kv head of
// it). Pass 1 walks the block table page by page and computes the scaled scores q.k of all the
// item's query heads; pass 2 takes each head's softmax; pass 3 accumulates p * v over the V rows.
// Items are split between threads by their token counts, so one long sequence does not leave the
// other threads idle. An optional tail mask hides some of a row's last tokens: a speculative
// tree's node sees its cached prefix and its ancestors only.
//
// With AVX-512 or AVX2+FMA (the extension is built -march=native; vectors of kW = 16 or 8 floats)
// and head_dim 32/64/128, pass 1 takes kW tokens of a page at a time: each query head's kW dot
// products are summed across lanes together (vsum_each), not one horizontal sum each; pass 2 is a
// vectorized exp; pass 3 keeps a tile of query heads' accumulators in registers over one kv head's
// V rows (the tile's heads from one row load). bfloat16 pools on a CPU with AVX-512 BF16 take pass 1
// through vdpbf16ps instead (score_chunk_bf16: the kernel 1.2x faster at decode shapes). Any other
// head_dim, or a CPU with neither, runs the portable loops below them. paged_decode_simd() names the path this build compiled.
//
// Logit soft-capping (Gemma 2/3: softcap > 0) rewrites pass 1's scores as softcap * tanh(s / softcap)
// before any mask; attention sinks (gpt-oss: one float32 logit per query head) join pass 2's max and
// denominator and have no value. Both live in their own instantiation (X = true), so the kernel
// without them is compiled exactly as before (and computes bit for bit the same).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace baton_simd;

constexpr float kHidden = -1e30f;  // a hidden token's score: exp(kHidden - max) is exactly 0


template <typename T>
struct Args {
  const T* q; const T* k; const T* v; T* out;
  const int32_t* tables; const int32_t* lens;
  int64_t q_row, out_row, table_row, blk_stride, tok_stride, head_stride;
  int64_t num_kv_heads, group, block_size, window;
  float scale;
  const uint8_t* tail;  // optional [batch, tail_len]: which of a row's last tail_len tokens it sees
  int64_t tail_len, tail_row;
  const float* sinks;  // optional [num_heads]: each query head's sink logit
  float softcap;  // > 0: scores become softcap * tanh(score / softcap)
};

// Calls fn(i, row) for the visible tokens start + i < len of one sequence, row pointing at the
// token's K or V (all kv heads side by side) in `pool`; the block table is read once per page.
template <typename T, typename Fn>
inline void for_each_row(const Args<T>& a, const T* pool, const int32_t* table, int64_t start, int64_t len, Fn&& fn) {
  for (int64_t t = start; t < len;) {
    const int64_t page = t / a.block_size, end = std::min(len, (page + 1) * a.block_size);
    const T* base = pool + table[page] * a.blk_stride;
    for (; t < end; ++t) fn(t - start, base + (t % a.block_size) * a.tok_stride);
  }
}

#if defined(BATON_SIMD)
// Scores of query heads [0, G) of one kv head for up to kW consecutive tokens of one page: the K
// rows stay in L1 while each head's dot products run. With 32 registers (AVX-512) a head's query
// stays in registers beside the kW accumulators and each token's dot product runs whole; with 16
// (AVX2) it would not fit, and the query is read one vector at a time for all kW tokens instead
// (3-8% faster on Zen 2 than the spilling order; each sum takes the same steps either way).
template <typename T, int NV>
inline void score_chunk(const T* rows, int64_t tok_stride, int cnt, const float* q, int64_t G, float scale,
                        float* s, int64_t n) {
  const T* kr[kW];  // a missing token (cnt < kW: the page ends) re-reads the first row, never stored
  for (int i = 0; i < kW; ++i) kr[i] = rows + (i < cnt ? i : 0) * tok_stride;
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * NV * kW;
    vec acc[kW];
    if constexpr (kQueryInRegisters) {
      vec qv[NV];
      for (int c = 0; c < NV; ++c) qv[c] = vload(qg + c * kW);
      for (int i = 0; i < kW; ++i) {
        acc[i] = vmul(qv[0], vload(kr[i]));
        for (int c = 1; c < NV; ++c) acc[i] = vfmadd(qv[c], vload(kr[i] + c * kW), acc[i]);
      }
    } else {
      for (int i = 0; i < kW; ++i) acc[i] = vmul(vload(qg), vload(kr[i]));
      for (int c = 1; c < NV; ++c) {
        const vec qc = vload(qg + c * kW);
        for (int i = 0; i < kW; ++i) acc[i] = vfmadd(qc, vload(kr[i] + c * kW), acc[i]);
      }
    }
    vstore_first(s + g * n, vfirst(cnt), vmul(vsum_each(acc), vset1(scale)));
  }
}

#if defined(__AVX512BF16__)
// score_chunk for bfloat16 pools on a CPU with AVX-512 BF16: the query and K rows stay bfloat16 and
// vdpbf16ps multiplies 32 pairs of them per instruction, accumulating in float32 (each product of two
// bfloat16 values is exact in float32, so only the summation order differs from the widened path,
// which spent three instructions on every K vector: load, widen, shift). Half the instructions of
// pass 1; the scores are the same sums up to float32 rounding (denormal inputs count as zero).
template <int D>
inline void score_chunk_bf16(const c10::BFloat16* rows, int64_t tok_stride, int cnt, const c10::BFloat16* q,
                             int64_t G, float scale, float* s, int64_t n) {
  constexpr int NP = D / 32;  // vectors of 32 bfloat16 in a row
  const c10::BFloat16* kr[kW];
  for (int i = 0; i < kW; ++i) kr[i] = rows + (i < cnt ? i : 0) * tok_stride;
  const auto load = [](const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  for (int64_t g = 0; g < G; ++g) {
    __m512bh qv[NP];
    for (int c = 0; c < NP; ++c) qv[c] = load(q + g * D + c * 32);
    vec acc[kW];
    for (int i = 0; i < kW; ++i) {
      acc[i] = _mm512_dpbf16_ps(vzero(), qv[0], load(kr[i]));
      for (int c = 1; c < NP; ++c) acc[i] = _mm512_dpbf16_ps(acc[i], qv[c], load(kr[i] + c * 32));
    }
    vstore_first(s + g * n, vfirst(cnt), vmul(vsum_each(acc), vset1(scale)));
  }
}
#endif

// o[g][c0..c0+NC) += sum_i p[g][i] * v_i for GT query heads of one kv head, GT x NC accumulators in registers.
template <typename T, int NC, int GT, typename Rows>
inline void value_tile(Rows&& rows, const float* p, int64_t n, float* o, int64_t dim, int c0) {
  vec acc[GT][NC];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = vzero();
  rows([&](int64_t i, const T* vr) {
    vec v[NC];
    for (int c = 0; c < NC; ++c) v[c] = vload(vr + (c0 + c) * kW);
    for (int g = 0; g < GT; ++g) {
      const vec pg = vset1(p[g * n + i]);
      for (int c = 0; c < NC; ++c) acc[g][c] = vfmadd(pg, v[c], acc[g][c]);
    }
  });
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < NC; ++c) vstore(o + g * dim + (c0 + c) * kW, acc[g][c]);
}
#endif

// Soft-caps the scores of nh heads over n tokens (before any mask: hide_tail runs after it).
template <typename T>
void cap_scores(const Args<T>& a, int64_t nh, float* scores, int64_t n) {
  if (a.softcap <= 0.f) return;
  const float cap = a.softcap, inv = 1.f / a.softcap;
  for (int64_t i = 0; i < nh * n; ++i) scores[i] = cap * std::tanh(scores[i] * inv);
}

// Hides the tree slots that are not a speculative tree row's ancestors (scores of nh heads, n tokens).
template <typename T>
void hide_tail(const Args<T>& a, int64_t b, int64_t start, int64_t len, int64_t nh, float* scores, int64_t n) {
  if (a.tail == nullptr) return;
  const uint8_t* keep = a.tail + b * a.tail_row;
  for (int64_t t = std::max(start, len - a.tail_len); t < len; ++t)
    if (!keep[t - (len - a.tail_len)])
      for (int64_t j = 0; j < nh; ++j) scores[j * n + (t - start)] = kHidden;
}

// One work item: sequence b, kv heads [h0, h1). Pass 1: every query head's scaled scores q.k; pass
// 2: each head's softmax numerators (normalised at the end); pass 3: the weighted sum of values.
// `buf` is the calling thread's scratch, grown as needed (no allocation per item).
// X: soft-capping and/or sinks are on (a.softcap > 0, a.sinks set).
template <typename T, int D, bool X>
void attend(const Args<T>& a, int64_t dim, int64_t b, int64_t h0, int64_t h1, std::vector<float>& buf) {
  const int64_t dl = D > 0 ? D : dim;
  const int64_t G = a.group, nkv = h1 - h0, nh = nkv * G;  // query heads in this item
  const int64_t len = a.lens[b];
  const int64_t start = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
  const int64_t n = len - start;
  const T* qt = a.q + b * a.q_row + h0 * G * dl;
  T* out = a.out + b * a.out_row + h0 * G * dl;
  if (n <= 0) {
    std::fill(out, out + nh * dl, T(0.f));
    return;
  }
  const int64_t need = 2 * nh * dl + nh + nh * n;
  if (static_cast<int64_t>(buf.size()) < need) buf.resize(need);
  float* q = buf.data();  // the item's queries, widened once
  float* o = q + nh * dl;  // the weighted sums, in float until the end
  float* inv = o + nh * dl;  // 1 / each head's softmax denominator
  float* scores = inv + nh;  // [nh, n]
  for (int64_t i = 0; i < nh * dl; ++i) q[i] = widen(qt[i]);
  const int32_t* table = a.tables + b * a.table_row;
#if defined(BATON_SIMD)
  if constexpr (D > 0 && D % kW == 0) {
    constexpr int NV = D / kW;
    for (int64_t t = start; t < len;) {  // pass 1, kW tokens of a page at a time
      const int64_t page = t / a.block_size;
      const int64_t end = std::min({len, (page + 1) * a.block_size, t + kW});
      const T* base = a.k + table[page] * a.blk_stride + (t % a.block_size) * a.tok_stride;
      for (int64_t h = 0; h < nkv; ++h) {
        const T* rows = base + (h0 + h) * a.head_stride;
        float* s = scores + h * G * n + (t - start);
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16> && D % 32 == 0) {
          score_chunk_bf16<D>(rows, a.tok_stride, static_cast<int>(end - t), qt + h * G * D, G, a.scale, s, n);
          continue;
        }
#endif
        score_chunk<T, NV>(rows, a.tok_stride, static_cast<int>(end - t), q + h * G * D, G, a.scale, s, n);
      }
      t = end;
    }
    if constexpr (X) cap_scores(a, nh, scores, n);
    hide_tail(a, b, start, len, nh, scores, n);
    const int64_t whole = n / kW * kW;
    const vmask rest = vfirst(n - whole);
    for (int64_t j = 0; j < nh; ++j) {  // pass 2
      float* s = scores + j * n;
      vec m = vload_first(s + whole, rest, kHidden);
      for (int64_t i = 0; i < whole; i += kW) m = vmax(m, vload(s + i));
      float mxf = vmaxof(m);
      float sink = 0.f;
      if constexpr (X) {
        if (a.sinks) {
          sink = a.sinks[h0 * G + j];
          mxf = std::max(mxf, sink);
        }
      }
      const vec mx = vset1(mxf);
      vec sum = vzero();
      for (int64_t i = 0; i < whole; i += kW) {
        const vec e = vexp(vsub(vload(s + i), mx));
        vstore(s + i, e);
        sum = vadd(sum, e);
      }
      const vec e = vkeep(rest, vexp(vsub(vload_first(s + whole, rest, 0.f), mx)));
      vstore_first(s + whole, rest, e);
      float total = vsum(vadd(sum, e));
      if constexpr (X) {
        if (a.sinks) total += std::exp(sink - mxf);
      }
      inv[j] = 1.f / total;
    }
    // pass 3, per kv head: tiles of GT query heads x NC vectors of head_dim, all heads of a tile
    // from one V row load; the accumulators fit the registers.
    constexpr int NC = std::min(NV, kTileCols), GT = kAccRegs / NC;
    for (int64_t h = 0; h < nkv; ++h) {
      const int64_t off = (h0 + h) * a.head_stride;
      auto rows = [&](auto&& fn) {
        for_each_row(a, a.v, table, start, len, [&](int64_t i, const T* row) { fn(i, row + off); });
      };
      for (int c0 = 0; c0 < NV; c0 += NC) {
        int64_t g = 0;
        for (; g + GT <= G; g += GT)
          value_tile<T, NC, GT>(rows, scores + (h * G + g) * n, n, o + (h * G + g) * D, D, c0);
        for (; g < G; ++g) value_tile<T, NC, 1>(rows, scores + (h * G + g) * n, n, o + (h * G + g) * D, D, c0);
      }
    }
  } else
#endif
  {
    for_each_row(a, a.k, table, start, len, [&](int64_t i, const T* row) {  // pass 1: scores
      for (int64_t j = 0; j < nh; ++j) {
        const T* kr = row + (h0 + j / G) * a.head_stride;
        const float* qj = q + j * dl;
        float s = 0.f;
        for (int64_t d = 0; d < dl; ++d) s += qj[d] * widen(kr[d]);
        scores[j * n + i] = s * a.scale;
      }
    });
    if constexpr (X) cap_scores(a, nh, scores, n);
    hide_tail(a, b, start, len, nh, scores, n);
    for (int64_t j = 0; j < nh; ++j) {  // pass 2: softmax numerators
      float* s = scores + j * n;
      float m = s[0];  // no infinities: -ffast-math assumes there are none
      for (int64_t i = 1; i < n; ++i) m = std::max(m, s[i]);
      float sink = 0.f;
      if constexpr (X) {
        if (a.sinks) {
          sink = a.sinks[h0 * G + j];
          m = std::max(m, sink);
        }
      }
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        s[i] = std::exp(s[i] - m);
        sum += s[i];
      }
      if constexpr (X) {
        if (a.sinks) sum += std::exp(sink - m);
      }
      inv[j] = 1.f / sum;
    }
    std::fill(o, o + nh * dl, 0.f);
    for_each_row(a, a.v, table, start, len, [&](int64_t i, const T* row) {  // pass 3: weighted values
      for (int64_t j = 0; j < nh; ++j) {
        const T* vr = row + (h0 + j / G) * a.head_stride;
        const float p = scores[j * n + i];
        float* oj = o + j * dl;
        for (int64_t d = 0; d < dl; ++d) oj[d] += p * widen(vr[d]);
      }
    });
  }
  for (int64_t j = 0; j < nh; ++j)
    for (int64_t d = 0; d < dl; ++d) out[j * dl + d] = T(o[j * dl + d] * inv[j]);
}

template <typename T, int D, bool X>
void run(const Args<T>& a, int64_t dim, int64_t batch) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // Whole sequences per item when there are enough of them; else one kv head per item.
  const int64_t split = batch >= 4 * threads ? 1 : a.num_kv_heads;
  const int64_t items = batch * split, per = a.num_kv_heads / split;
  std::vector<int64_t> cost(items + 1, 0);
  for (int64_t i = 0; i < items; ++i) {
    const int64_t len = a.lens[i / split];
    const int64_t n = a.window > 0 ? std::min(len, a.window) : len;
    cost[i + 1] = cost[i] + (std::max<int64_t>(n, 0) + 8) * per;
  }
  const int64_t parts = std::min(threads, items);
  std::vector<int64_t> bounds(parts + 1, items);
  bounds[0] = 0;
  for (int64_t t = 1, i = 0; t < parts; ++t) {
    const int64_t target = cost[items] * t / parts;
    while (i < items && cost[i] < target) ++i;
    bounds[t] = i;
  }
  at::parallel_for(0, parts, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf;
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t i = bounds[t]; i < bounds[t + 1]; ++i) {
        const int64_t b = i / split, h0 = (i % split) * per;
        attend<T, D, X>(a, dim, b, h0, h0 + per, buf);
      }
  });
}

template <typename T, bool X>
void dispatch_dim(const Args<T>& a, int64_t dim, int64_t batch) {
  switch (dim) {
    case 32: run<T, 32, X>(a, dim, batch); break;
    case 64: run<T, 64, X>(a, dim, batch); break;
    case 128: run<T, 128, X>(a, dim, batch); break;
    default: run<T, 0, X>(a, dim, batch);
  }
}

template <typename T>
void dispatch(const Args<T>& a, int64_t dim, int64_t batch) {
  if (a.sinks != nullptr || a.softcap > 0.f) {
    dispatch_dim<T, true>(a, dim, batch);
  } else {
    dispatch_dim<T, false>(a, dim, batch);
  }
}

}  // namespace

std::string paged_decode_simd() {
#if defined(BATON_SIMD)
  return BATON_SIMD;
#else
  return "portable";
#endif
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale, int64_t window,
                           std::optional<torch::Tensor> tail_mask, std::optional<torch::Tensor> sinks,
                           double softcap) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kBFloat16) && k_cache.scalar_type() == dtype &&
              v_cache.scalar_type() == dtype, "paged_decode (CPU): float32 or bfloat16, the same for q and the pools");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32,
              "paged_decode (CPU): int32 block tables and context lengths");
  TORCH_CHECK(q.is_contiguous() && block_tables.stride(-1) == 1 && context_lens.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(k_cache.strides() == v_cache.strides() && k_cache.stride(3) == 1, "K and V pools share one layout");
  const int64_t batch = q.size(0), num_heads = q.size(1), dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2);
  if (tail_mask) {
    TORCH_CHECK(tail_mask->scalar_type() == torch::kUInt8 && tail_mask->dim() == 2 && tail_mask->size(0) == batch &&
                tail_mask->stride(1) == 1, "tail_mask: uint8 [batch, tail_len], rows contiguous");
    TORCH_CHECK(window <= 0, "tail_mask and a sliding window together are not supported");
  }
  if (sinks) {
    TORCH_CHECK(sinks->scalar_type() == torch::kFloat32 && sinks->is_contiguous() && sinks->numel() == num_heads &&
                sinks->device().is_cpu(), "sinks: contiguous float32 [num_heads] on the CPU");
  }
  // A bad block table must fail loudly, not read outside the pools.
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t page = k_cache.size(1), num_blocks = k_cache.size(0);
  TORCH_CHECK(block_tables.size(0) == batch && context_lens.numel() == batch, "one block table and length per row");
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t pages = (static_cast<int64_t>(lens[b]) + page - 1) / page;
    TORCH_CHECK(lens[b] >= 0 && pages <= block_tables.size(1), "row ", b, ": context length ", lens[b],
                " needs ", pages, " blocks, its block table has ", block_tables.size(1));
    for (int64_t i = 0; i < pages; ++i) {
      const int32_t id = tables[b * block_tables.stride(0) + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "row ", b, ": block table entry ", i, " is ", id,
                  ", outside the pool of ", num_blocks, " blocks");
    }
  }
  auto out = torch::empty_like(q);
  const auto args = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return Args<T>{q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), out.data_ptr<T>(),
                   tables, lens,
                   q.stride(0), out.stride(0), block_tables.size(0) ? block_tables.stride(0) : 0,
                   k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                   num_kv_heads, num_heads / num_kv_heads, k_cache.size(1), window, static_cast<float>(scale),
                   tail_mask ? tail_mask->data_ptr<uint8_t>() : nullptr, tail_mask ? tail_mask->size(1) : 0,
                   tail_mask ? tail_mask->stride(0) : 0, sinks ? sinks->data_ptr<float>() : nullptr,
                   static_cast<float>(softcap)};
  };
  if (dtype == torch::kBFloat16) {
    dispatch(args(static_cast<c10::BFloat16*>(nullptr)), dim, batch);
  } else {
    dispatch(args(static_cast<float*>(nullptr)), dim, batch);
  }
  return out;
}

// The new tokens' K/V [T, Hkv, D] into the pools at slot_mapping[t] = block * block_size + offset (-1
// skips): one pass of row copies instead of torch's boolean mask, gather and index_put.
void cache_write(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                 torch::Tensor slot_mapping) {
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type() &&
              k.scalar_type() == v.scalar_type(), "cache_write (CPU): K/V and the pools share one dtype");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
              k.stride(1) == k.size(2) && v.stride(1) == v.size(2), "k/v: [T, Hkv, D] with contiguous token rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
              k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2), "pools: contiguous [blocks, block_size, Hkv, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == k.size(0), "slot_mapping: contiguous int64 [T]");
  const int64_t tokens = k.size(0), slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = k.size(1) * k.size(2) * k.element_size();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= -1 && slot[t] < slots, "token ", t, ": slot ", slot[t], " is outside the pool of ", slots);
  auto* kd = static_cast<char*>(k_cache.data_ptr());
  auto* vd = static_cast<char*>(v_cache.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  const int64_t k_tok = k.stride(0) * k.element_size(), v_tok = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0) continue;
    std::memcpy(kd + slot[t] * row_bytes, ks + t * k_tok, row_bytes);
    std::memcpy(vd + slot[t] * row_bytes, vs + t * v_tok, row_bytes);
  }
}
