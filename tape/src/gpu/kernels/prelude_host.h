/* Host flavour of the kernel macros: each kernel is a plain C function that runs its
 * FOR_EACH sequentially (the emulator device). */
#include <math.h>
#define KERNEL(name) void name(const KernelArgs* args_)
#define ARGS (args_)
#define DEVFN static inline
#define FOR_EACH(i, n) for (i64 i = 0; i < (i64)(n); ++i)
#define ATOMIC_ADD(address, value) (*(address) += (value))
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
