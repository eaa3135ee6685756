/* Row kernels: softmax, log-softmax, layer norm and cross-entropy over the last dimension
 * of a tensor viewed as [rows, width]. Slot meanings are mirrored by
 * tape/src/gpu/row_ops.rs.
 *
 * Cooperative: a warp per row (ROWS_OF_WARPS: warp w of the grid takes rows w, w + the
 * grid's warps, ...), its lanes reading the row's columns lane, lane + 32, ... (adjacent
 * lanes, adjacent addresses) and meeting in butterfly reductions of xor shuffles, so no
 * shared memory and no block barrier: the warps of a block work on their own rows
 * (WARP_SUM, WARP_MAX: a butterfly, the same tree in every lane; a NaN in a max stays
 * where it is compared, and the row's sums then make the row NaN, as on the CPU). Every
 * pass over a row reads it as stored (16-bit widened in registers). Rows read in full
 * are never empty: softmax and layer norm have no rows when the width is 0, and a
 * cross-entropy row with 0 classes can only be ignored (any label is out of range). */

#define LANE (THREAD_IDX % 32)
#define ROWS_OF_WARPS(r, rows)                                                         \
    for (i64 r = BLOCK_IDX * (BLOCK_DIM / 32) + THREAD_IDX / 32; r < (i64)(rows);       \
         r += GRID_DIM * (BLOCK_DIM / 32))
/* The columns of a row this lane takes. */
#define LANE_COLUMNS(j, width) for (i64 j = LANE; j < (i64)(width); j += 32)

/* Softmax (i2 = 0) or log-softmax (i2 = 1) of each row of f0 · x. With i3 = 1 (softmax
 * of square matrices) row r sees only columns j ≤ r mod width and the others are 0:
 * Megatron's upper-triangular masked softmax, with no mask in memory.  p0 out, p1 x;
 * i0 rows, i1 width; i4 x's format, i5 out's (as for `binary`); f0 scale. The input is
 * read in three passes and each result written once, so a 16-bit output is rounded once
 * and never serves as scratch. */
BLOCK_KERNEL(SFX(softmax_rows)) {
    const KernelArgs* A = ARGS;
    const void* x = (const void*)A->p[1];
    void* out = (void*)A->p[0];
    i64 width = A->i[1];
    int log_form = A->i[2] != 0;
    int causal = A->i[3] != 0;
    int fx = (int)A->i[4], fout = (int)A->i[5];
    real scale = (real)A->f[0];
    ROWS_OF_WARPS(r, A->i[0]) {
        i64 base = r * width;
        i64 seen = causal ? r % width + 1 : width;
        /* MUL_RN: the scaled value is rounded before it is used, as on the CPU. Every
         * lane starts from the row's first element, which every row has. */
        real max = MUL_RN(SFX(load)(x, base, fx), scale);
        LANE_COLUMNS(j, seen) {
            real v = MUL_RN(SFX(load)(x, base + j, fx), scale);
            if (v > max) max = v;
        }
        max = WARP_MAX(max);
        real total = (real)0;
        LANE_COLUMNS(j, seen) total += EXP(MUL_RN(SFX(load)(x, base + j, fx), scale) - max);
        total = WARP_SUM(total);
        real log_total = LOG(total) + max;
        LANE_COLUMNS(j, width) {
            real v = (real)0;
            if (j < seen) {
                real scaled = MUL_RN(SFX(load)(x, base + j, fx), scale);
                v = log_form ? scaled - log_total : EXP(scaled - max) / total;
            }
            SFX(store)(out, base + j, fout, v);
        }
    }
}

/* Gradient of `softmax_rows` from its output y: softmax dx = f0 · y ⊙ (g − Σ g⊙y),
 * log-softmax dx = f0 · (g − exp(y) · Σ g); with i3 = 1, columns a row does not see get
 * 0 and take no part in the sums.  p0 dx, p1 g, p2 y; i0 rows, i1 width, i2 and i3 as in
 * `softmax_rows`, i4 y's format (as for `binary`: the rounded 16-bit output is read as
 * stored), i5 g's, i6 dx's; f0 scale. */
BLOCK_KERNEL(SFX(softmax_rows_backward)) {
    const KernelArgs* A = ARGS;
    void* dx = (void*)A->p[0];
    const void* g = (const void*)A->p[1];
    const void* y = (const void*)A->p[2];
    i64 width = A->i[1];
    int log_form = A->i[2] != 0;
    int causal = A->i[3] != 0;
    int fy = (int)A->i[4], fg = (int)A->i[5], fdx = (int)A->i[6];
    real scale = (real)A->f[0];
    ROWS_OF_WARPS(r, A->i[0]) {
        i64 base = r * width;
        i64 seen = causal ? r % width + 1 : width;
        real acc = (real)0;
        LANE_COLUMNS(j, seen) {
            real gj = SFX(load)(g, base + j, fg);
            acc += log_form ? gj : gj * SFX(load)(y, base + j, fy);
        }
        acc = WARP_SUM(acc);
        LANE_COLUMNS(j, width) {
            i64 k = base + j;
            real d = (real)0;
            if (j < seen) {
                real yk = SFX(load)(y, k, fy);
                real gk = SFX(load)(g, k, fg);
                d = (log_form ? gk - EXP(yk) * acc : yk * (gk - acc)) * scale;
            }
            SFX(store)(dx, k, fdx, d);
        }
    }
}

/* Layer norm of each row: out = (x − mean) · rstd · weight + bias, rstd = 1/√(var + f0)
 * with the biased variance (the mean first, then the squares about it); mean and rstd
 * are kept for the backward.  p0 out, p1 x, p2 weight [width] (0: none), p3 bias [width]
 * (0: none), p4 mean [rows], p5 rstd [rows]; i0 rows, i1 width, i2 x's format, i3
 * weight's, i4 bias's, i5 out's (as for `binary`); f0 eps. */
BLOCK_KERNEL(SFX(layer_norm_rows)) {
    const KernelArgs* A = ARGS;
    const void* x = (const void*)A->p[1];
    const void* weight = (const void*)A->p[2];
    const void* bias = (const void*)A->p[3];
    real* means = (real*)A->p[4];
    real* rstds = (real*)A->p[5];
    i64 width = A->i[1];
    int fx = (int)A->i[2], fw = (int)A->i[3], fb = (int)A->i[4], fout = (int)A->i[5];
    real count = (real)width;
    real eps = (real)A->f[0];
    ROWS_OF_WARPS(r, A->i[0]) {
        i64 base = r * width;
        real total = (real)0;
        LANE_COLUMNS(j, width) total += SFX(load)(x, base + j, fx);
        real mean = WARP_SUM(total) / count;
        real squares = (real)0;
        LANE_COLUMNS(j, width) {
            real d = SFX(load)(x, base + j, fx) - mean;
            squares += d * d;
        }
        real rstd = (real)1 / SQRT(WARP_SUM(squares) / count + eps);
        LANE_COLUMNS(j, width) {
            real v = (SFX(load)(x, base + j, fx) - mean) * rstd;
            if (weight) v *= SFX(load)(weight, j, fw);
            if (bias) v += SFX(load)(bias, j, fb);
            SFX(store)((void*)A->p[0], base + j, fout, v);
        }
        if (LANE == 0) {
            means[r] = mean;
            rstds[r] = rstd;
        }
    }
}

/* Input gradient of `layer_norm_rows`: dx = rstd · (ĝ − mean(ĝ) − x̂ · mean(ĝ ⊙ x̂)) with
 * ĝ = g ⊙ weight and x̂ = (x − mean) · rstd.  p0 dx, p1 g, p2 x, p3 weight (0: none),
 * p4 mean, p5 rstd; i0 rows, i1 width, i2 x's storage format, i3 weight's, i4 g's, i5
 * dx's (as for `binary`). */
BLOCK_KERNEL(SFX(layer_norm_rows_backward)) {
    const KernelArgs* A = ARGS;
    void* dx = (void*)A->p[0];
    const void* g = (const void*)A->p[1];
    const void* x = (const void*)A->p[2];
    const void* weight = (const void*)A->p[3];
    const real* means = (const real*)A->p[4];
    const real* rstds = (const real*)A->p[5];
    i64 width = A->i[1];
    int fx = (int)A->i[2], fw = (int)A->i[3], fg = (int)A->i[4], fdx = (int)A->i[5];
    real count = (real)width;
    ROWS_OF_WARPS(r, A->i[0]) {
        i64 base = r * width;
        real mean = means[r], rstd = rstds[r];
        real sum_g = (real)0, sum_gx = (real)0;
        LANE_COLUMNS(j, width) {
            real gj = SFX(load)(g, base + j, fg);
            real g_hat = weight ? gj * SFX(load)(weight, j, fw) : gj;
            sum_g += g_hat;
            sum_gx += g_hat * ((SFX(load)(x, base + j, fx) - mean) * rstd);
        }
        real mean_g = WARP_SUM(sum_g) / count;
        real mean_gx = WARP_SUM(sum_gx) / count;
        LANE_COLUMNS(j, width) {
            real gj = SFX(load)(g, base + j, fg);
            real g_hat = weight ? gj * SFX(load)(weight, j, fw) : gj;
            real x_hat = (SFX(load)(x, base + j, fx) - mean) * rstd;
            SFX(store)(dx, base + j, fdx, rstd * (g_hat - mean_g - x_hat * mean_gx));
        }
    }
}

/* Weight and bias gradients of `layer_norm_rows` as `parts` partial sums over runs of
 * ceil(rows / parts) rows, one index per (part, column), so no atomics; the caller sums the
 * parts: dweight = Σ g ⊙ x̂, dbias = Σ g.  p0 dweight [parts, width] (0: not needed), p1
 * dbias (likewise), p2 g, p3 x, p4 mean, p5 rstd; i0 width, i1 rows, i2 parts, i3 x's
 * storage format, i4 g's. */
KERNEL(SFX(layer_norm_affine_backward)) {
    const KernelArgs* A = ARGS;
    real* dweight = (real*)A->p[0];
    real* dbias = (real*)A->p[1];
    const void* g = (const void*)A->p[2];
    const void* x = (const void*)A->p[3];
    int fx = (int)A->i[3], fg = (int)A->i[4];
    const real* means = (const real*)A->p[4];
    const real* rstds = (const real*)A->p[5];
    i64 width = A->i[0], rows = A->i[1], parts = A->i[2];
    i64 run = (rows + parts - 1) / parts;
    FOR_EACH(t, parts * width) {
        i64 c = t % width, begin = t / width * run;
        i64 end = begin + run < rows ? begin + run : rows;
        real sum_gx = (real)0, sum_g = (real)0;
        for (i64 r = begin; r < end; ++r) {
            i64 k = r * width + c;
            real gk = SFX(load)(g, k, fg);
            sum_gx += gk * ((SFX(load)(x, k, fx) - means[r]) * rstds[r]);
            sum_g += gk;
        }
        if (dweight) dweight[t] = sum_gx;
        if (dbias) dbias[t] = sum_g;
    }
}

/* Cross-entropy of each row of logits against its label, with label smoothing f0:
 * loss = (1 − ε)(lse − x[label]) + ε(lse − mean(x)), 0 for an ignored row; lse (log Σ exp
 * of the row, left unset for ignored rows) is kept for the backward.  p0 loss [rows], p1
 * lse [rows], p2 logits, p3 labels (i64, checked in range on the host); i0 rows, i1
 * classes, i2 whether i3 is an ignored label, i3 the ignored label, i4 the logits' format
 * (as for `binary`: 16-bit logits are read as stored); f0 ε. */
BLOCK_KERNEL(SFX(cross_entropy_rows)) {
    const KernelArgs* A = ARGS;
    real* loss = (real*)A->p[0];
    real* lses = (real*)A->p[1];
    const void* x = (const void*)A->p[2];
    const i64* labels = (const i64*)A->p[3];
    i64 classes = A->i[1];
    int has_ignore = A->i[2] != 0;
    i64 ignore = A->i[3];
    int fx = (int)A->i[4];
    real eps = (real)A->f[0];
    ROWS_OF_WARPS(r, A->i[0]) {
        i64 base = r * classes;
        i64 label = labels[r];
        /* Checked first: an ignored row may be empty (0 classes), and needs no lse. */
        if (has_ignore && label == ignore) {
            if (LANE == 0) loss[r] = (real)0;
            continue;
        }
        real max = SFX(load)(x, base, fx);
        LANE_COLUMNS(j, classes) {
            real v = SFX(load)(x, base + j, fx);
            if (v > max) max = v;
        }
        max = WARP_MAX(max);
        real exps = (real)0, total = (real)0;
        LANE_COLUMNS(j, classes) {
            real v = SFX(load)(x, base + j, fx);
            exps += EXP(v - max);
            total += v;
        }
        real lse = LOG(WARP_SUM(exps)) + max;
        total = WARP_SUM(total);
        if (LANE == 0) {
            real nll = lse - SFX(load)(x, base + label, fx);
            real smooth = lse - total / (real)classes;
            lses[r] = lse;
            loss[r] = ((real)1 - eps) * nll + eps * smooth;
        }
    }
}

/* Gradient of `cross_entropy_rows`: dx = u · (softmax − ε/C − (1 − ε)·[c = label]), 0 for an
 * ignored row, where u is the row's upstream gradient divided by f1.  p0 dx, p1 logits,
 * p2 lse, p3 labels, p4 upstream (one per row if i4, else one for all); i0 rows,
 * i1 classes, i2 and i3 as in `cross_entropy_rows`, i4 whether upstream is per row;
 * f0 ε, f1 divisor of upstream (the counted rows for a mean, else 1), f2 the C of ε/C
 * when the logits are one shard of more classes (0: i1); i5 dx's format, i6 the logits'
 * (as for `binary`). A negative label is a counted row whose target is in another shard. */
BLOCK_KERNEL(SFX(cross_entropy_rows_backward)) {
    const KernelArgs* A = ARGS;
    void* dx = (void*)A->p[0];
    int fdx = (int)A->i[5], fx = (int)A->i[6];
    const void* x = (const void*)A->p[1];
    const real* lses = (const real*)A->p[2];
    const i64* labels = (const i64*)A->p[3];
    const real* upstream = (const real*)A->p[4];
    i64 classes = A->i[1];
    int has_ignore = A->i[2] != 0;
    i64 ignore = A->i[3];
    int per_row = A->i[4] != 0;
    real eps = (real)A->f[0];
    real divisor = (real)A->f[1];
    real uniform_over = A->f[2] > 0 ? (real)A->f[2] : (real)classes;
    ROWS_OF_WARPS(r, A->i[0]) {
        i64 base = r * classes;
        i64 label = labels[r];
        if (has_ignore && label == ignore) {
            LANE_COLUMNS(j, classes) SFX(store)(dx, base + j, fdx, (real)0);
            continue;
        }
        real u = (per_row ? upstream[r] : upstream[0]) / divisor;
        real uniform = eps / uniform_over;
        real lse = lses[r];
        LANE_COLUMNS(j, classes) {
            real d = u * (EXP(SFX(load)(x, base + j, fx) - lse) - uniform);
            if (j == label) d -= u * ((real)1 - eps);
            SFX(store)(dx, base + j, fdx, d);
        }
    }
}
