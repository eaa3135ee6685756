/* Optimizer steps, in place; the same arithmetic as tape/src/optim.rs on the CPU. */

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
            param[i] = p - lr * (grad[i] + wd * p);
        } else {
            real direction = wd != (real)0 ? grad[i] + wd * p : grad[i];
            real b = (flags & 2) ? direction : mu * buffer[i] + damp * direction;
            buffer[i] = b;
            real step = (flags & 4) ? direction + mu * b : b;
            param[i] = p - lr * step;
        }
    }
}

/* AdamW (decoupled weight decay, torch's bias correction and moment updates).
 * p0 param, p1 grad, p2 first moment, p3 second moment, p4 the new param rounded to
 * 16 bits (0: none; mixed precision's model copy, written in the same pass); i0 n, i1 p4's
 * format (0 bf16, 1 f16, as `convert_half`); f0 1 - beta1, f1 beta2, f2 1 - beta2,
 * f3 1 - lr·weight_decay, f4 lr / (1 - beta1^t), f5 eps, f6 sqrt(1 - beta2^t); each formed
 * in double by the host and rounded once here. */
KERNEL(SFX(adamw_step)) {
    const KernelArgs* A = ARGS;
    real* param = (real*)A->p[0];
    const real* grad = (const real*)A->p[1];
    real* m = (real*)A->p[2];
    real* v = (real*)A->p[3];
    u16* rounded = (u16*)A->p[4];
    real w1 = (real)A->f[0], b2 = (real)A->f[1], w2 = (real)A->f[2], decay = (real)A->f[3];
    real step_size = (real)A->f[4], eps = (real)A->f[5], bias2_sqrt = (real)A->f[6];
    FOR_EACH(i, A->i[0]) {
        real g = grad[i];
        real mi = m[i];
        /* torch.lerp(m, g, w1): from the nearer end. */
        mi = w1 < (real)0.5 ? mi + w1 * (g - mi) : g - (g - mi) * ((real)1 - w1);
        real vi = b2 * v[i] + w2 * g * g;
        m[i] = mi;
        v[i] = vi;
        real p = param[i] * decay - step_size * mi / (SQRT(vi) / bias2_sqrt + eps);
        param[i] = p;
        if (rounded) rounded[i] = A->i[1] == 0 ? f32_to_bf16((float)p) : f32_to_f16((float)p);
    }
}
