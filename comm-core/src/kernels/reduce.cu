/* The local backend's reduction over device memory, in the device crate's kernel language:
 * NVRTC compiles it for a GPU, a C compiler for the emulated device (csrc/kernels.c), so
 * the same source runs on both. out[i] becomes the reduction of element i of `rows` rows,
 * combined in row order; 16-bit floats are reduced in f32 and rounded once, integers wrap
 * on overflow: the host path's rules (src/dtype.rs, reduce_raw). Op codes follow
 * ReduceOp: 0 Sum, 1 Avg, 2 Max, 3 Min, 4 Prod; Max keeps the current value unless the
 * next is larger, so a NaN stays where it is compared, as on the host. */

/* Most rows one launch reduces (so the argument block stays 64 words). */
#define REDUCE_ROWS 60

/* out: the result's address; row[r]: row r's; count elements each. */
typedef struct {
    u64 out;
    u64 count;
    i64 rows;
    i64 op;
    u64 row[REDUCE_ROWS];
} ReduceArgs;

/* Wrapping integer arithmetic (signed overflow is undefined in C, unsigned is not). */
DEVFN int add_i32(int a, int b) { return (int)((unsigned int)a + (unsigned int)b); }
DEVFN int mul_i32(int a, int b) { return (int)((unsigned int)a * (unsigned int)b); }
DEVFN i64 add_i64(i64 a, i64 b) { return (i64)((u64)a + (u64)b); }
DEVFN i64 mul_i64(i64 a, i64 b) { return (i64)((u64)a * (u64)b); }
DEVFN u8 add_u8(u8 a, u8 b) { return (u8)(a + b); }
DEVFN u8 mul_u8(u8 a, u8 b) { return (u8)(a * b); }
DEVFN float add_f32(float a, float b) { return a + b; }
DEVFN float mul_f32(float a, float b) { return MUL_RN_F32(a, b); }
DEVFN double add_f64(double a, double b) { return a + b; }
DEVFN double mul_f64(double a, double b) { return MUL_RN_F64(a, b); }

/* The kernel of element type `type` accumulated in `acc`, read and written through
 * `load` and `store`, combined by the `add` and `mul` of `suffix`. Avg divides floats
 * by the row count (integers are refused before any kernel runs). */
#define REDUCE_KERNEL(name, type, acc, load, store, suffix)                             \
    KERNEL_TAKING(name, ReduceArgs) {                                                   \
        const ReduceArgs* A = ARGS;                                                     \
        FOR_EACH(i, A->count) {                                                         \
            acc value = load(((const type*)A->row[0])[i]);                              \
            for (i64 r = 1; r < A->rows; ++r) {                                         \
                acc x = load(((const type*)A->row[r])[i]);                              \
                switch (A->op) {                                                        \
                    case 2: value = x > value ? x : value; break;                       \
                    case 3: value = x < value ? x : value; break;                        \
                    case 4: value = mul_##suffix(value, x); break;                      \
                    default: value = add_##suffix(value, x); break;                     \
                }                                                                       \
            }                                                                           \
            if (A->op == 1) value = (acc)(value / (acc)A->rows);                        \
            ((type*)A->out)[i] = store(value);                                          \
        }                                                                               \
    }

#define SAME(x) (x)
REDUCE_KERNEL(ferrotron_reduce_f32, float, float, SAME, SAME, f32)
REDUCE_KERNEL(ferrotron_reduce_f64, double, double, SAME, SAME, f64)
REDUCE_KERNEL(ferrotron_reduce_i32, int, int, SAME, SAME, i32)
REDUCE_KERNEL(ferrotron_reduce_i64, i64, i64, SAME, SAME, i64)
REDUCE_KERNEL(ferrotron_reduce_u8, u8, u8, SAME, SAME, u8)
REDUCE_KERNEL(ferrotron_reduce_f16, u16, float, f16_to_f32, f32_to_f16, f32)
REDUCE_KERNEL(ferrotron_reduce_bf16, u16, float, bf16_to_f32, f32_to_bf16, f32)
#undef SAME
