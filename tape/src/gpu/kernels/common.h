/* Tape's kernels' argument blocks and helpers (the kernel language itself, shared with
 * every crate's kernels, is the device crate's: ferrotron_kernels.h for the host build,
 * ferrotron_device::kernels::CUDA_PRELUDE for NVRTC). */

/* Device addresses, integer and floating arguments; the meaning of each slot is
 * documented at the kernel and mirrored by the Rust caller. */
typedef struct {
    u64 p[8];
    i64 i[32];
    double f[8];
} KernelArgs;

/* The argument block of a kernel over a list of tensors (a multi-tensor optimizer step),
 * taken with KERNEL_TAKING: up to LIST_TENSORS tensors, each with five addresses and
 * three numbers; element j of the launch is in the tensor t with
 * start[t] <= j < start[t + 1]. */
#define LIST_TENSORS 48
typedef struct {
    u64 p[LIST_TENSORS][5];
    i64 start[LIST_TENSORS + 1];
    double per_tensor[LIST_TENSORS][3];
    double shared[4];
    i64 count;
    i64 format;
} TensorListArgs;

#define MAX_DIMS 8

/* The flat offset of element `index` of a row-major `shape` in a tensor with `strides`. */
#define STRIDED_OFFSET(result, index, ndim, shape, strides)            \
    do {                                                               \
        i64 rest_ = (index);                                           \
        i64 off_ = 0;                                                  \
        for (int d_ = (int)(ndim) - 1; d_ >= 0; --d_) {                \
            off_ += (rest_ % (shape)[d_]) * (strides)[d_];             \
            rest_ /= (shape)[d_];                                      \
        }                                                              \
        (result) = off_;                                               \
    } while (0)
