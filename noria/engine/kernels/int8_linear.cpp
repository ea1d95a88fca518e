// Weight-only int8 linear on the CPU (engine.quantization: int8, noria/engine/quant.py). Built into
// the same extension as paged_attention.cpp.
//
//   y[m, n] = T(bf16(scale[n] * sum_k bf16(x[m, k]) * q[n, k]))
//
// x [M, K] bf16 or fp32 (T, the output's dtype), q int8 codes, scale fp32 (bf16 values) per output
// channel: the activations are rounded to bf16 and the result to bf16 whatever x's dtype (the recipe
// quant.py defines), the products are exact and accumulate in fp32.
//
// Weight layout ("packed"): [N / 16, K / 2, 32] int8, blocks of 16 output channels, and in a block
// each pair of input channels (k, k + 1) as 16 x (q[n, k], q[n, k + 1]). One 32-byte load is so a
// k-pair of 16 channels, the operand layout of AVX512_BF16's vdpbf16ps, and a broadcast of the
// activation pair (x[m, k], x[m, k + 1]) multiplies it (outer-product form: one accumulator vector
// per row and 16 channels, no horizontal sums).
//
// Paths (int8_linear's `path`; 0 picks the first that runs here):
//   1 avx512_bf16: int8 -> fp32 -> bf16 in registers (exact), vdpbf16ps; tiles of 12 rows x 32
//     channels. Needs an AVX-512 build and a CPU with AVX512_BF16 (checked at run time).
//   2 fma: int8 -> fp32, vfmadd on 8-float vectors (AVX2 + FMA); lanes hold a channel's even and odd
//     k, added at the end. Up to 3 rows: tiles of 3 rows x 16 channels converting as they read; more:
//     the block converted once, then tiles of 6 rows x 8 channels (15 of AVX2's 16 registers).
//   3 scalar: the portable loop (baseline builds; a reference).
// Every weight block is read from memory once per call: a call with more rows than one tile first
// converts the block (bf16 or fp32) into a per-thread buffer that all its row tiles then read.
// Threads split the output channels (at::parallel_for over blocks). Each output's sum runs over k
// in the same order whatever M is and whichever tile holds its row: batch-invariant within a path.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#if defined(__x86_64__) && (defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512))
#include <immintrin.h>
#define NORIA_INT8_FMA 1
#endif
#if defined(__x86_64__) && defined(CPU_CAPABILITY_AVX512)
#define NORIA_INT8_BF16 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using BF = c10::BFloat16;
constexpr int64_t kBlock = 16;  // output channels per packed block

inline float round_bf16(float v) { return static_cast<float>(BF(v)); }

// Activations as fp32 holding bf16 values, [M, K] (the fma and scalar paths).
std::vector<float> bf16_rounded_rows(const at::Tensor& x) {
  const int64_t n = x.numel();
  std::vector<float> out(n);
  if (x.scalar_type() == at::kBFloat16) {
    const BF* p = x.data_ptr<BF>();
    at::parallel_for(0, n, 4096, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) out[i] = static_cast<float>(p[i]);
    });
  } else {
    const float* p = x.data_ptr<float>();
    at::parallel_for(0, n, 4096, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) out[i] = round_bf16(p[i]);
    });
  }
  return out;
}

// The fp32 paths' frame: run(xf, out) gets x as fp32 rows of bf16 values and writes fp32 [M, N]
// results (bf16 values) that land in y, in x's dtype.
template <typename Run>
void via_f32_rows(const at::Tensor& x, at::Tensor& y, int64_t M, int64_t N, Run run) {
  const std::vector<float> xf = bf16_rounded_rows(x);
  const bool f32 = x.scalar_type() == at::kFloat;
  std::vector<float> yf(f32 ? 0 : M * N);
  run(xf.data(), f32 ? y.data_ptr<float>() : yf.data());
  if (!f32) {
    BF* yb = y.data_ptr<BF>();
    for (int64_t i = 0; i < M * N; ++i) yb[i] = BF(yf[i]);  // exact: yf holds bf16 values
  }
}

// ------------------------------------------------------------------------------------- scalar

void scalar_path(const float* x, const int8_t* w, const float* scale, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t KP = K / 2;
  at::parallel_for(0, N / kBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int8_t* wb = w + b * KP * 2 * kBlock;
      for (int64_t m = 0; m < M; ++m) {
        float acc[kBlock] = {0.f};
        const float* xr = x + m * K;
        for (int64_t p = 0; p < KP; ++p)
          for (int64_t c = 0; c < kBlock; ++c)
            acc[c] += xr[2 * p] * wb[p * 32 + 2 * c] + xr[2 * p + 1] * wb[p * 32 + 2 * c + 1];
        for (int64_t c = 0; c < kBlock; ++c) y[m * N + b * kBlock + c] = round_bf16(acc[c] * scale[b * kBlock + c]);
      }
    }
  });
}

// ------------------------------------------------------------------------------------- fma (AVX2)

#ifdef NORIA_INT8_FMA
constexpr int kFmaRows = 3;  // 12 accumulators + 3 broadcasts + 1 weight vector: AVX2's 16 registers

// The 4 fp32 vectors of a k-pair of 16 channels (lanes: c, c, c+1, c+1, ... for k, k+1).
inline void load_pair_fma(const int8_t* p, __m256 (&w)[4]) {
  for (int q = 0; q < 4; ++q)
    w[q] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * q))));
}

// (x[k], x[k + 1]) in every pair of lanes. Loaded as a double through memcpy: a load through a double
// pointer may alias the accumulators (vector types alias everything), and GCC then stored every
// accumulator to the stack after each multiply-add (half the rate, measured).
inline __m256 pair_fma(const float* p) {
  double pair;
  std::memcpy(&pair, p, sizeof pair);
  return _mm256_castpd_ps(_mm256_set1_pd(pair));
}

inline __m256 round_bf16_fma(__m256 v) {  // round to nearest even, as torch; NaN stays NaN
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
}

// Rows [0, R) of one block: x rows at x (stride K), weights int8 (packed), converted as they are read.
template <int R>
void tile_fma(const float* x, int64_t K, const int8_t* w8, const float* scale, float* y, int64_t N) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = _mm256_setzero_ps();
  const int64_t KP = K / 2;
  for (int64_t p = 0; p < KP; ++p) {
    __m256 xb[R];
    for (int r = 0; r < R; ++r)
      xb[r] = pair_fma(x + r * K + 2 * p);
    __m256 w[4];
    load_pair_fma(w8 + p * 32, w);
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < 4; ++q) acc[r][q] = _mm256_fmadd_ps(w[q], xb[r], acc[r][q]);
  }
  const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
  for (int r = 0; r < R; ++r) {
    // hadd(a, b) = a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, ...: channels 0 1 4 5 2 3 6 7, then in order
    const __m256 c0 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(acc[r][0], acc[r][1])), 0xD8));
    const __m256 c1 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(acc[r][2], acc[r][3])), 0xD8));
    _mm256_storeu_ps(y + r * N, round_bf16_fma(_mm256_mul_ps(c0, s0)));
    _mm256_storeu_ps(y + r * N + 8, round_bf16_fma(_mm256_mul_ps(c1, s1)));
  }
}

// At most kFmaRows rows, the block's codes converted as they are read.
void rows_fma(const float* x, int64_t M, int64_t K, const int8_t* w8, const float* scale, float* y, int64_t N) {
  static_assert(kFmaRows == 3, "1 to 3 rows");
  if (M == 3) tile_fma<3>(x, K, w8, scale, y, N);
  if (M == 2) tile_fma<2>(x, K, w8, scale, y, N);
  if (M == 1) tile_fma<1>(x, K, w8, scale, y, N);
}

// Rows [0, R) of half a converted block (8 channels: its vectors 2h and 2h + 1): 2R accumulators,
// 2 weight vectors and a broadcast in AVX2's 16 registers, so R = 6 rows share each weight load
// (tile_fma's 3 rows x 16 channels hold 19 values). Every lane sums in the same order as
// tile_fma's, and the same add and permute end it: the same bits for a row, whichever tile holds it.
template <int R>
void half_tile_fma(const float* x, int64_t K, const float* wf, const float* scale, float* y, int64_t N) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t KP = K / 2;
  for (int64_t p = 0; p < KP; ++p) {
    const __m256 w0 = _mm256_loadu_ps(wf + p * 32), w1 = _mm256_loadu_ps(wf + p * 32 + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = pair_fma(x + r * K + 2 * p);
      acc[r][0] = _mm256_fmadd_ps(w0, xb, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, xb, acc[r][1]);
    }
  }
  const __m256 s = _mm256_loadu_ps(scale);
  for (int r = 0; r < R; ++r) {
    const __m256 c = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(acc[r][0], acc[r][1])), 0xD8));
    _mm256_storeu_ps(y + r * N, round_bf16_fma(_mm256_mul_ps(c, s)));
  }
}

// Rows [0, M) of a converted block: 6-row tiles of each half, then the last rows.
void half_rows_fma(const float* x, int64_t M, int64_t K, const float* wf, const float* scale, float* y, int64_t N) {
  for (int h = 0; h < 2; ++h) {
    const float* w = wf + 16 * h;
    const float* s = scale + 8 * h;
    float* out = y + 8 * h;
    int64_t m = 0;
    for (; m + 6 <= M; m += 6) half_tile_fma<6>(x + m * K, K, w, s, out + m * N, N);
    switch (M - m) {
      case 5: half_tile_fma<5>(x + m * K, K, w, s, out + m * N, N); break;
      case 4: half_tile_fma<4>(x + m * K, K, w, s, out + m * N, N); break;
      case 3: half_tile_fma<3>(x + m * K, K, w, s, out + m * N, N); break;
      case 2: half_tile_fma<2>(x + m * K, K, w, s, out + m * N, N); break;
      case 1: half_tile_fma<1>(x + m * K, K, w, s, out + m * N, N); break;
      default: break;
    }
  }
}

void fma_path(const float* x, const int8_t* w, const float* scale, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t KP = K / 2;
  at::parallel_for(0, N / kBlock, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(M > kFmaRows ? KP * 32 : 0);
    for (int64_t b = b0; b < b1; ++b) {
      const int8_t* wb = w + b * KP * 32;
      if (M <= kFmaRows) {
        rows_fma(x, M, K, wb, scale + b * kBlock, y + b * kBlock, N);
        continue;
      }
      for (int64_t p = 0; p < KP; ++p) {  // the block once, as fp32, for every row tile
        __m256 v[4];
        load_pair_fma(wb + p * 32, v);
        for (int q = 0; q < 4; ++q) _mm256_storeu_ps(buf.data() + p * 32 + 8 * q, v[q]);
      }
      half_rows_fma(x, M, K, buf.data(), scale + b * kBlock, y + b * kBlock, N);
    }
  });
}
#endif

// ------------------------------------------------------------------------------------- avx512_bf16

#ifdef NORIA_INT8_BF16
#define NORIA_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
constexpr int kBfRows = 12;

NORIA_BF16_TARGET inline __m512i pair_bf16(const int8_t* p) {  // 32 codes -> 32 bf16 (exact)
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
}

// Rows [0, R) against V (1 or 2) blocks: weights int8 (packed, block stride KP * 32) or bf16
// (converted: [V][KP][32] words). x bf16 rows, stride ldx.
template <int R, int V, bool Converted>
NORIA_BF16_TARGET void tile_bf16(const uint16_t* x, int64_t ldx, int64_t KP, const void* wsrc, const float* scale, float* yf,
                                 BF* yb, int64_t N) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < KP; ++p) {
    __m512i w[V];
    for (int v = 0; v < V; ++v) {
      if constexpr (Converted) {
        w[v] = _mm512_loadu_si512(static_cast<const uint16_t*>(wsrc) + (v * KP + p) * 32);
      } else {
        w[v] = pair_bf16(static_cast<const int8_t*>(wsrc) + (v * KP + p) * 32);
      }
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, 4);
      const __m512i xb = _mm512_set1_epi32(pair);
      for (int v = 0; v < V; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], reinterpret_cast<__m512bh>(w[v]), reinterpret_cast<__m512bh>(xb));
    }
  }
  for (int v = 0; v < V; ++v) {
    const __m512 s = _mm512_loadu_ps(scale + v * kBlock);
    for (int r = 0; r < R; ++r) {
      const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][v], s)));
      if (yb != nullptr) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(yb + r * N + v * kBlock), h);
      } else {
        const __m512i f = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
        _mm512_storeu_ps(yf + r * N + v * kBlock, _mm512_castsi512_ps(f));
      }
    }
  }
}

template <int V, bool Converted>
NORIA_BF16_TARGET void rows_bf16(const uint16_t* x, int64_t M, int64_t K, const void* w, const float* scale, float* yf, BF* yb,
                                 int64_t N) {
  const int64_t KP = K / 2;
  int64_t m = 0;
  auto at = [&](int64_t row) { return std::make_pair(yf == nullptr ? nullptr : yf + row * N, yb == nullptr ? nullptr : yb + row * N); };
  for (; m + kBfRows <= M; m += kBfRows) {
    auto [f, b] = at(m);
    tile_bf16<kBfRows, V, Converted>(x + m * K, K, KP, w, scale, f, b, N);
  }
  const int64_t rest = M - m;
  if (rest == 0) return;
  auto [f, b] = at(m);
  const uint16_t* xr = x + m * K;
  switch (rest) {  // the last rows, one instantiation per count
#define NORIA_TAIL(n) \
  case n:             \
    tile_bf16<n, V, Converted>(xr, K, KP, w, scale, f, b, N); \
    break;
    NORIA_TAIL(1) NORIA_TAIL(2) NORIA_TAIL(3) NORIA_TAIL(4) NORIA_TAIL(5) NORIA_TAIL(6)
    NORIA_TAIL(7) NORIA_TAIL(8) NORIA_TAIL(9) NORIA_TAIL(10) NORIA_TAIL(11)
#undef NORIA_TAIL
  }
}

NORIA_BF16_TARGET void bf16_span_from_float(const float* x, uint16_t* out, int64_t b, int64_t e) {
  int64_t i = b;
  for (; i + 16 <= e; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i))));
  for (; i < e; ++i) out[i] = BF(x[i]).x;
}

void bf16_rows_from_float(const float* x, uint16_t* out, int64_t n) {
  at::parallel_for(0, n, 4096, [&](int64_t b, int64_t e) { bf16_span_from_float(x, out, b, e); });
}

// Units [u0, u1) of 32 output channels (the last may be 16) for all M rows.
NORIA_BF16_TARGET void bf16_units(const uint16_t* x, const int8_t* w, const float* scale, float* yf, BF* yb, int64_t M, int64_t N,
                                  int64_t K, int64_t u0, int64_t u1) {
  const int64_t KP = K / 2, blocks = N / kBlock;
  std::vector<uint16_t> buf(M > kBfRows ? 2 * KP * 32 : 0);
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t b = 2 * u, V = std::min<int64_t>(2, blocks - b);
    const int8_t* wb = w + b * KP * 32;
    float* f = yf == nullptr ? nullptr : yf + b * kBlock;
    BF* o = yb == nullptr ? nullptr : yb + b * kBlock;
    const float* s = scale + b * kBlock;
    if (M <= kBfRows) {
      V == 2 ? rows_bf16<2, false>(x, M, K, wb, s, f, o, N) : rows_bf16<1, false>(x, M, K, wb, s, f, o, N);
      continue;
    }
    // The blocks once, as bf16, for every row tile; meanwhile the next unit's codes are fetched into
    // L2 (one line per two pairs), so that its conversion does not wait on memory.
    const int8_t* next = u + 1 < u1 ? wb + V * KP * 32 : nullptr;
    const int64_t ahead = next == nullptr ? 0 : std::min<int64_t>(2, blocks - b - 2) * KP * 32;
    for (int64_t p = 0; p < V * KP; ++p) {
      if (p % 2 == 0 && p * 32 < ahead) _mm_prefetch(reinterpret_cast<const char*>(next + p * 32), _MM_HINT_T1);
      _mm512_storeu_si512(buf.data() + p * 32, pair_bf16(wb + p * 32));
    }
    V == 2 ? rows_bf16<2, true>(x, M, K, buf.data(), s, f, o, N) : rows_bf16<1, true>(x, M, K, buf.data(), s, f, o, N);
  }
}

void bf16_path(const uint16_t* x, const int8_t* w, const float* scale, float* yf, BF* yb, int64_t M, int64_t N, int64_t K) {
  const int64_t units = (N / kBlock + 1) / 2;  // pairs of blocks (32 channels); the last may be one
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) { bf16_units(x, w, scale, yf, yb, M, N, K, u0, u1); });
}

bool bf16_supported() {
  static const bool ok = __builtin_cpu_supports("avx512bf16");
  return ok;
}
#endif

bool path_runs(int64_t path) {
  switch (path) {
#ifdef NORIA_INT8_BF16
    case 1:
      return bf16_supported();
#endif
#ifdef NORIA_INT8_FMA
    case 2:
      return true;
#endif
    case 3:
      return true;
    default:
      return false;
  }
}

}  // namespace

// The first path that runs here (1 avx512_bf16, 2 fma, 3 scalar), or whether `path` runs here.
int64_t int8_linear_path(int64_t path) {
  if (path != 0) return path_runs(path) ? path : 0;
  for (int64_t p = 1; p <= 3; ++p)
    if (path_runs(p)) return p;
  return 0;
}

at::Tensor int8_linear(at::Tensor x, at::Tensor w, at::Tensor scale, int64_t path) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "int8_linear: x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "int8_linear: x must be bfloat16 or float32, got ",
              x.scalar_type());
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 2 * kBlock && w.scalar_type() == at::kChar && w.is_contiguous(),
              "int8_linear: w must be packed int8 [N / 16, K / 2, 32]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * kBlock;
  TORCH_CHECK(w.size(1) * 2 == K, "int8_linear: x has ", K, " input features, w ", w.size(1) * 2);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "int8_linear: scale must be float32 [", N, "]");
  const int64_t chosen = int8_linear_path(path);
  TORCH_CHECK(chosen != 0, "int8_linear: path ", path, " does not run on this CPU or build");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
#ifdef NORIA_INT8_BF16
  if (chosen == 1) {
    const bool bf = x.scalar_type() == at::kBFloat16;
    std::vector<uint16_t> xb(bf ? 0 : M * K);
    if (!bf) bf16_rows_from_float(x.data_ptr<float>(), xb.data(), M * K);
    const uint16_t* xp = bf ? reinterpret_cast<const uint16_t*>(x.data_ptr<BF>()) : xb.data();
    bf16_path(xp, wp, sp, bf ? nullptr : y.data_ptr<float>(), bf ? y.data_ptr<BF>() : nullptr, M, N, K);
    return y;
  }
#endif
  via_f32_rows(x, y, M, N, [&](const float* xf, float* out) {
#ifdef NORIA_INT8_FMA
    if (chosen == 2) fma_path(xf, wp, sp, out, M, N, K);
#endif
    if (chosen == 3) scalar_path(xf, wp, sp, out, M, N, K);
  });
  return y;
}

// ------------------------------------------------------------------------------------- quantizer
// quant.quantize_int8 in one pass over the weight, written straight into the packed layout (the
// re-quantization inside every weight commit): scale = bf16(max(amax|row| / 127, 1e-8)),
// q = clamp(round_half_even(w / scale), -127, 127), as fp32 operations in that order. No fast-math
// here: w / scale must be the correctly rounded quotient (not w * (1 / scale)) for the codes to
// equal the Python definition's bit for bit.

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

namespace {

#ifdef NORIA_INT8_FMA
inline __m256 load8(const BF* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
#endif

inline int8_t code(float v, float s) { return static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(v / s)))); }

// One row's scale and codes (codes into `out`, in row order).
template <typename T>
void quantize_row(const T* row, int64_t K, BF* scale, float* scale_f32, int8_t* out) {
  float amax = 0.f;
  int64_t k = 0;
#ifdef NORIA_INT8_FMA
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, load8(row + k)));
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  for (float v : lanes) amax = std::max(amax, v);
#endif
  for (; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(row[k])));
  const BF s(std::max(amax / 127.f, 1e-8f));
  const float sf = static_cast<float>(s);
  *scale = s;
  *scale_f32 = sf;
  k = 0;
#ifdef NORIA_INT8_FMA
  const __m256 vs = _mm256_set1_ps(sf), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (; k + 32 <= K; k += 32) {
    __m256i c[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 q = _mm256_round_ps(_mm256_div_ps(load8(row + k + 8 * j), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c[j] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, q)));
    }
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm256_permutevar8x32_epi32(b, order));
  }
#endif
  for (; k < K; ++k) out[k] = code(static_cast<float>(row[k]), sf);
}

template <typename T>
void quantize_rows(const T* w, int8_t* q, BF* scale, float* scale_f32, int64_t N, int64_t K) {
  const int64_t KP = K / 2;
  at::parallel_for(0, N / kBlock, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int16_t> rows(kBlock * KP);  // a block's codes in row order, as (k, k + 1) pairs
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t c = 0; c < kBlock; ++c) {
        const int64_t n = b * kBlock + c;
        quantize_row(w + n * K, K, scale + n, scale_f32 + n, reinterpret_cast<int8_t*>(rows.data() + c * KP));
      }
      int16_t* out = reinterpret_cast<int16_t*>(q + b * KP * 32);  // [KP][16] pairs
      for (int64_t p = 0; p < KP; ++p)
        for (int64_t c = 0; c < kBlock; ++c) out[p * kBlock + c] = rows[c * KP + p];
    }
  });
}

}  // namespace

void quantize_int8_packed(at::Tensor w, at::Tensor q, at::Tensor scale, at::Tensor scale_f32) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat),
              "quantize_int8_packed: w must be a contiguous bfloat16 or float32 [N, K] tensor");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kBlock == 0 && K % 2 == 0, "quantize_int8_packed: [", N, ", ", K, "] is not a multiple of [16, 2]");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.numel() == N * K && q.dim() == 3 && q.size(0) == N / kBlock,
              "quantize_int8_packed: q must be packed int8 [", N / kBlock, ", ", K / 2, ", 32]");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.numel() == N && scale.is_contiguous(),
              "quantize_int8_packed: scale must be bfloat16 [", N, "]");
  TORCH_CHECK(scale_f32.scalar_type() == at::kFloat && scale_f32.numel() == N && scale_f32.is_contiguous(),
              "quantize_int8_packed: scale_f32 must be float32 [", N, "]");
  int8_t* qp = q.data_ptr<int8_t>();
  if (w.scalar_type() == at::kBFloat16) {
    quantize_rows(w.data_ptr<BF>(), qp, scale.data_ptr<BF>(), scale_f32.data_ptr<float>(), N, K);
  } else {
    quantize_rows(w.data_ptr<float>(), qp, scale.data_ptr<BF>(), scale_f32.data_ptr<float>(), N, K);
  }
}

#pragma GCC pop_options
