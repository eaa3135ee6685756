/* CUDA flavour of the kernel macros (compiled by NVRTC). */
/* __grid_constant__ keeps the argument block in constant parameter memory even though
 * kernels take its address (needs compute capability 7.0; the minimum target is 7.5). */
#define KERNEL(name) extern "C" __global__ void name(const __grid_constant__ KernelArgs args_)
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
