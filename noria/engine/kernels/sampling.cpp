// One token per row from a batch of logits, in one fused pass per row (no [S, V] temporaries).
// Built into the same extension as paged_attention.cpp (see __init__.py).
//
// Per row r with temperature T_r (T_r <= 0: greedy) and a uniform draw u_r in [0, 1):
//   s_i = x_i / T_r (x_i when greedy), m = max_i s_i, e_i = exp(s_i - m), Z = sum_i e_i
//   token = argmax_i x_i (greedy, lowest id on ties) or the inverse CDF: the first i whose running
//           sum of e exceeds u_r * Z (sampled)
//   logprob = s_token - m - log(Z) = log_softmax(s)[token]
// Z is summed per 64-wide block in a fixed order, and the inverse-CDF walk re-adds the same block
// sums in the same order, so the search is consistent with Z. Every row depends only on its own
// logits, T and u: results are independent of the batch. No truncation here (top-k/top-p/min-p
// rows are redone by the caller).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kSumBlock = 64;

template <typename T>
inline Vec load_f(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    // Vec::size() values of T, widened to fp32.
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, Vec::size())));
  }
}

template <typename T>
void sample_row(const T* x, int64_t V, float temp, float u, float* e, std::vector<float>& block_sums,
                int64_t* token, float* logprob) {
  const bool greedy = temp <= 0.f;
  const float inv_t = greedy ? 1.f : temp;  // divide, as torch does (logits / T), not multiply
  // Pass 1: the max of s and the first index reaching it.
  float m = -std::numeric_limits<float>::infinity();
  int64_t arg = 0;
  {
    int64_t i = 0;
    Vec vmax(-std::numeric_limits<float>::infinity());
    for (; i + Vec::size() <= V; i += Vec::size()) {
      Vec s = load_f(x + i);
      if (!greedy) s = s / Vec(inv_t);
      vmax = at::vec::maximum(vmax, s);
    }
    m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
    for (; i < V; ++i) {
      float s = greedy ? static_cast<float>(x[i]) : static_cast<float>(x[i]) / inv_t;
      m = std::max(m, s);
    }
    if (greedy) {
      for (i = 0; i < V; ++i)
        if (static_cast<float>(x[i]) == m) break;
      arg = i < V ? i : 0;
    }
  }
  // Pass 2: e = exp(s - m), summed per block.
  const int64_t n_blocks = (V + kSumBlock - 1) / kSumBlock;
  block_sums.resize(n_blocks);
  const Vec vm(m);
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t lo = b * kSumBlock, hi = std::min(V, lo + kSumBlock);
    int64_t i = lo;
    Vec acc(0.f);
    for (; i + Vec::size() <= hi; i += Vec::size()) {
      Vec s = load_f(x + i);
      if (!greedy) s = s / Vec(inv_t);
      Vec ev = (s - vm).exp();
      ev.store(e + i);
      acc = acc + ev;
    }
    float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return a + c; }, acc);
    for (; i < hi; ++i) {
      float s = greedy ? static_cast<float>(x[i]) : static_cast<float>(x[i]) / inv_t;
      e[i] = std::exp(s - m);
      sum += e[i];
    }
    block_sums[b] = sum;
  }
  float total = 0.f;
  for (int64_t b = 0; b < n_blocks; ++b) total += block_sums[b];
  if (!greedy) {
    // Pass 3: inverse CDF over the same block sums, then inside the block.
    const float target = u * total;
    float run = 0.f;
    int64_t b = 0;
    for (; b < n_blocks; ++b) {
      if (run + block_sums[b] > target) break;
      run += block_sums[b];
    }
    arg = -1;
    if (b < n_blocks) {
      const int64_t lo = b * kSumBlock, hi = std::min(V, lo + kSumBlock);
      for (int64_t i = lo; i < hi; ++i) {
        if (e[i] > 0.f) arg = i;  // the last positive one, should rounding leave the target unreached
        run += e[i];
        if (run > target && e[i] > 0.f) break;
      }
    }
    if (arg < 0) {  // rounding at the very end of the CDF: take the last token with mass
      for (int64_t i = V - 1; i >= 0; --i)
        if (e[i] > 0.f) { arg = i; break; }
      if (arg < 0) arg = 0;
    }
  }
  const float s_tok = greedy ? static_cast<float>(x[arg]) : static_cast<float>(x[arg]) / inv_t;
  *token = arg;
  *logprob = s_tok - m - std::log(total);
}

template <typename T>
void sample_all(const T* logits, int64_t S, int64_t V, const float* temps, const float* uniforms, int64_t* tokens,
                float* logprobs) {
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(V), block_sums;
    for (int64_t r = begin; r < end; ++r)
      sample_row(logits + r * V, V, temps[r], uniforms[r], e.data(), block_sums, tokens + r, logprobs + r);
  });
}

}  // namespace

std::vector<at::Tensor> sample_rows(at::Tensor logits, at::Tensor temps, at::Tensor uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be a contiguous [S, V]");
  TORCH_CHECK(temps.scalar_type() == at::kFloat && uniforms.scalar_type() == at::kFloat, "temps/uniforms fp32");
  const int64_t S = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temps.numel() == S && uniforms.numel() == S && V > 0, "one temperature and one uniform per row");
  auto t = temps.contiguous(), u = uniforms.contiguous();
  auto tokens = at::empty({S}, logits.options().dtype(at::kLong));
  auto logprobs = at::empty({S}, logits.options().dtype(at::kFloat));
  switch (logits.scalar_type()) {
    case at::kFloat:
      sample_all(logits.data_ptr<float>(), S, V, t.data_ptr<float>(), u.data_ptr<float>(),
                 tokens.data_ptr<int64_t>(), logprobs.data_ptr<float>());
      break;
    case at::kBFloat16:
      sample_all(logits.data_ptr<at::BFloat16>(), S, V, t.data_ptr<float>(), u.data_ptr<float>(),
                 tokens.data_ptr<int64_t>(), logprobs.data_ptr<float>());
      break;
    default:
      TORCH_CHECK(false, "unsupported dtype ", logits.scalar_type());
  }
  return {tokens, logprobs};
}
