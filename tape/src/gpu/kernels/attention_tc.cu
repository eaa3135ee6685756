/* Fused attention on the tensor cores: attention.cu's op (same argument slots, causal
 * offset, dropout rule, log-sum-exp and delta) with queries, keys, values and dO as
 * 16-bit operands of mma.m16n8k16 (dO and f32 sources are rounded to that format when
 * staged), accumulators, softmax and statistics in f32. Included in the f32 precision
 * only, once per head dimension and format with TC_D (64 or 128), TC_KIND (1 bf16, 2
 * f16: i22 must be it) and TC_TAG (_d64_bf16, ...) defined, so that each product's
 * instruction is fixed when compiled rather than chosen around every mma; it uses
 * attention.cu's helpers. Causal query tiles further down see more keys, so blocks take
 * them first.
 *
 * Blocks of four warps. A warp owns 16 rows of its block's side (queries; keys in the
 * key/value backward), a block 64, and the other side passes through shared memory 64
 * rows at a time. Tiles are 16-byte chunks of eight elements, chunk c of row r stored at
 * r·TC_D/8 + (c ^ (r % 8)): the eight rows one ldmatrix reads at one column fall in
 * eight different bank groups, so loads have no bank conflicts. The warp's own rows are
 * loaded into A fragments once and stay in registers. A 16 × 64 score tile lives in the
 * C layout (s[n][i]: n-tile n of 8 columns); rounded to 16-bit, values (0, 1) and (2, 3)
 * of n-tiles 2j and 2j + 1 are exactly A's four registers for columns 16j .. 16j + 15, so
 * probabilities go from one product into the next without leaving registers.
 *
 * Backward: one kernel per side, so that nothing is summed by atomics and every
 * gradient is the same bits run after run: dQ per query tile (recomputing P and dP),
 * dK and dV per key tile over the group's query heads and their query tiles in order.
 * A planted fault (i31 = 3, tests only) swaps two A registers of the probabilities. */

#define TC_CAT2(a, b) a##b
#define TC_CAT(a, b) TC_CAT2(a, b)
#define TSFX(name) TC_CAT(TC_CAT(name, TC_TAG), _f32)
#define TC_ROWS 64
#define TC_CHUNKS (TC_D / 8)
#define TC_K (TC_D / 16)

/* Two floats rounded to the 16-bit format `kind`, the first in the low half. */
DEVFN unsigned int TSFX(tc_pack)(int kind, float lo, float hi) {
    u16 a = kind == 1 ? f32_to_bf16(lo) : f32_to_f16(lo);
    u16 b = kind == 1 ? f32_to_bf16(hi) : f32_to_f16(hi);
    return (unsigned int)a | ((unsigned int)b << 16);
}

/* Where chunk c of row r of a staged tile is. */
DEVFN const void* TSFX(tc_at)(const u32x4* tile, int r, int c) {
    return &tile[r * TC_CHUNKS + (c ^ (r & 7))];
}

/* Stages rows first .. first + count - 1 of tensor t for head z (rows past `rows` zeros)
 * from x, stored in `format`, as 16-bit `kind`: sixteen bytes a thread at a time, loaded
 * whole where x is already `kind` and the rows are 16-byte aligned. */
DEVFN void TSFX(tc_stage)(THREAD_PARAM, const KernelArgs* A, u32x4* tile, int count, int t,
                          i64 z, i64 first, i64 rows, const void* x, int format, int kind) {
    i64 base = SFX(att_row)(A, t, z, first), step = A->i[6 + 4 * t + 3];
    int whole = format == kind && ((u64)x + 2 * (u64)base) % 16 == 0 && step % 8 == 0;
    for (int ch = (int)THREAD_IDX; ch < count * TC_CHUNKS; ch += (int)BLOCK_DIM) {
        int r = ch / TC_CHUNKS, c = ch % TC_CHUNKS;
        u32x4 v;
        v.x = v.y = v.z = v.w = 0u;
        if (first + r < rows) {
            i64 at = base + r * step + c * 8;
            if (whole) {
                v = *(const u32x4*)((const u16*)x + at);
            } else {
                unsigned int w[4];
                UNROLL
                for (int e = 0; e < 4; ++e)
                    w[e] = TSFX(tc_pack)(kind, SFX(load)(x, at + 2 * e, format),
                                         SFX(load)(x, at + 2 * e + 1, format));
                v.x = w[0];
                v.y = w[1];
                v.z = w[2];
                v.w = w[3];
            }
        }
        SHARED_STORE(tile, r * TC_CHUNKS + (c ^ (r & 7)), v);
    }
}

/* The A fragments of rows r0 .. r0 + 15 of a staged tile, a k-step of 16 columns each. */
DEVFN void TSFX(tc_rows)(THREAD_PARAM, const u32x4* tile, int r0, unsigned int f[TC_K][4]) {
    int lane = (int)(THREAD_IDX % 32);
    UNROLL
    for (int kk = 0; kk < TC_K; ++kk)
        LDMATRIX_X4(f[kk], TSFX(tc_at)(tile, r0 + lane % 16, 2 * kk + lane / 16));
}

/* s = a · bᵀ: the warp's 16 rows (A fragments) against the first 8·tiles rows of tile b
 * (read as B, column-major: a row of b is a column of B), `tiles` n-tiles of 8. */
DEVFN void TSFX(tc_scores)(THREAD_PARAM, int kind, unsigned int a[TC_K][4], const u32x4* b,
                           int tiles, float s[][4]) {
    int lane = (int)(THREAD_IDX % 32);
    UNROLL
    for (int n = 0; n < tiles; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    UNROLL
    for (int kk = 0; kk < TC_K; ++kk)
        UNROLL
        for (int nn = 0; nn < tiles / 2; ++nn) {
            unsigned int f[4];
            int row = nn * 16 + (lane / 16) * 8 + lane % 8;
            LDMATRIX_X4(f, TSFX(tc_at)(b, row, 2 * kk + (lane / 8) % 2));
            MMA_16816(kind, s[2 * nn], a[kk], f, s[2 * nn]);
            MMA_16816(kind, s[2 * nn + 1], a[kk], f + 2, s[2 * nn + 1]);
        }
}

/* acc += p · b: the warp's 16 × 8·tiles tile p (C layout, rounded to `kind` into A
 * fragments) times as many rows of tile b (read transposed, as B rows), over the head
 * dimension's n-tiles. */
DEVFN void TSFX(tc_accumulate)(THREAD_PARAM, int kind, float p[][4], int tiles,
                               const u32x4* b, float acc[TC_D / 8][4], int fault) {
    int lane = (int)(THREAD_IDX % 32);
    UNROLL
    for (int kk = 0; kk < tiles / 2; ++kk) {
        unsigned int a[4];
        a[0] = TSFX(tc_pack)(kind, p[2 * kk][0], p[2 * kk][1]);
        a[1] = TSFX(tc_pack)(kind, p[2 * kk][2], p[2 * kk][3]);
        a[2] = TSFX(tc_pack)(kind, p[2 * kk + 1][0], p[2 * kk + 1][1]);
        a[3] = TSFX(tc_pack)(kind, p[2 * kk + 1][2], p[2 * kk + 1][3]);
        if (fault == 3) {
            unsigned int swap = a[1];
            a[1] = a[2];
            a[2] = swap;
        }
        UNROLL
        for (int dd = 0; dd < TC_D / 16; ++dd) {
            unsigned int f[4];
            int row = kk * 16 + ((lane / 8) % 2) * 8 + lane % 8;
            LDMATRIX_X4_TRANS(f, TSFX(tc_at)(b, row, 2 * dd + lane / 16));
            MMA_16816(kind, acc[2 * dd], a, f, acc[2 * dd]);
            MMA_16816(kind, acc[2 * dd + 1], a, f + 2, acc[2 * dd + 1]);
        }
    }
}

/* The keys a query tile starting at q0 sees: [0, end). */
DEVFN i64 TSFX(tc_key_end)(const KernelArgs* A, i64 q0) {
    i64 sk = A->i[4], last = q0 + TC_ROWS - 1 < A->i[3] - 1 ? q0 + TC_ROWS - 1 : A->i[3] - 1;
    if (A->i[24] == 0) return sk;
    i64 end = last + A->i[25] + 1;
    return end < 0 ? 0 : end < sk ? end : sk;
}

/* Whether every query of queries q0 .. q0 + nq - 1 sees every key of k0 .. k0 + nk - 1,
 * so that no score of the pair needs its mask checked. */
DEVFN int TSFX(tc_inside)(const KernelArgs* A, i64 q0, i64 nq, i64 k0, i64 nk) {
    int within = q0 + nq <= A->i[3] && k0 + nk <= A->i[4];
    return within && (A->i[24] == 0 || k0 + nk - 1 <= q0 + A->i[25]);
}

/* Writes this warp's 16 rows of acc (C layout over the head dimension) times factor[h]
 * (h 0: row g, 1: row g + 8) into rows r0 .. of tensor t for head z. */
DEVFN void TSFX(tc_write)(THREAD_PARAM, const KernelArgs* A, void* out, int format, int t,
                          i64 z, i64 r0, i64 rows, float acc[TC_D / 8][4], float factor[2]) {
    int lane = (int)(THREAD_IDX % 32), g = lane / 4, tq = lane % 4;
    UNROLL
    for (int h = 0; h < 2; ++h) {
        i64 i = r0 + g + 8 * h;
        if (i >= rows) continue;
        i64 at = SFX(att_row)(A, t, z, i) + 2 * tq;
        UNROLL
        for (int n = 0; n < TC_D / 8; ++n)
            UNROLL
            for (int e = 0; e < 2; ++e)
                SFX(store)(out, at + 8 * n + e, format, acc[n][2 * h + e] * factor[h]);
    }
}

DEVFN float TSFX(tc_max4)(THREAD_PARAM, float v) {
    float other = SHFL_XOR(v, 1);
    v = other > v ? other : v;
    other = SHFL_XOR(v, 2);
    return other > v ? other : v;
}

/* Forward (attention_forward's slots: p0 out, p1 lse, p2 q, p3 k, p4 v); a block per
 * (head z, tile of 64 queries). */
BLOCK_KERNEL(TSFX(attention_tc_forward)) {
    const KernelArgs* A = ARGS;
    i64 sq = A->i[3], sk = A->i[4];
    int kind = TC_KIND, fault = (int)A->i[31];
    float scale = (float)A->f[0], kept = (float)A->f[1];
    i64 tiles = (sq + TC_ROWS - 1) / TC_ROWS;
    i64 z = BLOCK_IDX / tiles, q0 = (tiles - 1 - BLOCK_IDX % tiles) * TC_ROWS;
    int warp = (int)(THREAD_IDX / 32), lane = (int)(THREAD_IDX % 32), g = lane / 4;
    SHARED(u32x4, ks, TC_ROWS * TC_CHUNKS);
    SHARED(u32x4, vs, TC_ROWS * TC_CHUNKS);
    unsigned int qf[TC_K][4];
    float m[2], l[2], o[TC_D / 8][4];
    UNROLL
    for (int h = 0; h < 2; ++h) {
        m[h] = ATT_NEG_INF;
        l[h] = 0.0f;
    }
    UNROLL
    for (int n = 0; n < TC_D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    /* The queries pass through the keys' tile into registers. */
    TSFX(tc_stage)(THREAD, A, ks, TC_ROWS, 0, z, q0, sq, (const void*)A->p[2], kind, kind);
    SYNC_THREADS();
    TSFX(tc_rows)(THREAD, ks, warp * 16, qf);
    i64 end = TSFX(tc_key_end)(A, q0);
    for (i64 k0 = 0; k0 < end; k0 += TC_ROWS) {
        SYNC_THREADS(); /* every warp has read the tiles before they are replaced */
        TSFX(tc_stage)(THREAD, A, ks, TC_ROWS, 1, z, k0, sk, (const void*)A->p[3], kind, kind);
        TSFX(tc_stage)(THREAD, A, vs, TC_ROWS, 2, z, k0, sk, (const void*)A->p[4], kind, kind);
        SYNC_THREADS();
        float s[8][4];
        TSFX(tc_scores)(THREAD, kind, qf, ks, 8, s);
        int inside = TSFX(tc_inside)(A, q0, TC_ROWS, k0, TC_ROWS);
        UNROLL
        for (int h = 0; h < 2; ++h) {
            i64 i = q0 + warp * 16 + g + 8 * h;
            float top = ATT_NEG_INF;
            UNROLL
            for (int n = 0; n < 8; ++n)
                UNROLL
                for (int e = 0; e < 2; ++e) {
                    float* v = &s[n][2 * h + e];
                    int seen = inside || SFX(att_sees)(A, i, k0 + 8 * n + 2 * (lane % 4) + e);
                    *v = seen ? MUL_RN(*v, scale) : ATT_NEG_INF;
                    top = *v > top ? *v : top;
                }
            top = TSFX(tc_max4)(THREAD, top);
            float m_new = top > m[h] ? top : m[h];
            float base = m_new == ATT_NEG_INF ? 0.0f : m_new;
            float sum = 0.0f;
            UNROLL
            for (int n = 0; n < 8; ++n)
                UNROLL
                for (int e = 0; e < 2; ++e) {
                    float* v = &s[n][2 * h + e];
                    float p = *v == ATT_NEG_INF ? 0.0f : EXP(*v - base);
                    sum += p;
                    i64 key = k0 + 8 * n + 2 * (lane % 4) + e;
                    if (p != 0.0f && !SFX(att_keep)(A, z, i, key)) p = 0.0f;
                    else if (A->i[26] != 0) p *= kept;
                    *v = p;
                }
            sum += SHFL_XOR(sum, 1);
            sum += SHFL_XOR(sum, 2);
            float alpha = EXP(m[h] - base);
            l[h] = l[h] * alpha + sum;
            m[h] = m_new;
            UNROLL
            for (int n = 0; n < TC_D / 8; ++n) {
                o[n][2 * h] *= alpha;
                o[n][2 * h + 1] *= alpha;
            }
        }
        TSFX(tc_accumulate)(THREAD, kind, s, 8, vs, o, fault);
    }
    float inv[2];
    UNROLL
    for (int h = 0; h < 2; ++h) {
        i64 i = q0 + warp * 16 + g + 8 * h;
        inv[h] = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        if (lane % 4 == 0 && i < sq)
            ((float*)A->p[1])[z * sq + i] = l[h] > 0.0f ? m[h] + LOG(l[h]) : ATT_NEG_INF;
    }
    TSFX(tc_write)(THREAD, A, (void*)A->p[0], (int)A->i[23], 3, z, q0 + warp * 16, sq, o, inv);
}

/* Backward for the queries (attention_backward_q's slots: p0 dQ, p1 q, p2 k, p3 v, p4 dO,
 * p5 lse, p6 delta); a block per (head z, tile of 64 queries). */
BLOCK_KERNEL(TSFX(attention_tc_backward_q)) {
    const KernelArgs* A = ARGS;
    const float *lse = (const float*)A->p[5], *delta = (const float*)A->p[6];
    i64 sq = A->i[3], sk = A->i[4];
    int kind = TC_KIND, fault = (int)A->i[31];
    i64 tiles = (sq + TC_ROWS - 1) / TC_ROWS;
    i64 z = BLOCK_IDX / tiles, q0 = (tiles - 1 - BLOCK_IDX % tiles) * TC_ROWS;
    int warp = (int)(THREAD_IDX / 32), lane = (int)(THREAD_IDX % 32), g = lane / 4;
    SHARED(u32x4, ks, TC_ROWS * TC_CHUNKS);
    SHARED(u32x4, vs, TC_ROWS * TC_CHUNKS);
    unsigned int qf[TC_K][4], dof[TC_K][4];
    float dq[TC_D / 8][4], row_lse[2], row_delta[2];
    UNROLL
    for (int n = 0; n < TC_D / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
    UNROLL
    for (int h = 0; h < 2; ++h) {
        i64 i = q0 + warp * 16 + g + 8 * h;
        row_lse[h] = i < sq ? lse[z * sq + i] : 0.0f;
        row_delta[h] = i < sq ? delta[z * sq + i] : 0.0f;
    }
    TSFX(tc_stage)(THREAD, A, ks, TC_ROWS, 0, z, q0, sq, (const void*)A->p[1], kind, kind);
    TSFX(tc_stage)(THREAD, A, vs, TC_ROWS, 3, z, q0, sq, (const void*)A->p[4], (int)A->i[30], kind);
    SYNC_THREADS();
    TSFX(tc_rows)(THREAD, ks, warp * 16, qf);
    TSFX(tc_rows)(THREAD, vs, warp * 16, dof);
    i64 end = TSFX(tc_key_end)(A, q0);
    for (i64 k0 = 0; k0 < end; k0 += TC_ROWS) {
        SYNC_THREADS();
        TSFX(tc_stage)(THREAD, A, ks, TC_ROWS, 1, z, k0, sk, (const void*)A->p[2], kind, kind);
        TSFX(tc_stage)(THREAD, A, vs, TC_ROWS, 2, z, k0, sk, (const void*)A->p[3], kind, kind);
        SYNC_THREADS();
        float s[8][4], dp[8][4];
        TSFX(tc_scores)(THREAD, kind, qf, ks, 8, s);
        TSFX(tc_scores)(THREAD, kind, dof, vs, 8, dp);
        int inside = TSFX(tc_inside)(A, q0, TC_ROWS, k0, TC_ROWS);
        UNROLL
        for (int h = 0; h < 2; ++h) {
            i64 i = q0 + warp * 16 + g + 8 * h;
            UNROLL
            for (int n = 0; n < 8; ++n)
                UNROLL
                for (int e = 0; e < 2; ++e) {
                    i64 key = k0 + 8 * n + 2 * (lane % 4) + e;
                    int seen = inside || SFX(att_sees)(A, i, key);
                    float p = SFX(att_prob)(A, s[n][2 * h + e], row_lse[h], seen);
                    float factor = SFX(att_factor)(A, z, i, key);
                    s[n][2 * h + e] =
                        seen ? p * (dp[n][2 * h + e] * factor - row_delta[h]) : 0.0f;
                }
        }
        TSFX(tc_accumulate)(THREAD, kind, s, 8, ks, dq, fault);
    }
    float scale[2] = {(float)A->f[0], (float)A->f[0]};
    TSFX(tc_write)(THREAD, A, (void*)A->p[0], (int)A->i[29], 0, z, q0 + warp * 16, sq, dq,
                   scale);
}

/* Queries a step of the key/value backward takes: four tiles (keys, values, queries,
 * dO) in 48 KiB of shared memory. */
#define TC_KV_COLS (TC_D == 128 ? 32 : 64)

/* Backward for the keys and values of one group (attention_backward_kv's slots: p0 dK,
 * p1 dV, p2 q, p3 k, p4 v, p5 dO, p6 lse, p7 delta); a block per (batch, group, tile of
 * 64 keys), its rows the keys: Pᵀ and dPᵀ are computed as K·Qᵀ and V·dOᵀ over
 * TC_KV_COLS queries at a time. The keys' and values' fragments are loaded from shared
 * memory for each step rather than held, leaving the registers to dK and dV. */
BLOCK_KERNEL(TSFX(attention_tc_backward_kv)) {
    const KernelArgs* A = ARGS;
    const float *lse = (const float*)A->p[6], *delta = (const float*)A->p[7];
    i64 H = A->i[1], r = A->i[2], sq = A->i[3], sk = A->i[4];
    int kind = TC_KIND, fault = (int)A->i[31];
    i64 tiles = (sk + TC_ROWS - 1) / TC_ROWS;
    i64 kv = BLOCK_IDX / tiles, k0 = (BLOCK_IDX % tiles) * TC_ROWS;
    int warp = (int)(THREAD_IDX / 32), lane = (int)(THREAD_IDX % 32), g = lane / 4;
    /* Query head 0 of the group: batch kv / (H / r), group kv % (H / r). */
    i64 z0 = (kv / (H / r)) * H + (kv % (H / r)) * r;
    SHARED(u32x4, ks, TC_ROWS * TC_CHUNKS);
    SHARED(u32x4, vs, TC_ROWS * TC_CHUNKS);
    SHARED(u32x4, qs, TC_KV_COLS * TC_CHUNKS);
    SHARED(u32x4, dos, TC_KV_COLS * TC_CHUNKS);
    float dk[TC_D / 8][4], dv[TC_D / 8][4];
    UNROLL
    for (int n = 0; n < TC_D / 8; ++n)
        UNROLL
        for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;
    TSFX(tc_stage)(THREAD, A, ks, TC_ROWS, 1, z0, k0, sk, (const void*)A->p[3], kind, kind);
    TSFX(tc_stage)(THREAD, A, vs, TC_ROWS, 2, z0, k0, sk, (const void*)A->p[4], kind, kind);
    /* The first query step that sees key k0 under the causal mask. */
    i64 first = A->i[24] != 0 && k0 - A->i[25] > 0 ? (k0 - A->i[25]) / TC_KV_COLS * TC_KV_COLS : 0;
    for (i64 head = 0; head < r; ++head) {
        i64 z = z0 + head;
        for (i64 q0 = first; q0 < sq; q0 += TC_KV_COLS) {
            SYNC_THREADS(); /* every warp has read the last step's queries and dO */
            TSFX(tc_stage)(THREAD, A, qs, TC_KV_COLS, 0, z, q0, sq, (const void*)A->p[2], kind,
                           kind);
            TSFX(tc_stage)(THREAD, A, dos, TC_KV_COLS, 3, z, q0, sq, (const void*)A->p[5],
                           (int)A->i[30], kind);
            SYNC_THREADS();
            float p[TC_KV_COLS / 8][4], ds[TC_KV_COLS / 8][4];
            unsigned int f[TC_K][4];
            TSFX(tc_rows)(THREAD, ks, warp * 16, f);
            TSFX(tc_scores)(THREAD, kind, f, qs, TC_KV_COLS / 8, p);
            TSFX(tc_rows)(THREAD, vs, warp * 16, f);
            TSFX(tc_scores)(THREAD, kind, f, dos, TC_KV_COLS / 8, ds);
            int inside = TSFX(tc_inside)(A, q0, TC_KV_COLS, k0, TC_ROWS);
            UNROLL
            for (int n = 0; n < TC_KV_COLS / 8; ++n)
                UNROLL
                for (int e = 0; e < 2; ++e) {
                    i64 i = q0 + 8 * n + 2 * (lane % 4) + e;
                    float row_lse = i < sq ? lse[z * sq + i] : 0.0f;
                    float row_delta = i < sq ? delta[z * sq + i] : 0.0f;
                    UNROLL
                    for (int h = 0; h < 2; ++h) {
                        i64 key = k0 + warp * 16 + g + 8 * h;
                        int seen = inside || SFX(att_sees)(A, i, key);
                        float prob = SFX(att_prob)(A, p[n][2 * h + e], row_lse, seen);
                        float factor = seen ? SFX(att_factor)(A, z, i, key) : 0.0f;
                        float* d = &ds[n][2 * h + e];
                        *d = seen ? prob * (*d * factor - row_delta) : 0.0f;
                        p[n][2 * h + e] = prob * factor;
                    }
                }
            TSFX(tc_accumulate)(THREAD, kind, p, TC_KV_COLS / 8, dos, dv, fault);
            TSFX(tc_accumulate)(THREAD, kind, ds, TC_KV_COLS / 8, qs, dk, fault);
        }
    }
    float scale[2] = {(float)A->f[0], (float)A->f[0]}, one[2] = {1.0f, 1.0f};
    TSFX(tc_write)(THREAD, A, (void*)A->p[0], (int)A->i[29], 1, z0, k0 + warp * 16, sk, dk,
                   scale);
    TSFX(tc_write)(THREAD, A, (void*)A->p[1], (int)A->i[29], 2, z0, k0 + warp * 16, sk, dv,
                   one);
}

#undef TC_CAT2
#undef TC_CAT
#undef TSFX
#undef TC_ROWS
#undef TC_CHUNKS
#undef TC_K
#undef TC_KV_COLS
