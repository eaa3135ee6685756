/* Host flavour of the kernel macros: each kernel is a plain C function that runs its
 * FOR_EACH sequentially (the emulator device). */
#include <math.h>
#define KERNEL(name) void name(const KernelArgs* args_)
#define KERNEL_TAKING(name, type) void name(const type* args_)
#define ARGS (args_)
#define DEVFN static inline
#define UNROLL
#define FOR_EACH(i, n) for (i64 i = 0; i < (i64)(n); ++i)
#define ATOMIC_ADD(address, value) (*(address) += (value))
/* Cooperative kernels: each thread a call with its FerrotronThread, run by the emulated
 * device (ferrotron_device::blocks), whose calls are its meetings and shared memory. */
#include "ferrotron_blocks.h"
#define BLOCK_KERNEL(name) void name(const KernelArgs* args_, FerrotronThread* thread_)
#define THREAD_PARAM FerrotronThread* thread_
#define THREAD thread_
#define THREAD_IDX ((i64)thread_->thread)
#define BLOCK_IDX ((i64)thread_->block)
#define BLOCK_DIM ((i64)thread_->threads)
#define GRID_DIM ((i64)thread_->blocks)
#define SYNC_THREADS() thread_->ops->barrier(thread_, __LINE__)
#define SYNC_WARP() thread_->ops->sync_warp(thread_, __LINE__)
#define SHARED(type, name, count) \
    type* name = (type*)thread_->ops->shared(thread_, sizeof(type) * (count), __LINE__)
#define SHARED_LOAD(array, index)                                                    \
    (thread_->ops->access(thread_, &(array)[index], sizeof((array)[index]), 0, __LINE__), \
     (array)[index])
#define SHARED_STORE(array, index, value)                                              \
    do {                                                                               \
        thread_->ops->access(thread_, &(array)[index], sizeof((array)[index]), 1, __LINE__); \
        (array)[index] = (value);                                                      \
    } while (0)
/* Products are never contracted on the host (built with -ffp-contract=off). */
#define MUL_RN_F32(a, b) ((a) * (b))
#define MUL_RN_F64(a, b) ((a) * (b))
/* The bits of a float and back (16-bit conversions in half.h). */
DEVFN unsigned int float_bits(float x) {
    union { float f; unsigned int u; } pun;
    pun.f = x;
    return pun.u;
}
DEVFN float bits_float(unsigned int u) {
    union { float f; unsigned int u; } pun;
    pun.u = u;
    return pun.f;
}
/* A whole-warp xor shuffle: every lane gets the value of lane (its lane ^ mask). */
DEVFN float shfl_xor_f32(FerrotronThread* t, float v, int mask, int line) {
    int lane = (int)(t->thread % 32u) ^ mask;
    return bits_float((unsigned int)t->ops->shuffle(t, float_bits(v), lane, line));
}
DEVFN double shfl_xor_f64(FerrotronThread* t, double v, int mask, int line) {
    union { double d; u64 u; } pun;
    pun.d = v;
    pun.u = t->ops->shuffle(t, pun.u, (int)(t->thread % 32u) ^ mask, line);
    return pun.d;
}
#define SHFL_XOR_F32(v, mask) shfl_xor_f32(thread_, (v), (mask), __LINE__)
#define SHFL_XOR_F64(v, mask) shfl_xor_f64(thread_, (v), (mask), __LINE__)
/* A whole-warp butterfly reduction (the five xor shuffles of prelude_cuda.h's, with the
 * same operations in the same order) in one meeting of the warp's lanes. */
DEVFN float warp_reduce_f32(FerrotronThread* t, float v, int kind, int line) {
    return bits_float((unsigned int)t->ops->reduce(t, float_bits(v), kind, line));
}
DEVFN double warp_reduce_f64(FerrotronThread* t, double v, int kind, int line) {
    union { double d; u64 u; } pun;
    pun.d = v;
    pun.u = t->ops->reduce(t, pun.u, kind, line);
    return pun.d;
}
#define WARP_SUM_F32(v) warp_reduce_f32(thread_, (v), 0, __LINE__)
#define WARP_MAX_F32(v) warp_reduce_f32(thread_, (v), 1, __LINE__)
#define WARP_SUM_F64(v) warp_reduce_f64(thread_, (v), 2, __LINE__)
#define WARP_MAX_F64(v) warp_reduce_f64(thread_, (v), 3, __LINE__)
/* Warp-level matrix instructions (tensor cores), run by the emulator with the PTX ISA's
 * fragment layouts: MMA_16816(kind, d, a, b, c) is mma.m16n8k16 with kind 1 bf16 or 2
 * f16 inputs and f32 accumulators (d may be c); LDMATRIX_X<n>[_TRANS](out, address)
 * loads n 8x8 matrices of 16-bit elements from shared memory, address this lane's row. */
#define MMA_16816(kind, d, a, b, c) \
    thread_->ops->mma(thread_, (kind), (a), (b), (c), (d), __LINE__)
#define LDMATRIX_X4(out, address) \
    thread_->ops->ldmatrix(thread_, 4, 0, (address), (out), __LINE__)
#define LDMATRIX_X4_TRANS(out, address) \
    thread_->ops->ldmatrix(thread_, 4, 1, (address), (out), __LINE__)
/* Sixteen bytes, as shared-memory tiles of 16-bit elements move (aligned to 16). */
typedef struct {
    _Alignas(16) unsigned int x;
    unsigned int y, z, w;
} u32x4;
