// Reduction kernels of the local backend over CUDA buffers, compiled at run time by NVRTC.
// `in` holds `rows` contiguous rows of `count` elements; `out[i]` becomes the reduction of
// column i. Half types are reduced in f32 and rounded once, integers wrap on overflow:
// the same rules as the host path (comm-core/src/dtype.rs).
// Op codes follow ReduceOp: 0 Sum, 1 Avg, 2 Max, 3 Min, 4 Prod.

typedef unsigned long long u64;

__device__ float load(unsigned short h, int is_bf16) {
    if (is_bf16) return __uint_as_float(((unsigned int)h) << 16);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ unsigned short store(float f, int is_bf16) {
    if (is_bf16) {
        unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
        u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
        return (unsigned short)(u >> 16);
    }
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Wrapping integer arithmetic (signed overflow is undefined in C++, unsigned is not).
__device__ int add(int a, int b) { return (int)((unsigned int)a + (unsigned int)b); }
__device__ int mul(int a, int b) { return (int)((unsigned int)a * (unsigned int)b); }
__device__ long long add(long long a, long long b) { return (long long)((u64)a + (u64)b); }
__device__ long long mul(long long a, long long b) { return (long long)((u64)a * (u64)b); }
__device__ unsigned int add(unsigned int a, unsigned int b) { return a + b; }
__device__ unsigned int mul(unsigned int a, unsigned int b) { return a * b; }
__device__ float add(float a, float b) { return a + b; }
__device__ float mul(float a, float b) { return a * b; }
__device__ double add(double a, double b) { return a + b; }
__device__ double mul(double a, double b) { return a * b; }

template <typename A>
__device__ A combine(A acc, A x, int op) {
    switch (op) {
        case 2: return x > acc ? x : acc;
        case 3: return x < acc ? x : acc;
        case 4: return mul(acc, x);
        default: return add(acc, x);
    }
}

template <typename T, typename A>
__device__ void reduce_columns(T* out, const T* in, u64 count, int rows, int op) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        A acc = (A)in[i];
        for (int r = 1; r < rows; ++r) acc = combine<A>(acc, (A)in[(u64)r * count + i], op);
        if (op == 1) acc = acc / (A)rows;
        out[i] = (T)acc;
    }
}

__device__ void reduce_half_columns(unsigned short* out, const unsigned short* in, u64 count,
                                    int rows, int op, int is_bf16) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        float acc = load(in[i], is_bf16);
        for (int r = 1; r < rows; ++r)
            acc = combine<float>(acc, load(in[(u64)r * count + i], is_bf16), op);
        if (op == 1) acc = acc / (float)rows;
        out[i] = store(acc, is_bf16);
    }
}

extern "C" __global__ void reduce_f32(float* out, const float* in, u64 count, int rows, int op) {
    reduce_columns<float, float>(out, in, count, rows, op);
}
extern "C" __global__ void reduce_f64(double* out, const double* in, u64 count, int rows, int op) {
    reduce_columns<double, double>(out, in, count, rows, op);
}
extern "C" __global__ void reduce_i32(int* out, const int* in, u64 count, int rows, int op) {
    reduce_columns<int, int>(out, in, count, rows, op);
}
extern "C" __global__ void reduce_i64(long long* out, const long long* in, u64 count, int rows,
                                      int op) {
    reduce_columns<long long, long long>(out, in, count, rows, op);
}
extern "C" __global__ void reduce_u8(unsigned char* out, const unsigned char* in, u64 count,
                                     int rows, int op) {
    reduce_columns<unsigned char, unsigned int>(out, in, count, rows, op);
}
extern "C" __global__ void reduce_f16(unsigned short* out, const unsigned short* in, u64 count,
                                      int rows, int op) {
    reduce_half_columns(out, in, count, rows, op, 0);
}
extern "C" __global__ void reduce_bf16(unsigned short* out, const unsigned short* in, u64 count,
                                       int rows, int op) {
    reduce_half_columns(out, in, count, rows, op, 1);
}
