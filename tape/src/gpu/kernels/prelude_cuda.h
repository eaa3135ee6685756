/* CUDA flavour of the kernel macros (compiled by NVRTC). */
#define KERNEL(name) extern "C" __global__ void name(const KernelArgs args_)
#define ARGS (&args_)
#define DEVFN static __device__ __forceinline__
#define FOR_EACH(i, n)                                                          \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n);       \
         i += (i64)gridDim.x * blockDim.x)
#define ATOMIC_ADD(address, value) atomicAdd((address), (value))
