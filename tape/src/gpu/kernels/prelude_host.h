/* Host flavour of the kernel macros: each kernel is a plain C function that runs its
 * FOR_EACH sequentially (the emulator device). */
#include <math.h>
#define KERNEL(name) void name(const KernelArgs* args_)
#define ARGS (args_)
#define DEVFN static inline
#define FOR_EACH(i, n) for (i64 i = 0; i < (i64)(n); ++i)
#define ATOMIC_ADD(address, value) (*(address) += (value))
