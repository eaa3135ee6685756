/* Shape kernels: copies between contiguous arrays and strided views of them (device
 * arrays are always contiguous, so permute, narrow and concat move data). Slot meanings
 * are mirrored by tape/src/gpu/shape_ops.rs.
 *
 * Both kernels take the same slots: p0 out, p1 x; i0 elements iterated, i1 ndim, i2 the
 * view's offset, i[3..11) the iterated shape, i[11..19) the view's strides; i19 the
 * elements' format as for pointwise kernels (nonzero: 16-bit, moved as bits). */

/* Gather: out[i] = x[offset + sum_d coord_d(i) * stride_d], iterating over out's shape. */
KERNEL(SFX(gather_strided)) {
    const KernelArgs* A = ARGS;
    int bits_16 = A->i[19] != 0;
    FOR_EACH(i, A->i[0]) {
        i64 at;
        STRIDED_OFFSET(at, i, A->i[1], A->i + 3, A->i + 11);
        at += A->i[2];
        if (bits_16) ((u16*)A->p[0])[i] = ((const u16*)A->p[1])[at];
        else ((real*)A->p[0])[i] = ((const real*)A->p[1])[at];
    }
}

/* The gradient of a narrow: out (the input's shape, viewed as [outer, extent, inner]
 * around the narrowed dimension) is g where the coordinate c along it is in
 * [start, start + len) and 0 elsewhere, each element written once (no fill first).
 * p0 out, p1 g ([outer, len, inner]); i0 out's elements, i1 inner, i2 extent, i3 start,
 * i4 len, i5 g's format, i6 out's (as for `binary`). */
KERNEL(SFX(narrow_backward)) {
    const KernelArgs* A = ARGS;
    const void* g = (const void*)A->p[1];
    i64 inner = A->i[1], extent = A->i[2], start = A->i[3], len = A->i[4];
    int fg = (int)A->i[5], fout = (int)A->i[6];
    FOR_EACH(i, A->i[0]) {
        i64 within = i % inner, c = i / inner % extent, outer = i / (inner * extent);
        i64 k = c - start;
        real v = k >= 0 && k < len ? SFX(load)(g, (outer * len + k) * inner + within, fg) : (real)0;
        SFX(store)((void*)A->p[0], i, fout, v);
    }
}

/* Scatter: out[offset + sum_d coord_d(i) * stride_d] = x[i], iterating over x's shape.
 * The views written are one-to-one, so iterations never touch the same element. */
KERNEL(SFX(scatter_strided)) {
    const KernelArgs* A = ARGS;
    int bits_16 = A->i[19] != 0;
    FOR_EACH(i, A->i[0]) {
        i64 at;
        STRIDED_OFFSET(at, i, A->i[1], A->i + 3, A->i + 11);
        at += A->i[2];
        if (bits_16) ((u16*)A->p[0])[at] = ((const u16*)A->p[1])[i];
        else ((real*)A->p[0])[at] = ((const real*)A->p[1])[i];
    }
}
