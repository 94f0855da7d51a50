// Paged prefill attention for CPU, bf16 with AVX512-BF16: a chunk's queries against every cached key of their
// sequence (earlier chunks and prefix-cache hits included), read from the block pool. torch's CPU flash attention
// ran W1's prompts at ~57 GFLOP/s on a machine whose bf16 matmuls reach ~414; here both products are register-blocked
// vdpbf16ps GEMM tiles, as in quant_gemm.cpp:
//   1. per KV head, the context's K is laid out as pairs along the head dimension for 16 keys at a time and V as
//      pairs of consecutive keys (the layouts vdpbf16ps reads), gathered from the pool once for all query heads;
//   2. per KV head and block of MR rows (its query heads at each position, position-major): S = Q K^T over 32 keys,
//      causal / window mask, online softmax, O += P V with P rounded to bf16 (as FlashAttention), key blocks past
//      the causal edge skipped.
// Decode (paged_decode_attention, invariant) runs the same two steps for its one query a sequence, its query heads
// as the rows: keys are visited in tiles of 32 from a multiple of 32, a row's operations do not depend on the other
// rows of its block, and the arithmetic is compiled in a fixed order, so a query's output is the same bits as a
// decode row, in a fresh prompt or in a chunk after cached context (a recomputed or prefix-cached token gets the K/V
// it had).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "avx512_util.h"
#include "checks.h"

#ifdef EMBER_AVX512_BF16
EMBER_FIXED_ORDER_BEGIN
namespace {

constexpr int64_t KB = 32;  // keys a step: two vectors of 16

// Keys j .. j + 15 (j a multiple of 16) of KV head h lying in one block, laid out as layout_kv does, with vector
// transposes: K's 16 rows of D / 2 words -> D / 2 vectors of one word (pair) from each key; V's key pairs
// interleaved element by element. row: the first key's (K and V) offset in the pools; jr: j's place in kt / vt.
template <int64_t D>
void layout16(const uint16_t* kc, const uint16_t* vc, int64_t row, int64_t row_stride, int64_t jr, uint32_t* kt,
              uint32_t* vt) {
  const uint32_t* kw = reinterpret_cast<const uint32_t*>(kc + row);
  uint32_t* kd = kt + (jr / 16) * (D / 2) * 16;
  for (int64_t c = 0; c < D / 32; ++c) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(kw + i * row_stride / 2 + 16 * c);
    ember_avx512::transpose16(r);
    for (int v = 0; v < 16; ++v) _mm512_storeu_si512(kd + (16 * c + v) * 16, r[v]);
  }
  for (int64_t p = 0; p < 8; ++p) {
    const uint16_t* a = vc + row + 2 * p * row_stride;
    uint32_t* vd = vt + (jr / 2 + p) * D;
    for (int64_t c = 0; c < D / 32; ++c) {
      const __m512i x = _mm512_loadu_si512(a + 32 * c), y = _mm512_loadu_si512(a + row_stride + 32 * c);
      // per 128-bit lane L: lo = elements 8L..8L+3 of x and y interleaved, hi = 8L+4..8L+7
      const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
      const __m512i t0 = _mm512_shuffle_i32x4(lo, hi, 0x44), t1 = _mm512_shuffle_i32x4(lo, hi, 0xEE);
      _mm512_storeu_si512(vd + 32 * c, _mm512_shuffle_i32x4(t0, t0, 0xD8));
      _mm512_storeu_si512(vd + 32 * c + 16, _mm512_shuffle_i32x4(t1, t1, 0xD8));
    }
  }
}

// kt[(jr / 16) * (D / 2) * 16 + dp * 16 + j % 16] = K[j] pair dp;  vt[(jr / 2) * D + x] = (V[j][x], V[j + 1][x]),
// keys [j0, j1) of KV head h, jr = j - key0 (the buffers start at key key0, a multiple of 32). Whole groups of 16
// keys in one block take the vector transposes (layout16), others go key by key. With `prefetch` the rows one block
// ahead are prefetched as keys are laid out: blocks lie anywhere in the pool, where the hardware prefetcher does not
// follow (decode_sequence prefetches its own).
// With that and work items of (KV head, 64 keys) in place of one KV head a thread, a 40-token chunk against 424
// cached tokens in scattered blocks (W2's shape, 9 / 3 heads, 2 threads) 0.170 -> 0.142 ms; 500 tokens against
// 1,500: 3.54 -> 3.41 ms (scalar layout; the vector transposes of whole groups of 16 are not measured yet).
template <int64_t D>
void layout_kv(const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t bs, int64_t hkv, int64_t h,
               int64_t S, int64_t key0, int64_t j0, int64_t j1, uint32_t* kt, uint32_t* vt, bool prefetch) {
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t jr = j - key0;
    if (jr % 16 == 0 && j + 16 <= ember_fixed::min(S, j1) && bs % 16 == 0) {
      if (prefetch && j + bs < S)
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t at = ((table[(j + bs) / bs] * bs + (j + i) % bs) * hkv + h) * D;
          for (int64_t b = 0; b < D * 2; b += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(kc + at) + b);
            __builtin_prefetch(reinterpret_cast<const char*>(vc + at) + b);
          }
        }
      layout16<D>(kc, vc, ((table[j / bs] * bs + j % bs) * hkv + h) * D, hkv * D, jr, kt, vt);
      j += 15;
      continue;
    }
    uint32_t* kd = kt + (jr / 16) * (D / 2) * 16 + jr % 16;
    uint16_t* vd = reinterpret_cast<uint16_t*>(vt + (jr / 2) * D) + (jr % 2);
    if (j < S) {
      if (prefetch && j + bs < S) {
        const int64_t at = ((table[(j + bs) / bs] * bs + j % bs) * hkv + h) * D;
        for (int64_t i = 0; i < D * 2; i += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(kc + at) + i);
          __builtin_prefetch(reinterpret_cast<const char*>(vc + at) + i);
        }
      }
      const int64_t row = ((table[j / bs] * bs + j % bs) * hkv + h) * D;
      const uint32_t* kr = reinterpret_cast<const uint32_t*>(kc + row);
      for (int64_t dp = 0; dp < D / 2; ++dp) kd[dp * 16] = kr[dp];
      const uint16_t* vr = vc + row;
      for (int64_t x = 0; x < D; ++x) vd[2 * x] = vr[x];
    } else {  // padding keys: zeros (masked out of the softmax)
      for (int64_t dp = 0; dp < D / 2; ++dp) kd[dp * 16] = 0;
      for (int64_t x = 0; x < D; ++x) vd[2 * x] = 0;
    }
  }
}

// Lines to prefetch a share at a time between pieces of work: a decode sequence's next chunk of K / V rows, into
// L2, a share before each pass of query heads over this chunk. Issued all at once, hundreds of prefetches overran the
// core's miss buffers; into L1 (T0) they gained nothing, the L1's miss buffers being what limits a core's reads; a
// few lines every few steps inside the tile loop cost the D = 128 loop a third of its speed from cache (measured:
// decode_sequence). At most MAX ranges (a chunk over more blocks prefetches its first ones: a hint only).
struct Ahead {
  static constexpr int MAX = 16;
  const char* at[MAX];
  int64_t left[MAX];  // bytes
  int n = 0, i = 0;
  void add(const void* p, int64_t bytes) {
    if (n < MAX && bytes > 0) {
      at[n] = static_cast<const char*>(p);
      left[n++] = bytes;
    }
  }
  void step(int lines) {
    for (; lines > 0 && i < n; --lines) {
      __builtin_prefetch(at[i], 0, 2);  // prefetcht1 on x86
      at[i] += 64;
      if ((left[i] -= 64) <= 0) ++i;
    }
  }
  void rest() { step(1 << 30); }
};

// The running state of up to MR query rows of one KV head: O (unnormalised), softmax max m and sum l, each row's
// query (qrow[r]) and position (pos[r], non-decreasing; rows past `rows` repeat the last). Kept between calls of
// attend_tiles, so that a decode step can attend each chunk of keys right after laying it out.
template <int64_t D, int MR>
struct RowState {
  __m512 o[MR][D / 16];
  float m[MR], l[MR];
  const uint32_t* qw[MR];
  int64_t pos[MR];
  int rows;
};

template <int64_t D, int MR>
void start_rows(RowState<D, MR>& st, const uint16_t* const* qrow, const int64_t* pos, int rows) {
  st.rows = rows;
  for (int r = 0; r < MR; ++r) {
    for (int64_t x = 0; x < D / 16; ++x) st.o[r][x] = _mm512_setzero_ps();
    st.m[r] = -std::numeric_limits<float>::infinity();
    st.l[r] = 0.f;
    st.qw[r] = reinterpret_cast<const uint32_t*>(qrow[ember_fixed::min(r, rows - 1)]);
    st.pos[r] = pos[ember_fixed::min(r, rows - 1)];
  }
}

// The rows against the key tiles of [t_lo, t_hi) (multiples of KB) that any of them may see, in key order, from
// keys laid out in kt / vt from key0 (a multiple of KB, <= t_lo). Calls over consecutive ranges do what one call
// over their union does, the same operations in the same order. A row's arithmetic does not depend on the other
// rows: key tiles past a row's position or before its window are masked out of it whole.
template <int64_t D, int MR>
void attend_tiles(RowState<D, MR>& st, const uint32_t* kt, const uint32_t* vt, int64_t key0, int64_t t_lo,
                  int64_t t_hi, int64_t S, int64_t window, float scale) {
  using namespace ember_avx512;
  constexpr int64_t NV = D / 16;
  // O in registers where MR x NV accumulators fit (D 64, 128); else (D 256) in memory, each vector loaded once a key
  // tile, rescaled and updated over the tile's 16 key pairs in registers: every element gets the same operations in
  // the same order either way
  constexpr bool in_registers = MR * NV <= 16;
  __m512 o[MR][NV];
  float m[MR], l[MR], corr_of[MR];
  const uint32_t* const* qw = st.qw;
  const int64_t* pos = st.pos;
  for (int r = 0; r < MR; ++r) {
    for (int64_t x = 0; x < NV; ++x) o[r][x] = st.o[r][x];
    m[r] = st.m[r];
    l[r] = st.l[r];
  }
  const int64_t p_first = pos[0], p_last = pos[MR - 1];
  const int64_t lo = window > 0 ? ember_fixed::max<int64_t>(0, p_first - window + 1) : 0;
  const int64_t hi = ember_fixed::min(ember_fixed::min(S, p_last + 1), t_hi);
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t k0 = ember_fixed::max(lo / KB * KB, t_lo); k0 < hi; k0 += KB) {
    __m512 s[MR][2];
    for (int r = 0; r < MR; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    const uint32_t* k_a = kt + ((k0 - key0) / 16) * (D / 2) * 16;
    const uint32_t* k_b = k_a + (D / 2) * 16;
    for (int64_t dp = 0; dp < D / 2; ++dp) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(k_a + dp * 16);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(k_b + dp * 16);
      for (int r = 0; r < MR; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[r][dp]));
        s[r][0] = _mm512_dpbf16_ps(s[r][0], a, b0);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], a, b1);
      }
    }
    alignas(64) uint32_t pw[MR][16];
    for (int r = 0; r < MR; ++r) {
      const int64_t p = pos[r];
      const __m512i first = _mm512_set1_epi32(static_cast<int>(window > 0 ? p - window + 1 : 0));
      const __m512i last = _mm512_set1_epi32(static_cast<int>(ember_fixed::min(p, S - 1)));
      __mmask16 valid[2];
      for (int j = 0; j < 2; ++j) {
        const __m512i kj = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(k0 + 16 * j)), iota);
        valid[j] = _mm512_cmple_epi32_mask(kj, last) & _mm512_cmpge_epi32_mask(kj, first);
        s[r][j] = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid[j],
                                     _mm512_mul_ps(s[r][j], _mm512_set1_ps(scale)));
      }
      const float mx = ember_fixed::max(_mm512_reduce_max_ps(s[r][0]), _mm512_reduce_max_ps(s[r][1]));
      const float m_new = ember_fixed::max(m[r], mx);
      if (m_new == -std::numeric_limits<float>::infinity()) {  // no visible key in this block for this row
        std::memset(pw[r], 0, sizeof(pw[r]));
        corr_of[r] = 1.f;  // x * 1 is x: O as it was
        continue;
      }
      const float corr = m[r] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[r] - m_new);
      const __m512 mv = _mm512_set1_ps(m_new);
      const __m512 p0 = _mm512_maskz_mov_ps(valid[0], exp_ps(_mm512_sub_ps(s[r][0], mv)));
      const __m512 p1 = _mm512_maskz_mov_ps(valid[1], exp_ps(_mm512_sub_ps(s[r][1], mv)));
      m[r] = m_new;
      l[r] = l[r] * corr + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      corr_of[r] = corr;
      if constexpr (in_registers) {
        const __m512 cv = _mm512_set1_ps(corr);
        for (int64_t x = 0; x < NV; ++x) o[r][x] = _mm512_mul_ps(o[r][x], cv);
      }
      _mm512_store_si512(pw[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));  // 32 bf16 in key order = 16 key pairs
    }
    const uint32_t* v0 = vt + ((k0 - key0) / 2) * D;
    if constexpr (in_registers) {
      for (int64_t kp = 0; kp < KB / 2; ++kp) {
        __m512bh b[NV];
        for (int64_t x = 0; x < NV; ++x) b[x] = (__m512bh)_mm512_loadu_si512(v0 + kp * D + 16 * x);
        for (int r = 0; r < MR; ++r) {
          const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[r][kp]));
          for (int64_t x = 0; x < NV; ++x) o[r][x] = _mm512_dpbf16_ps(o[r][x], a, b[x]);
        }
      }
    } else {
      for (int64_t x = 0; x < NV; ++x) {
        __m512 acc[MR];
        for (int r = 0; r < MR; ++r) acc[r] = _mm512_mul_ps(o[r][x], _mm512_set1_ps(corr_of[r]));
        for (int64_t kp = 0; kp < KB / 2; ++kp) {
          const __m512bh b = (__m512bh)_mm512_loadu_si512(v0 + kp * D + 16 * x);
          for (int r = 0; r < MR; ++r)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[r][kp])), b);
        }
        for (int r = 0; r < MR; ++r) o[r][x] = acc[r];
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int64_t x = 0; x < NV; ++x) st.o[r][x] = o[r][x];
    st.m[r] = m[r];
    st.l[r] = l[r];
  }
}

// O / l of the first `rows` rows, as bf16, to orow[r].
template <int64_t D, int MR>
void finish_rows(const RowState<D, MR>& st, c10::BFloat16* const* orow) {
  for (int r = 0; r < st.rows && r < MR; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / st.l[r]);
    for (int64_t x = 0; x < D / 16; ++x)
      _mm256_storeu_si256((__m256i*)(orow[r] + 16 * x),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(st.o[r][x], inv)));
  }
}

// Up to MR query rows of one KV head against all its laid-out keys (kt / vt from key0), written to orow[r].
template <int64_t D, int MR>
void attend_rows(const uint16_t* const* qrow, const int64_t* pos, int rows, const uint32_t* kt, const uint32_t* vt,
                 int64_t key0, int64_t S, int64_t window, float scale, c10::BFloat16* const* orow) {
  RowState<D, MR> st;
  start_rows(st, qrow, pos, rows);
  attend_tiles(st, kt, vt, key0, key0, (S + KB - 1) / KB * KB, S, window, scale);
  finish_rows(st, orow);
}

template <int64_t D>
constexpr int rows_a_pass() { return D == 128 ? 2 : 4; }  // D 64, 128: O in registers (MR x D/16 accumulators)

// Rows [r0, r1) of KV head kh's rows (its g query heads at each of the chunk's L positions, position-major: a
// drafted span of L tokens is ceil(L g / MR) passes instead of g ceil(L / MR)), MR at a time, against its keys laid
// out from key0.
template <int64_t D>
void attend_kv_rows(const uint16_t* qp, c10::BFloat16* op, int64_t hq, int64_t g, int64_t kh, int64_t L, int64_t S,
                    int64_t r0, int64_t r1, const uint32_t* kt, const uint32_t* vt, int64_t key0, int64_t window,
                    float scale) {
  constexpr int MR = rows_a_pass<D>();
  const uint16_t* qrow[MR];
  c10::BFloat16* orow[MR];
  int64_t pos[MR];
  for (int64_t p0 = r0; p0 < r1; p0 += MR) {
    const int rows = static_cast<int>(ember_fixed::min<int64_t>(MR, r1 - p0));
    for (int r = 0; r < rows; ++r) {
      const int64_t i = (p0 + r) / g, h = kh * g + (p0 + r) % g;
      qrow[r] = qp + (i * hq + h) * D;
      orow[r] = op + (i * hq + h) * D;
      pos[r] = S - L + i;
    }
    attend_rows<D, MR>(qrow, pos, rows, kt, vt, key0, S, window, scale, orow);
  }
}

// One sequence's L queries (positions S - L .. S - 1) in two parallel regions: its keys laid out in work items of (KV
// head, 64 keys) from the first its window needs, so that 1, 2 or 3 KV heads still split evenly over the threads
// (Gemma 3 270M's one KV head at batch 1 too); then its rows (each KV head's g query heads at each position) MR a
// task, round-robin: later rows see more keys (causal), so every thread gets early and late ones. Fewer rows a task
// does not pay: a pass computes MR rows whatever it holds (4 rows of head size 256 split 2 + 2: 24 -> 53 us).
template <int64_t D>
void attend_split(const uint16_t* kp, const uint16_t* vp, const int64_t* table, int64_t bs, int64_t hkv,
                  const uint16_t* qp, c10::BFloat16* op, int64_t hq, int64_t L, int64_t S, int64_t window,
                  float scale) {
  constexpr int MR = rows_a_pass<D>();
  const int64_t g = hq / hkv, rows_kv = L * g, S32 = (S + KB - 1) / KB * KB;
  const int64_t first = window > 0 ? ember_fixed::max<int64_t>(0, S - L - window + 1) : 0;
  const int64_t key0 = first / KB * KB, n = S32 - key0, spans = (n + 63) / 64;
  std::vector<uint32_t> kt(hkv * n * D / 2), vt(hkv * n / 2 * D);
  at::parallel_for(0, hkv * spans, 1, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t h = item / spans, j0 = key0 + item % spans * 64, j1 = ember_fixed::min(S32, j0 + 64);
      layout_kv<D>(kp, vp, table, bs, hkv, h, S, key0, j0, j1, kt.data() + h * n * D / 2, vt.data() + h * n / 2 * D,
                   true);
    }
  });
  const int64_t step = MR, tasks = hkv * ((rows_kv + step - 1) / step);
  const int64_t nt = ember_fixed::max<int64_t>(1, ember_fixed::min<int64_t>(at::get_num_threads(), tasks));
  at::parallel_for(0, nt, 1, [&](int64_t b, int64_t e) {
    for (int64_t tid = b; tid < e; ++tid)
      for (int64_t t = tid; t < tasks; t += nt) {
        const int64_t kh = t % hkv, r0 = t / hkv * step;
        attend_kv_rows<D>(qp, op, hq, g, kh, L, S, r0, ember_fixed::min(rows_kv, r0 + step),
                          kt.data() + kh * n * D / 2, vt.data() + kh * n / 2 * D, key0, window, scale);
      }
  });
}

// Chunks of up to SHORT_CHUNK tokens (a verify step's drafted span, a short chunk) run as decode does where there
// are at least as many KV heads as threads: a work item per KV head lays its keys out (from the first its window
// needs) and attends all its rows, one parallel region (3 heads on 2 threads split 2:1 and are still faster, below;
// other splits are not measured).
// Longer ones split the layout and the rows into finer work items, two regions. SmolLM2-135M's verify step (9 / 3
// heads, 256 keys, 30 layers' pools, 64 MB read between steps, 2 threads, AMD Zen 5, 2026-11-28; the rows grouped
// by KV head counted too): 5 tokens 0.76 -> 0.55 ms, 9 tokens 0.91 -> 0.77 (a decode step's 0.44); the same bits.
constexpr int64_t SHORT_CHUNK = 32;

template <int64_t D>
void prefill(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const int64_t* table,
             int64_t S, int64_t window, float scale, torch::Tensor& out) {
  constexpr int MR = rows_a_pass<D>();
  const int64_t L = q.size(0), hq = q.size(1), hkv = kc.size(2), bs = kc.size(1), g = hq / hkv;
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(kc.data_ptr<c10::BFloat16>());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(vc.data_ptr<c10::BFloat16>());
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t rows_kv = L * g, S32 = (S + KB - 1) / KB * KB;
  if (L <= SHORT_CHUNK && hkv >= at::get_num_threads()) {
    const int64_t first = window > 0 ? ember_fixed::max<int64_t>(0, S - L - window + 1) : 0;
    const int64_t key0 = first / KB * KB;
    at::parallel_for(0, hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint32_t> kt((S32 - key0) * D / 2), vt((S32 - key0) / 2 * D);
      for (int64_t kh = begin; kh < end; ++kh) {
        layout_kv<D>(kp, vp, table, bs, hkv, kh, S, key0, key0, S32, kt.data(), vt.data(), true);
        attend_kv_rows<D>(qp, op, hq, g, kh, L, S, 0, rows_kv, kt.data(), vt.data(), key0, window, scale);
      }
    });
    return;
  }
  attend_split<D>(kp, vp, table, bs, hkv, qp, op, hq, L, S, window, scale);
}

constexpr int64_t DECODE_CHUNK = 32;  // keys of every KV head a decode sequence lays out, then attends

// Where a decode sequence's keys lie: its block table, the first key its window needs (rounded down to KB), its length.
struct SeqKeys {
  const int64_t* table;
  int64_t key0, len;
};

inline SeqKeys seq_keys(const int64_t* table, int64_t len, int64_t window) {
  const int64_t first = window > 0 ? ember_fixed::max<int64_t>(0, len - window) : 0;
  return {table, first / KB * KB, len};
}

// The K and V rows (every KV head's: whole lines, in pool order) of keys [j0, min(j1, len)) of a sequence.
inline void add_rows(Ahead& ah, const uint16_t* kp, const uint16_t* vp, const SeqKeys& sk, int64_t bs,
                     int64_t row, int64_t j0, int64_t j1) {
  for (int64_t j = j0, end = ember_fixed::min(j1, sk.len); j < end;) {
    const int64_t n = ember_fixed::min(end, (j / bs + 1) * bs) - j;
    const int64_t at = (sk.table[j / bs] * bs + j % bs) * row;
    ah.add(kp + at, n * row * 2);
    ah.add(vp + at, n * row * 2);
    j += n;
  }
}

// One decode sequence, all its KV heads, a chunk of keys at a time: the chunk's keys (every KV head's) are laid out
// and then attended by every query head, the rows' state carried from chunk to chunk (attend_tiles: the same
// operations as one pass over all the keys), and while a chunk is attended the next one's rows are prefetched, a
// share before each pass (the next sequence's first chunk after the last: `next`, or null). One layout of all the
// keys and then the attention left the memory idle while it computed, and the reads a layout stalls on are short
// runs in scattered blocks, which the hardware prefetchers do not run ahead of. 64 sequences of 256 tokens, every
// layer's pools in scattered blocks, 2 threads, AMD Zen 4, interleaved with the kernel before: SmolLM2's 9 / 3 heads
// of 64 (30 layers) 33.2-33.4 -> 21.7-22.0 ms (the bf16 decode kernel's 19.2-19.4), Qwen2.5-1.5B's 12 / 2 of 128 (28
// layers) 38.9-39.4 -> 29.3-30.0 (28.2-28.5), Gemma 3's 4 / 1 of 256 (18 layers) 24.6 -> 16.5; laying out a chunk
// at a time without the prefetches, or prefetching into L1, changed nothing; 3 query heads a pass instead of 4 with
// one repeated: 24.7 -> 21.2 ms.
template <int64_t D, int MR>
void decode_sequence(const uint16_t* kp, const uint16_t* vp, const SeqKeys& sk, const SeqKeys* next, int64_t bs,
                     int64_t hkv, int64_t g, int64_t window, float scale, const uint16_t* qs, c10::BFloat16* os,
                     std::vector<uint32_t>& kt, std::vector<uint32_t>& vt, std::vector<RowState<D, MR>>& st) {
  constexpr int64_t CK = DECODE_CHUNK;
  const int64_t groups = (g + MR - 1) / MR, row = hkv * D, len = sk.len;
  const int burst = static_cast<int>((CK * row * 4 / 64 + hkv * groups - 1) / (hkv * groups));  // lines a pass
  const int64_t end_key = (len + KB - 1) / KB * KB;
  kt.resize(hkv * CK * D / 2);
  vt.resize(hkv * CK / 2 * D);
  st.resize(hkv * groups);
  const uint16_t* qrow[MR];
  int64_t pos[MR];
  for (int r = 0; r < MR; ++r) pos[r] = len - 1;
  for (int64_t h = 0; h < hkv; ++h)
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int rows = static_cast<int>(ember_fixed::min<int64_t>(MR, g - gi * MR));
      for (int r = 0; r < rows; ++r) qrow[r] = qs + (h * g + gi * MR + r) * D;
      start_rows(st[h * groups + gi], qrow, pos, rows);
    }
  for (int64_t c0 = sk.key0; c0 < end_key; c0 += CK) {
    const int64_t c1 = ember_fixed::min(c0 + CK, end_key);
    Ahead ah;
    if (c1 < len) add_rows(ah, kp, vp, sk, bs, row, c1, c1 + CK);
    else if (next != nullptr) add_rows(ah, kp, vp, *next, bs, row, next->key0, next->key0 + CK);
    for (int64_t h = 0; h < hkv; ++h)
      layout_kv<D>(kp, vp, sk.table, bs, hkv, h, len, c0, c0, c1, kt.data() + h * CK * D / 2,
                   vt.data() + h * CK / 2 * D, false);
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t gi = 0; gi < groups; ++gi) {
        ah.step(burst);
        attend_tiles(st[h * groups + gi], kt.data() + h * CK * D / 2, vt.data() + h * CK / 2 * D, c0, c0, c1, len,
                     window, scale);
      }
    ah.rest();
  }
  c10::BFloat16* orow[MR];
  for (int64_t h = 0; h < hkv; ++h)
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int rows = static_cast<int>(ember_fixed::min<int64_t>(MR, g - gi * MR));
      for (int r = 0; r < rows; ++r) orow[r] = os + (h * g + gi * MR + r) * D;
      finish_rows(st[h * groups + gi], orow);
    }
}

// Sequences [begin, end) of a decode batch, one after another on this thread (decode_sequence), MR query heads a pass.
template <int64_t D, int MR>
void decode_sequences(const uint16_t* kp, const uint16_t* vp, const int64_t* tables, const int64_t* lens,
                      const uint16_t* qp, c10::BFloat16* out, int64_t begin, int64_t end, int64_t hq, int64_t hkv,
                      int64_t bs, int64_t max_blocks, int64_t window, float scale) {
  std::vector<uint32_t> kt, vt;
  std::vector<RowState<D, MR>> st;
  for (int64_t s = begin; s < end; ++s) {
    c10::BFloat16* o = out + s * hq * D;
    if (lens[s] <= 0) {
      std::memset(static_cast<void*>(o), 0, sizeof(c10::BFloat16) * hq * D);
      continue;
    }
    const SeqKeys sk = seq_keys(tables + s * max_blocks, lens[s], window);
    SeqKeys nx;
    const bool has_next = s + 1 < end && lens[s + 1] > 0;
    if (has_next) nx = seq_keys(tables + (s + 1) * max_blocks, lens[s + 1], window);
    decode_sequence<D, MR>(kp, vp, sk, has_next ? &nx : nullptr, bs, hkv, hq / hkv, window, scale, qp + s * hq * D,
                           o, kt, vt, st);
  }
}

// One query a sequence: a sequence a work item where there are at least as many sequences as threads
// (decode_sequence), else each (sequence, KV head) a work item: its context laid out from the first key its window
// needs (rounded down to 32), then its query heads as the rows of attend_rows; fewer of those than threads: a
// sequence at a time, split as a prefill chunk is.
template <int64_t D>
void decode(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* tables,
            const int64_t* lens, c10::BFloat16* out, int64_t nd, int64_t hq, int64_t hkv, int64_t bs,
            int64_t max_blocks, int64_t window, float scale) {
  constexpr int MR = rows_a_pass<D>();
  const int64_t g = hq / hkv;
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(kc);
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(vc);
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q);
  if (nd * hkv < at::get_num_threads()) {  // fewer (sequence, KV head) items than threads: a sequence at a time
    for (int64_t s = 0; s < nd; ++s) {
      c10::BFloat16* o = out + s * hq * D;
      if (lens[s] <= 0) std::memset(static_cast<void*>(o), 0, sizeof(c10::BFloat16) * hq * D);
      else attend_split<D>(kp, vp, tables + s * max_blocks, bs, hkv, qp + s * hq * D, o, hq, 1, lens[s], window, scale);
    }
    return;
  }
  if (nd >= at::get_num_threads()) {
    // fewer query heads a KV head than a pass takes (SmolLM2's 3 of D 64): passes of that many, not MR with the
    // last repeated (a row's operations do not depend on the rows beside it; D 256 keeps its MR: O in memory)
    const int mr = D <= 128 && g < MR ? static_cast<int>(g) : MR;
    at::parallel_for(0, nd, 1, [&](int64_t begin, int64_t end) {
      const auto run = [&](auto rows) {
        decode_sequences<D, decltype(rows)::value>(kp, vp, tables, lens, qp, out, begin, end, hq, hkv, bs,
                                                   max_blocks, window, scale);
      };
      switch (mr) {
        case 1: run(std::integral_constant<int, 1>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        case 3: run(std::integral_constant<int, 3>{}); break;
        default: run(std::integral_constant<int, MR>{});
      }
    });
    return;
  }
  at::parallel_for(0, nd * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> kt, vt;
    int64_t pos[MR];
    const uint16_t* qrow[MR];
    c10::BFloat16* orow[MR];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / hkv, h = item % hkv, len = lens[s];
      c10::BFloat16* o = out + (s * hq + h * g) * D;
      if (len <= 0) {  // nothing to attend to (a padding row)
        std::memset(static_cast<void*>(o), 0, sizeof(c10::BFloat16) * g * D);
        continue;
      }
      const int64_t key0 = seq_keys(tables + s * max_blocks, len, window).key0, end_key = (len + KB - 1) / KB * KB;
      kt.resize((end_key - key0) * D / 2);
      vt.resize((end_key - key0) / 2 * D);
      layout_kv<D>(kp, vp, tables + s * max_blocks, bs, hkv, h, len, key0, key0, end_key, kt.data(), vt.data(),
                   true);
      for (int r = 0; r < MR; ++r) pos[r] = len - 1;
      const uint16_t* qh = qp + (s * hq + h * g) * D;
      for (int64_t r0 = 0; r0 < g; r0 += MR) {
        const int rows = static_cast<int>(ember_fixed::min<int64_t>(MR, g - r0));
        for (int r = 0; r < rows; ++r) {
          qrow[r] = qh + (r0 + r) * D;
          orow[r] = o + (r0 + r) * D;
        }
        attend_rows<D, MR>(qrow, pos, rows, kt.data(), vt.data(), key0, len, window, scale, orow);
      }
    }
  });
}

}  // namespace
EMBER_FIXED_ORDER_END

void decode_bf16_invariant(const c10::BFloat16* q, const c10::BFloat16* kc, const c10::BFloat16* vc,
                           const int64_t* tables, const int64_t* lens, c10::BFloat16* out, int64_t nd, int64_t hq,
                           int64_t hkv, int64_t d, int64_t bs, int64_t max_blocks, int64_t window, float scale) {
  if (d == 64) decode<64>(q, kc, vc, tables, lens, out, nd, hq, hkv, bs, max_blocks, window, scale);
  else if (d == 128) decode<128>(q, kc, vc, tables, lens, out, nd, hq, hkv, bs, max_blocks, window, scale);
  else decode<256>(q, kc, vc, tables, lens, out, nd, hq, hkv, bs, max_blocks, window, scale);
}
#endif

bool avx512_attention(at::ScalarType dtype, int64_t d);
void check_paged_pool(const char* fn, const torch::Tensor& q, const torch::Tensor& k_cache,
                      const torch::Tensor& v_cache);
torch::Tensor paged_prefill_attention_portable(const torch::Tensor& q, const torch::Tensor& k_cache,
                                               const torch::Tensor& v_cache, const torch::Tensor& table,
                                               int64_t context_len, int64_t window, double scale);

// q [L, Hq, D]: the chunk's queries, at positions context_len - L .. context_len - 1; k_cache/v_cache
// [num_blocks, block_size, Hkv, D] in q's dtype with the chunk's K/V already written; block_table
// [>= ceil(context_len / bs)]; window <= 0: full causal attention. Returns [L, Hq, D]. bf16 with head size 64, 128
// or 256 on an AVX512-BF16 build runs the kernel above, everything else the portable one (paged_attention.cpp); each
// computes a query exactly as paged_decode_attention (invariant) does.
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_table, int64_t context_len, int64_t window, double scale) {
  constexpr const char* fn = "paged_prefill_attention";
  check_paged_pool(fn, q, k_cache, v_cache);
  ember_check::cpu(fn, "block_table", block_table);
  ember_check::dtype(fn, "block_table", block_table, torch::kLong);
  ember_check::dims(fn, "block_table", block_table, 1, "[blocks]");
  const int64_t D = q.size(2), bs = k_cache.size(1), num_blocks = k_cache.size(0);
  TORCH_CHECK(context_len >= q.size(0) && context_len <= block_table.numel() * bs, fn, ": context_len = ",
              context_len, " must cover the chunk's ", q.size(0), " queries and fit the block table's ",
              block_table.numel(), " blocks of ", bs, " tokens");
  q = q.contiguous();
  auto table = block_table.contiguous();
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t i = 0, used = (context_len + bs - 1) / bs; i < used; ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < num_blocks, fn, ": block_table[", i, "] = ", tp[i], " is outside the pool of ",
                num_blocks, " blocks");
  if (!avx512_attention(q.scalar_type(), D))
    return paged_prefill_attention_portable(q, k_cache, v_cache, table, context_len, window, scale);
#ifdef EMBER_AVX512_BF16
  auto out = torch::empty_like(q);
  if (D == 64)
    prefill<64>(q, k_cache, v_cache, tp, context_len, window, static_cast<float>(scale), out);
  else if (D == 128)
    prefill<128>(q, k_cache, v_cache, tp, context_len, window, static_cast<float>(scale), out);
  else
    prefill<256>(q, k_cache, v_cache, tp, context_len, window, static_cast<float>(scale), out);
  return out;
#else
  return torch::Tensor();  // not reached: avx512_attention is false without the build
#endif
}
