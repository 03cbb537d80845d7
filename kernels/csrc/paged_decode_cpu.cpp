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
// With AVX-512 (the extension is built -march=native) and head_dim 32/64/128, pass 1 takes 16
// tokens of a page at a time: each query head's 16 dot products are summed across lanes together
// (sum16), not one horizontal sum each; pass 2 is a vectorized exp; pass 3 keeps a tile of query
// heads' accumulators in registers over one kv head's V rows (all G heads of a kv head from one
// row load). Any other head_dim, or a CPU without AVX-512, runs the portable loops below them.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr float kHidden = -1e30f;  // a hidden token's score: exp(kHidden - max) is exactly 0

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
struct Args {
  const T* q; const T* k; const T* v; T* out;
  const int32_t* tables; const int32_t* lens;
  int64_t q_row, out_row, table_row, blk_stride, tok_stride, head_stride;
  int64_t num_kv_heads, group, block_size, window;
  float scale;
  const uint8_t* tail;  // optional [batch, tail_len]: which of a row's last tail_len tokens it sees
  int64_t tail_len, tail_row;
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

#if defined(__AVX512F__)
// AVX-512 (the build is -march=native): 16 floats a vector; bfloat16 widens by a 16-bit shift.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// v[0..15] -> one vector whose lane i is the sum of v[i]'s lanes: 15 adds and 30 shuffles for 16
// dot products, against ~8 dependent steps each for a horizontal sum.
inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (x0+x2, y0+y2, x1+x3, y1+y3)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per lane: the lane's sums of 4 inputs
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// exp(x) for x <= 0 (a score minus its row's max), Cephes' polynomial (~1 ulp); below -87 (where
// float's exp underflows anyway, and every hidden token's score) exactly 0.
inline __m512 exp16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(y, n));
}

// Scores of query heads [j0, j0 + G) (one kv head, at offset `kh` in a token row) for up to 16
// consecutive tokens of one page: the K rows stay in L1 while each head's dot products run.
template <typename T, int NV>
inline void score_chunk(const T* rows, int64_t tok_stride, int cnt, const float* q, int64_t G, float scale,
                        float* s, int64_t n) {
  for (int64_t g = 0; g < G; ++g) {
    __m512 qv[NV], acc[16];
    for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(q + (g * NV + c) * 16);
    for (int i = 0; i < 16; ++i) {
      if (i < cnt) {
        const T* kr = rows + i * tok_stride;
        __m512 x = _mm512_mul_ps(qv[0], load16(kr));
        for (int c = 1; c < NV; ++c) x = _mm512_fmadd_ps(qv[c], load16(kr + c * 16), x);
        acc[i] = x;
      } else {
        acc[i] = _mm512_setzero_ps();
      }
    }
    _mm512_mask_storeu_ps(s + g * n, static_cast<__mmask16>((1u << cnt) - 1),
                          _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
  }
}

// o[g] += sum_i p[g][i] * v_i for GT query heads of one kv head, the GT x NV accumulators in registers.
template <typename T, int NV, int GT, typename Rows>
inline void value_tile(Rows&& rows, const float* p, int64_t n, float* o) {
  __m512 acc[GT][NV];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
  rows([&](int64_t i, const T* vr) {
    __m512 v[NV];
    for (int c = 0; c < NV; ++c) v[c] = load16(vr + c * 16);
    for (int g = 0; g < GT; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * n + i]);
      for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_fmadd_ps(pg, v[c], acc[g][c]);
    }
  });
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + (g * NV + c) * 16, acc[g][c]);
}
#endif

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
template <typename T, int D>
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
#if defined(__AVX512F__)
  if constexpr (D > 0 && D % 16 == 0) {
    constexpr int NV = D / 16;
    for (int64_t t = start; t < len;) {  // pass 1, 16 tokens of a page at a time
      const int64_t page = t / a.block_size;
      const int64_t end = std::min({len, (page + 1) * a.block_size, t + 16});
      const T* base = a.k + table[page] * a.blk_stride + (t % a.block_size) * a.tok_stride;
      for (int64_t h = 0; h < nkv; ++h)
        score_chunk<T, NV>(base + (h0 + h) * a.head_stride, a.tok_stride, static_cast<int>(end - t),
                           q + h * G * D, G, a.scale, scores + h * G * n + (t - start), n);
      t = end;
    }
    hide_tail(a, b, start, len, nh, scores, n);
    for (int64_t j = 0; j < nh; ++j) {  // pass 2
      float* s = scores + j * n;
      __m512 m = _mm512_set1_ps(kHidden);
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + i));
      const __mmask16 rest = static_cast<__mmask16>((1u << (n - i)) - 1);
      m = _mm512_mask_max_ps(m, rest, m, _mm512_maskz_loadu_ps(rest, s + i));
      const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
      __m512 sum = _mm512_setzero_ps();
      for (i = 0; i + 16 <= n; i += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), mx));
        _mm512_storeu_ps(s + i, e);
        sum = _mm512_add_ps(sum, e);
      }
      const __m512 e = _mm512_maskz_mov_ps(rest, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(rest, s + i), mx)));
      _mm512_mask_storeu_ps(s + i, rest, e);
      inv[j] = 1.f / _mm512_reduce_add_ps(_mm512_add_ps(sum, e));
    }
    constexpr int GT = NV >= 8 ? 2 : NV >= 4 ? 4 : 8;  // accumulators GT x NV <= 16 registers
    for (int64_t h = 0; h < nkv; ++h) {  // pass 3, per kv head, GT query heads at a time
      const int64_t off = (h0 + h) * a.head_stride;
      auto rows = [&](auto&& fn) {
        for_each_row(a, a.v, table, start, len, [&](int64_t i, const T* row) { fn(i, row + off); });
      };
      int64_t g = 0;
      for (; g + GT <= G; g += GT)
        value_tile<T, NV, GT>(rows, scores + (h * G + g) * n, n, o + (h * G + g) * D);
      for (; g < G; ++g) value_tile<T, NV, 1>(rows, scores + (h * G + g) * n, n, o + (h * G + g) * D);
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
    hide_tail(a, b, start, len, nh, scores, n);
    for (int64_t j = 0; j < nh; ++j) {  // pass 2: softmax numerators
      float* s = scores + j * n;
      float m = s[0];  // no infinities: -ffast-math assumes there are none
      for (int64_t i = 1; i < n; ++i) m = std::max(m, s[i]);
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        s[i] = std::exp(s[i] - m);
        sum += s[i];
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

template <typename T, int D>
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
        attend<T, D>(a, dim, b, h0, h0 + per, buf);
      }
  });
}

template <typename T>
void dispatch(const Args<T>& a, int64_t dim, int64_t batch) {
  switch (dim) {
    case 32: run<T, 32>(a, dim, batch); break;
    case 64: run<T, 64>(a, dim, batch); break;
    case 128: run<T, 128>(a, dim, batch); break;
    default: run<T, 0>(a, dim, batch);
  }
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale, int64_t window,
                           std::optional<torch::Tensor> tail_mask) {
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
                   tail_mask ? tail_mask->stride(0) : 0};
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
