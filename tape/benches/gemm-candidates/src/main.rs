//! Best-of-15 single-thread f32 GEMM times of matrixmultiply (tape's GEMM), the `gemm`
//! crate and OpenBLAS's `cblas_sgemm` on the products of `bench_tape` and `bench_block`,
//! as a Markdown table.

use std::time::Instant;

extern "C" {
    #[allow(clippy::too_many_arguments)]
    fn cblas_sgemm(
        order: i32,
        transpose_a: i32,
        transpose_b: i32,
        m: i32,
        n: i32,
        k: i32,
        alpha: f32,
        a: *const f32,
        lda: i32,
        b: *const f32,
        ldb: i32,
        beta: f32,
        c: *mut f32,
        ldc: i32,
    );
}

const ROW_MAJOR: i32 = 101;
const NO_TRANSPOSE: i32 = 111;
const TRANSPOSE: i32 = 112;

/// One product `C[m,n] = op(A)·op(B)`; a transposed A is stored `[k,m]`, a transposed B
/// `[n,k]`, as the backward pass reads them.
struct Case {
    name: &'static str,
    m: usize,
    k: usize,
    n: usize,
    transpose_a: bool,
    transpose_b: bool,
}

fn time(case: &Case) -> [f64; 3] {
    let Case {
        m,
        k,
        n,
        transpose_a,
        transpose_b,
        ..
    } = *case;
    let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.1).collect();
    let mut c = vec![0f32; m * n];
    // Row and column strides of op(A) and op(B).
    let (a_row, a_col) = if transpose_a {
        (1, m as isize)
    } else {
        (k as isize, 1)
    };
    let (b_row, b_col) = if transpose_b {
        (1, k as isize)
    } else {
        (n as isize, 1)
    };
    let mut best = [f64::MAX; 3];
    for _ in 0..15 {
        let start = Instant::now();
        // SAFETY: the strides describe the vectors' extents exactly.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                a.as_ptr(),
                a_row,
                a_col,
                b.as_ptr(),
                b_row,
                b_col,
                0.0,
                c.as_mut_ptr(),
                n as isize,
                1,
            );
        }
        best[0] = best[0].min(start.elapsed().as_secs_f64());
        let start = Instant::now();
        // SAFETY: as above (gemm takes column stride first, then row stride).
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                c.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr(),
                a_col,
                a_row,
                b.as_ptr(),
                b_col,
                b_row,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        best[1] = best[1].min(start.elapsed().as_secs_f64());
        let start = Instant::now();
        let lda = if transpose_a { m } else { k } as i32;
        let ldb = if transpose_b { k } else { n } as i32;
        let op = |t: bool| if t { TRANSPOSE } else { NO_TRANSPOSE };
        // SAFETY: row-major operands with the leading dimensions of their storage.
        unsafe {
            cblas_sgemm(
                ROW_MAJOR,
                op(transpose_a),
                op(transpose_b),
                m as i32,
                n as i32,
                k as i32,
                1.0,
                a.as_ptr(),
                lda,
                b.as_ptr(),
                ldb,
                0.0,
                c.as_mut_ptr(),
                n as i32,
            );
        }
        best[2] = best[2].min(start.elapsed().as_secs_f64());
    }
    best
}

fn main() {
    let case = |name, m, k, n, transpose_a, transpose_b| Case {
        name,
        m,
        k,
        n,
        transpose_a,
        transpose_b,
    };
    let cases = [
        case("MLP forward x·W1", 64, 1024, 4096, false, false),
        case("MLP forward h·W2", 64, 4096, 1024, false, false),
        case("MLP backward g·W2ᵀ", 64, 1024, 4096, false, true),
        case("MLP backward hᵀ·g", 4096, 64, 1024, true, false),
        case("MLP backward xᵀ·g", 1024, 64, 4096, true, false),
        case("block QKV x·W", 1024, 512, 1536, false, false),
        case("block MLP up", 1024, 512, 2048, false, false),
        case("block MLP down", 1024, 2048, 512, false, false),
        case("block weight grad xᵀ·g", 512, 1024, 2048, true, false),
        case("attention scores q·kᵀ", 128, 64, 128, false, true),
    ];
    println!("| product | m×k×n | matrixmultiply ms (GFLOP/s) | gemm 0.18 | OpenBLAS |");
    println!("|---|---|---:|---:|---:|");
    let mut total = [0.0; 3];
    for case in &cases {
        let best = time(case);
        let flops = 2.0 * (case.m * case.k * case.n) as f64;
        let cell = |s: f64| format!("{:.2} ({:.0})", s * 1e3, flops / s / 1e9);
        println!(
            "| {} | {}×{}×{} | {} | {} | {} |",
            case.name,
            case.m,
            case.k,
            case.n,
            cell(best[0]),
            cell(best[1]),
            cell(best[2])
        );
        for (sum, t) in total.iter_mut().zip(best) {
            *sum += t;
        }
    }
    println!(
        "| total | | {:.1} ms | {:.1} ms | {:.1} ms |",
        total[0] * 1e3,
        total[1] * 1e3,
        total[2] * 1e3
    );
}
