/* The kernel language of every ferrotron crate's kernels, one source for both builds: the
 * CUDA build (NVRTC, ferrotron_device::kernels::CUDA_PRELUDE) and the host build the
 * emulated device runs (a C compiler, ferrotron_kernels.h).
 *
 * Kernel rules, so that the emulator's run is a faithful model of the GPU. A KERNEL is a
 * FOR_EACH over independent indices, whose iterations communicate only through
 * ATOMIC_ADD. A BLOCK_KERNEL is cooperative: its threads (THREAD_IDX of BLOCK_DIM, in
 * block BLOCK_IDX of GRID_DIM, whole warps) meet at SYNC_THREADS (every thread of the
 * block, on the same line) and at whole-warp operations (SHFL_XOR, SYNC_WARP, the
 * reductions WARP_SUM and WARP_MAX, and the tensor-core instructions MMA_16816 and
 * LDMATRIX_X4[_TRANS]: every lane of the warp); shared memory is declared
 * with SHARED and read and written only through SHARED_LOAD and SHARED_STORE, which the
 * emulator checks for races (LDMATRIX's rows too: 16-byte aligned, declared, written
 * before, with a barrier between). UNROLL before a loop of constant trip count keeps the
 * register arrays it indexes out of local memory on a GPU. Device functions a cooperative kernel calls take
 * THREAD_PARAM first and are passed THREAD. A kernel takes one argument block: KERNEL's
 * is a KernelArgs the including crate defines; KERNEL_TAKING names its own type. */

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned char u8;
typedef unsigned short u16;
