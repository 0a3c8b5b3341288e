// Int8 weight-only GEMV/GEMM for CPU decode: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// Plain C ABI (no torch headers: builds in about a second with g++, called through ctypes).
// Weights stay int8 in memory (a quarter of fp32's bytes, which is what a memory-bound decode step
// reads); each 8-code chunk is widened to fp32 in registers (vpmovsxbd + vcvtdq2ps, both exact) and
// FMA'd into fp32 accumulators against x, with the per-row scale applied once at the end. Rows are
// processed four at a time so one x load feeds four weight rows (the next four are prefetched), and
// the x rows in tiles of up to three (a widened weight chunk feeds up to three x rows); rows are split
// across OpenMP threads (the same libgomp runtime torch uses, so no second thread pool).
//
// Exactness: int8 -> fp32 is exact and FMA rounds once per step, so the result is the exact
// product up to fp32 summation order: |err| <= (K + 2) * 2^-24 * (scale[n] * sum_k |x||w| + |bias[n]|).

#include <immintrin.h>
#include <stdint.h>

extern "C" {

int woq_int8_cpu_ok(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // extern "C"

namespace {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline __m256 widen8(const int8_t* p) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// R weight rows (R <= 4) times MT x rows (MT <= 3): y[m, n0 + r] for r < R, m < MT.
template <int R, int MT>
void block(const float* x, int64_t ldx, const int8_t* w, int64_t K, const float* scale,
           const float* bias, float* y, int64_t ldy, int64_t n0) {
    __m256 acc[MT][R];
    for (int m = 0; m < MT; ++m)
        for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
    const int8_t* wr[R];
    for (int r = 0; r < R; ++r) wr[r] = w + (n0 + r) * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        if ((k & 63) == 0)  // the next block's rows, one cache line each per 64 codes: measured 1.4-1.8x
            for (int r = 0; r < R; ++r)  // single-threaded from DRAM (prefetch never faults past the end)
                _mm_prefetch(reinterpret_cast<const char*>(wr[r] + k + 4 * K), _MM_HINT_T0);
        __m256 xv[MT];
        for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
        for (int r = 0; r < R; ++r) {
            __m256 wv = widen8(wr[r] + k);
            for (int m = 0; m < MT; ++m) acc[m][r] = _mm256_fmadd_ps(xv[m], wv, acc[m][r]);
        }
    }
    for (int m = 0; m < MT; ++m) {
        for (int r = 0; r < R; ++r) {
            float s = hsum(acc[m][r]);
            for (int64_t kk = k; kk < K; ++kk) s += x[m * ldx + kk] * static_cast<float>(wr[r][kk]);
            float v = s * scale[n0 + r];
            if (bias) v += bias[n0 + r];
            y[m * ldy + n0 + r] = v;
        }
    }
}

template <int R>
void rows(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scale,
          const float* bias, float* y, int64_t N, int64_t n0) {
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) block<R, 3>(x + m * K, K, w, K, scale, bias, y + m * N, N, n0);
    if (M - m == 2) block<R, 2>(x + m * K, K, w, K, scale, bias, y + m * N, N, n0);
    if (M - m == 1) block<R, 1>(x + m * K, K, w, K, scale, bias, y + m * N, N, n0);
}

}  // namespace

extern "C" {

// x [M, K] fp32, w [N, K] int8, scale [N] fp32, bias [N] fp32 or null, y [M, N] fp32; all contiguous.
void woq_int8_linear_f32(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scale,
                         const float* bias, float* y, int64_t N, int nthreads) {
    const int64_t blocks = (N + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t b = 0; b < blocks; ++b) {
        int64_t n0 = b * 4;
        switch (N - n0 >= 4 ? 4 : N - n0) {
            case 4: rows<4>(x, M, K, w, scale, bias, y, N, n0); break;
            case 3: rows<3>(x, M, K, w, scale, bias, y, N, n0); break;
            case 2: rows<2>(x, M, K, w, scale, bias, y, N, n0); break;
            default: rows<1>(x, M, K, w, scale, bias, y, N, n0); break;
        }
    }
}

}  // extern "C"
