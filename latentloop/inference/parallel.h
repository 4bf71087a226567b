/* What the kernels (int8_linear.c, rows_linear.c) share about threads: below this many multiply-adds
 * a product runs on one thread, waking the others costs more than it saves. native.py's
 * PARALLEL_MIN_MACS (a test checks the two agree, through int8_linear.c's
 * `latentloop_parallel_min_macs`). */
#ifndef LATENTLOOP_PARALLEL_H
#define LATENTLOOP_PARALLEL_H
#define PARALLEL_MIN_MACS (1 << 16)
#endif
