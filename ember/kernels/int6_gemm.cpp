// int6: GGUF Q6_K's 6-bit weights as they are stored, w = d * sc * (q - 32) with q 0..63, an int8 sc per 16
// values and an f16 d per 256, for CPU: y[M, N] = x[M, K] (bf16) . W^T, the packed form the only copy of the
// weight. The values enter AVX512-BF16 dot products as exact bf16 integers (128 + q) and each group of 16's sum is
// scaled by d * sc in float32 (exact), so w is never rounded. Batch invariant by default: a row's chain is the same
// at every row count (passes of up to INV_PASS rows a block); with invariant=False, from INT4_PANEL_MIN_ROWS rows,
// quant_blocks.h's bf16 panel (w rounded to bf16 once). Needs AVX512-VBMI besides AVX512-BF16 (the unpack's byte
// permutations and multishifts), which every CPU with AVX512-BF16 but Cooper Lake has: has_int6().
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "avx512_util.h"
#include "checks.h"
#include "quant_blocks.h"

#if defined(EMBER_AVX512_BF16) && defined(EMBER_AVX512_VBMI)
EMBER_FIXED_ORDER_BEGIN
namespace {

using namespace ember_quant;

// One stream a 64-row block, super-block after super-block (INT6_SUPER_BYTES each): the block's 64 d as float32,
// then its 16 x 64 int8 sc, then 128 pairs of inputs of 96 bytes, 6 bits a value: the pair (k, k + 1) of columns
// 16j + 2t and 16j + 2t + 1 in the 24 bits at byte 24j + 3t, value i (column 16j + 2t + i / 2, input k + i % 2) in
// bits 6i..6i+5. 6.625 bits a weight against int8's 8 (a scale a row), and d * sc exact in float32, so w is the
// file's value.
constexpr int64_t INT6_PAIR_BYTES = 96, INT6_SUPER_BYTES = 64 * 4 + 16 * 64 + 128 * INT6_PAIR_BYTES;
// besides int4's prefetch into L1, a super-block's worth ahead into L2: one row through 1536 x 8960 and 17920 x 1536
// weights from memory (2 threads, AMD Zen 4, 2026-11-29, 9 interleaved rounds in one process): 0.535 -> 0.413 and
// 0.976 -> 0.803 ms (8 KB ahead 0.446 / 0.833, 16 KB 0.445 / 0.846). int4's kernel gained nothing from it.
constexpr int64_t INT6_PREFETCH_L2 = 12288;
constexpr int64_t INT6_HALF_PASS = 12;  // rows a pass at most: 7 to 12 rows run two passes over half the columns

// A pair step's 96 bytes -> b[j] as int4_unpack makes them (lane c: 128 + q of column 16j + c at inputs k, k + 1 as a
// bf16 pair): a byte permutation puts each 64-bit lane's 24 bits in its low 3 bytes, a multishift moves value i to
// byte 2i, and a mask with an OR makes 0x4300 | q (128 + q, exact). Three instructions a vector, as int4's.
struct Int6Consts {
  __m512i idx[4], shifts, keep, magic;
  Int6Consts() {
    alignas(64) uint8_t ix[4][64], sh[64];
    for (int j = 0; j < 4; ++j)
      for (int t = 0; t < 8; ++t)
        for (int i = 0; i < 8; ++i)  // vectors 2 and 3 come from the 64 bytes at p + 32
          ix[j][8 * t + i] = static_cast<uint8_t>(24 * j + 3 * t + (i < 3 ? i : 0) - (j < 2 ? 0 : 32));
    for (int t = 0; t < 8; ++t)
      for (int i = 0; i < 8; ++i) sh[8 * t + i] = static_cast<uint8_t>(6 * (i / 2));
    for (int j = 0; j < 4; ++j) idx[j] = _mm512_load_si512(ix[j]);
    shifts = _mm512_load_si512(sh);
    keep = _mm512_set1_epi32(0x003F003F);
    magic = _mm512_set1_epi32(0x43004300);
  }
};

// vectors J0 .. J0 + NJ - 1 of a pair step (b[0] is vector J0): 0 and 1 read the 64 bytes at p, 2 and 3 those at p + 32
template <int J0 = 0, int NJ = 4>
inline void int6_unpack(const Int6Consts& c, const uint8_t* p, __m512i b[NJ]) {
  const __m512i v0 = _mm512_loadu_si512(p + (J0 < 2 ? 0 : 32)), v1 = _mm512_loadu_si512(p + 32);
  for (int j = J0; j < J0 + NJ; ++j) {
    const __m512i v = _mm512_permutexvar_epi8(c.idx[j], j < 2 || J0 >= 2 ? v0 : v1);
    b[j - J0] = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(c.shifts, v), c.keep, c.magic, 0xEA);
  }
}

// a block's super-block s: its d (64 float32), its sc (16 groups x 64 int8), then its 128 pairs' values
struct Int6Super {
  const float* d;
  const int8_t* sc;
  const uint8_t* q;
  Int6Super(const uint8_t* blk, int64_t s)
      : d(reinterpret_cast<const float*>(blk + s * INT6_SUPER_BYTES)),
        sc(reinterpret_cast<const int8_t*>(blk + s * INT6_SUPER_BYTES + 256)),
        q(blk + s * INT6_SUPER_BYTES + 256 + 1024) {}
  // d * sc of group g, columns 16j..16j+15: exact in float32 (an 11-bit f16 times an 8-bit integer)
  __m512 scale(int64_t g, int j) const {
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g * 64 + 16 * j)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_loadu_ps(d + 16 * j));
  }
};

// y[0 : R, 16 J0 : 16 (J0 + NJ)] of one block: a chain of 8 pair steps a group of 16 from -160 * xsum, times d * sc
// added to the output's total (the unpacked values are 128 + q: w = (128 + q - 160) d sc). xoff[r * groups + g] =
// -160 * the row's sum over group g. Each output's chain is the same at every R, J0 and NJ: more rows a pass over
// half the columns (NJ = 2) unpack each pair step once for twice the rows.
template <int R, int J0 = 0, int NJ = 4, typename T>
inline void int6_block_rows(const Int6Consts& c, const int32_t* xw, int64_t kw, const float* xoff, int64_t supers,
                            const uint8_t* blk, int64_t N, T* y) {
  __m512 acc[R][NJ];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const Int6Super sup(blk, s);
    for (int64_t g = 0; g < 16; ++g) {
      const int64_t gg = s * 16 + g;
      __m512 part[R][NJ];  // each chain starts at the group's offset term: no add after it
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NJ; ++j) part[r][j] = _mm512_set1_ps(xoff[r * supers * 16 + gg]);
      for (int64_t t = 0; t < 8; ++t) {
        const int64_t kl = g * 8 + t, kp = s * 128 + kl;
        const uint8_t* p = sup.q + kl * INT6_PAIR_BYTES;
        for (int64_t ahead : {INT4_PREFETCH, INT4_PREFETCH + 64})  // 96 bytes a step: 1.5 lines
          _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
        for (int64_t ahead : {INT6_PREFETCH_L2, INT6_PREFETCH_L2 + 64})
          _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T1);
        __m512i b[NJ];
        int6_unpack<J0, NJ>(c, p, b);
        for (int r = 0; r < R; ++r) {
          const __m512bh a = (__m512bh)_mm512_set1_epi32(xw[r * kw + kp]);
          for (int j = 0; j < NJ; ++j) part[r][j] = _mm512_dpbf16_ps(part[r][j], a, (__m512bh)b[j]);
        }
      }
      for (int j = 0; j < NJ; ++j) {
        const __m512 scale = sup.scale(g, J0 + j);
        for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(part[r][j], scale, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NJ; ++j)
      if constexpr (std::is_same_v<T, float>)  // logits
        _mm512_storeu_ps(y + r * N + 16 * (J0 + j), acc[r][j]);
      else
        _mm256_storeu_si256((__m256i*)(y + r * N + 16 * (J0 + j)), (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

// rows 7..12 of a pass: the block's two column halves in turn
template <int R, typename T>
inline void int6_half_passes(const Int6Consts& c, const int32_t* xw, int64_t kw, const float* xoff, int64_t supers,
                             const uint8_t* blk, int64_t N, T* y) {
  int6_block_rows<R, 0, 2>(c, xw, kw, xoff, supers, blk, N, y);
  int6_block_rows<R, 2, 2>(c, xw, kw, xoff, supers, blk, N, y);
}

// a block's weights as bf16 pairs (the panel path, non-invariant from INT4_PANEL_MIN_ROWS rows): (q - 32) d sc,
// exact in float32, rounded once to bf16
void int6_panel(const Int6Consts& c, const uint8_t* blk, int64_t supers, uint32_t* panel) {
  const PanelStore store;
  for (int64_t s = 0; s < supers; ++s) {
    const Int6Super sup(blk, s);
    for (int64_t g = 0; g < 16; ++g) {
      __m512 scale[4], off[4];
      for (int j = 0; j < 4; ++j) {
        scale[j] = sup.scale(g, j);
        off[j] = _mm512_mul_ps(_mm512_set1_ps(-160.f), scale[j]);
      }
      for (int64_t t = 0; t < 8; ++t) {
        const int64_t kl = g * 8 + t;
        __m512i b[4];
        int6_unpack(c, sup.q + kl * INT6_PAIR_BYTES, b);
        store(b, scale, off, panel + (s * 128 + kl) * NB);
      }
    }
  }
}

// every row in passes of up to INV_PASS rows against each block (work items: a block and a span of ROW_SPAN rows)
template <typename T>
void int6_rows(const c10::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* y) {
  const int64_t supers = K / 256, groups = K / 16, kw = K / 2;
  std::vector<float> xoff = group_sums(x, M, K, 16);
  for (float& v : xoff) v *= -160.f;
  const int32_t* xw = reinterpret_cast<const int32_t*>(x);
  block_spans<Int6Consts>(N, M, [&](const Int6Consts& c, int64_t nb, int64_t m0, int64_t m1) {
    const uint8_t* blk = w + nb * supers * INT6_SUPER_BYTES;
    for (int64_t m = m0, rows; m < m1; m += rows) {
      rows = ember_fixed::min<int64_t>(INT6_HALF_PASS, m1 - m);
      const int32_t* xr = xw + m * kw;
      const float* orow = xoff.data() + m * groups;
      T* yr = y + m * N + nb * NB;
      switch (rows) {
        case 1: int6_block_rows<1>(c, xr, kw, orow, supers, blk, N, yr); break;
        case 2: int6_block_rows<2>(c, xr, kw, orow, supers, blk, N, yr); break;
        case 3: int6_block_rows<3>(c, xr, kw, orow, supers, blk, N, yr); break;
        case 4: int6_block_rows<4>(c, xr, kw, orow, supers, blk, N, yr); break;
        case 5: int6_block_rows<5>(c, xr, kw, orow, supers, blk, N, yr); break;
        case 6: int6_block_rows<6>(c, xr, kw, orow, supers, blk, N, yr); break;
        case 7: int6_half_passes<7>(c, xr, kw, orow, supers, blk, N, yr); break;
        case 8: int6_half_passes<8>(c, xr, kw, orow, supers, blk, N, yr); break;
        case 9: int6_half_passes<9>(c, xr, kw, orow, supers, blk, N, yr); break;
        case 10: int6_half_passes<10>(c, xr, kw, orow, supers, blk, N, yr); break;
        case 11: int6_half_passes<11>(c, xr, kw, orow, supers, blk, N, yr); break;
        default: int6_half_passes<12>(c, xr, kw, orow, supers, blk, N, yr); break;
      }
    }
  });
}

}  // namespace
EMBER_FIXED_ORDER_END
#endif

bool has_int6() {
#if defined(EMBER_AVX512_BF16) && defined(EMBER_AVX512_VBMI)
  return true;
#else
  return false;
#endif
}

// x bf16 [M, K]; w uint8 [N/64, K/256, INT6_SUPER_BYTES] (ember.quantization.kernels.pack_cpu_int6: a 64-row block's
// super-blocks one after another). Returns bf16 [M, N], or float32 with float_out (logits: the sums not rounded to
// bf16; the panel's bf16 widened). invariant: no bf16 panel from 128 rows (the same chain at every row count).
torch::Tensor int6_gemm(torch::Tensor x, torch::Tensor w, bool invariant, bool float_out) {
#if defined(EMBER_AVX512_BF16) && defined(EMBER_AVX512_VBMI)
  using namespace ember_check;
  constexpr const char* fn = "int6_gemm";
  cpu(fn, "x", x);
  cpu(fn, "w", w);
  dtype(fn, "x", x, at::kBFloat16);
  dtype(fn, "w", w, at::kByte);
  dims(fn, "x", x, 2, "[M, K]");
  dims(fn, "w", w, 3, "[N/64, K/256, super-block bytes]");
  size(fn, "w", w, 2, INT6_SUPER_BYTES, "the bytes of a 64-row block's super-block");
  x = x.contiguous();
  const int64_t K = x.size(1), N = w.size(0) * NB;
  TORCH_CHECK(K % 256 == 0, fn, ": x's K = ", K, " must be a multiple of 256 (super-blocks of 256 inputs)");
  size(fn, "w", w, 1, K / 256, "K / 256 from x");
  auto wc = w.contiguous();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  const auto out = x.options().dtype(float_out ? at::kFloat : at::kBFloat16);
  if (x.size(0) == 0) return torch::empty({0, N}, out);
  const int64_t supers = K / 256;
  if (!invariant && x.size(0) >= INT4_PANEL_MIN_ROWS) {
    const Int6Consts c;
    auto y = panel_gemm(x, N, [&](int64_t nb, uint32_t* panel) {
      int6_panel(c, wp + nb * supers * INT6_SUPER_BYTES, supers, panel);
    }, [](int64_t) -> const float* { return nullptr; });
    return float_out ? y.to(at::kFloat) : y;
  }
  auto y = torch::empty({x.size(0), N}, out);
  if (float_out)
    int6_rows(x.data_ptr<c10::BFloat16>(), x.size(0), K, wp, N, y.data_ptr<float>());
  else
    int6_rows(x.data_ptr<c10::BFloat16>(), x.size(0), K, wp, N, y.data_ptr<c10::BFloat16>());
  return y;
#else
  TORCH_CHECK(false, "int6_gemm needs AVX512-BF16 and AVX512-VBMI (has_int6())");
#endif
}
