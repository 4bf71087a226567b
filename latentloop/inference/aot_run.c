/* One decode step of an ahead-of-time package (aot.py), called through ctypes with everything it needs
 * made once: the model library's run function and container, a handle of each input tensor, and the
 * tensors its outputs are copied into.
 *
 * Why: a step through the library's C interface takes a new handle (`at::Tensor*`) of every input and
 * gives new tensors back. Made in Python, 14 handles and 2 result tensors cost 20-40 us a step at the
 * engines benchmark's small shape (1 thread), where the step's kernel takes 300-350 us; the Python that
 * runs after the kernel finds its caches flushed by the weights the kernel streamed. Here a step is one
 * foreign call: new handles of held ones (a reference count each), the run, a copy of each output
 * (a row of logits and the greedy ids) into the caller's tensors, and the outputs freed.
 *
 * Built for packages only (LATENTLOOP_AOTI: linked with libtorch, whose C interface it calls). */
#ifdef LATENTLOOP_AOTI
#include <stddef.h>
#include <string.h>
#include "aoti_shim.h"

/* AOTInductorModelContainerRun (torch's aoti_runtime/interface.h): inputs taken over, outputs new. */
typedef int32_t (*ContainerRun)(void *container, AtenTensorHandle *inputs, size_t n_inputs,
                                AtenTensorHandle *outputs, size_t n_outputs, void *stream, void *proxy_executor);

#define MAX_HANDLES 4096 /* far above any cache's tensors (a few per layer); more returns TOO_MANY */

enum { DONE = 0, NO_HANDLE = 1, RUN_FAILED = 2, OUTPUT_MISMATCH = 3, TOO_MANY = 4 };

/* `output` has `into`'s element count and dtype, and both are contiguous: `into` can take its bytes. */
static int same_layout(AtenTensorHandle output, AtenTensorHandle into) {
    int64_t count, into_count, dim, into_dim;
    int32_t type, into_type;
    return !aoti_torch_get_numel(output, &count) && !aoti_torch_get_numel(into, &into_count) &&
           !aoti_torch_get_dtype(output, &type) && !aoti_torch_get_dtype(into, &into_type) &&
           !aoti_torch_get_dim(output, &dim) && !aoti_torch_get_dim(into, &into_dim) && count == into_count &&
           type == into_type && contiguous(output, dim) && contiguous(into, into_dim);
}

/* A step: the library's `run` on `container`, its inputs new handles of `held` (which the library
 * takes over), its output j copied into the tensor of `into[j]` (`into_bytes[j]` bytes: its element
 * count times its element size) and freed. Returns DONE, or what went wrong (RUN_FAILED: the library's
 * last error says why); the outputs are freed in every case. */
int latentloop_aot_run(ContainerRun run, void *container, AtenTensorHandle const *held, size_t n_inputs,
                       AtenTensorHandle const *into, const int64_t *into_bytes, size_t n_outputs) {
    if (n_inputs > MAX_HANDLES || n_outputs > MAX_HANDLES)
        return TOO_MANY;
    AtenTensorHandle inputs[n_inputs > 0 ? n_inputs : 1], outputs[n_outputs > 0 ? n_outputs : 1];
    for (size_t i = 0; i < n_inputs; ++i) {
        if (aoti_torch_new_tensor_handle(held[i], &inputs[i])) {
            while (i > 0)
                aoti_torch_delete_tensor_object(inputs[--i]);
            return NO_HANDLE;
        }
    }
    if (run(container, inputs, n_inputs, outputs, n_outputs, NULL, NULL))
        return RUN_FAILED;
    int status = DONE;
    for (size_t j = 0; j < n_outputs; ++j) {
        void *source, *target;
        if (!same_layout(outputs[j], into[j]) || aoti_torch_get_data_ptr(outputs[j], &source) ||
            aoti_torch_get_data_ptr(into[j], &target))
            status = OUTPUT_MISMATCH;
        else
            memcpy(target, source, (size_t)into_bytes[j]);
        aoti_torch_delete_tensor_object(outputs[j]);
    }
    return status;
}
#endif
