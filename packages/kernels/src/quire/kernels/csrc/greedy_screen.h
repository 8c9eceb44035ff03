// The arithmetic both screened greedy heads share (greedy_head_tokens in onednn_gemv.cpp for oneDNN-packed
// heads, greedy_head_tokens_bf16 in linear_bf16.cpp for linear_bf16's): x rounded to int16 with its error, the
// radius of one approximate logit, and the cut below which an output cannot be the argmax.
//
// An approximate logit is dot(q_n, xq_m) * scale_n * step_m (an exact integer dot product times two scales);
// its distance to the logit the full head computes is at most the weight's rounding (|w - scale q| <= w_error_n,
// times sum |x|), x's rounding (scale_n * sum |q_n| * x_error_m), float32 summation in any order ((K + 2)
// 2^-23 * sum |x| * max |w|), with margins for the bound's own float32 arithmetic.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace quire::screen {

// Rows of x rounded to int16 with one step per row, so that no dot product with an int8 row can leave int32:
// |sum| <= K * 127 * limit.
struct QuantizedRows {
  std::vector<int16_t> xq;  // [M, K]
  std::vector<double> l1, step, x_error;  // per row: sum |x|, the step, the largest |x - step xq|
};

// `value(i)`: element i of x ([M, K], row-major) as a float. False where the screen cannot run: a value that
// is not finite, or a row of zeros (every logit zero: left to the full head).
template <typename Value>
bool quantize_rows(int64_t M, int64_t K, const Value& value, QuantizedRows& rows) {
  const int64_t limit = std::min<int64_t>(16383, (int64_t{1} << 31) / (K * 128));
  rows.xq.assign(M * K, 0);
  rows.l1.assign(M, 0.0);
  rows.step.assign(M, 0.0);
  rows.x_error.assign(M, 0.0);
  for (int64_t m = 0; m < M; ++m) {
    double largest = 0.0, sum = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const float v = value(m * K + k);
      if (!std::isfinite(v)) return false;
      largest = std::max(largest, static_cast<double>(std::fabs(v)));
      sum += std::fabs(v);
    }
    if (largest == 0.0) return false;
    const double step = largest / static_cast<double>(limit);
    double worst = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double v = value(m * K + k);
      const double r = std::nearbyint(v / step);
      const int16_t q = static_cast<int16_t>(std::max(-32767.0, std::min(32767.0, r)));
      rows.xq[m * K + k] = q;
      worst = std::max(worst, std::fabs(v - step * q));
    }
    rows.l1[m] = sum;
    rows.step[m] = step;
    rows.x_error[m] = worst;
  }
  return true;
}

// float32 summation of K terms, generously: relative errors of about 2^-23 per operation
inline double summation_error(int64_t K) { return static_cast<double>(K + 2) * std::ldexp(1.0, -23); }

// The radius of one approximate logit, in double (the outputs past the vectorized groups).
inline double radius(double w_error, double scale, double q_l1, double w_max, double l1, double x_error,
                     double summation) {
  return (w_error * l1 + x_error * scale * q_l1 + summation * l1 * w_max) * (1.0 + 1e-6) + 1e-30;
}

// Below this, a logit's bfloat16 value is below the best lower bound's: 2^-7 covers one bfloat16 rounding either
// way.
inline double cut_below(double best_lower) { return best_lower - std::fabs(best_lower) * std::ldexp(1.0, -6) - 1e-30; }

}  // namespace quire::screen
