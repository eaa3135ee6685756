//! The warp-level matrix instructions of compute capability 8.0 as the emulated device
//! runs them: `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32` and
//! `ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16`, with the PTX ISA's
//! fragment layouts (which lane holds which elements) exactly, so a kernel that indexes
//! a fragment wrongly computes wrong numbers here as it would on a GPU.
//!
//! Lane `l` of a warp is in group `g = l / 4` at place `t = l % 4`. Each 32-bit register
//! holds two 16-bit elements, the lower-numbered one in its low half.
//! - A (16 × 16, row-major), four registers: register `r` holds row `g + 8·(r & 1)`,
//!   columns `2t + 8·(r >> 1)` and the next.
//! - B (16 × 8, column-major: element `[k][n]`), two registers: register `r` holds
//!   rows `k = 2t + 8r` and the next, column `n = g`.
//! - C and D (16 × 8, f32), four values: value `i` is row `g + 8·(i >> 1)`, column
//!   `2t + (i & 1)`.
//! - `ldmatrix`: lanes `8j .. 8j + 7` give the addresses of rows 0 to 7 of matrix `j` (8 ×
//!   8 elements, each row 16 bytes, 16-byte aligned in shared memory); lane `l` gets, in
//!   its register `j`, row `g` columns `2t, 2t + 1` of matrix `j`, or with `.trans` column
//!   `g` rows `2t, 2t + 1` (the transposed matrix's row).
//!
//! NVIDIA does not specify the order in which a tensor core adds its products. The
//! emulated device adds them in one documented order: every product of two 16-bit
//! values is exact in f32, and `D[m][n] = C[m][n] + A[m][0]·B[0][n] + … + A[m][15]·B[15][n]`
//! is summed left to right in f32, rounding to nearest even after each add. So emulated
//! runs are bit-reproducible, and a GPU's results differ from them by the accumulation's
//! rounding only (a few units of f32's last place per product, far below 16-bit inputs'
//! rounding).

use half::{bf16, f16};

/// Threads of a warp (the lanes the layouts above name).
const LANES: usize = 32;

/// The 16-bit input format of a matrix product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatrixFormat {
    /// bfloat16 (`.bf16`).
    Bf16 = 1,
    /// IEEE half precision (`.f16`).
    F16 = 2,
}

impl MatrixFormat {
    /// The format of kind `kind` as kernels name it (1 bf16, 2 f16).
    pub fn of(kind: i32) -> Option<MatrixFormat> {
        match kind {
            1 => Some(MatrixFormat::Bf16),
            2 => Some(MatrixFormat::F16),
            _ => None,
        }
    }

    /// The value of 16-bit element `bits`, exactly, in f32.
    fn widen(self, bits: u16) -> f32 {
        match self {
            MatrixFormat::Bf16 => bf16::from_bits(bits).to_f32(),
            MatrixFormat::F16 => f16::from_bits(bits).to_f32(),
        }
    }
}

/// Element `half` (0 low, 1 high) of a register.
fn element(register: u32, half: usize) -> u16 {
    (register >> (16 * half)) as u16
}

/// One lane's operands of `mma.m16n8k16`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fragments {
    /// The lane's four registers of A.
    pub a: [u32; 4],
    /// Its two registers of B.
    pub b: [u32; 2],
    /// Its four values of C.
    pub c: [f32; 4],
}

/// `D = A·B + C` over the warp: lane `l` gave `lanes[l]`, and gets `D`'s four values
/// of its layout, summed in the documented order.
pub fn mma_m16n8k16(format: MatrixFormat, lanes: &[Fragments; LANES]) -> [[f32; 4]; LANES] {
    let mut a = [[0f32; 16]; 16];
    let mut b = [[0f32; 8]; 16];
    let mut c = [[0f32; 8]; 16];
    for (lane, f) in lanes.iter().enumerate() {
        let (g, t) = (lane / 4, lane % 4);
        for (r, &register) in f.a.iter().enumerate() {
            for half in 0..2 {
                let (row, col) = (g + 8 * (r & 1), 2 * t + half + 8 * (r >> 1));
                a[row][col] = format.widen(element(register, half));
            }
        }
        for (r, &register) in f.b.iter().enumerate() {
            for half in 0..2 {
                b[2 * t + half + 8 * r][g] = format.widen(element(register, half));
            }
        }
        for (i, &value) in f.c.iter().enumerate() {
            c[g + 8 * (i >> 1)][2 * t + (i & 1)] = value;
        }
    }
    let mut d = [[0f32; 4]; LANES];
    for (lane, out) in d.iter_mut().enumerate() {
        let (g, t) = (lane / 4, lane % 4);
        for (i, value) in out.iter_mut().enumerate() {
            let (m, n) = (g + 8 * (i >> 1), 2 * t + (i & 1));
            // Products of 16-bit values are exact in f32; the adds round in order.
            *value = (0..16).fold(c[m][n], |sum, k| sum + a[m][k] * b[k][n]);
        }
    }
    d
}

/// What `ldmatrix` hands lane `lane` in its register for one 8 × 8 matrix whose rows
/// are `rows` (each eight 16-bit elements): row `g` columns `2t, 2t + 1`, or transposed
/// column `g` rows `2t, 2t + 1`.
pub fn ldmatrix_register(rows: &[[u16; 8]; 8], lane: usize, transposed: bool) -> u32 {
    let (g, t) = (lane / 4, lane % 4);
    let (low, high) = match transposed {
        false => (rows[g][2 * t], rows[g][2 * t + 1]),
        true => (rows[2 * t][g], rows[2 * t + 1][g]),
    };
    u32::from(low) | (u32::from(high) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bf16 bits of small integers (exact).
    fn bits(x: f32) -> u16 {
        bf16::from_f32(x).to_bits()
    }

    /// The fragments of A[m][k] = m·16 + k and B[k][n] = k − n by the documented layout,
    /// C = 0.
    fn operands() -> [Fragments; LANES] {
        let pack = |lo: f32, hi: f32| u32::from(bits(lo)) | (u32::from(bits(hi)) << 16);
        std::array::from_fn(|lane| {
            let (g, t) = (lane / 4, lane % 4);
            let av =
                |r: usize, h: usize| ((g + 8 * (r & 1)) * 16 + 2 * t + h + 8 * (r >> 1)) as f32;
            let bv = |r: usize, h: usize| (2 * t + h + 8 * r) as f32 - g as f32;
            Fragments {
                a: std::array::from_fn(|r| pack(av(r, 0), av(r, 1))),
                b: std::array::from_fn(|r| pack(bv(r, 0), bv(r, 1))),
                c: [0.0; 4],
            }
        })
    }

    #[test]
    fn the_product_is_the_matrices_product_at_the_documented_places() {
        let d = mma_m16n8k16(MatrixFormat::Bf16, &operands());
        for (lane, values) in d.iter().enumerate() {
            let (g, t) = (lane / 4, lane % 4);
            for (i, &value) in values.iter().enumerate() {
                let (m, n) = ((g + 8 * (i >> 1)) as f32, (2 * t + (i & 1)) as f32);
                let expected: f32 = (0..16)
                    .map(|k| (m * 16.0 + k as f32) * (k as f32 - n))
                    .sum();
                assert_eq!(value, expected, "lane {lane} value {i}");
            }
        }
    }

    #[test]
    fn a_transposed_load_hands_the_columns() {
        let rows: [[u16; 8]; 8] =
            std::array::from_fn(|r| std::array::from_fn(|c| (r * 8 + c) as u16));
        assert_eq!(ldmatrix_register(&rows, 5, false), 10 | (11 << 16));
        assert_eq!(ldmatrix_register(&rows, 5, true), 17 | (25 << 16));
    }
}
