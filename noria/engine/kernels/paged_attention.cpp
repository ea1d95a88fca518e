// Paged decode attention on the CPU: one query token per sequence against its cached K/V, read
// through a block table. Built by noria/engine/kernels/__init__.py with torch's C++ extension
// loader (at first use, cached afterwards).
//
// Layout: q [S, Hq, D]; k_pool, v_pool [num_slots, Hkv, D] with slot = block * block_size + offset;
// block_tables int32 [S, max_blocks]; context_lens int32 [S]. Work is split over (sequence,
// kv head) pairs; each pair handles its G = Hq / Hkv query heads together so every K/V row is
// read once. Accumulation is fp32 whatever the storage dtype.
//
// Every (sequence, head) result depends only on that sequence's own data and a fixed reduction
// order, so the output for a sequence is the same whatever else is in the batch (batch-invariant).
//
// The bf16 AVX-512 path scores 16 cached positions at a time (one transposing add tree for 16 dot
// products) and prefetches the next 16 K rows and the V row 8 positions on (rows are scattered
// over pages, so the hardware prefetcher does not see them coming). Measured against the previous
// one-row-at-a-time loop (SmolLM2 shapes, 128 sequences, 30 layers' pools, this 2-core VM):
// 0.80x the time at 50 cached tokens, 0.74x at 178, 0.73x at 400.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
#if defined(__AVX512F__)
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    // bf16 is the top half of an fp32: widen and shift, 16 values per instruction.
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
      _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
#endif
  } else {
    using TVec = at::vec::Vectorized<T>;
    int64_t i = 0;
    for (; i + TVec::size() <= n; i += TVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<T>(TVec::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + Vec::size());
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// In place: x[i] = exp(x[i] - max); returns the sum.
inline float exp_and_sum(float* x, int64_t n, float max) {
  Vec vmax(max), vsum(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    Vec e = (Vec::loadu(x + i) - vmax).exp_u20();
    e.store(x + i);
    vsum = vsum + e;
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    s += x[i];
  }
  return s;
}

inline void axpy(float w, const float* x, float* y, int64_t n) {
  Vec vw(w);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) at::vec::fmadd(vw, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += w * x[i];
}

#if defined(__AVX512F__)
// Register-resident fast path for bf16 with head_dim = 16 * NV and G query heads per KV head:
// the G query rows and G accumulators stay in zmm registers, so each cached position costs one
// K row and one V row read plus G * NV fused multiply-adds per pass.
inline __m512 load_bf16(const at::BFloat16* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// r[i] = sum of the 16 lanes of v[i], for 16 vectors at once (a transposing add tree: 45
// instructions for 16 sums instead of 16 horizontal reductions).
inline __m512 sum16(const __m512 v[16]) {
  __m512 t[8], u[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: the lane sums of v[4k .. 4k+3]
    const __m512d a = _mm512_castps_pd(t[2 * k]), b = _mm512_castps_pd(t[2 * k + 1]);
    u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

template <int G, int NV>
void decode_item_bf16(const at::BFloat16* q, const at::BFloat16* k_pool, const at::BFloat16* v_pool,
                      const int32_t* table, int64_t L, int64_t Hkv, int64_t h, int64_t block_size, float scale,
                      at::BFloat16* out, std::vector<float>& scores) {
  constexpr int D = NV * 16;
  __m512 qv[G][NV];
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) qv[g][j] = _mm512_mul_ps(load_bf16(q + g * D + j * 16), vscale);
  scores.resize(G * L);
  float maxes[G];
  for (int g = 0; g < G; ++g) maxes[g] = -INFINITY;
  // Scores 16 positions at a time: their K rows widened once into kbuf, then per query head 16
  // dot-product vectors summed across lanes together (sum16), instead of one horizontal sum each.
  alignas(64) float kbuf[16 * D];
  for (int64_t p0 = 0; p0 < L; p0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, L - p0));
    for (int i = 0; i < 16; ++i) {
      const int64_t p = p0 + std::min(i, n - 1);  // a short last group repeats its last row
      const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
      const at::BFloat16* k = k_pool + (slot * Hkv + h) * D;
      for (int j = 0; j < NV; ++j) _mm512_store_ps(kbuf + i * D + j * 16, load_bf16(k + j * 16));
    }
    for (int64_t p = p0 + 16; p < std::min<int64_t>(L, p0 + 32); ++p) {  // the next group's rows
      const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
      const char* row = reinterpret_cast<const char*>(k_pool + (slot * Hkv + h) * D);
      for (int b = 0; b < D * 2; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
    for (int g = 0; g < G; ++g) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) {
        acc[i] = _mm512_mul_ps(qv[g][0], _mm512_load_ps(kbuf + i * D));
        for (int j = 1; j < NV; ++j) acc[i] = _mm512_fmadd_ps(qv[g][j], _mm512_load_ps(kbuf + i * D + j * 16), acc[i]);
      }
      const __m512 sc = sum16(acc);
      _mm512_mask_storeu_ps(&scores[g * L + p0], valid, sc);
      maxes[g] = std::max(maxes[g], _mm512_mask_reduce_max_ps(valid, sc));
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = 1.f / exp_and_sum(&scores[g * L], L, maxes[g]);
  __m512 acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < L; ++p) {
    const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
    const at::BFloat16* v = v_pool + (slot * Hkv + h) * D;
    if (p + 8 < L) {
      const int64_t ahead = static_cast<int64_t>(table[(p + 8) / block_size]) * block_size + (p + 8) % block_size;
      const char* row = reinterpret_cast<const char*>(v_pool + (ahead * Hkv + h) * D);
      for (int b = 0; b < D * 2; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    }
    __m512 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load_bf16(v + j * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * L + p]);
      for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(w, vv[j], acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float tmp[D];
    for (int j = 0; j < NV; ++j) _mm512_store_ps(tmp + j * 16, _mm512_mul_ps(acc[g][j], _mm512_set1_ps(inv[g])));
    for (int d = 0; d < D; ++d) out[g * D + d] = static_cast<at::BFloat16>(tmp[d]);
  }
}

using ItemFn = void (*)(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, const int32_t*, int64_t,
                        int64_t, int64_t, int64_t, float, at::BFloat16*, std::vector<float>&);

template <int G>
ItemFn pick_nv(int64_t D) {
  switch (D) {
    case 64: return &decode_item_bf16<G, 4>;
    case 128: return &decode_item_bf16<G, 8>;
    default: return nullptr;
  }
}

ItemFn pick_fast(int64_t G, int64_t D) {
  switch (G) {
    case 1: return pick_nv<1>(D);
    case 2: return pick_nv<2>(D);
    case 3: return pick_nv<3>(D);
    case 4: return pick_nv<4>(D);
    case 5: return pick_nv<5>(D);
    case 6: return pick_nv<6>(D);
    case 7: return pick_nv<7>(D);
    case 8: return pick_nv<8>(D);
    default: return nullptr;
  }
}
#endif

template <typename T>
void decode(const T* q, const T* k_pool, const T* v_pool, const int32_t* tables, const int32_t* lens, T* out,
            int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int64_t max_blocks, int64_t block_size, float scale) {
  const int64_t G = Hq / Hkv;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (ItemFn fn = pick_fast(G, D)) {
      at::parallel_for(0, S * Hkv, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        for (int64_t item = begin; item < end; ++item) {
          const int64_t s = item / Hkv, h = item % Hkv;
          fn(q + (s * Hq + h * G) * D, k_pool, v_pool, tables + s * max_blocks, lens[s], Hkv, h, block_size, scale,
             out + (s * Hq + h * G) * D, scores);
        }
      });
      return;
    }
  }
#endif
  at::parallel_for(0, S * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), row(D), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / Hkv, h = item % Hkv, L = lens[s];
      const int32_t* table = tables + s * max_blocks;
      scores.resize(G * L);
      for (int64_t g = 0; g < G; ++g) {
        to_float(q + (s * Hq + h * G + g) * D, &qf[g * D], D);
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= scale;
      }
      std::vector<float> maxes(G, -INFINITY);
      for (int64_t p = 0; p < L; ++p) {
        const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
        to_float(k_pool + (slot * Hkv + h) * D, row.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          const float sc = dot(&qf[g * D], row.data(), D);
          scores[g * L + p] = sc;
          maxes[g] = std::max(maxes[g], sc);
        }
      }
      std::vector<float> inv(G);
      for (int64_t g = 0; g < G; ++g) inv[g] = 1.f / exp_and_sum(&scores[g * L], L, maxes[g]);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < L; ++p) {
        const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
        to_float(v_pool + (slot * Hkv + h) * D, row.data(), D);
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * L + p], row.data(), &acc[g * D], D);
      }
      for (int64_t g = 0; g < G; ++g) {
        T* o = out + (s * Hq + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[g * D + d] * inv[g]);
      }
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                                  at::Tensor block_tables, at::Tensor context_lens, int64_t block_size,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3, "q [S,Hq,D], pools [slots,Hkv,D]");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(), "dtype mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt, "int32 tables");
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous(), "tables must be contiguous");
  const int64_t S = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_pool.size(1);
  TORCH_CHECK(k_pool.size(2) == D && Hq % Hkv == 0, "head shapes do not match");
  TORCH_CHECK(block_tables.size(0) == S && context_lens.size(0) == S, "one table row per sequence");
  auto out = at::empty_like(q);
  const auto* tables = block_tables.data_ptr<int32_t>();
  const auto* lens = context_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  switch (q.scalar_type()) {
    case at::kBFloat16:
      decode(q.data_ptr<at::BFloat16>(), k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>(), tables, lens,
             out.data_ptr<at::BFloat16>(), S, Hq, Hkv, D, max_blocks, block_size, static_cast<float>(scale));
      break;
    case at::kHalf:
      decode(q.data_ptr<at::Half>(), k_pool.data_ptr<at::Half>(), v_pool.data_ptr<at::Half>(), tables, lens,
             out.data_ptr<at::Half>(), S, Hq, Hkv, D, max_blocks, block_size, static_cast<float>(scale));
      break;
    case at::kFloat:
      decode(q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), tables, lens,
             out.data_ptr<float>(), S, Hq, Hkv, D, max_blocks, block_size, static_cast<float>(scale));
      break;
    default:
      TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}
