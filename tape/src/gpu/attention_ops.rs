//! Fused attention's geometry, its dropout rule, and the launches of `kernels/attention.cu`
//! (whose argument slots are restated at each caller). The CPU path (`ops/flash.rs`) uses
//! the same geometry and tiles.

use super::{GpuArray, Kernel, KernelArgs, Precision};
use crate::{Device, Element, Error, Result};
use ferrotron_device::Grid;

block_kernels! {
    ATTENTION_KERNELS:
    ATTENTION_FORWARD = "attention_forward": attention_forward_f32, attention_forward_f64;
    ATTENTION_DELTA = "attention_delta": attention_delta_f32, attention_delta_f64;
    ATTENTION_BACKWARD_Q = "attention_backward_q":
        attention_backward_q_f32, attention_backward_q_f64;
    ATTENTION_BACKWARD_KV = "attention_backward_kv":
        attention_backward_kv_f32, attention_backward_kv_f64;
}

f32_block_kernels! {
    TENSOR_CORE_KERNELS:
    TC_FORWARD_D64_BF16 = "attention_tc_forward_d64_bf16": attention_tc_forward_d64_bf16_f32;
    TC_BACKWARD_Q_D64_BF16 = "attention_tc_backward_q_d64_bf16": attention_tc_backward_q_d64_bf16_f32;
    TC_BACKWARD_KV_D64_BF16 = "attention_tc_backward_kv_d64_bf16": attention_tc_backward_kv_d64_bf16_f32;
    TC_FORWARD_D64_F16 = "attention_tc_forward_d64_f16": attention_tc_forward_d64_f16_f32;
    TC_BACKWARD_Q_D64_F16 = "attention_tc_backward_q_d64_f16": attention_tc_backward_q_d64_f16_f32;
    TC_BACKWARD_KV_D64_F16 = "attention_tc_backward_kv_d64_f16": attention_tc_backward_kv_d64_f16_f32;
    TC_FORWARD_D128_BF16 = "attention_tc_forward_d128_bf16": attention_tc_forward_d128_bf16_f32;
    TC_BACKWARD_Q_D128_BF16 = "attention_tc_backward_q_d128_bf16": attention_tc_backward_q_d128_bf16_f32;
    TC_BACKWARD_KV_D128_BF16 = "attention_tc_backward_kv_d128_bf16": attention_tc_backward_kv_d128_bf16_f32;
    TC_FORWARD_D128_F16 = "attention_tc_forward_d128_f16": attention_tc_forward_d128_f16_f32;
    TC_BACKWARD_Q_D128_F16 = "attention_tc_backward_q_d128_f16": attention_tc_backward_q_d128_f16_f32;
    TC_BACKWARD_KV_D128_F16 = "attention_tc_backward_kv_d128_f16": attention_tc_backward_kv_d128_f16_f32;
}

/// Rows of a tile: the queries a block takes, and the keys it visits at a time.
pub(crate) const TILE: usize = 32;

/// Threads of an attention block (two warps; eight threads to a group of four rows).
const THREADS: u32 = 64;

/// The kernels of one fused attention and the blocks they run in.
#[derive(Clone, Copy)]
pub(crate) struct Kernels {
    forward: &'static Kernel,
    backward_q: &'static Kernel,
    backward_kv: &'static Kernel,
    /// Rows of a block's own side (queries, or keys), and its threads.
    rows: usize,
    threads: u32,
}

/// `attention.cu`'s kernels, on CUDA cores in the kernel's precision.
const CUDA_CORES: Kernels = Kernels {
    forward: &ATTENTION_FORWARD,
    backward_q: &ATTENTION_BACKWARD_Q,
    backward_kv: &ATTENTION_BACKWARD_KV,
    rows: TILE,
    threads: THREADS,
};

/// `attention_tc.cu`'s for head dimension `d` (64 or 128) and operands stored as
/// `format` (1 bf16, 2 f16): four warps of 16 rows.
const fn tensor_cores(d: usize, format: i64) -> Kernels {
    let [forward, backward_q, backward_kv]: [&'static Kernel; 3] = match (d, format) {
        (64, 1) => [
            &TC_FORWARD_D64_BF16,
            &TC_BACKWARD_Q_D64_BF16,
            &TC_BACKWARD_KV_D64_BF16,
        ],
        (64, _) => [
            &TC_FORWARD_D64_F16,
            &TC_BACKWARD_Q_D64_F16,
            &TC_BACKWARD_KV_D64_F16,
        ],
        (_, 1) => [
            &TC_FORWARD_D128_BF16,
            &TC_BACKWARD_Q_D128_BF16,
            &TC_BACKWARD_KV_D128_BF16,
        ],
        _ => [
            &TC_FORWARD_D128_F16,
            &TC_BACKWARD_Q_D128_F16,
            &TC_BACKWARD_KV_D128_F16,
        ],
    };
    Kernels {
        forward,
        backward_q,
        backward_kv,
        rows: 64,
        threads: 128,
    }
}

/// Whether the tensor-core kernels take attention of head dimension `d` over operands
/// stored as `format` (1 bf16, 2 f16) on `device` from `T` tensors: 16-bit operands, f32
/// accumulators, head dimensions 64 and 128, compute capability 8.0 or newer (and the
/// emulated device, which runs them with the PTX layouts).
pub(crate) fn takes_tensor_cores<T>(device: Device, format: i64, d: usize) -> bool {
    std::mem::size_of::<T>() == 4
        && matches!(format, 1 | 2)
        && matches!(d, 64 | 128)
        && !CUDA_CORES_ONLY.get()
        && super::tensor_cores(device)
}

thread_local! {
    /// Set on a thread that must run the CUDA-core kernels even where the tensor-core
    /// ones apply (benchmarks and tests comparing the two).
    static CUDA_CORES_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `work` with fused attention on CUDA cores only on this thread (the kernels
/// before tensor cores, for comparison), then as before.
pub fn with_cuda_core_attention<R>(work: impl FnOnce() -> R) -> R {
    let before = CUDA_CORES_ONLY.replace(true);
    let result = work();
    CUDA_CORES_ONLY.set(before);
    result
}

impl Kernels {
    /// The kernels for `g` over `ops` on `device`, chosen at each launch: the CUDA-core
    /// ones refuse heads wider than their tiles (a forward on tensor cores whose
    /// backward runs under [`with_cuda_core_attention`] would otherwise overflow them).
    fn of<T>(g: &FlashGeometry, ops: &Operands, device: Device) -> Result<Kernels> {
        if takes_tensor_cores::<T>(device, ops.q.format, g.d) {
            return Ok(tensor_cores(g.d, ops.q.format));
        }
        if g.d > max_head_dim::<T>() {
            return Err(Error::invalid(
                "attention",
                format!(
                    "head dimension {} is wider than the CUDA-core fused kernel takes ({}), \
                     and the tensor-core one does not run here (16-bit input, compute \
                     capability 8.0+, and not inside with_cuda_core_attention): run the \
                     backward as its forward ran",
                    g.d,
                    max_head_dim::<T>()
                ),
            ));
        }
        Ok(CUDA_CORES)
    }
}

/// The widest head a device kernel takes in `T` (four of its tiles fit 48 KiB of shared
/// memory).
pub(crate) fn max_head_dim<T>() -> usize {
    match std::mem::size_of::<T>() {
        4 => 64,
        _ => 32,
    }
}

/// Where one operand's rows are, in elements: the strides of the batch, the key/value
/// group, the query head within its group (0 for keys and values) and the position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowStrides {
    pub batch: usize,
    pub group: usize,
    pub head: usize,
    pub pos: usize,
}

/// The extents of one attention call and where its operands' rows are: query head `z`
/// of `batch · heads` is batch `z / heads`, head `h = z % heads`, of group
/// `h / per_group`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FlashGeometry {
    pub batch: usize,
    pub heads: usize,
    pub per_group: usize,
    pub sq: usize,
    pub sk: usize,
    pub d: usize,
    /// Queries, keys, values and outputs (each gradient has its tensor's layout).
    pub strides: [RowStrides; 4],
    /// `Some(offset)`: query `i` sees key `j` only when `j <= i + offset`.
    pub causal: Option<i64>,
}

/// Operand indices into [`FlashGeometry::strides`].
pub(crate) const Q: usize = 0;
pub(crate) const K: usize = 1;
pub(crate) const V: usize = 2;
pub(crate) const O: usize = 3;

impl FlashGeometry {
    /// Element offset of row `i` of operand `t` for query head `z`.
    pub fn row(&self, t: usize, z: usize, i: usize) -> usize {
        let s = self.strides[t];
        let h = z % self.heads;
        (z / self.heads) * s.batch
            + (h / self.per_group) * s.group
            + (h % self.per_group) * s.head
            + i * s.pos
    }

    /// Whether query `i` sees key `j`.
    pub fn sees(&self, i: usize, j: usize) -> bool {
        i < self.sq
            && j < self.sk
            && self
                .causal
                .is_none_or(|offset| j as i64 <= i as i64 + offset)
    }

    /// The keys the query tile starting at `q0` sees: `0..key_end`.
    pub fn key_end(&self, q0: usize) -> usize {
        let Some(offset) = self.causal else {
            return self.sk;
        };
        let last = (q0 + TILE - 1).min(self.sq.saturating_sub(1)) as i64;
        (last + offset + 1).clamp(0, self.sk as i64) as usize
    }

    /// The first query tile that sees any key of the tile starting at `k0`.
    pub fn first_query_tile(&self, k0: usize) -> usize {
        match self.causal {
            Some(offset) if k0 as i64 - offset > 0 => (k0 as i64 - offset) as usize / TILE * TILE,
            _ => 0,
        }
    }

    /// Query heads of all batches (`batch · heads`).
    pub fn query_heads(&self) -> usize {
        self.batch * self.heads
    }

    /// Key/value heads of all batches.
    pub fn kv_heads(&self) -> usize {
        self.batch * (self.heads / self.per_group)
    }

    fn args(&self, flash: &Flash) -> KernelArgs {
        let mut args = KernelArgs::default();
        args.i[..6].copy_from_slice(&[
            self.batch as i64,
            self.heads as i64,
            self.per_group as i64,
            self.sq as i64,
            self.sk as i64,
            self.d as i64,
        ]);
        for (t, s) in self.strides.iter().enumerate() {
            let at = 6 + 4 * t;
            args.i[at..at + 4].copy_from_slice(&[
                s.batch as i64,
                s.group as i64,
                s.head as i64,
                s.pos as i64,
            ]);
        }
        args.i[24] = i64::from(self.causal.is_some());
        args.i[25] = self.causal.unwrap_or(0);
        if let Some(dropout) = flash.dropout {
            args.i[26] = 1;
            args.i[27] = dropout.seed as i64;
            args.i[28] = dropout.threshold() as i64;
            args.f[1] = dropout.scale();
        }
        args.f[0] = flash.scale;
        #[cfg(test)]
        {
            args.i[31] = tests::FAULT.get();
        }
        args
    }
}

/// Dropout on the probabilities, each draw a function of the seed and the element's
/// place, so the backward regenerates the mask instead of keeping it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct FlashDropout {
    pub seed: u64,
    pub p: f64,
}

impl FlashDropout {
    /// Draws at or above this (53-bit) are kept: `P(keep) = 1 − p`.
    fn threshold(&self) -> u64 {
        (self.p * (1u64 << 53) as f64).ceil() as u64
    }

    /// What a kept probability is multiplied by.
    pub fn scale(&self) -> f64 {
        1.0 / (1.0 - self.p)
    }

    /// Whether element `index` of a `[batch · heads, sq, sk]` mask is kept: SplitMix64 of
    /// the seed and the index (`attention.cu`'s `att_keep`).
    pub fn keeps(&self, index: u64) -> bool {
        let mut x = self
            .seed
            .wrapping_add(index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^= x >> 31;
        (x >> 11) >= self.threshold()
    }
}

/// One fused attention: where, how scaled, and with what dropout.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Flash {
    pub geometry: FlashGeometry,
    pub scale: f64,
    pub dropout: Option<FlashDropout>,
}

impl Flash {
    /// Dropout's factor for probability `(z, i, j)`: 0 dropped, `1/(1 − p)` kept, 1
    /// without dropout.
    pub fn factor(&self, z: usize, i: usize, j: usize) -> f64 {
        let g = &self.geometry;
        match self.dropout {
            None => 1.0,
            Some(dropout) => {
                let index = ((z * g.sq + i) * g.sk + j) as u64;
                match dropout.keeps(index) {
                    true => dropout.scale(),
                    false => 0.0,
                }
            }
        }
    }

    /// A grid of `kernels`' blocks, one per (head, tile) over `heads` heads and `rows`
    /// rows.
    fn grid(&self, kernels: &Kernels, heads: usize, rows: usize) -> Result<Grid> {
        let op = "attention";
        let blocks = heads * rows.div_ceil(kernels.rows);
        let blocks = u32::try_from(blocks)
            .ok()
            .filter(|&b| b <= i32::MAX as u32)
            .ok_or_else(|| {
                Error::invalid(
                    op,
                    format!("{blocks} attention tiles are more than a grid launches"),
                )
            })?;
        Ok(Grid {
            blocks,
            threads: kernels.threads,
        })
    }

    fn flops(&self) -> u64 {
        let g = &self.geometry;
        let pairs = (g.query_heads() * g.sq * g.sk) as u64;
        let pairs = if g.causal.is_some() { pairs / 2 } else { pairs };
        4 * pairs * g.d as u64
    }
}

/// A device operand: its address and storage format (0: the kernel's `T`, 1/2: 16-bit).
#[derive(Clone, Copy, Debug)]
pub(crate) struct At {
    pub ptr: u64,
    pub format: i64,
}

/// The operands of a call: queries, keys and values (one format), and the output.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operands {
    pub q: At,
    pub k: At,
    pub v: At,
    pub out: At,
}

impl Operands {
    fn set(&self, args: &mut KernelArgs) {
        args.i[22] = self.q.format;
        args.i[23] = self.out.format;
    }

    /// Bytes of the queries, keys and values, and of the output, as stored.
    fn bytes<T>(&self, g: &FlashGeometry) -> (usize, usize) {
        let (queries, keys) = (g.query_heads() * g.sq * g.d, g.kv_heads() * g.sk * g.d);
        let size = |a: At| super::stored_bytes::<T>(1, a.format);
        (
            queries * size(self.q) + keys * (size(self.k) + size(self.v)),
            queries * size(self.out),
        )
    }
}

/// The forward: the output into `ops.out`, each row's log-sum-exp into `lse`
/// (`[batch · heads · sq]`).
pub(crate) fn forward<T: Element>(flash: &Flash, ops: &Operands, lse: &GpuArray<T>) -> Result<()> {
    let g = &flash.geometry;
    // p0 out, p1 lse, p2 q, p3 k, p4 v; slots as in `attention.cu`.
    let mut args = g.args(flash);
    args.p[..5].copy_from_slice(&[ops.out.ptr, lse.ptr(), ops.q.ptr, ops.k.ptr, ops.v.ptr]);
    ops.set(&mut args);
    let (inputs, out) = ops.bytes::<T>(g);
    let cost = super::Cost {
        read: inputs as u64,
        written: (out + lse.bytes()) as u64,
        flops: flash.flops(),
    };
    let kernels = Kernels::of::<T>(g, ops, lse.device())?;
    let grid = flash.grid(&kernels, g.query_heads(), g.sq)?;
    lse.launch_grid(kernels.forward, Precision::of::<T>(), grid, &args, cost)
}

/// The backward's gradients: where they go and their format.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gradients {
    pub d_out: At,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub format: i64,
}

/// The backward: `delta = Σ dO ⊙ out` per row into `delta`, then dQ, and dK with dV per
/// key/value group, from the forward's `lse`.
pub(crate) fn backward<T: Element>(
    flash: &Flash,
    ops: &Operands,
    lse: &GpuArray<T>,
    delta: &GpuArray<T>,
    grads: &Gradients,
) -> Result<()> {
    let g = &flash.geometry;
    // Chosen before anything is queued, so a refusal leaves nothing half done.
    let kernels = Kernels::of::<T>(g, ops, delta.device())?;
    let mut args = g.args(flash);
    ops.set(&mut args);
    args.i[29] = grads.format;
    args.i[30] = grads.d_out.format;
    let precision = Precision::of::<T>();
    let rows = g.query_heads() * g.sq;
    // Bytes each launch reads and writes, each array once.
    let (inputs, out) = ops.bytes::<T>(g);
    let d_out = rows * g.d * super::stored_bytes::<T>(1, grads.d_out.format);
    let grad = |n: usize| n * g.d * super::stored_bytes::<T>(1, grads.format);
    let stats = lse.bytes() + delta.bytes();
    // p0 delta, p1 out, p2 dO.
    let mut per_row = args;
    per_row.p[..3].copy_from_slice(&[delta.ptr(), ops.out.ptr, grads.d_out.ptr]);
    let cost = super::moves(out + d_out, delta.bytes());
    let grid = Grid {
        blocks: rows.div_ceil(4).clamp(1, 65_535) as u32,
        threads: 128,
    };
    if rows > 0 {
        delta.launch_grid(&ATTENTION_DELTA, precision, grid, &per_row, cost)?;
    }
    let read = (inputs + d_out + stats) as u64;
    let cost = |written: usize| super::Cost {
        read,
        written: written as u64,
        flops: flash.flops(),
    };
    // p0 dQ, p1 q, p2 k, p3 v, p4 dO, p5 lse, p6 delta.
    let mut queries = args;
    queries.p[..7].copy_from_slice(&[
        grads.dq,
        ops.q.ptr,
        ops.k.ptr,
        ops.v.ptr,
        grads.d_out.ptr,
        lse.ptr(),
        delta.ptr(),
    ]);
    let grid = flash.grid(&kernels, g.query_heads(), g.sq)?;
    delta.launch_grid(
        kernels.backward_q,
        precision,
        grid,
        &queries,
        cost(grad(rows)),
    )?;
    // p0 dK, p1 dV, p2 q, p3 k, p4 v, p5 dO, p6 lse, p7 delta.
    let mut keys = args;
    keys.p = [
        grads.dk,
        grads.dv,
        ops.q.ptr,
        ops.k.ptr,
        ops.v.ptr,
        grads.d_out.ptr,
        lse.ptr(),
        delta.ptr(),
    ];
    let grid = flash.grid(&kernels, g.kv_heads(), g.sk)?;
    let written = grad(2 * g.kv_heads() * g.sk);
    delta.launch_grid(kernels.backward_kv, precision, grid, &keys, cost(written))
}

#[cfg(test)]
pub(crate) mod tests {
    use std::cell::Cell;

    use crate::{AttentionOptions, DType, Device, Generator, Result, Tensor};

    thread_local! {
        /// The fault this thread's attention launches plant (`attention.cu`'s i31).
        pub(crate) static FAULT: Cell<i64> = const { Cell::new(0) };
    }

    /// Fused attention's forward over 70 positions (tiles of 32, 32 and 6) on `device`
    /// with `fault` planted.
    fn forward(device: Device, fault: i64) -> Result<Vec<f32>> {
        let mut generator = Generator::new(1);
        let qkv = Tensor::<f32>::uniform(&[70, 1, 2, 3, 64], -1.0, 1.0, &mut generator);
        FAULT.set(fault);
        let out = qkv
            .to_device(device)
            .and_then(|x| x.packed_attention(AttentionOptions::causal(64), None))
            .and_then(|out| out.to_vec());
        FAULT.set(0);
        out
    }

    /// Output and packed gradient of bf16 attention over 70 positions at head dimension
    /// `d` on `device` with `fault` planted (the emulated device runs the tensor-core
    /// kernels).
    fn tensor_cores(device: Device, d: usize, fault: i64) -> Result<Vec<f32>> {
        let mut generator = Generator::new(2);
        let qkv = Tensor::<f32>::uniform(&[70, 1, 1, 4, d], -1.0, 1.0, &mut generator)
            .to_dtype(DType::BF16)?
            .to_device(device)?;
        let parameter = crate::Parameter::new("qkv", qkv);
        let tape = crate::Tape::new();
        FAULT.set(fault);
        let out = tape
            .watch(&parameter)
            .and_then(|x| x.packed_attention(AttentionOptions::causal(d), None))
            .and_then(|out| {
                out.to_dtype(DType::F32)?.sum()?.backward()?;
                let grad = parameter.grad().expect("a gradient").to_vec()?;
                Ok([out.to_vec()?, grad].concat())
            });
        FAULT.set(0);
        out
    }

    /// A kernel that hands the probabilities to the next product in a wrong fragment
    /// register (two A registers swapped, i31 = 3) computes wrong numbers on the
    /// emulated device, as it would on a GPU: the layouts are the PTX ISA's, not
    /// whatever the kernel assumes.
    fn a_wrong_fragment_register_is_caught() -> Result<()> {
        for d in [64, 128] {
            let cpu = tensor_cores(Device::Cpu, d, 0)?;
            let error = |out: &[f32]| {
                let scale = cpu.iter().fold(1f32, |m, x| m.max(x.abs()));
                out.iter()
                    .zip(&cpu)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
                    / scale
            };
            // Within bf16's rounding (2⁻⁸) when right, far outside it when wrong.
            assert!(error(&tensor_cores(Device::Emulated, d, 0)?) < 2.0 / 256.0);
            let planted = error(&tensor_cores(Device::Emulated, d, 3)?);
            assert!(
                planted > 0.05,
                "a swapped fragment register went unseen: {planted}"
            );
        }
        Ok(())
    }

    /// One test, since a failed launch fails the emulated stream it ran on, which every
    /// test of this binary shares: the silent faults first, then the one the checker
    /// stops.
    #[test]
    fn planted_faults_are_caught_on_the_emulated_device() -> Result<()> {
        a_wrong_fragment_register_is_caught()?;
        let cpu = forward(Device::Cpu, 0)?;
        let close = |out: &[f32]| out.iter().zip(&cpu).all(|(a, b)| (a - b).abs() < 1e-5);
        assert!(close(&forward(Device::Emulated, 0)?));
        let off_by_one = forward(Device::Emulated, 2)?;
        assert!(!close(&off_by_one), "a tail off by one went unseen");
        let error = forward(Device::Emulated, 1).expect_err("a race");
        assert!(error.to_string().contains("no barrier between"), "{error}");
        Ok(())
    }
}
