/* CUDA flavour of the kernel macros (compiled by NVRTC). */
/* __grid_constant__ keeps the argument block in constant parameter memory even though
 * kernels take its address (needs compute capability 7.0; the minimum target is 7.5). */
#define KERNEL(name) extern "C" __global__ void name(const __grid_constant__ KernelArgs args_)
#define KERNEL_TAKING(name, type) extern "C" __global__ void name(const __grid_constant__ type args_)
#define ARGS (&args_)
#define DEVFN static __device__ __forceinline__
#define FOR_EACH(i, n)                                                          \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n);       \
         i += (i64)gridDim.x * blockDim.x)
#define ATOMIC_ADD(address, value) atomicAdd((address), (value))
/* A product rounded on its own, never fused into a following add (NVRTC contracts a*b+c
 * into an FMA by default), where a kernel must match the CPU's arithmetic. */
#define MUL_RN_F32(a, b) __fmul_rn((a), (b))
#define MUL_RN_F64(a, b) __dmul_rn((a), (b))
/* The bits of a float and back (16-bit conversions in half.h). */
#define float_bits(x) __float_as_uint(x)
#define bits_float(u) __uint_as_float(u)
/* Cooperative kernels: CUDA's own threads, barriers, shuffles and shared memory. */
#define BLOCK_KERNEL(name) extern "C" __global__ void name(const __grid_constant__ KernelArgs args_)
#define THREAD_PARAM int thread_
#define THREAD 0
#define THREAD_IDX ((i64)threadIdx.x)
#define BLOCK_IDX ((i64)blockIdx.x)
#define BLOCK_DIM ((i64)blockDim.x)
#define GRID_DIM ((i64)gridDim.x)
#define SYNC_THREADS() __syncthreads()
#define SYNC_WARP() __syncwarp()
#define SHARED(type, name, count) __shared__ type name[count]
#define SHARED_LOAD(array, index) ((array)[index])
#define SHARED_STORE(array, index, value) ((array)[index] = (value))
#define SHFL_XOR_F32(v, mask) __shfl_xor_sync(0xffffffffu, (v), (mask))
#define SHFL_XOR_F64(v, mask) __shfl_xor_sync(0xffffffffu, (v), (mask))
/* Whole-warp butterfly reductions: five xor shuffles, each lane combining its value with
 * its partner's (the emulator computes the same operations in one meeting). A max keeps
 * its own value unless the partner's is larger, so a NaN stays where it is compared. */
#define WARP_BUTTERFLY(type, name, combine)                                  \
    static __device__ __forceinline__ type name(type v) {                    \
        for (int mask = 16; mask > 0; mask /= 2) {                            \
            type partner = __shfl_xor_sync(0xffffffffu, v, mask);            \
            v = combine;                                                      \
        }                                                                     \
        return v;                                                             \
    }
WARP_BUTTERFLY(float, warp_sum_f32, v + partner)
WARP_BUTTERFLY(float, warp_max_f32, partner > v ? partner : v)
WARP_BUTTERFLY(double, warp_sum_f64, v + partner)
WARP_BUTTERFLY(double, warp_max_f64, partner > v ? partner : v)
#define WARP_SUM_F32(v) warp_sum_f32(v)
#define WARP_MAX_F32(v) warp_max_f32(v)
#define WARP_SUM_F64(v) warp_sum_f64(v)
#define WARP_MAX_F64(v) warp_max_f64(v)
