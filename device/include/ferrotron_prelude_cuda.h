/* CUDA flavour of the kernel macros (compiled by NVRTC). */
/* __grid_constant__ keeps the argument block in constant parameter memory even though
 * kernels take its address (needs compute capability 7.0; the minimum target is 7.5). */
#define KERNEL(name) extern "C" __global__ void name(const __grid_constant__ KernelArgs args_)
#define KERNEL_TAKING(name, type) extern "C" __global__ void name(const __grid_constant__ type args_)
#define ARGS (&args_)
#define DEVFN static __device__ __forceinline__
/* Before a loop of constant trip count over register arrays: unrolled, so the arrays stay
 * in registers instead of local memory. */
#define UNROLL _Pragma("unroll")
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
/* Warp-level matrix instructions (tensor cores; the host prelude says what each does).
 * mma.m16n8k16 with 16-bit inputs needs compute capability 8.0: a module built for an
 * older target traps if one runs (the host launches them on 8.0 and newer only). */
DEVFN void mma_16816(int kind, float* d, const unsigned int* a, const unsigned int* b,
                     const float* c) {
#if __CUDA_ARCH__ >= 800
    if (kind == 1)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
            "{%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
              "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
            "{%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
              "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
    __trap();
#endif
}
DEVFN void ldmatrix_x4(unsigned int* out, const void* address, int trans) {
    unsigned int at = (unsigned int)__cvta_generic_to_shared(address);
    if (trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3])
                     : "r"(at)
                     : "memory");
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3])
                     : "r"(at)
                     : "memory");
}
#define MMA_16816(kind, d, a, b, c) mma_16816((kind), (d), (a), (b), (c))
#define LDMATRIX_X4(out, address) ldmatrix_x4((out), (address), 0)
#define LDMATRIX_X4_TRANS(out, address) ldmatrix_x4((out), (address), 1)
typedef uint4 u32x4;
