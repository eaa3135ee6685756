/* One thread of a cooperative kernel as the emulated device runs it: what the host build
 * of such a kernel takes beside its argument, and the calls through which its threads
 * meet (block barriers, warp shuffles and syncs) and use the block's shared memory.
 * Laid out as ferrotron_device::Thread (device/src/blocks.rs); kernels reach it through
 * the macros of their own prelude, never directly. */
#ifndef FERROTRON_BLOCKS_H
#define FERROTRON_BLOCKS_H

typedef struct FerrotronThread FerrotronThread;

typedef struct {
    /* __syncthreads(): returns once every thread of the block has reached it. */
    void (*barrier)(FerrotronThread* thread, int line);
    /* __syncwarp(): returns once every lane of the thread's warp has reached it. */
    void (*sync_warp)(FerrotronThread* thread, int line);
    /* __shfl_sync over the whole warp: every lane offers `bits` and gets lane `lane`'s. */
    unsigned long long (*shuffle)(FerrotronThread* thread, unsigned long long bits, int lane,
                                  int line);
    /* The next `bytes` of the block's shared memory (the same address in every thread
     * that declares its arrays in the same order). */
    void* (*shared)(FerrotronThread* thread, unsigned long long bytes, int line);
    /* Declares a read (write = 0) or write of shared memory, which the emulator checks
     * against the other threads' accesses since they last met. */
    void (*access)(FerrotronThread* thread, const void* address, unsigned long long bytes,
                   int write, int line);
    /* A whole-warp butterfly reduction of every lane's `bits`, as five xor shuffles (masks
     * 16 to 1) compute it, in one meeting: kind 0 f32 sum, 1 f32 max (v = partner > v ?
     * partner : v), 2 f64 sum, 3 f64 max. Every lane gets the result. */
    unsigned long long (*reduce)(FerrotronThread* thread, unsigned long long bits, int kind,
                                 int line);
    /* mma.sync.aligned.m16n8k16.row.col.f32.<kind>.<kind>.f32 over the whole warp (kind 1
     * bf16, 2 f16): every lane offers its registers a[4], b[2] and values c[4], and gets
     * its four values of D in d (which may be c). Layouts: device/src/tensor_cores.rs. */
    void (*mma)(FerrotronThread* thread, int kind, const unsigned int* a,
                const unsigned int* b, const float* c, float* d, int line);
    /* ldmatrix.sync.aligned.m8n8.x<count>[.trans].shared.b16 over the whole warp: every
     * lane offers a row address (lanes 8j..8j+7 the rows of matrix j) and gets its
     * register of each matrix in out[0..count). */
    void (*ldmatrix)(FerrotronThread* thread, int count, int trans, const void* address,
                     unsigned int* out, int line);
} FerrotronThreadOps;

struct FerrotronThread {
    const FerrotronThreadOps* ops;
    unsigned int thread;  /* threadIdx.x */
    unsigned int block;   /* blockIdx.x */
    unsigned int threads; /* blockDim.x */
    unsigned int blocks;  /* gridDim.x */
    void* runner;         /* the emulator's, opaque */
};

#endif
