/* Optimizer steps, in place; the same arithmetic as tape/src/optim.rs on the CPU, each
 * product rounded on its own (MUL_RN: NVRTC would fuse a product and a sum into one FMA,
 * and the CPU's numbers would differ in the last bit). */

/* SGD with optional momentum, dampening, Nesterov and (coupled) weight decay.
 * p0 param, p1 grad, p2 momentum buffer (unused without momentum); i0 n, i1 flags
 * (1: has momentum, 2: first step, the buffer starts as the direction, 4: Nesterov);
 * f0 lr, f1 weight decay, f2 momentum, f3 1 - dampening. */
KERNEL(SFX(sgd_step)) {
    const KernelArgs* A = ARGS;
    real* param = (real*)A->p[0];
    const real* grad = (const real*)A->p[1];
    real* buffer = (real*)A->p[2];
    i64 flags = A->i[1];
    real lr = (real)A->f[0], wd = (real)A->f[1], mu = (real)A->f[2], damp = (real)A->f[3];
    FOR_EACH(i, A->i[0]) {
        real p = param[i];
        if (!(flags & 1)) {
            param[i] = p - MUL_RN(lr, grad[i] + MUL_RN(wd, p));
        } else {
            real direction = wd != (real)0 ? grad[i] + MUL_RN(wd, p) : grad[i];
            real b = (flags & 2) ? direction : MUL_RN(mu, buffer[i]) + MUL_RN(damp, direction);
            buffer[i] = b;
            real step = (flags & 4) ? direction + MUL_RN(mu, b) : b;
            param[i] = p - MUL_RN(lr, step);
        }
    }
}

/* One AdamW update of element i (decoupled weight decay, torch's bias correction and
 * moment updates), writing the param rounded to 16 bits too where `rounded` is not 0
 * (`format` 0 bf16, 1 f16, as `convert_half`). c: 1 - beta1, beta2, 1 - beta2, eps,
 * 1 - lr·weight_decay, lr / (1 - beta1^t), sqrt(1 - beta2^t); each formed in double by
 * the host and rounded once here. */
DEVFN void SFX(adamw_element)(real* param, const real* grad, real* m, real* v, u16* rounded,
                              i64 format, const double* c, i64 i) {
    real w1 = (real)c[0], b2 = (real)c[1], w2 = (real)c[2], eps = (real)c[3];
    real decay = (real)c[4], step_size = (real)c[5], bias2_sqrt = (real)c[6];
    real g = grad[i];
    real mi = m[i];
    /* torch.lerp(m, g, w1): from the nearer end. */
    mi = w1 < (real)0.5 ? mi + MUL_RN(w1, g - mi) : g - MUL_RN(g - mi, (real)1 - w1);
    real vi = MUL_RN(b2, v[i]) + MUL_RN(MUL_RN(w2, g), g);
    m[i] = mi;
    v[i] = vi;
    real p = MUL_RN(param[i], decay) - MUL_RN(step_size, mi) / (SQRT(vi) / bias2_sqrt + eps);
    param[i] = p;
    if (rounded) rounded[i] = format == 0 ? f32_to_bf16((float)p) : f32_to_f16((float)p);
}

/* AdamW on one tensor.  p0 param, p1 grad, p2 first moment, p3 second moment, p4 the new
 * param rounded to 16 bits (0: none; mixed precision's model copy, written in the same
 * pass); i0 n, i1 p4's format; f0..f6 the scalars of `adamw_element` in its order. */
KERNEL(SFX(adamw_step)) {
    const KernelArgs* A = ARGS;
    FOR_EACH(i, A->i[0]) {
        SFX(adamw_element)((real*)A->p[0], (const real*)A->p[1], (real*)A->p[2],
                           (real*)A->p[3], (u16*)A->p[4], A->i[1], A->f, i);
    }
}

/* AdamW on a list of tensors in one launch (a multi-tensor step; each element as
 * `adamw_step` updates it).  p[t]: param, grad, moments and the rounded copy (0: none)
 * of tensor t; format as in `adamw_step`; shared: 1 - beta1, beta2, 1 - beta2, eps;
 * per_tensor[t]: 1 - lr·weight_decay, lr / (1 - beta1^t), sqrt(1 - beta2^t). */
KERNEL_TAKING(SFX(adamw_list), TensorListArgs) {
    const TensorListArgs* A = ARGS;
    FOR_EACH(j, A->start[A->count]) {
        /* The tensor of element j: the last whose start is at or before j. */
        i64 lo = 0, hi = A->count - 1;
        while (lo < hi) {
            i64 mid = (lo + hi + 1) / 2;
            if (A->start[mid] <= j) lo = mid;
            else hi = mid - 1;
        }
        const u64* p = A->p[lo];
        double c[7] = {A->shared[0], A->shared[1], A->shared[2], A->shared[3],
                       A->per_tensor[lo][0], A->per_tensor[lo][1], A->per_tensor[lo][2]};
        SFX(adamw_element)((real*)p[0], (const real*)p[1], (real*)p[2], (real*)p[3],
                           (u16*)p[4], A->format, c, j - A->start[lo]);
    }
}
