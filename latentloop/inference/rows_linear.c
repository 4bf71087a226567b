/* A linear layer for a block of rows (a short prefill), float32 or int8 weights:
 *
 *     y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]          (scale = 1 for float32 weights)
 *
 * x (M, K) float32, w (N, K) float32 or int8, scale (N,) float32, y (M, N) float32, all contiguous.
 *
 * Why not BLAS: for a few rows the product's cost is streaming the weight, which a prefill reads
 * cold (the layers before evicted it). MKL's sgemm reads a cold weight with 16 rows at a few GB/s
 * (its time for one 4 x 256 model's products doubles against the same products on a weight in
 * cache); here every weight row is read once, in order, for all the rows of x. The rows of x are
 * the vector lanes (an outer product): x is transposed once to (K, rows), each weight element is
 * broadcast against one vector of rows, and TILE weight rows accumulate side by side in registers.
 * The sums run over k in order, float32, like a dot product's: the result agrees with BLAS to
 * float32 rounding, not bit for bit.
 *
 * int8: each tile's rows are widened to float once into a buffer of the thread's (L1/L2), then the
 * same loop runs; the scale is applied at the end, as `int8_linear.c` does.
 *
 * Up to 8 rows with AVX-512 (and an even K), each vector holds two k of 8 rows instead (`tile_pairs`):
 * half the broadcasts and multiply-adds, which bound the plain tile (on AMD's Zen 4 it runs 92-97
 * GFLOP/s at 16 rows with the weight in the L2, and that rate times the share of lanes used below:
 * a verification's 5-9 rows read the weights at 7-9 GB/s where one row's reduction streams 28).
 *
 * The weight tiles are split over `threads` OpenMP threads (torch's pool, see native.py). Built with
 * the host's -march=native: 16 lanes with AVX-512, 8 with AVX2 + FMA, a plain loop otherwise.
 *
 * LATENTLOOP_AOTI (the library's second build, linked with libtorch): `aoti_torch_cpu_rows_linear`,
 * the C function an ahead-of-time compiled decode step (aot.py) calls for `latentloop::rows_linear`
 * (a batch's or a verification's products of 5 to 64 rows) in place of torch's matrix product.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 12 /* weight rows accumulated at once: 12 vectors + the row vector fit 16 registers */

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
typedef __m512 vec;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_load_ps(p)
#define vfma_scalar(s, v, acc) _mm512_fmadd_ps(_mm512_set1_ps(s), v, acc)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
typedef __m256 vec;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_load_ps(p)
#define vfma_scalar(s, v, acc) _mm256_fmadd_ps(_mm256_set1_ps(s), v, acc)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#else
#define LANES 1
typedef float vec;
#define vzero() 0.0f
#define vload(p) (*(p))
#define vfma_scalar(s, v, acc) ((acc) + (s) * (v))
#define vstore(p, v) (*(p) = (v))
#endif

#define ALIGN 64

#define LINE 64 /* bytes in a cache line */

/* y[:, n0:n0 + rows] for TILE weight rows `w` (float, K apart; rows past `rows` repeat the last and
 * are not stored) against the transposed, lane-padded x `xt` (K, padded). `ahead` (`ahead_bytes`
 * long, may be empty) is the next tile's weight, prefetched a line per step of k while this one
 * computes: without it the TILE streams of a cold weight wait on memory (the loop ran at half its
 * speed on a weight in cache). */
static void tile(const float *xt, const float *w, const float *scale, float *y, int64_t M, int64_t N, int64_t K,
                 int64_t padded, int64_t n0, int64_t rows, const char *ahead, int64_t ahead_bytes) {
    const float *r[TILE];
    for (int j = 0; j < TILE; ++j)
        r[j] = w + (j < rows ? j : rows - 1) * K;
    for (int64_t m0 = 0; m0 < padded; m0 += LANES) {
        vec acc[TILE];
        for (int j = 0; j < TILE; ++j)
            acc[j] = vzero();
        for (int64_t k = 0; k < K; ++k) {
            if (m0 == 0 && k * LINE < ahead_bytes)
                __builtin_prefetch(ahead + k * LINE);
            vec xv = vload(xt + k * padded + m0);
            for (int j = 0; j < TILE; ++j)
                acc[j] = vfma_scalar(r[j][k], xv, acc[j]);
        }
        float out[LANES];
        int64_t lanes = M - m0 < LANES ? M - m0 : LANES;
        for (int64_t j = 0; j < rows; ++j) {
            vstore(out, acc[j]);
            float s = scale ? scale[n0 + j] : 1.0f;
            for (int64_t m = 0; m < lanes; ++m)
                y[(m0 + m) * N + n0 + j] = out[m] * s;
        }
    }
}

/* x (M, K) -> (K, padded) with the rows past M zero; NULL when out of memory. */
static float *transposed(const float *x, int64_t M, int64_t K, int64_t padded) {
    float *xt = aligned_alloc(ALIGN, (size_t)((K * padded * sizeof(float) + ALIGN - 1) / ALIGN * ALIGN));
    if (!xt)
        return NULL;
    for (int64_t k = 0; k < K; ++k) {
        float *row = xt + k * padded;
        for (int64_t m = 0; m < M; ++m)
            row[m] = x[m * K + k];
        for (int64_t m = M; m < padded; ++m)
            row[m] = 0.0f;
    }
    return xt;
}

#if LANES == 16
/* Up to 8 rows with AVX-512: two k per vector, so each broadcast and multiply-add takes two weight
 * elements where the plain tile takes one and leaves half its lanes empty. Lane 2m + i holds row m's
 * x[m, 2k2 + i] (`paired`); a 64-bit broadcast of w[n, 2k2], w[n, 2k2 + 1] meets it, and y[m, n] is
 * the sum of lanes 2m and 2m + 1 (the even k's sum and the odd k's: another order than the plain
 * tile's, float32 rounding apart). K even. */
#define PAIR_MAX_ROWS (LANES / 2)
static void tile_pairs(const float *xp, const float *w, float *y, int64_t M, int64_t N, int64_t K, int64_t n0,
                       int64_t rows, const char *ahead, int64_t ahead_bytes) {
    const float *r[TILE];
    for (int j = 0; j < TILE; ++j)
        r[j] = w + (j < rows ? j : rows - 1) * K;
    vec acc[TILE];
    for (int j = 0; j < TILE; ++j)
        acc[j] = vzero();
    for (int64_t k2 = 0; k2 < K / 2; ++k2) {
        if (k2 * 2 * LINE < ahead_bytes) /* two lines a step: K / 2 steps cover the next tile's TILE * K * 4 bytes */
            __builtin_prefetch(ahead + k2 * 2 * LINE);
        if (k2 * 2 * LINE + LINE < ahead_bytes)
            __builtin_prefetch(ahead + k2 * 2 * LINE + LINE);
        vec xv = vload(xp + k2 * LANES);
        for (int j = 0; j < TILE; ++j) {
            double pair;
            memcpy(&pair, r[j] + 2 * k2, sizeof pair);
            acc[j] = _mm512_fmadd_ps(_mm512_castpd_ps(_mm512_set1_pd(pair)), xv, acc[j]);
        }
    }
    float out[LANES];
    for (int64_t j = 0; j < rows; ++j) {
        vstore(out, acc[j]);
        for (int64_t m = 0; m < M; ++m)
            y[m * N + n0 + j] = out[2 * m] + out[2 * m + 1];
    }
}

/* x (M, K), M <= PAIR_MAX_ROWS, K even -> (K / 2, LANES): lane 2m + i of row k2 is x[m, 2k2 + i], the
 * lanes past 2M zero; NULL when out of memory. */
static float *paired(const float *x, int64_t M, int64_t K) {
    float *xp = aligned_alloc(ALIGN, (size_t)((K / 2 * LANES * sizeof(float) + ALIGN - 1) / ALIGN * ALIGN));
    if (!xp)
        return NULL;
    for (int64_t k2 = 0; k2 < K / 2; ++k2) {
        float *row = xp + k2 * LANES;
        for (int64_t m = 0; m < PAIR_MAX_ROWS; ++m) {
            row[2 * m] = m < M ? x[m * K + 2 * k2] : 0.0f;
            row[2 * m + 1] = m < M ? x[m * K + 2 * k2 + 1] : 0.0f;
        }
    }
    return xp;
}
#else
#define PAIR_MAX_ROWS 0
#endif

/* The rows one vector holds (1: a plain loop, see native.py's ROWS_MIN_LANES). */
int latentloop_rows_linear_lanes(void) { return LANES; }

/* Both return 0, or -1 when a buffer could not be allocated (y is then not written). */
int latentloop_rows_linear_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                               int threads) {
    int64_t padded = (M + LANES - 1) / LANES * LANES;
#if PAIR_MAX_ROWS
    int pairs = M <= PAIR_MAX_ROWS && K % 2 == 0;
    float *xt = pairs ? paired(x, M, K) : transposed(x, M, K, padded);
#else
    float *xt = transposed(x, M, K, padded);
#endif
    if (!xt)
        return -1;
    int64_t tiles = (N + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
        int64_t n0 = t * TILE, rows = N - n0 < TILE ? N - n0 : TILE;
        int64_t next = N - n0 - rows < TILE ? N - n0 - rows : TILE; /* rows of the next tile */
        const char *ahead = (const char *)(w + (n0 + rows) * K);
        int64_t ahead_bytes = next * K * (int64_t)sizeof(float);
#if PAIR_MAX_ROWS
        if (pairs) {
            tile_pairs(xt, w + n0 * K, y, M, N, K, n0, rows, ahead, ahead_bytes);
            continue;
        }
#endif
        tile(xt, w + n0 * K, NULL, y, M, N, K, padded, n0, rows, ahead, ahead_bytes);
    }
    free(xt);
    return 0;
}

int latentloop_rows_linear_i8(const float *x, const int8_t *q, const float *scale, float *y, int64_t M, int64_t N,
                              int64_t K, int threads) {
    int64_t padded = (M + LANES - 1) / LANES * LANES;
    float *xt = transposed(x, M, K, padded);
    if (!xt)
        return -1;
    int64_t tiles = (N + TILE - 1) / TILE;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *wide = malloc((size_t)(TILE * K) * sizeof(float)); /* this thread's widened tile */
        if (!wide) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            if (!wide)
                continue;
            int64_t n0 = t * TILE, rows = N - n0 < TILE ? N - n0 : TILE;
            const int8_t *src = q + n0 * K;
            for (int64_t i = 0; i < rows * K; ++i)
                wide[i] = (float)src[i];
            tile(xt, wide, scale, y, M, N, K, padded, n0, rows, NULL, 0); /* int8 is read in order */
        }
        free(wide);
    }
    free(xt);
    return failed ? -1 : 0;
}

#ifdef LATENTLOOP_AOTI
#include "aoti_shim.h"

/* latentloop::rows_linear(x (..., K) float32, weight (N, K) float32) -> (..., N), as AOTInductor calls
 * an operator listed in `aot_inductor.custom_ops_to_c_shims`. */
AOTITorchError aoti_torch_cpu_rows_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle *out) {
    int64_t dim, weight_dim, *x_sizes, *w_sizes;
    int32_t x_type, w_type;
    if (aoti_torch_get_dim(x, &dim) || aoti_torch_get_dim(weight, &weight_dim) || dim < 1 || dim > MAX_DIMS ||
        weight_dim != 2 || aoti_torch_get_sizes(x, &x_sizes) || aoti_torch_get_sizes(weight, &w_sizes) ||
        aoti_torch_get_dtype(x, &x_type) || aoti_torch_get_dtype(weight, &w_type))
        return FAILED;
    int64_t N = w_sizes[0], K = w_sizes[1], M = 1;
    if (x_sizes[dim - 1] != K || x_type != aoti_torch_dtype_float32() || w_type != aoti_torch_dtype_float32() ||
        !contiguous(x, dim) || !contiguous(weight, 2))
        return FAILED;
    for (int64_t d = 0; d < dim - 1; ++d)
        M *= x_sizes[d];
    void *x_data, *w_data, *y_data;
    if (empty_like_rows(dim, x_sizes, N, out) || aoti_torch_get_data_ptr(x, &x_data) ||
        aoti_torch_get_data_ptr(weight, &w_data) || aoti_torch_get_data_ptr(*out, &y_data))
        return FAILED;
    int threads = package_threads(M * N * K);
    if (M > 0 && N > 0 && latentloop_rows_linear_f32(x_data, w_data, y_data, M, N, K, threads))
        return FAILED;
    return 0;
}
#endif
