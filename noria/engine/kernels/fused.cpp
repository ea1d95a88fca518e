// Fused elementwise steps of a decoder layer on the CPU (the engine's fast decode path,
// noria/engine/inference.py). Built into the same extension as paged_attention.cpp.
//
// At rollout batch sizes each eager torch op of a norm, RoPE or SwiGLU costs ~10 us of dispatch
// for a few microseconds of arithmetic; a layer has about thirty of them. These kernels do each
// step in one pass over the rows (parallel over rows), computing in fp32 and rounding to the
// storage dtype where the eager modules round:
//
//   add_rmsnorm: residual = T(residual + x) (in place, when given); out = T(w * T(h * rsqrt(mean(h^2) + eps)))
//                with h = residual (or x); the model's RMSNorm order (cast back before the weight).
//   rope:        out = T(T(x * cos) + T(rot(x) * sin)), rot(x) = cat(-x2, x1) (HF's half split),
//                over the first `heads` heads of x [T, H_all, D]; cos/sin [T, D] in the storage dtype.
//   silu_mul:    out = T(T(silu(g)) * u) for gu = [g | u] along the last dimension.
//
// RoPE and the SwiGLU product round exactly as the eager ops do; the norm's sum of squares runs in
// another order than torch's reduction, so a norm can differ from the module in the last bit.
// Every row depends only on its own inputs (batch-invariant).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <vector>

namespace {

template <typename T>
inline float f(T v) {
  return static_cast<float>(v);
}

template <typename T>
inline T r(float v) {
  return static_cast<T>(v);  // round to nearest even for bf16 / fp16, identity for fp32
}

template <typename T>
void add_rmsnorm_rows(const T* x, T* res, const T* w, T* out, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(H);
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * H;
      T* rr = res == nullptr ? nullptr : res + row * H;
      // Four partial sums in a fixed order: the result depends on the row only.
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t i = 0; i < H; ++i) {
        float v;
        if (rr != nullptr) {
          T s = r<T>(f(rr[i]) + f(xr[i]));
          rr[i] = s;
          v = f(s);
        } else {
          v = f(xr[i]);
        }
        h[i] = v;
        acc[i & 3] += v * v;
      }
      const float mean = ((acc[0] + acc[1]) + (acc[2] + acc[3])) / static_cast<float>(H);
      const float inv = 1.f / std::sqrt(mean + eps);
      T* o = out + row * H;
      for (int64_t i = 0; i < H; ++i) o[i] = r<T>(f(w[i]) * f(r<T>(h[i] * inv)));
    }
  });
}

template <typename T, bool kScalar = false>
void rope_rows(const T* x, const T* cos, const T* sin, T* out, int64_t tokens, int64_t h_all, int64_t heads,
               int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t t = idx / heads, hd = idx % heads;
      const T* xr = x + (t * h_all + hd) * D;
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      T* o = out + (t * heads + hd) * D;
      for (int64_t i = 0; i < D; ++i) {
        const float rot = i < half ? -f(xr[i + half]) : f(xr[i - half]);
        o[i] = r<T>(f(r<T>(f(xr[i]) * f(c[i]))) + f(r<T>(rot * f(s[i]))));
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* g = gu + row * 2 * I;
      const T* u = g + I;
      T* o = out + row * I;
      for (int64_t i = 0; i < I; ++i) {
        const float x = f(g[i]);
        o[i] = r<T>(f(r<T>(x / (1.f + std::exp(-x)))) * f(u[i]));
      }
    }
  });
}

// bf16 versions of the three loops, vectorized with ATen's Vectorized (one bf16 vector = two fp32
// vectors); each rounding point is a round trip through bf16 (round to nearest even, as torch).
using BF = at::BFloat16;
using fVec = at::vec::Vectorized<float>;
using bVec = at::vec::Vectorized<BF>;

inline std::tuple<fVec, fVec> load2(const BF* p) { return at::vec::convert_to_float<BF>(bVec::loadu(p)); }
inline void store2(BF* p, const fVec& a, const fVec& b) { at::vec::convert_from_float<BF>(a, b).store(p); }
inline std::tuple<fVec, fVec> round2(const fVec& a, const fVec& b) {
  return at::vec::convert_to_float<BF>(at::vec::convert_from_float<BF>(a, b));
}
constexpr int64_t kW = bVec::size();

template <>
void add_rmsnorm_rows<BF>(const BF* x, BF* res, const BF* w, BF* out, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const BF* xr = x + row * H;
      BF* rr = res == nullptr ? nullptr : res + row * H;
      const BF* src = rr == nullptr ? xr : rr;  // the normed values, once the residual is written
      fVec acc0(0.f), acc1(0.f);
      float tail = 0.f;
      int64_t i = 0;
      for (; i + kW <= H; i += kW) {
        auto [a, b] = load2(xr + i);
        if (rr != nullptr) {
          auto [ra, rb] = load2(rr + i);
          auto [sa, sb] = round2(ra + a, rb + b);
          store2(rr + i, sa, sb);
          a = sa;
          b = sb;
        }
        acc0 = at::vec::fmadd(a, a, acc0);
        acc1 = at::vec::fmadd(b, b, acc1);
      }
      for (; i < H; ++i) {
        float v = f(xr[i]);
        if (rr != nullptr) {
          rr[i] = r<BF>(f(rr[i]) + v);
          v = f(rr[i]);
        }
        tail += v * v;
      }
      const float sum = at::vec::vec_reduce_all<float>([](fVec& p, fVec& q) { return p + q; }, acc0 + acc1) + tail;
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + eps);
      const fVec vinv(inv);
      BF* o = out + row * H;
      for (i = 0; i + kW <= H; i += kW) {
        auto [a, b] = load2(src + i);
        auto [na, nb] = round2(a * vinv, b * vinv);
        auto [wa, wb] = load2(w + i);
        store2(o + i, wa * na, wb * nb);
      }
      for (; i < H; ++i) o[i] = r<BF>(f(w[i]) * f(r<BF>(f(src[i]) * inv)));
    }
  });
}

template <>
void rope_rows<BF>(const BF* x, const BF* cos, const BF* sin, BF* out, int64_t tokens, int64_t h_all, int64_t heads,
                   int64_t D) {
  const int64_t half = D / 2;
  if (half % kW != 0) {  // head sizes that do not fill whole vectors: the scalar loop
    rope_rows<BF, true>(x, cos, sin, out, tokens, h_all, heads, D);
    return;
  }
  at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t t = idx / heads, hd = idx % heads;
      const BF* x1 = x + (t * h_all + hd) * D;
      const BF* x2 = x1 + half;
      const BF* c = cos + t * D;
      const BF* s = sin + t * D;
      BF* o = out + (t * heads + hd) * D;
      for (int64_t i = 0; i < half; i += kW) {
        auto [a1, b1] = load2(x1 + i);
        auto [a2, b2] = load2(x2 + i);
        auto [ca, cb] = load2(c + i);
        auto [sa, sb] = load2(s + i);
        auto [pa, pb] = round2(a1 * ca, b1 * cb);
        auto [qa, qb] = round2(a2.neg() * sa, b2.neg() * sb);
        store2(o + i, pa + qa, pb + qb);  // first half: x1 cos - x2 sin
        auto [ca2, cb2] = load2(c + half + i);
        auto [sa2, sb2] = load2(s + half + i);
        auto [ua, ub] = round2(a2 * ca2, b2 * cb2);
        auto [va, vb] = round2(a1 * sa2, b1 * sb2);
        store2(o + half + i, ua + va, ub + vb);  // second half: x2 cos + x1 sin
      }
    }
  });
}

template <>
void silu_mul_rows<BF>(const BF* gu, BF* out, int64_t rows, int64_t I) {
  const fVec one(1.f);
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const BF* g = gu + row * 2 * I;
      const BF* u = g + I;
      BF* o = out + row * I;
      int64_t i = 0;
      for (; i + kW <= I; i += kW) {
        auto [ga, gb] = load2(g + i);
        auto [sa, sb] = round2(ga / (one + ga.neg().exp()), gb / (one + gb.neg().exp()));
        auto [ua, ub] = load2(u + i);
        store2(o + i, sa * ua, sb * ub);
      }
      for (; i < I; ++i) {
        const float v = f(g[i]);
        o[i] = r<BF>(f(r<BF>(v / (1.f + std::exp(-v)))) * f(u[i]));
      }
    }
  });
}

}  // namespace

// out = norm(residual += x) or norm(x); x, residual [rows, H] contiguous, weight [H].
at::Tensor add_rmsnorm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "add_rmsnorm: contiguous inputs");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "add_rmsnorm: weight dtype must match x");
  const int64_t H = x.size(-1), rows = x.numel() / H;
  TORCH_CHECK(weight.numel() == H, "add_rmsnorm: weight has ", weight.numel(), " entries for width ", H);
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type(), "add_rmsnorm: residual must match x");
  }
  auto out = at::empty_like(x);
  switch (x.scalar_type()) {
    case at::kBFloat16:
      add_rmsnorm_rows(x.data_ptr<at::BFloat16>(), residual ? residual->data_ptr<at::BFloat16>() : nullptr,
                       weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, H, static_cast<float>(eps));
      break;
    case at::kFloat:
      add_rmsnorm_rows(x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr, weight.data_ptr<float>(),
                       out.data_ptr<float>(), rows, H, static_cast<float>(eps));
      break;
    default:
      TORCH_CHECK(false, "add_rmsnorm: unsupported dtype ", x.scalar_type());
  }
  return out;
}

// x [T, H_all, D] with contiguous rows (a view of the fused qkv output is fine: stride(1) == D,
// stride(0) == H_all * D); rotates heads [0, heads) -> [T, heads, D].
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t heads) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.stride(0) == x.size(1) * x.size(2),
              "rope: x must be [T, H, D] with dense rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(), "rope: cos/sin contiguous, in x's dtype");
  const int64_t T = x.size(0), H_all = x.size(1), D = x.size(2);
  TORCH_CHECK(heads <= H_all && D % 2 == 0 && cos.numel() == T * D && sin.numel() == T * D, "rope: shapes");
  auto out = at::empty({T, heads, D}, x.options());
  switch (x.scalar_type()) {
    case at::kBFloat16:
      rope_rows(x.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(),
                out.data_ptr<at::BFloat16>(), T, H_all, heads, D);
      break;
    case at::kFloat:
      rope_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<float>(), T, H_all,
                heads, D);
      break;
    default:
      TORCH_CHECK(false, "rope: unsupported dtype ", x.scalar_type());
  }
  return out;
}

// gu [rows, 2 I] = [gate | up] -> silu(gate) * up [rows, I].
at::Tensor silu_mul(at::Tensor gu) {
  TORCH_CHECK(gu.is_contiguous() && gu.size(-1) % 2 == 0, "silu_mul: contiguous [.., 2 I]");
  const int64_t I = gu.size(-1) / 2, rows = gu.numel() / (2 * I);
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, gu.options());
  switch (gu.scalar_type()) {
    case at::kBFloat16:
      silu_mul_rows(gu.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, I);
      break;
    case at::kFloat:
      silu_mul_rows(gu.data_ptr<float>(), out.data_ptr<float>(), rows, I);
      break;
    default:
      TORCH_CHECK(false, "silu_mul: unsupported dtype ", gu.scalar_type());
  }
  return out;
}
