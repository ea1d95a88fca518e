// Weight-only int4 linear on the CPU (engine.quantization: int4, noria/engine/quant.py). Included
// after int8_linear.cpp in kernels.cpp's one translation unit: it runs that file's row tiles.
//
//   y[m, n] = T(bf16(sum_k bf16(x[m, k]) * w[n, k])),   w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]
//
// with g = k / 32 (noria.models.quantize's int4 recipe: codes 0..15, scale and zero bf16 values per
// group of 32 input channels). (q - 8) * scale is exact in fp32, so w is the recipe's fp32 weight,
// one rounding from the exact value, as dequantize_int4 computes it.
//
// Layout: codes [N / 16, K / 2, 16] uint8, blocks of 16 output channels as int8_linear's, each pair
// of input channels (k, k + 1) in 16 bytes: byte c = q[c, k] | q[c, k + 1] << 4, so a pair's 32
// codes take half the bytes of int8's. scale and zero fp32 [N / 16, K / 32, 16].
//
// Every call dequantizes each block once into a per-thread buffer, then int8_linear's converted row
// tiles multiply every row with it (unit scales). Paths, as int8_linear's (int8_linear_path):
//   1 avx512_bf16: the buffer in bf16 (each weight rounded to bf16, as a bf16 model's QAT weight
//     is in the trainer), vdpbf16ps. bf16 activations only: fp32 ones take path 2.
//   2 fma: the buffer in fp32 (the recipe's weights), AVX2 FMA.
//   3 scalar: the fp32 buffer, the portable loop.
// Each output's sum runs over k in the same order whatever M is: batch-invariant within a path.
// Why not torch's _weight_int4pack_mm_for_cpu: see quant.py's docstring (measured there).

namespace {

constexpr int64_t kInt4Group = 32;               // input channels per scale/zero group
constexpr int64_t kInt4GroupPairs = kInt4Group / 2;

// Block `wb` (KP pairs) as fp32 weights in the int8 layout's lane order: out[p * 32 + 2c + j] = w[c, 2p + j].
void int4_block_f32(const uint8_t* wb, const float* s, const float* z, int64_t KP, float* out) {
  int64_t p0 = 0;
#ifdef NORIA_INT8_FMA
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m256 eight = _mm256_set1_ps(8.f);
  for (int64_t g = 0; g < KP / kInt4GroupPairs; ++g) {
    float se[32], ze[32];
    for (int c = 0; c < 16; ++c) {
      se[2 * c] = se[2 * c + 1] = s[g * 16 + c];
      ze[2 * c] = ze[2 * c + 1] = z[g * 16 + c];
    }
    __m256 sv[4], zv[4];
    for (int j = 0; j < 4; ++j) {
      sv[j] = _mm256_loadu_ps(se + 8 * j);
      zv[j] = _mm256_loadu_ps(ze + 8 * j);
    }
    for (int64_t p = g * kInt4GroupPairs; p < (g + 1) * kInt4GroupPairs; ++p) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + p * 16));
      const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
      const __m128i a = _mm_unpacklo_epi8(lo, hi), b = _mm_unpackhi_epi8(lo, hi);  // lanes 0-15, 16-31
      const __m128i parts[4] = {a, _mm_srli_si128(a, 8), b, _mm_srli_si128(b, 8)};
      for (int j = 0; j < 4; ++j) {
        const __m256 q = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])), eight);
        _mm256_storeu_ps(out + p * 32 + 8 * j, _mm256_fmadd_ps(q, sv[j], zv[j]));
      }
    }
  }
  p0 = KP;
#endif
  for (int64_t p = p0; p < KP; ++p) {
    const int64_t g = p / kInt4GroupPairs;
    for (int c = 0; c < 16; ++c) {
      const uint8_t byte = wb[p * 16 + c];
      const float sc = s[g * 16 + c], zc = z[g * 16 + c];
      out[p * 32 + 2 * c] = static_cast<float>((byte & 15) - 8) * sc + zc;
      out[p * 32 + 2 * c + 1] = static_cast<float>((byte >> 4) - 8) * sc + zc;
    }
  }
}

void int4_scalar_rows(const float* x, const float* wf, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t KP = K / 2;
  for (int64_t m = 0; m < M; ++m) {
    float acc[kBlock] = {0.f};
    const float* xr = x + m * K;
    for (int64_t p = 0; p < KP; ++p)
      for (int64_t c = 0; c < kBlock; ++c) acc[c] += xr[2 * p] * wf[p * 32 + 2 * c] + xr[2 * p + 1] * wf[p * 32 + 2 * c + 1];
    for (int64_t c = 0; c < kBlock; ++c) y[m * N + c] = round_bf16(acc[c]);
  }
}

// Paths 2 and 3: x fp32 rows holding bf16 values, y fp32 [M, N].
void int4_f32_path(int64_t path, const float* x, const uint8_t* w, const float* s, const float* z, float* y, int64_t M, int64_t N,
                   int64_t K) {
  const int64_t KP = K / 2, G = K / kInt4Group;
  at::parallel_for(0, N / kBlock, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(KP * 32);
    const float ones[kBlock] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};
    for (int64_t b = b0; b < b1; ++b) {
      int4_block_f32(w + b * KP * 16, s + b * G * 16, z + b * G * 16, KP, buf.data());
#ifdef NORIA_INT8_FMA
      if (path == 2) {
        half_rows_fma(x, M, K, buf.data(), ones, y + b * kBlock, N);
        continue;
      }
#endif
      (void)ones;
      int4_scalar_rows(x, buf.data(), y + b * kBlock, M, N, K);
    }
  });
}

#ifdef NORIA_INT8_BF16
// Block `wb` as bf16 weights in the int8 layout's lane order ([KP][32] words).
NORIA_BF16_TARGET void int4_block_bf16(const uint8_t* wb, const float* s, const float* z, int64_t KP, uint16_t* out) {
  const __m512i lo_idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
  const __m512 eight = _mm512_set1_ps(8.f);
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < KP / kInt4GroupPairs; ++g) {
    const __m512 sv = _mm512_loadu_ps(s + g * 16), zv = _mm512_loadu_ps(z + g * 16);
    const __m512 s0 = _mm512_permutexvar_ps(lo_idx, sv), s1 = _mm512_permutexvar_ps(hi_idx, sv);
    const __m512 z0 = _mm512_permutexvar_ps(lo_idx, zv), z1 = _mm512_permutexvar_ps(hi_idx, zv);
    for (int64_t p = g * kInt4GroupPairs; p < (g + 1) * kInt4GroupPairs; ++p) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + p * 16));
      const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
      const __m512 fa = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi))), eight), s0, z0);
      const __m512 fb = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi))), eight), s1, z1);
      _mm512_storeu_si512(out + p * 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(fb, fa)));
    }
  }
}

void int4_bf16_path(const uint16_t* x, const uint8_t* w, const float* s, const float* z, BF* y, int64_t M, int64_t N, int64_t K) {
  const int64_t KP = K / 2, G = K / kInt4Group, blocks = N / kBlock;
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t u0, int64_t u1) {
    std::vector<uint16_t> buf(2 * KP * 32);
    std::vector<float> ones(2 * kBlock, 1.f);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = 2 * u, V = std::min<int64_t>(2, blocks - b);
      for (int64_t v = 0; v < V; ++v)
        int4_block_bf16(w + (b + v) * KP * 16, s + (b + v) * G * 16, z + (b + v) * G * 16, KP, buf.data() + v * KP * 32);
      BF* o = y + b * kBlock;
      V == 2 ? rows_bf16<2, true>(x, M, K, buf.data(), ones.data(), nullptr, o, N)
             : rows_bf16<1, true>(x, M, K, buf.data(), ones.data(), nullptr, o, N);
    }
  });
}
#endif

}  // namespace

at::Tensor int4_linear(at::Tensor x, at::Tensor w, at::Tensor scale, at::Tensor zero, int64_t path) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "int4_linear: x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "int4_linear: x must be bfloat16 or float32, got ",
              x.scalar_type());
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kBlock && w.scalar_type() == at::kByte && w.is_contiguous(),
              "int4_linear: w must be packed uint8 [N / 16, K / 2, 16]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * kBlock;
  TORCH_CHECK(w.size(1) * 2 == K && K % kInt4Group == 0, "int4_linear: x has ", K, " input features, w ", w.size(1) * 2,
              " (a multiple of 32 is needed)");
  for (const at::Tensor* t : {&scale, &zero})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == N / kBlock && t->size(1) == K / kInt4Group && t->size(2) == kBlock &&
                    t->scalar_type() == at::kFloat && t->is_contiguous(),
                "int4_linear: scale and zero must be float32 [", N / kBlock, ", ", K / kInt4Group, ", 16]");
  int64_t chosen = int8_linear_path(path);
  TORCH_CHECK(chosen != 0, "int4_linear: path ", path, " does not run on this CPU or build");
  if (chosen == 1 && x.scalar_type() == at::kFloat) {  // fp32 activations keep the recipe's fp32 weights
    TORCH_CHECK(path == 0, "int4_linear: path 1 (avx512_bf16) takes bfloat16 activations");
    chosen = int8_linear_path(2) != 0 ? 2 : 3;
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = zero.data_ptr<float>();
#ifdef NORIA_INT8_BF16
  if (chosen == 1) {
    int4_bf16_path(reinterpret_cast<const uint16_t*>(x.data_ptr<BF>()), wp, sp, zp, y.data_ptr<BF>(), M, N, K);
    return y;
  }
#endif
  via_f32_rows(x, y, M, N, [&](const float* xf, float* out) { int4_f32_path(chosen, xf, wp, sp, zp, out, M, N, K); });
  return y;
}

// ------------------------------------------------------------------------------------- quantizer
// noria.models.quantize.quantize_int4 (groups of 32, scales and zeros in bf16) in one pass over the
// weight, written straight into the kernel's layout (the re-quantization inside every weight commit):
// per group lo = min, hi = max, scale = bf16(max((hi - lo) / 15, 1e-8)), zero = bf16(lo + 8 * scale),
// q = clamp(round_half_even((w - (zero - 8 * scale)) / scale), 0, 15), as fp32 operations in that
// order. No fast-math here: the quotient must be correctly rounded for the codes to equal the
// Python definition's bit for bit.

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

namespace {

// One group's scale, zero and lowest value (fp32 holding bf16 values, as quantize_int4 rounds them).
inline void int4_group_params(float lo, float hi, float* scale, float* zero, float* lo_r) {
  const float s = static_cast<float>(BF(std::max((hi - lo) / 15.f, 1e-8f)));
  const float z = static_cast<float>(BF(lo + 8.f * s));
  *scale = s;
  *zero = z;
  *lo_r = z - 8.f * s;
}

#ifdef NORIA_INT8_FMA
inline __m128 int4_half_min(__m256 v) { return _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); }
inline __m128 int4_half_max(__m256 v) { return _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); }
inline __m128i int4_nibbles(__m128i h) {
  return _mm_or_si128(_mm_and_si128(h, _mm_set1_epi16(0x000F)), _mm_and_si128(_mm_srli_epi16(h, 4), _mm_set1_epi16(0x00F0)));
}
#endif

// One row's groups: scales, zeros, and the codes two a byte in row order (byte p = q[2p] | q[2p + 1] << 4).
template <typename T>
void int4_quantize_row(const T* row, int64_t K, float* scale, float* zero, uint8_t* pairs) {
  int64_t g = 0;
#ifdef NORIA_INT8_FMA
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (; g < K / kInt4Group; ++g) {
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = load8(row + g * kInt4Group + 8 * j);
    __m128 mn = int4_half_min(_mm256_min_ps(_mm256_min_ps(v[0], v[1]), _mm256_min_ps(v[2], v[3])));
    __m128 mx = int4_half_max(_mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3])));
    mn = _mm_min_ps(mn, _mm_movehl_ps(mn, mn));
    mx = _mm_max_ps(mx, _mm_movehl_ps(mx, mx));
    const float lo = _mm_cvtss_f32(_mm_min_ss(mn, _mm_shuffle_ps(mn, mn, 1)));
    const float hi = _mm_cvtss_f32(_mm_max_ss(mx, _mm_shuffle_ps(mx, mx, 1)));
    float lo_r;
    int4_group_params(lo, hi, scale + g, zero + g, &lo_r);
    const __m256 vs = _mm256_set1_ps(scale[g]), vl = _mm256_set1_ps(lo_r), zero_v = _mm256_setzero_ps(), top = _mm256_set1_ps(15.f);
    __m256i c[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(v[j], vl), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c[j] = _mm256_cvtps_epi32(_mm256_min_ps(top, _mm256_max_ps(zero_v, q)));
    }
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    const __m256i bytes = _mm256_permutevar8x32_epi32(b, order);  // the 32 codes in row order
    // as 16-bit lanes q[2j] | q[2j + 1] << 8 -> q[2j] | q[2j + 1] << 4, then narrowed in order
    const __m128i h0 = int4_nibbles(_mm256_castsi256_si128(bytes)), h1 = int4_nibbles(_mm256_extracti128_si256(bytes, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pairs + g * kInt4Group / 2), _mm_packus_epi16(h0, h1));
  }
#endif
  for (; g < K / kInt4Group; ++g) {
    float v[kInt4Group];
    for (int64_t j = 0; j < kInt4Group; ++j) v[j] = static_cast<float>(row[g * kInt4Group + j]);
    float lo = v[0], hi = v[0];
    for (int64_t j = 1; j < kInt4Group; ++j) {
      lo = std::min(lo, v[j]);
      hi = std::max(hi, v[j]);
    }
    float lo_r;
    int4_group_params(lo, hi, scale + g, zero + g, &lo_r);
    uint8_t codes[kInt4Group];
    for (int64_t j = 0; j < kInt4Group; ++j)
      codes[j] = static_cast<uint8_t>(std::min(15.f, std::max(0.f, std::nearbyint((v[j] - lo_r) / scale[g]))));
    for (int64_t j = 0; j < kInt4Group / 2; ++j)
      pairs[g * kInt4Group / 2 + j] = static_cast<uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
  }
}

template <typename T>
void int4_quantize_rows(const T* w, uint8_t* q, float* scale, float* zero, int64_t N, int64_t K) {
  const int64_t KP = K / 2, G = K / kInt4Group;
  at::parallel_for(0, N / kBlock, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> pairs(kBlock * KP);
    std::vector<float> s(kBlock * G), z(kBlock * G);
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t c = 0; c < kBlock; ++c)
        int4_quantize_row(w + (b * kBlock + c) * K, K, s.data() + c * G, z.data() + c * G, pairs.data() + c * KP);
      uint8_t* out = q + b * KP * kBlock;  // [KP][16]: the block's rows side by side
      for (int64_t p = 0; p < KP; ++p)
        for (int64_t c = 0; c < kBlock; ++c) out[p * kBlock + c] = pairs[c * KP + p];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < kBlock; ++c) {
          scale[(b * G + g) * kBlock + c] = s[c * G + g];
          zero[(b * G + g) * kBlock + c] = z[c * G + g];
        }
    }
  });
}

}  // namespace

void quantize_int4_packed(at::Tensor w, at::Tensor q, at::Tensor scale, at::Tensor zero) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat),
              "quantize_int4_packed: w must be a contiguous bfloat16 or float32 [N, K] tensor");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kBlock == 0 && K % kInt4Group == 0, "quantize_int4_packed: [", N, ", ", K, "] is not a multiple of [16, 32]");
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 3 && q.size(0) == N / kBlock && q.size(1) == K / 2 &&
                  q.size(2) == kBlock,
              "quantize_int4_packed: q must be packed uint8 [", N / kBlock, ", ", K / 2, ", 16]");
  for (const at::Tensor* t : {&scale, &zero})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == N * (K / kInt4Group),
                "quantize_int4_packed: scale and zero must be float32 [", N / kBlock, ", ", K / kInt4Group, ", 16]");
  uint8_t* qp = q.data_ptr<uint8_t>();
  if (w.scalar_type() == at::kBFloat16) {
    int4_quantize_rows(w.data_ptr<BF>(), qp, scale.data_ptr<float>(), zero.data_ptr<float>(), N, K);
  } else {
    int4_quantize_rows(w.data_ptr<float>(), qp, scale.data_ptr<float>(), zero.data_ptr<float>(), N, K);
  }
}

#pragma GCC pop_options
