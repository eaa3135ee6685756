/* Elementwise kernels. Slot meanings are mirrored by tape/src/gpu/ops.rs. */

/* Storage formats of pointwise kernels' arrays: 0 `real`, 1 bf16, 2 f16. 16-bit values
 * are widened on load and the result rounded once on store, so a 16-bit operand needs
 * no widened copy. */
DEVFN real SFX(load)(const void* p, i64 at, int format) {
    if (format == 0) return ((const real*)p)[at];
    u16 h = ((const u16*)p)[at];
    return (real)(format == 1 ? bf16_to_f32(h) : f16_to_f32(h));
}

DEVFN void SFX(store)(void* p, i64 at, int format, real v) {
    if (format == 0) ((real*)p)[at] = v;
    else ((u16*)p)[at] = format == 1 ? f32_to_bf16((float)v) : f32_to_f16((float)v);
}

/* v rounded to storage format `format` and widened back: what a kernel that stored v
 * there would hand the next one. */
DEVFN real SFX(rounded)(real v, int format) {
    if (format == 0) return v;
    float f = (float)v;
    return (real)(format == 1 ? bf16_to_f32(f32_to_bf16(f)) : f16_to_f32(f32_to_f16(f)));
}

/* The input of a unary kernel at i: x's element, plus (with a bias at `bias`) the bias
 * of its column, the sum rounded to the format `add` would store it in, so that
 * f(x + bias) in one kernel gives exactly the two kernels' numbers. */
DEVFN real SFX(unary_input)(const KernelArgs* A, const void* x, int fx, i64 i) {
    real v = SFX(load)(x, i, fx);
    const void* bias = (const void*)A->p[3];
    if (!bias) return v;
    return SFX(rounded)(v + SFX(load)(bias, i % A->i[5], (int)A->i[4]), (int)A->i[6]);
}

/* out[i] = f0, stored in format i1 (as for `binary`: a 16-bit one rounded once).  p0
 * out; i0 n, i1 out's format. */
KERNEL(SFX(fill)) {
    const KernelArgs* A = ARGS;
    int format = (int)A->i[1];
    real value = (real)A->f[0];
    FOR_EACH(i, A->i[0]) SFX(store)((void*)A->p[0], i, format, value);
}

/* Broadcasting a (op) b.  p0 out, p1 a, p2 b; i0 n, i1 op (0 add, 1 sub, 2 mul, 3 div),
 * i2 ndim, i[3..11) output shape, i[11..19) a's strides, i[19..27) b's strides (0 where
 * the operand is broadcast), i27 a's format, i28 b's, i29 out's. */
KERNEL(SFX(binary)) {
    const KernelArgs* A = ARGS;
    int op = (int)A->i[1];
    int ndim = (int)A->i[2];
    int fa = (int)A->i[27], fb = (int)A->i[28], fout = (int)A->i[29];
    FOR_EACH(i, A->i[0]) {
        i64 rest = i, offset_a = 0, offset_b = 0;
        for (int d = ndim - 1; d >= 0; --d) {
            i64 c = rest % A->i[3 + d];
            rest /= A->i[3 + d];
            offset_a += c * A->i[11 + d];
            offset_b += c * A->i[19 + d];
        }
        real x = SFX(load)((const void*)A->p[1], offset_a, fa);
        real y = SFX(load)((const void*)A->p[2], offset_b, fb);
        SFX(store)((void*)A->p[0], i, fout, op == 0 ? x + y : op == 1 ? x - y : op == 2 ? x * y : x / y);
    }
}

DEVFN real SFX(gelu_value)(real x, int tanh_form) {
    if (tanh_form) {
        real inner = (real)0.7978845608028654 * (x + (real)0.044715 * x * x * x);
        return (real)0.5 * x * ((real)1 + TANH(inner));
    }
    return (real)0.5 * x * ((real)1 + ERF(x * (real)0.7071067811865476));
}

DEVFN real SFX(gelu_derivative)(real x, int tanh_form) {
    if (tanh_form) {
        real c = (real)0.7978845608028654, k = (real)0.044715;
        real t = TANH(c * (x + k * x * x * x));
        real dinner = c * ((real)1 + (real)3 * k * x * x);
        return (real)0.5 * ((real)1 + t) + (real)0.5 * x * ((real)1 - t * t) * dinner;
    }
    real cdf = (real)0.5 * ((real)1 + ERF(x * (real)0.7071067811865476));
    real pdf = EXP((real)-0.5 * x * x) * (real)0.3989422804014327;
    return cdf + x * pdf;
}

/* out = f(x) or f(x + bias).  p0 out, p1 x, p3 bias over x's last dimension (0: none);
 * i0 n, i1 kind (0 scale by f0, 1 exp, 2 log, 3 tanh, 4 relu, 5 gelu erf, 6 gelu tanh),
 * i2 x's format, i3 out's (as for `binary`), i4 the bias's format, i5 its length, i6 the
 * format x + bias is rounded to (see `unary_input`). */
KERNEL(SFX(unary)) {
    const KernelArgs* A = ARGS;
    int kind = (int)A->i[1];
    int fx = (int)A->i[2], fout = (int)A->i[3];
    real factor = (real)A->f[0];
    FOR_EACH(i, A->i[0]) {
        real v = SFX(unary_input)(A, (const void*)A->p[1], fx, i);
        real r;
        switch (kind) {
            case 0: r = v * factor; break;
            case 1: r = EXP(v); break;
            case 2: r = LOG(v); break;
            case 3: r = TANH(v); break;
            case 4: r = v > (real)0 ? v : (real)0; break;
            default: r = SFX(gelu_value)(v, kind == 6); break;
        }
        SFX(store)((void*)A->p[0], i, fout, r);
    }
}

/* Gradient of `unary`.  p0 out, p1 grad, p2 what the derivative reads: the output y for
 * exp and tanh, the input x for the others (unread by a scale); i0 n, i1 kind as in
 * `unary`, i2 p2's format (as for `binary`); p3 and i4..i6 the bias as in `unary`, added
 * to the input read; i7 grad's format, i8 out's; f0 the scale factor. */
KERNEL(SFX(unary_backward)) {
    const KernelArgs* A = ARGS;
    const void* g = (const void*)A->p[1];
    const void* kept = (const void*)A->p[2];
    int kind = (int)A->i[1];
    int fk = (int)A->i[2], fg = (int)A->i[7], fout = (int)A->i[8];
    real factor = (real)A->f[0];
    FOR_EACH(i, A->i[0]) {
        real r;
        real gi = SFX(load)(g, i, fg);
        real v = kind == 0 ? (real)0 : SFX(unary_input)(A, kept, fk, i);
        switch (kind) {
            case 0: r = gi * factor; break;
            case 1: r = gi * v; break;
            case 2: r = gi / v; break;
            case 3: r = gi * ((real)1 - v * v); break;
            case 4: r = v <= (real)0 ? (real)0 : gi; break;
            default: r = gi * SFX(gelu_derivative)(v, kind == 6); break;
        }
        SFX(store)((void*)A->p[0], i, fout, r);
    }
}

/* 16-bit storage.  p0 out, p1 x; i0 n, i1 kind: 0 real -> bf16, 1 real -> f16,
 * 2 bf16 -> real, 3 f16 -> real (via f32 for f64, as the CPU path). */
KERNEL(SFX(convert_half)) {
    const KernelArgs* A = ARGS;
    int kind = (int)A->i[1];
    FOR_EACH(i, A->i[0]) {
        if (kind < 2) {
            float v = (float)((const real*)A->p[1])[i];
            ((u16*)A->p[0])[i] = kind == 0 ? f32_to_bf16(v) : f32_to_f16(v);
        } else {
            u16 h = ((const u16*)A->p[1])[i];
            ((real*)A->p[0])[i] = (real)(kind == 2 ? bf16_to_f32(h) : f16_to_f32(h));
        }
    }
}
