// Paged decode attention for CPU: one query token per sequence against its K/V read in place from the block pool.
// The torch fallback gathers every sequence's blocks into a padded copy each step; this reads each cached K/V
// row exactly once, so a decode step costs what the cache weighs, not three times that plus padding.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "avx512_util.h"
#include "checks.h"
#ifdef __FMA__
#include <immintrin.h>
#endif

namespace {

// Row to float32. bf16 is the top half of a float32: a shift the compiler vectorises (c10's scalar conversion
// it does not).
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(raw[i]) << 16;
}

template <>
inline void to_float<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

// float32 row to T (round to nearest even for bf16 / fp16, as c10's conversions)
template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// The next block of the table is somewhere else in the pool: ask for it while this one is being used.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

// The portable attention (any dtype and head size; the AVX512-BF16 path is in prefill_attention.cpp). Decode and
// prefill rows run through the same code, so a query's output is the same bits whether it is a decode row, a row of
// a fresh prompt or of a chunk after cached context, whatever rows share the call: keys in tiles of 8 from a
// multiple of 8, a row's operations on a tile independent of the other rows, no reassociation, and fused
// multiply-adds only where written (fma8).
EMBER_FIXED_ORDER_BEGIN
namespace canon {

// Code in these regions calls only builtins and always-inlined code: GCC does not inline a function compiled with
// other options (std::max, c10's conversions, a helper of the other region), and a call in an inner loop costs more
// than the arithmetic.
typedef float f8 __attribute__((vector_size(32)));  // 8 lanes: one AVX register, two SSE ones
typedef int32_t i8v __attribute__((vector_size(32)));
constexpr int KT = 8;  // keys a tile: one vector of scores

EMBER_INLINE f8 load8(const float* p) {
  f8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

EMBER_INLINE void store8(float* p, f8 v) { __builtin_memcpy(p, &v, sizeof(v)); }

EMBER_INLINE f8 splat(float x) { return f8{x, x, x, x, x, x, x, x}; }

// a * b + c in one rounding where the CPU has FMA (the build's choice, the same for every call), else two
#ifdef __FMA__
EMBER_INLINE f8 fma8(f8 a, f8 b, f8 c) { return (f8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
EMBER_INLINE float fma1(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#else
EMBER_INLINE f8 fma8(f8 a, f8 b, f8 c) { return a * b + c; }
EMBER_INLINE float fma1(float a, float b, float c) { return a * b + c; }
#endif

EMBER_INLINE float tree8(f8 l) { return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])); }

// lane i of the result = tree8(v[i]) for 8 accumulators v: the same additions in the same order, as a transposing
// tree (3 steps of 4 vector additions instead of 8 horizontal trees)
EMBER_INLINE f8 tree8x8(const f8* v) {
  f8 w[4], x[2];
  for (int i = 0; i < 4; ++i)  // s_k = l_k + l_k+4 of two accumulators: [s(v2i) | s(v2i+1)]
    w[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], i8v{0, 1, 2, 3, 8, 9, 10, 11}) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1], i8v{4, 5, 6, 7, 12, 13, 14, 15});
  for (int i = 0; i < 2; ++i)  // u0 = s0 + s2, u1 = s1 + s3 of four accumulators
    x[i] = __builtin_shuffle(w[2 * i], w[2 * i + 1], i8v{0, 1, 8, 9, 4, 5, 12, 13}) +
           __builtin_shuffle(w[2 * i], w[2 * i + 1], i8v{2, 3, 10, 11, 6, 7, 14, 15});
  const f8 r = __builtin_shuffle(x[0], x[1], i8v{0, 2, 8, 10, 4, 6, 12, 14}) +  // u0 + u1: v0, v2, v4, v6, v1, ...
               __builtin_shuffle(x[0], x[1], i8v{1, 3, 9, 11, 5, 7, 13, 15});
  return __builtin_shuffle(r, i8v{0, 4, 1, 5, 2, 6, 3, 7});
}

// exp for the softmax (arguments <= 0 after the max is subtracted), Cephes' expf polynomial on 8 lanes (within 2
// ulp of std::exp)
EMBER_INLINE f8 exp8(f8 x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const f8 t = x * splat(1.44269504088896341f) + splat(0.5f);
  const f8 tr = __builtin_convertvector(__builtin_convertvector(t, i8v), f8);  // toward zero
  const f8 n = tr - __builtin_convertvector(-(t < tr), f8);                   // floor: one less where t < trunc(t)
  const f8 r = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f);
  f8 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  const f8 y = p * r * r + r + splat(1.0f);
  const i8v bits = (__builtin_convertvector(n, i8v) + 127) << 23;
  f8 scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// One row (a query token's head): its query (times the softmax scale), the keys it may see [first, len), and its
// running softmax state: max m, sum l, output accumulator acc [d].
struct Row {
  const float* q;
  float* acc;
  int64_t first, len;
  float m, l;
};

// A tile: 8 keys from k0, each key's K and V row of d floats (a row of zeros past the context).
struct Tile {
  const float* k[KT];
  const float* v[KT];
};

// A tile against rows. Each row, alone: score of key i = tree8 of the lane sums (lane j: x = j, j + 8, ...) of
// q[x] * k_i[x]; keys outside [first, len) masked; online softmax (m, l, acc rescaled by exp(m_old - m_new)); then
// acc += p_i * v_i in key order. D: the head size when it is fixed at compile time (64, 128), 0 when read from d.
template <int64_t D>
void tile_rows(Row* rows, int nr, int64_t k0, const Tile& t, int64_t d) {
  if constexpr (D > 0) d = D;
  const i8v key = i8v{0, 1, 2, 3, 4, 5, 6, 7} + static_cast<int32_t>(k0);
  const float* k[KT];
  const float* v[KT];  // in locals: the stores to acc could otherwise alias the tile's pointers
  for (int i = 0; i < KT; ++i) {
    k[i] = t.k[i];
    v[i] = t.v[i];
  }
  const int64_t whole = d / KT * KT;
  for (int r = 0; r < nr; ++r) {
    Row& row = rows[r];
    f8 l[KT];
    for (int i = 0; i < KT; ++i) l[i] = splat(0.f);
    for (int64_t x = 0; x < whole; x += KT) {
      const f8 qx = load8(row.q + x);
      for (int i = 0; i < KT; ++i) l[i] = fma8(qx, load8(k[i] + x), l[i]);
    }
    for (int j = 0; whole + j < d; ++j)
      for (int i = 0; i < KT; ++i) l[i][j] = fma1(row.q[whole + j], k[i][whole + j], l[i][j]);
    const i8v valid = (key >= static_cast<int32_t>(row.first)) & (key < static_cast<int32_t>(row.len));
    const f8 sc = valid ? tree8x8(l) : splat(-__builtin_inff());
    f8 mv = __builtin_shuffle(sc, i8v{4, 5, 6, 7, 0, 1, 2, 3});  // the max of the 8 lanes (exact in any order)
    mv = sc > mv ? sc : mv;
    const f8 mw = __builtin_shuffle(mv, i8v{2, 3, 0, 1, 6, 7, 4, 5});
    mv = mv > mw ? mv : mw;
    const float mx = mv[0] > mv[1] ? mv[0] : mv[1];
    const float m_new = mx > row.m ? mx : row.m;
    const f8 p = valid ? exp8(sc - splat(m_new)) : splat(0.f);
    // the running sums rescaled by exp(m_old - m_new): 0 on the first tile, and skipped while the max holds (the
    // factor is then exactly 1)
    const bool rescale = m_new != row.m;
    const float corr = row.m == -__builtin_inff() ? 0.f : rescale ? exp8(splat(row.m - m_new))[0] : 1.f;
    row.l = (rescale ? row.l * corr : row.l) + tree8(p);
    row.m = m_new;
    const f8 c = splat(corr);
    for (int64_t x = 0; x < whole; x += KT) {
      f8 a = rescale ? load8(row.acc + x) * c : load8(row.acc + x);
      for (int i = 0; i < KT; ++i) a = fma8(splat(p[i]), load8(v[i] + x), a);
      store8(row.acc + x, a);
    }
    for (int64_t x = whole; x < d; ++x) {  // head sizes that are not a multiple of 8
      float a = rescale ? row.acc[x] * corr : row.acc[x];
      for (int i = 0; i < KT; ++i) a = fma1(p[i], v[i][x], a);
      row.acc[x] = a;
    }
  }
}


// The rows against the keys they may see, all of one KV head: tiles of 8 from a multiple of 8; a row takes exactly
// the tiles that hold any of its keys. tile(k0, t) fills the tile's K and V rows.
template <typename TileFn>
inline void attend_rows(Row* rows, int64_t n, int64_t d, TileFn tile) {
  auto step = d == 64 ? tile_rows<64> : d == 128 ? tile_rows<128> : tile_rows<0>;
  int64_t lo = rows[0].first, hi = rows[0].len;
  for (int64_t r = 1; r < n; ++r) {
    lo = rows[r].first < lo ? rows[r].first : lo;
    hi = rows[r].len > hi ? rows[r].len : hi;
  }
  Row* active[64];
  Row block[64];
  Tile t;
  for (int64_t k0 = lo / KT * KT; k0 < hi; k0 += KT) {
    tile(k0, t);
    for (int64_t r0 = 0; r0 < n; r0 += 64) {
      int na = 0;
      for (int64_t r = r0; r < n && r < r0 + 64; ++r)
        if (rows[r].first < k0 + KT && rows[r].len > k0 && rows[r].len > rows[r].first) {
          active[na] = &rows[r];
          block[na++] = rows[r];
        }
      step(block, na, k0, t, d);
      for (int j = 0; j < na; ++j) {
        active[j]->m = block[j].m;
        active[j]->l = block[j].l;
      }
    }
  }
  for (int64_t r = 0; r < n; ++r) {  // out = acc / l (a row with no key: zeros)
    const float inv = rows[r].l > 0.f ? 1.f / rows[r].l : 0.f;
    for (int64_t x = 0; x < d; ++x) rows[r].acc[x] = rows[r].acc[x] * inv;
  }
}

}  // namespace canon
EMBER_FIXED_ORDER_END

// The float32 rows of a tile: keys [k0, k0 + 8) of KV head h, from the pool itself when it holds float32, else
// converted into buf [2][8][d]; keys at or past len point at zeros (never read from the pool).
template <typename T>
inline void fill_tile(const T* kc, const T* vc, const int64_t* table, int64_t bs, int64_t hkv, int64_t h, int64_t d,
                      int64_t k0, int64_t len, const float* zeros, float* buf, canon::Tile& t) {
  for (int i = 0; i < canon::KT; ++i) {
    const int64_t key = k0 + i;
    if (key >= len) {
      t.k[i] = t.v[i] = zeros;
      continue;
    }
    const int64_t off = ((table[key / bs] * bs + key % bs) * hkv + h) * d;
    if constexpr (std::is_same_v<T, float>) {
      t.k[i] = kc + off;
      t.v[i] = vc + off;
    } else {
      float* kb = buf + i * d;
      float* vb = buf + (canon::KT + i) * d;
      to_float(kc + off, kb, d);
      to_float(vc + off, vb, d);
      t.k[i] = kb;
      t.v[i] = vb;
    }
  }
}

// Row state for the g query heads of KV head h of query tokens [i0, i0 + n) (their context lengths in lens): q
// times scale, acc zeroed.
template <typename T>
void setup_rows(const T* q, int64_t hq, int64_t d, int64_t g, int64_t h, int64_t i0, int64_t n, const int64_t* lens,
                int64_t window, float scale, std::vector<float>& qf, std::vector<float>& acc,
                std::vector<canon::Row>& rows) {
  qf.resize(n * g * d);
  acc.assign(n * g * d, 0.f);
  rows.resize(n * g);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t r = 0; r < g; ++r) {
      const int64_t idx = j * g + r;
      to_float(q + ((i0 + j) * hq + h * g + r) * d, qf.data() + idx * d, d);
      for (int64_t x = 0; x < d; ++x) qf[idx * d + x] *= scale;
      const int64_t len = lens[j];
      rows[idx] = {qf.data() + idx * d, acc.data() + idx * d, window > 0 ? std::max<int64_t>(0, len - window) : 0,
                   len, -std::numeric_limits<float>::infinity(), 0.f};
    }
}

template <typename T>
void write_rows(const std::vector<float>& acc, T* out, int64_t hq, int64_t d, int64_t g, int64_t h, int64_t i0,
                int64_t n) {
  for (int64_t j = 0; j < n; ++j) from_float(acc.data() + j * g * d, out + ((i0 + j) * hq + h * g) * d, g * d);
}

// decode: one query a sequence; work items (sequence, KV head)
template <typename T>
void canon_decode(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens, T* out,
                  int64_t nd, int64_t hq, int64_t hkv, int64_t d, int64_t bs, int64_t max_blocks, int64_t window,
                  float scale) {
  const int64_t g = hq / hkv;
  const std::vector<float> zeros(d, 0.f);
  at::parallel_for(0, nd * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, buf(2 * canon::KT * d);
    std::vector<canon::Row> rows;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / hkv, h = item % hkv, len = lens[s];
      setup_rows(q, hq, d, g, h, s, 1, lens + s, window, scale, qf, acc, rows);
      const int64_t* table = tables + s * max_blocks;
      canon::attend_rows(rows.data(), g, d, [&](int64_t k0, canon::Tile& t) {
        fill_tile(kc, vc, table, bs, hkv, h, d, k0, len, zeros.data(), buf.data(), t);
      });
      write_rows(acc, out, hq, d, g, h, s, 1);
    }
  });
}

constexpr int64_t PREFILL_TOKENS = 16;  // query tokens a work item (times the KV head's query heads: its rows)

// prefill: a chunk's L queries at positions S - L .. S - 1; work items (KV head, PREFILL_TOKENS tokens)
template <typename T>
void canon_prefill(const T* q, const T* kc, const T* vc, const int64_t* table, T* out, int64_t L, int64_t S,
                   int64_t hq, int64_t hkv, int64_t d, int64_t bs, int64_t window, float scale) {
  const int64_t g = hq / hkv;
  const std::vector<float> zeros(d, 0.f);
  std::vector<int64_t> lens(L);
  for (int64_t i = 0; i < L; ++i) lens[i] = S - L + i + 1;
  const int64_t blocks = (L + PREFILL_TOKENS - 1) / PREFILL_TOKENS, items = hkv * blocks;
  // later tokens see more keys: items go round-robin, so that every thread gets early and late ones
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, nt, 1, [&](int64_t tb, int64_t te) {
    std::vector<float> qf, acc, buf(2 * canon::KT * d);
    std::vector<canon::Row> rows;
    for (int64_t tid = tb; tid < te; ++tid)
    for (int64_t item = tid; item < items; item += nt) {
      const int64_t h = item % hkv, i0 = item / hkv * PREFILL_TOKENS;
      const int64_t n = std::min(PREFILL_TOKENS, L - i0);
      setup_rows(q, hq, d, g, h, i0, n, lens.data() + i0, window, scale, qf, acc, rows);
      canon::attend_rows(rows.data(), n * g, d, [&](int64_t k0, canon::Tile& t) {
        fill_tile(kc, vc, table, bs, hkv, h, d, k0, S, zeros.data(), buf.data(), t);
      });
      write_rows(acc, out, hq, d, g, h, i0, n);
    }
  });
}

#ifdef EMBER_AVX512_BF16
// acc (NR heads' running P.V sums, rescaled by corr first) += P.V over a tile of T tokens of one KV head. NR is a
// template parameter so the 2 * NV * NR accumulators stay in registers (with a run-time count they lived on the
// stack: 40% slower over 30 layers read from memory).
template <int64_t D, int NR>
inline void pv_heads(const c10::BFloat16* vt, int64_t row_stride, int64_t T, const uint32_t* pp, const float* corr,
                     float* acc_store) {
  constexpr int64_t NV = D / 32;
  __m512 acc[NR][2 * NV];
  for (int i = 0; i < NR; ++i) {
    const __m512 cv = _mm512_set1_ps(corr[i]);
    for (int64_t j = 0; j < 2 * NV; ++j) acc[i][j] = _mm512_mul_ps(_mm512_loadu_ps(acc_store + (i * 2 * NV + j) * 16), cv);
  }
  for (int64_t t = 0; t < T; t += 2) {
    const c10::BFloat16* va = vt + t * row_stride;
    __m512bh lo[NV], hi[NV];
    for (int64_t j = 0; j < NV; ++j) {
      const __m512i x = _mm512_loadu_si512(va + 32 * j);
      const __m512i y = t + 1 < T ? _mm512_loadu_si512(va + row_stride + 32 * j) : _mm512_setzero_si512();
      lo[j] = (__m512bh)_mm512_unpacklo_epi16(x, y);
      hi[j] = (__m512bh)_mm512_unpackhi_epi16(x, y);
    }
    for (int i = 0; i < NR; ++i) {
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[i * 8 + t / 2]));
      for (int64_t j = 0; j < NV; ++j) {
        acc[i][2 * j] = _mm512_dpbf16_ps(acc[i][2 * j], lo[j], pv);
        acc[i][2 * j + 1] = _mm512_dpbf16_ps(acc[i][2 * j + 1], hi[j], pv);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int64_t j = 0; j < 2 * NV; ++j) _mm512_storeu_ps(acc_store + (i * 2 * NV + j) * 16, acc[i][j]);
}

// bf16 with AVX512-BF16, D = 64 or 128: the cache is read in tiles of up to 16 tokens of one block; for each query
// head of a KV head the tile's 16 scores come from vdpbf16ps dot products (one transposing add tree instead of 16
// horizontal sums), an online softmax keeps a running max and sum, and P.V runs as vdpbf16ps over token pairs with
// P rounded to bf16 (as FlashAttention does). The tile stays in L1 while every query head of its KV head uses it,
// and P.V runs for up to RB of those heads together, each V token pair loaded and interleaved once for all of them
// (64 sequences of 450 tokens, 9 query / 3 KV heads, 2 threads, one layer's cache reused: 0.46-0.49 -> 0.32-0.37 ms;
// 30 layers of 48 x 400 tokens read from memory are bandwidth-bound and stay level, 15.1-15.6 vs 15.2-15.9 ms).
template <int64_t D>
void decode_kernel_bf16(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc,
                        const int64_t* tables, const int64_t* lens, c10::BFloat16* out, int64_t nd, int64_t hq,
                        int64_t hkv, int64_t bs, int64_t max_blocks, int64_t window, float scale) {
  using namespace ember_avx512;
  constexpr int64_t NV = D / 32;  // bf16 vectors of 32 in a row, and fp32 accumulators of 16 for each pair half
  constexpr int64_t RB = 8 / NV;  // query heads whose P.V accumulators stay in registers together (16 of them)
  const int64_t g = hq / hkv;
  const int64_t row_stride = hkv * D;
  at::parallel_for(0, nd, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc_store(hq * 2 * NV * 16), m_store(hq), l_store(hq), corr(hq);
    std::vector<uint32_t> pp(hq * 8);  // each head's tile probabilities as bf16 pairs (token t in pair t / 2)
    for (int64_t s = begin; s < end; ++s) {
      const int64_t len = lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      if (len - first <= 0) continue;
      std::fill(acc_store.begin(), acc_store.end(), 0.f);
      std::fill(m_store.begin(), m_store.end(), -std::numeric_limits<float>::infinity());
      std::fill(l_store.begin(), l_store.end(), 0.f);
      const int64_t* table = tables + s * max_blocks;
      const c10::BFloat16* qs = q + s * hq * D;
      for (int64_t t0 = first; t0 < len;) {
        const int64_t blk = table[t0 / bs];
        const int64_t in_blk = t0 % bs;
        const int64_t T = std::min<int64_t>({16, bs - in_blk, len - t0});
        const int64_t base = (blk * bs + in_blk) * row_stride;
        // The block read next lies elsewhere in the pool (this sequence's next block, or after its last tile the next
        // sequence's first): its K and V are prefetched a slice per query head while this tile computes. Issued
        // all at once, the 192 prefetches of a 6 KB block overran the core's miss buffers and most were lost: 30
        // layers of 48 x 400 tokens in scattered blocks took 21.1 ms that way, 13.5 ms spread (11.5 ms to read
        // the same bytes and compute nothing); blocks in pool order 14.6 -> 11.1 ms.
        const char* pk = nullptr;
        const char* pv = nullptr;
        if (in_blk + T == bs && t0 + T < len) {
          const int64_t nxt = table[(t0 + T) / bs] * bs * row_stride;
          pk = reinterpret_cast<const char*>(kc + nxt);
          pv = reinterpret_cast<const char*>(vc + nxt);
        } else if (t0 + T >= len && s + 1 < end) {
          const int64_t next_len = lens[s + 1];
          const int64_t next_first = window > 0 ? std::max<int64_t>(0, next_len - window) : 0;
          if (next_len > next_first) {
            const int64_t nxt = tables[(s + 1) * max_blocks + next_first / bs] * bs * row_stride;
            pk = reinterpret_cast<const char*>(kc + nxt);
            pv = reinterpret_cast<const char*>(vc + nxt);
          }
        }
        const int64_t blk_bytes = bs * row_stride * 2;
        const int64_t slice = ((blk_bytes / 64 + hq - 1) / hq) * 64;  // bytes of each pool prefetched per query head
        const __mmask16 valid = static_cast<__mmask16>((1u << T) - 1);
        for (int64_t h = 0; h < hkv; ++h) {
          const c10::BFloat16* kt = kc + base + h * D;
          const c10::BFloat16* vt = vc + base + h * D;
          for (int64_t r = h * g; r < (h + 1) * g; ++r) {
            if (pk != nullptr && r * slice < blk_bytes) {
              prefetch(pk + r * slice, std::min(slice, blk_bytes - r * slice));
              prefetch(pv + r * slice, std::min(slice, blk_bytes - r * slice));
            }
            __m512bh qv[NV];
            for (int64_t j = 0; j < NV; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(qs + r * D + 32 * j);
            __m512 part[16];
            for (int64_t t = 0; t < 16; ++t) {
              __m512 a = _mm512_setzero_ps();
              if (t < T) {
                const c10::BFloat16* kr = kt + t * row_stride;
                for (int64_t j = 0; j < NV; ++j) a = _mm512_dpbf16_ps(a, qv[j], (__m512bh)_mm512_loadu_si512(kr + 32 * j));
              }
              part[t] = a;
            }
            __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid,
                                           _mm512_mul_ps(reduce16(part), _mm512_set1_ps(scale)));
            const float m_old = m_store[r];
            const float m_new = std::max(m_old, _mm512_reduce_max_ps(sc));
            corr[r] = m_old == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m_old - m_new);
            __m512 p = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(sc, _mm512_set1_ps(m_new))));
            m_store[r] = m_new;
            l_store[r] = l_store[r] * corr[r] + _mm512_reduce_add_ps(p);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp.data() + r * 8), (__m256i)_mm512_cvtneps_pbh(p));
          }
          for (int64_t r0 = h * g; r0 < (h + 1) * g; r0 += RB) {
            float* ar = acc_store.data() + r0 * 2 * NV * 16;
            const uint32_t* pr = pp.data() + r0 * 8;
            const float* cr = corr.data() + r0;
            switch (std::min<int64_t>(RB, (h + 1) * g - r0)) {
              case 1: pv_heads<D, 1>(vt, row_stride, T, pr, cr, ar); break;
              case 2: pv_heads<D, 2>(vt, row_stride, T, pr, cr, ar); break;
              case 3: if constexpr (RB >= 3) pv_heads<D, 3>(vt, row_stride, T, pr, cr, ar); break;
              default: if constexpr (RB >= 4) pv_heads<D, 4>(vt, row_stride, T, pr, cr, ar); break;
            }
          }
        }
        t0 += T;
      }
      // acc[2j] lane 4c+i holds dimension 32j + 8c + i, acc[2j+1] lane 4c+i dimension 32j + 8c + 4 + i
      // (unpacklo/hi interleave within 128-bit quarters)
      for (int64_t r = 0; r < hq; ++r) {
        const float inv = 1.f / l_store[r];
        const float* ar = acc_store.data() + r * 2 * NV * 16;
        c10::BFloat16* o = out + (s * hq + r) * D;
        for (int64_t j = 0; j < NV; ++j)
          for (int64_t c = 0; c < 4; ++c)
            for (int64_t i = 0; i < 4; ++i) {
              o[32 * j + 8 * c + i] = static_cast<c10::BFloat16>(ar[16 * (2 * j) + 4 * c + i] * inv);
              o[32 * j + 8 * c + 4 + i] = static_cast<c10::BFloat16>(ar[16 * (2 * j + 1) + 4 * c + i] * inv);
            }
      }
    }
  });
}
#endif

}  // namespace

#ifdef EMBER_AVX512_BF16
// prefill_attention.cpp: the AVX512-BF16 kernels' decode with the prefill's arithmetic
void decode_bf16_invariant(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc,
                           const int64_t* tables, const int64_t* lens, c10::BFloat16* out, int64_t nd, int64_t hq,
                           int64_t hkv, int64_t d, int64_t bs, int64_t max_blocks, int64_t window, float scale);
#endif

// Whether a query of this dtype and head size runs the AVX512-BF16 kernels (decode and prefill alike).
bool avx512_attention(at::ScalarType dtype, int64_t d) {
#ifdef EMBER_AVX512_BF16
  return dtype == at::kBFloat16 && (d == 64 || d == 128 || d == 256);
#else
  return false;
#endif
}

// The checks decode and prefill share: q [T, Hq, D] and the pools [num_blocks, block_size, Hkv, D], CPU, one float
// dtype, contiguous pools (read in place), Hq a multiple of Hkv.
void check_paged_pool(const char* fn, const torch::Tensor& q, const torch::Tensor& k_cache,
                      const torch::Tensor& v_cache) {
  using namespace ember_check;
  cpu(fn, "q", q);
  cpu(fn, "k_cache", k_cache);
  cpu(fn, "v_cache", v_cache);
  dtype_in(fn, "q", q, {at::kFloat, at::kBFloat16, at::kHalf});
  same_dtype(fn, "k_cache", k_cache, "q", q);
  same_dtype(fn, "v_cache", v_cache, "q", q);
  dims(fn, "q", q, 3, "[tokens, query_heads, head_dim]");
  dims(fn, "k_cache", k_cache, 4, "[num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), fn, ": v_cache must have k_cache's shape ", k_cache.sizes(),
              ", got ", v_cache.sizes());
  contiguous(fn, "k_cache", k_cache);
  contiguous(fn, "v_cache", v_cache);
  positive(fn, "block_size (k_cache.size(1))", k_cache.size(1));
  positive(fn, "kv_heads (k_cache.size(2))", k_cache.size(2));
  size(fn, "q", q, 2, k_cache.size(3), "k_cache's head_dim");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, fn, ": q's ", q.size(1), " query heads must be a multiple of the ",
              k_cache.size(2), " KV heads");
}

// Every block a sequence reads (the first ceil(len / block_size) of its table row) inside the pool, every length
// within its table: one pass over the small index tensors before any K/V row is addressed.
void check_block_tables(const char* fn, const int64_t* tables, const int64_t* lens, int64_t n, int64_t max_blocks,
                        int64_t bs, int64_t num_blocks) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = lens[i];
    TORCH_CHECK(len >= 0 && len <= max_blocks * bs, fn, ": context_lens[", i, "] = ", len, " is outside 0..",
                max_blocks * bs, " (", max_blocks, " table entries of ", bs, " tokens)");
    const int64_t* row = tables + i * max_blocks;
    for (int64_t j = 0, used = (len + bs - 1) / bs; j < used; ++j)
      TORCH_CHECK(row[j] >= 0 && row[j] < num_blocks, fn, ": block_tables[", i, ", ", j, "] = ", row[j],
                  " is outside the pool of ", num_blocks, " blocks");
  }
}

// q [nd, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [nd, max_blocks] int64;
// context_lens [nd] int64; window <= 0: full attention. Returns [nd, Hq, D]. invariant: each row computed exactly
// as paged_prefill_attention computes the same query (batch invariance); false: the bf16 decode kernel above,
// faster where the AVX512-BF16 kernels run, with its own order of operations.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t window,
                                     double scale, bool invariant) {
  check_paged_pool("paged_decode_attention", q, k_cache, v_cache);
  using namespace ember_check;
  constexpr const char* fn = "paged_decode_attention";
  cpu(fn, "block_tables", block_tables);
  cpu(fn, "context_lens", context_lens);
  dtype(fn, "block_tables", block_tables, torch::kLong);
  dtype(fn, "context_lens", context_lens, torch::kLong);
  dims(fn, "block_tables", block_tables, 2, "[num_queries, max_blocks]");
  size(fn, "block_tables", block_tables, 0, q.size(0), "one table a query");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == q.size(0), fn, ": context_lens must be [",
              q.size(0), "] (one length a query), got shape ", context_lens.sizes());
  q = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t nd = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t bs = k_cache.size(1), hkv = k_cache.size(2);
  const int64_t* lp = lens.data_ptr<int64_t>();
  check_block_tables(fn, tables.data_ptr<int64_t>(), lp, nd, tables.size(1), bs, k_cache.size(0));
#ifdef EMBER_AVX512_BF16
  if (avx512_attention(q.scalar_type(), d)) {
    const auto* qp = q.data_ptr<c10::BFloat16>();
    const auto *kp = k_cache.data_ptr<c10::BFloat16>(), *vp = v_cache.data_ptr<c10::BFloat16>();
    auto* op = out.data_ptr<c10::BFloat16>();
    if (invariant || d == 256) {  // no faster decode kernel for 256 (Gemma): the invariant one
      decode_bf16_invariant(qp, kp, vp, tables.data_ptr<int64_t>(), lp, op, nd, hq, hkv, d, bs, tables.size(1),
                            window, static_cast<float>(scale));
    } else if (d == 64) {
      decode_kernel_bf16<64>(qp, kp, vp, tables.data_ptr<int64_t>(), lp, op, nd, hq, hkv, bs, tables.size(1), window,
                             static_cast<float>(scale));
    } else {
      decode_kernel_bf16<128>(qp, kp, vp, tables.data_ptr<int64_t>(), lp, op, nd, hq, hkv, bs, tables.size(1), window,
                              static_cast<float>(scale));
    }
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    canon_decode<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                           tables.data_ptr<int64_t>(), lp, out.data_ptr<scalar_t>(), nd, hq, hkv, d, bs,
                           tables.size(1), window, static_cast<float>(scale));
  });
  return out;
}

// The portable prefill (dtypes and head sizes the AVX512-BF16 kernel does not take): q [L, Hq, D] at positions
// context_len - L .. context_len - 1, the chunk's K/V already in the pool. Returns [L, Hq, D].
torch::Tensor paged_prefill_attention_portable(const torch::Tensor& q, const torch::Tensor& k_cache,
                                               const torch::Tensor& v_cache, const torch::Tensor& table,
                                               int64_t context_len, int64_t window, double scale) {
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill_attention", [&] {
    canon_prefill<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            table.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), q.size(0), context_len, q.size(1),
                            k_cache.size(2), q.size(2), k_cache.size(1), window, static_cast<float>(scale));
  });
  return out;
}
