/* Index kernels: embedding lookup, masked fill, dropout. Slot meanings are mirrored by
 * tape/src/gpu/shape_ops.rs. */

/* out[r, h] = table[ids[r], h].  p0 out [rows, hidden], p1 table [vocab, hidden], p2 ids
 * (i64, checked in range on the host); i0 rows, i1 hidden, i2 the elements' format as for
 * shape kernels (nonzero: 16-bit, moved as bits). */
KERNEL(SFX(embedding)) {
    const KernelArgs* A = ARGS;
    const i64* ids = (const i64*)A->p[2];
    i64 hidden = A->i[1];
    int bits_16 = A->i[2] != 0;
    FOR_EACH(j, A->i[0] * hidden) {
        i64 at = ids[j / hidden] * hidden + j % hidden;
        if (bits_16) ((u16*)A->p[0])[j] = ((const u16*)A->p[1])[at];
        else ((real*)A->p[0])[j] = ((const real*)A->p[1])[at];
    }
}

/* Gradient of `embedding`: table_grad[ids[r], h] += g[r, h]. Repeated ids hit the same
 * row, hence the atomic add.  p0 table_grad (zeroed), p1 g [rows, hidden], p2 ids;
 * i0 rows, i1 hidden, i2 g's format (as for `binary`). */
KERNEL(SFX(embedding_backward)) {
    const KernelArgs* A = ARGS;
    real* table_grad = (real*)A->p[0];
    const void* g = (const void*)A->p[1];
    const i64* ids = (const i64*)A->p[2];
    i64 hidden = A->i[1];
    int fg = (int)A->i[2];
    FOR_EACH(j, A->i[0] * hidden) {
        ATOMIC_ADD(&table_grad[ids[j / hidden] * hidden + j % hidden], SFX(load)(g, j, fg));
    }
}

/* out[i] = mask[i broadcast] ? f0 : x[i]; with f0 = 0 it is also the gradient.  p0 out,
 * p1 x, p2 mask (u8, 1 = fill, broadcast to x's shape); i0 n, i1 ndim, i[2..10) x's shape,
 * i[10..18) the mask's strides (0 along the dimensions it is broadcast over), i18 x's
 * storage format, i19 out's (as for `binary`); f0 value. */
KERNEL(SFX(masked_fill)) {
    const KernelArgs* A = ARGS;
    const u8* mask = (const u8*)A->p[2];
    int fx = (int)A->i[18], fout = (int)A->i[19];
    real value = (real)A->f[0];
    FOR_EACH(i, A->i[0]) {
        i64 m;
        STRIDED_OFFSET(m, i, A->i[1], A->i + 2, A->i + 10);
        SFX(store)((void*)A->p[0], i, fout, mask[m] ? value : SFX(load)((const void*)A->p[1], i, fx));
    }
}

/* out[i] = x[i] * (keep[i] ? f0 : 0), the CPU's product (so a dropped inf gives NaN there
 * too); the same kernel gives the gradient.  p0 out, p1 x, p2 keep (u8); i0 n, i1 x's
 * storage format, i2 out's (as for `binary`); f0 the scale of kept elements, 1/(1-p). */
KERNEL(SFX(dropout)) {
    const KernelArgs* A = ARGS;
    const u8* keep = (const u8*)A->p[2];
    int fx = (int)A->i[1], fout = (int)A->i[2];
    real scale = (real)A->f[0];
    FOR_EACH(i, A->i[0]) {
        real x = SFX(load)((const void*)A->p[1], i, fx);
        SFX(store)((void*)A->p[0], i, fout, x * (keep[i] ? scale : (real)0));
    }
}

/* A residual branch's bias, dropout and addition in one pass:
 * out = residual + dropout(x + bias), each intermediate rounded to the format its own
 * kernel would store it in, so that the numbers are those of add, dropout and add.
 * p0 out, p1 x, p2 bias over x's last dimension (0: none), p3 residual, p4 keep (u8; 0:
 * no dropout); i0 n, i1 the bias's length, i2..i5 the formats of x, bias, residual and
 * out (as for `binary`), i6 the format x + bias is rounded to, i7 the dropped branch's;
 * f0 the scale of kept elements. */
KERNEL(SFX(bias_dropout_add)) {
    const KernelArgs* A = ARGS;
    const void* bias = (const void*)A->p[2];
    const u8* keep = (const u8*)A->p[4];
    real scale = (real)A->f[0];
    FOR_EACH(i, A->i[0]) {
        real v = SFX(load)((const void*)A->p[1], i, (int)A->i[2]);
        if (bias) v = SFX(rounded)(v + SFX(load)(bias, i % A->i[1], (int)A->i[3]), (int)A->i[6]);
        if (keep) v = SFX(rounded)(v * (keep[i] ? scale : (real)0), (int)A->i[7]);
        real r = SFX(load)((const void*)A->p[3], i, (int)A->i[4]);
        SFX(store)((void*)A->p[0], i, (int)A->i[5], r + v);
    }
}
