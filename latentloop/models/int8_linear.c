/* Weight-only int8 linear layer for a few rows of float32 activations (decoding):
 *
 *     y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]
 *
 * x (M, K) float32, q (N, K) int8, scale (N,) float32, y (M, N) float32, all contiguous. Each weight
 * is read as one byte and widened to float in registers, so a decode step streams a quarter of the
 * bytes of the float layer; the products and sums stay float32 (the activations are not quantised).
 * The output rows n are split over `threads` OpenMP threads; every row of q is read once for all M
 * rows of x (it stays in L1 between them). Built by latentloop/models/native.py with the host's
 * -march=native; without AVX2 + FMA the plain loop below is what runs.
 */
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 widen8(const int8_t *q) { /* 8 int8 -> 8 float */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

static inline float dot(const float *x, const int8_t *q, int64_t K) {
    /* four independent accumulators: an FMA's latency is four of its issue slots */
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), widen8(q + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), widen8(q + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), widen8(q + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), widen8(q + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), widen8(q + k), a0);
    __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float sum = _mm_cvtss_f32(s);
    for (; k < K; ++k)
        sum += x[k] * (float)q[k];
    return sum;
}
#else
static inline float dot(const float *x, const int8_t *q, int64_t K) {
    float sum = 0.0f;
    for (int64_t k = 0; k < K; ++k)
        sum += x[k] * (float)q[k];
    return sum;
}
#endif

void latentloop_int8_linear(const float *x, const int8_t *q, const float *scale, float *y, int64_t M, int64_t N,
                            int64_t K, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const int8_t *row = q + n * K;
        for (int64_t m = 0; m < M; ++m)
            y[m * N + n] = dot(x + m * K, row, K) * scale[n];
    }
}
