/* Reductions along one dimension of a tensor viewed as [outer, dim, inner]. */

/* p0 out [outer, parts, inner], p1 x, p2 argmax (i64, only for max; may be 0); i0 outer,
 * i1 dim, i2 inner, i3 kind (0 sum, 2 max), i4 parts, i5 x's storage format (as for
 * `binary`: a 16-bit x is widened as it is read); f0 scale of a sum.  Output slice p
 * reduces the p-th run of ceil(dim / parts) elements of dim, so that a long dimension is
 * shared by many threads and summed again by the caller (max always has one part). */
KERNEL(SFX(reduce_dim)) {
    const KernelArgs* A = ARGS;
    real* out = (real*)A->p[0];
    const void* x = (const void*)A->p[1];
    i64* argmax = (i64*)A->p[2];
    i64 dim = A->i[1], inner = A->i[2], parts = A->i[4];
    int kind = (int)A->i[3], format = (int)A->i[5];
    i64 run = (dim + parts - 1) / parts;
    FOR_EACH(t, A->i[0] * parts * inner) {
        i64 o = t / (parts * inner), part = t / inner % parts;
        i64 row = o * dim * inner + t % inner;
        i64 begin = part * run, end = begin + run < dim ? begin + run : dim;
        if (kind == 2) {
            real best = SFX(load)(x, row, format);
            i64 at = 0;
            for (i64 d = 1; d < dim; ++d) {
                real v = SFX(load)(x, row + d * inner, format);
                /* NaN propagates, and the first maximum wins, as on the CPU. */
                if (v > best || (v != v && best == best)) {
                    best = v;
                    at = d;
                }
            }
            out[t] = best;
            argmax[t] = at;
        } else {
            real acc = (real)0;
            for (i64 d = begin; d < end; ++d) acc += SFX(load)(x, row + d * inner, format);
            out[t] = acc * (real)A->f[0];
        }
    }
}

/* Gradient of sum/mean: out[o, d, i] = g[o, i] * f0.  p0 out, p1 g; i0 outer, i1 dim, i2 inner. */
KERNEL(SFX(expand_dim)) {
    const KernelArgs* A = ARGS;
    real* out = (real*)A->p[0];
    const real* g = (const real*)A->p[1];
    i64 dim = A->i[1], inner = A->i[2];
    real scale = (real)A->f[0];
    FOR_EACH(j, A->i[0] * dim * inner) {
        i64 o = j / (dim * inner), i = j % inner;
        out[j] = g[o * inner + i] * scale;
    }
}

/* Gradient of max: out[o, d, i] = g[o, i] where d is the argmax, else 0.  p0 out, p1 g,
 * p2 argmax; i0 outer, i1 dim, i2 inner. */
KERNEL(SFX(max_backward)) {
    const KernelArgs* A = ARGS;
    real* out = (real*)A->p[0];
    const real* g = (const real*)A->p[1];
    const i64* argmax = (const i64*)A->p[2];
    i64 dim = A->i[1], inner = A->i[2];
    FOR_EACH(j, A->i[0] * dim * inner) {
        i64 o = j / (dim * inner), d = (j / inner) % dim, i = j % inner;
        out[j] = argmax[o * inner + i] == d ? g[o * inner + i] : (real)0;
    }
}
