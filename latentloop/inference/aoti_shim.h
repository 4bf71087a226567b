/* What the package builds of the kernels (LATENTLOOP_AOTI, linked with libtorch: see native.py) need
 * to be called by an ahead-of-time compiled decode step (aot.py) in place of an operator listed in
 * `aot_inductor.custom_ops_to_c_shims`: the few functions of libtorch's stable C interface
 * (torch/csrc/inductor/aoti_torch/c/shim.h) they use, declared here so that the build needs no torch
 * headers, a contiguity check, the result's allocation and the thread count. Included by
 * int8_linear.c, rows_linear.c, attention.c and aot_run.c. */
#ifndef LATENTLOOP_AOTI_SHIM_H
#define LATENTLOOP_AOTI_SHIM_H
#include <stdint.h>
#include "parallel.h"
#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct AtenTensorOpaque *AtenTensorHandle;
typedef int32_t AOTITorchError;
extern AOTITorchError aoti_torch_get_data_ptr(AtenTensorHandle tensor, void **data);
extern AOTITorchError aoti_torch_get_dim(AtenTensorHandle tensor, int64_t *dim);
extern AOTITorchError aoti_torch_get_sizes(AtenTensorHandle tensor, int64_t **sizes);
extern AOTITorchError aoti_torch_get_strides(AtenTensorHandle tensor, int64_t **strides);
extern AOTITorchError aoti_torch_get_dtype(AtenTensorHandle tensor, int32_t *dtype);
extern AOTITorchError aoti_torch_get_numel(AtenTensorHandle tensor, int64_t *numel);
extern AOTITorchError aoti_torch_new_tensor_handle(AtenTensorHandle tensor, AtenTensorHandle *new_handle);
extern AOTITorchError aoti_torch_delete_tensor_object(AtenTensorHandle tensor);
extern AOTITorchError aoti_torch_empty_strided(int64_t dim, const int64_t *sizes, const int64_t *strides,
                                               int32_t dtype, int32_t device_type, int32_t device_index,
                                               AtenTensorHandle *out);
extern int32_t aoti_torch_dtype_float32(void);
extern int32_t aoti_torch_dtype_float16(void);
extern int32_t aoti_torch_dtype_int8(void);
extern int32_t aoti_torch_dtype_bool(void);
extern int32_t aoti_torch_device_type_cpu(void);

#define MAX_DIMS 8
#define FAILED 1 /* AOTI_TORCH_FAILURE: the package raises */

static inline int contiguous(AtenTensorHandle t, int64_t dim) {
    int64_t *sizes, *strides, expected = 1;
    if (aoti_torch_get_sizes(t, &sizes) || aoti_torch_get_strides(t, &strides))
        return 0;
    for (int64_t d = dim - 1; d >= 0; --d) {
        if (sizes[d] != 1 && strides[d] != expected)
            return 0;
        expected *= sizes[d];
    }
    return 1;
}

/* The result of an operator with x's sizes but the last, which is `last`: (..., last) float32, contiguous. */
static inline AOTITorchError empty_like_rows(int64_t dim, const int64_t *x_sizes, int64_t last, AtenTensorHandle *out) {
    int64_t sizes[MAX_DIMS], strides[MAX_DIMS], stride = 1;
    for (int64_t d = 0; d < dim; ++d)
        sizes[d] = d == dim - 1 ? last : x_sizes[d];
    for (int64_t d = dim - 1; d >= 0; --d) {
        strides[d] = stride;
        stride *= sizes[d];
    }
    return aoti_torch_empty_strided(dim, sizes, strides, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(), 0,
                                    out);
}

/* Threads for a product of `macs` multiply-adds: torch's (it sets OpenMP's) from PARALLEL_MIN_MACS on. */
static inline int package_threads(int64_t macs) {
#ifdef _OPENMP
    if (macs >= PARALLEL_MIN_MACS)
        return omp_get_max_threads();
#endif
    (void)macs;
    return 1;
}
#endif
