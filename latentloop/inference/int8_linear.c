/* Weight-only int8 linear layer for a few rows of float32 activations (decoding):
 *
 *     y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]
 *
 * x (M, K) float32, q (N, K) int8, scale (N,) float32, y (M, N) float32, all contiguous. A decode
 * step streams each weight once as bytes: a quarter of the float layer's traffic.
 *
 * With AVX-512 VNNI and the weight packed for it (`packed`, made by quant.pack_weight: q + 128 as
 * unsigned bytes, laid out [N / 16][K / 4][16][4]) the products are integer: one `vpdpbusd` sums
 * 4 k's of 16 output rows (64 byte products) into the 16 int32 lanes of those rows, so a block of 16
 * outputs needs no horizontal sum. The activations are not rounded to int8 as an int8 x int8
 * engine does (CTranslate2's int8): each row of x is written in base 254 with DIGITS signed digits,
 *
 *     x[k] = s * (d0[k] + d1[k] / 254 + d2[k] / 254^2),   s = max_k |x[k]| / 127,
 *
 * which keeps ~23 bits relative to the row's largest element (float32 has 24); each digit's sum is
 * exact in int32, and the three are combined in float at the end. The weights' + 128 is taken off
 * as 128 * (sum of the row's digits). The result agrees with the float path and with `F.linear`
 * over the dequantised weight to float32 rounding (the tests hold all to one tolerance) for rows of
 * activations of one scale. It is fixed point, though: an element 2^b times smaller than the row's
 * largest keeps 23 - b bits, so where one channel is 10^4 times the rest (the "massive activations"
 * of trained LLMs) outputs that barely read it err by up to 4e-4 of the largest output, against 1e-7 for
 * the float path (measured with K = N = 768).
 *
 * Otherwise (no VNNI, or no packed weight): each weight widened to float in registers (AVX2 + FMA,
 * 8 lanes), float32 products and sums; without AVX2 the plain loop.
 *
 * The output rows are split over `threads` OpenMP threads (torch's pool: see native.py), so that
 * every output is summed by one thread in one order whatever the thread count. Built by
 * latentloop/inference/native.py with the host's -march=native.
 *
 * LATENTLOOP_AOTI (the library's second build, linked with libtorch): `aoti_torch_cpu_int8_linear`,
 * the C function an ahead-of-time compiled decode step (aot.py) calls for `latentloop::int8_linear`
 * in place of a reduction inductor writes itself.
 */
#include <math.h> /* NAN */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "parallel.h" /* PARALLEL_MIN_MACS */
#define LANE_ROWS 16 /* output rows in one vector of int32 lanes (the packed layout's blocks) */
#define GROUP 4      /* k's a lane sums per vpdpbusd (the packed layout's inner dimension) */
#define GROUP_BYTES (LANE_ROWS * GROUP) /* one group of a block: a vpdpbusd's weight operand */

int64_t latentloop_int8_packed_bytes(int64_t N, int64_t K) {
    return (N + LANE_ROWS - 1) / LANE_ROWS * LANE_ROWS * ((K + GROUP - 1) / GROUP * GROUP);
}

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

static void float_product(const float *x, const int8_t *q, const float *scale, float *y, int64_t M, int64_t N,
                          int64_t K, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const int8_t *row = q + n * K; /* read once for all M rows of x: it stays in L1 between them */
        for (int64_t m = 0; m < M; ++m)
            y[m * N + n] = dot(x + m * K, row, K) * scale[n];
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VNNI 1
#define DIGITS 3 /* lanes() is written out for 3 */
#define DIGIT_BASE 254.0f /* a remainder in [-0.5, 0.5] times this is a digit in [-127, 127] */
#define DIGIT_MAX 127.0f
#define WEIGHT_OFFSET 128 /* the packed weight is q + 128: vpdpbusd's unsigned operand */

static inline __mmask16 live16(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* The digits of one row x (K) into `digits` (DIGITS rows of `padded` signed bytes, a multiple of 16
 * and at least the packed weight's K, zero past K) and
 * each digit row's sum into `sums`; returns the row's scale s. */
static float split_row(const float *x, int64_t K, int64_t padded, int8_t *digits, int32_t *sums) {
    __m512 top = _mm512_setzero_ps();
    __mmask16 nonfinite = 0; /* max_ps drops a NaN operand: x - x is NaN exactly where x is NaN or inf */
    for (int64_t k = 0; k < K; k += 16) {
        __m512 v = _mm512_maskz_loadu_ps(live16(K - k), x + k);
        top = _mm512_max_ps(top, _mm512_abs_ps(v));
        nonfinite |= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_UNORD_Q);
    }
    float largest = _mm512_reduce_max_ps(top);
    /* a row holding NaN or inf: its scale NaN makes each of its outputs NaN, as the float product's
     * non-finite sums would be, where digits of NaN would have been finite numbers */
    float s = nonfinite ? NAN : largest > 0.0f ? largest / DIGIT_MAX : 1.0f;
    const __m512 inverse = _mm512_set1_ps(1.0f / s), base = _mm512_set1_ps(DIGIT_BASE);
    const __m512 hi = _mm512_set1_ps(DIGIT_MAX), lo = _mm512_set1_ps(-DIGIT_MAX);
    __m512 total[DIGITS]; /* digits are integers below 2^7: float sums exact below 2^17 elements */
    for (int d = 0; d < DIGITS; ++d)
        total[d] = _mm512_setzero_ps();
    for (int64_t k = 0; k < padded; k += 16) {
        __m512 rest = _mm512_mul_ps(_mm512_maskz_loadu_ps(live16(K - k), x + k), inverse);
        for (int d = 0; d < DIGITS; ++d) {
            __m512 digit = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(rest, _MM_FROUND_TO_NEAREST_INT)));
            _mm_storeu_si128((__m128i *)(digits + d * padded + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(digit)));
            total[d] = _mm512_add_ps(total[d], digit);
            rest = _mm512_mul_ps(_mm512_sub_ps(rest, digit), base);
        }
    }
    for (int d = 0; d < DIGITS; ++d)
        sums[d] = (int32_t)_mm512_reduce_add_ps(total[d]);
    return s;
}

static inline __m512i broadcast4(const int8_t *p) { /* 4 digits -> every int32 lane */
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* One digit's sums as float, the weights' offset taken off (exact in int32). */
static inline __m512 unbiased(__m512i even, __m512i odd, int32_t digit_sum) {
    __m512i sum = _mm512_add_epi32(even, odd);
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, _mm512_set1_epi32(WEIGHT_OFFSET * digit_sum)));
}

/* Outputs n0 .. n0 + 16 of one row of x (its digits, their sums, scale s) from the packed block
 * `w` (groups x GROUP_BYTES). Even and odd groups go to separate accumulators: six chains of
 * vpdpbusd, so that the instruction's latency is hidden. */
static void lanes(const int8_t *digits, int64_t groups, int64_t padded, const int32_t *sums, float s,
                  const uint8_t *w, const float *scale, float *y, int64_t n0, int64_t N) {
    const int8_t *d0 = digits, *d1 = digits + padded, *d2 = digits + 2 * padded;
    __m512i e0 = _mm512_setzero_si512(), e1 = e0, e2 = e0, o0 = e0, o1 = e0, o2 = e0;
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
        __m512i we = _mm512_loadu_si512(w + g * GROUP_BYTES), wo = _mm512_loadu_si512(w + (g + 1) * GROUP_BYTES);
        e0 = _mm512_dpbusd_epi32(e0, we, broadcast4(d0 + g * GROUP));
        e1 = _mm512_dpbusd_epi32(e1, we, broadcast4(d1 + g * GROUP));
        e2 = _mm512_dpbusd_epi32(e2, we, broadcast4(d2 + g * GROUP));
        o0 = _mm512_dpbusd_epi32(o0, wo, broadcast4(d0 + g * GROUP + GROUP));
        o1 = _mm512_dpbusd_epi32(o1, wo, broadcast4(d1 + g * GROUP + GROUP));
        o2 = _mm512_dpbusd_epi32(o2, wo, broadcast4(d2 + g * GROUP + GROUP));
    }
    if (g < groups) {
        __m512i we = _mm512_loadu_si512(w + g * GROUP_BYTES);
        e0 = _mm512_dpbusd_epi32(e0, we, broadcast4(d0 + g * GROUP));
        e1 = _mm512_dpbusd_epi32(e1, we, broadcast4(d1 + g * GROUP));
        e2 = _mm512_dpbusd_epi32(e2, we, broadcast4(d2 + g * GROUP));
    }
    __m512 total = _mm512_fmadd_ps(unbiased(e2, o2, sums[2]), _mm512_set1_ps(1.0f / (DIGIT_BASE * DIGIT_BASE)),
                                   _mm512_fmadd_ps(unbiased(e1, o1, sums[1]), _mm512_set1_ps(1.0f / DIGIT_BASE),
                                                   unbiased(e0, o0, sums[0])));
    __mmask16 live = live16(N - n0);
    __m512 scaled = _mm512_mul_ps(_mm512_mul_ps(total, _mm512_set1_ps(s)), _mm512_maskz_loadu_ps(live, scale + n0));
    _mm512_mask_storeu_ps(y + n0, live, scaled);
}

/* Returns 1 (and computes nothing) when its buffers cannot be allocated: the caller's float path runs. */
static int packed_product(const float *x, const uint8_t *packed, const float *scale, float *y, int64_t M,
                          int64_t N, int64_t K, int threads) {
    const int64_t groups = (K + GROUP - 1) / GROUP, padded = (groups * GROUP + 15) / 16 * 16;
    int8_t *digits = malloc((size_t)(M * DIGITS * padded) + 1);
    int32_t *sums = malloc((size_t)(M * DIGITS) * sizeof(int32_t) + 1);
    float *s = malloc((size_t)M * sizeof(float) + 1);
    if (digits == NULL || sums == NULL || s == NULL) {
        free(digits);
        free(sums);
        free(s);
        return 1;
    }
    for (int64_t m = 0; m < M; ++m)
        s[m] = split_row(x + m * K, K, padded, digits + m * DIGITS * padded, sums + m * DIGITS);
    const int64_t blocks = (N + LANE_ROWS - 1) / LANE_ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b)
        for (int64_t m = 0; m < M; ++m) /* the block stays in L1 between the rows of x */
            lanes(digits + m * DIGITS * padded, groups, padded, sums + m * DIGITS, s[m], packed + b * groups * GROUP_BYTES,
                  scale, y + m * N, b * LANE_ROWS, N);
    free(digits);
    free(sums);
    free(s);
    return 0;
}
#else
#define VNNI 0
#endif

/* 2: VNNI digits over a packed weight, 1: AVX2 float, 0: plain loop (what this build runs with a
 * packed weight; for quant.py, which packs only for 2, and for the tests). */
int latentloop_int8_linear_path(void) {
#if VNNI
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

int latentloop_parallel_min_macs(void) { return PARALLEL_MIN_MACS; }

/* `packed` NULL (or a build without VNNI): the float path over q. */
static void product(const float *x, const int8_t *q, const uint8_t *packed, const float *scale, float *y, int64_t M,
                    int64_t N, int64_t K, int threads) {
#if VNNI
    if (packed != NULL && packed_product(x, packed, scale, y, M, N, K, threads) == 0)
        return;
#endif
    (void)packed;
    float_product(x, q, scale, y, M, N, K, threads);
}

void latentloop_int8_linear(const float *x, const int8_t *q, const uint8_t *packed, const float *scale, float *y,
                            int64_t M, int64_t N, int64_t K, int threads) {
    product(x, q, packed, scale, y, M, N, K, threads);
}

#ifdef LATENTLOOP_AOTI
#include "aoti_shim.h"

/* latentloop::int8_linear(x (..., K) float32, weight_int8 (N, K) int8, scale (N,) float32, packed uint8
 * (quant.pack_weight's, or empty)) -> (..., N), as AOTInductor calls an operator listed in
 * `aot_inductor.custom_ops_to_c_shims`. */
AOTITorchError aoti_torch_cpu_int8_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle scale,
                                          AtenTensorHandle packed, AtenTensorHandle *out) {
    int64_t dim, weight_dim, packed_dim, *x_sizes, *w_sizes, *p_sizes;
    int32_t x_type, w_type, s_type;
    if (aoti_torch_get_dim(x, &dim) || aoti_torch_get_dim(weight, &weight_dim) || dim < 1 || dim > MAX_DIMS ||
        weight_dim != 2 || aoti_torch_get_sizes(x, &x_sizes) || aoti_torch_get_sizes(weight, &w_sizes) ||
        aoti_torch_get_dtype(x, &x_type) || aoti_torch_get_dtype(weight, &w_type) ||
        aoti_torch_get_dtype(scale, &s_type) || aoti_torch_get_dim(packed, &packed_dim) ||
        aoti_torch_get_sizes(packed, &p_sizes))
        return FAILED;
    int64_t N = w_sizes[0], K = w_sizes[1], M = 1, packed_bytes = 1;
    for (int64_t d = 0; d < packed_dim; ++d)
        packed_bytes *= p_sizes[d];
    if (x_sizes[dim - 1] != K || x_type != aoti_torch_dtype_float32() || w_type != aoti_torch_dtype_int8() ||
        s_type != aoti_torch_dtype_float32() || !contiguous(x, dim) || !contiguous(weight, 2) ||
        !contiguous(scale, 1) || !contiguous(packed, packed_dim))
        return FAILED;
    for (int64_t d = 0; d < dim - 1; ++d)
        M *= x_sizes[d];
    void *x_data, *w_data, *s_data, *p_data, *y_data;
    if (empty_like_rows(dim, x_sizes, N, out) || aoti_torch_get_data_ptr(x, &x_data) ||
        aoti_torch_get_data_ptr(weight, &w_data) || aoti_torch_get_data_ptr(scale, &s_data) || aoti_torch_get_data_ptr(packed, &p_data) ||
        aoti_torch_get_data_ptr(*out, &y_data))
        return FAILED;
    int threads = package_threads(M * N * K);
    if (M > 0 && N > 0)
        product(x_data, w_data, packed_bytes == latentloop_int8_packed_bytes(N, K) ? p_data : NULL, s_data, y_data,
                M, N, K, threads);
    return 0;
}
#endif
