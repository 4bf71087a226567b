/* The fastest plain read of memory a kernel can do, the ceiling a memory-bound decode step meets:
 *
 *     total = sum of x[0:n]
 *
 * Each of `threads` OpenMP threads (torch's pool: this library is loaded after torch) sums one
 * contiguous share of x, in order, into four independent vector accumulators (one would make the
 * add's latency the limit, not memory). GCC's vector type lowers to AVX-512, AVX2 or SSE, whichever
 * -march=native gives. Blocks of 64 floats; the tail past the last whole block is not read (n is
 * millions: the caller divides the bytes it reports accordingly). The sum is returned so the reads
 * cannot be optimised away. Built by `benchmarks/engines.py` (`read_ceiling`). */
#include <omp.h>
#include <stdint.h>

#define BLOCK 64 /* floats: four vectors of 16 */
typedef float v16 __attribute__((vector_size(64), aligned(4)));

float latentloop_bench_read(const float *x, int64_t n, int threads) {
    float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int64_t blocks = n / BLOCK, parts = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t first = blocks * me / parts, last = blocks * (me + 1) / parts;
        v16 a = {0}, b = {0}, c = {0}, d = {0};
        for (int64_t i = first; i < last; ++i) {
            const v16 *p = (const v16 *)(x + i * BLOCK);
            a += p[0];
            b += p[1];
            c += p[2];
            d += p[3];
        }
        v16 s = (a + b) + (c + d);
        for (int j = 0; j < 16; ++j)
            total += s[j];
    }
    return total;
}
