// Vector exp for the `omp simd` loops of Quire's CPU kernels (SiLU, the softmax of paged decode).
//
// glibc's libmvec has vector versions of exp and expf (at most 1-4 ulp from the exact result, and the scalar
// function's results for infinities and NaN), but <math.h> declares them only under -ffast-math. The kernels
// are built without it (they keep infinities and NaN as PyTorch does), so the declarations are made here:
// without them every element calls the scalar exp, which made SiLU-and-multiply about 4 times slower. The
// vector versions do not set errno, which nothing here reads.
#pragma once

#include <cmath>

#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__)
extern "C" {
double exp(double) noexcept __attribute__((__simd__("notinbranch")));
float expf(float) noexcept __attribute__((__simd__("notinbranch")));
}
#endif
