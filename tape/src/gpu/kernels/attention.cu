/* Fused attention (FlashAttention-2's scheme): softmax(scale · q·kᵀ) · v computed tile by
 * tile with an online softmax, keeping only the output and each query's log-sum-exp; the
 * backward recomputes the probabilities from them. Slot meanings are mirrored by
 * tape/src/gpu/attention_ops.rs.
 *
 * Addressing (every kernel): query head z of B·H is batch z / H, head h = z % H, of
 * key/value group h / r (r query heads share a group's key and value). Row i of tensor t
 * (0 queries, 1 keys, 2 values, 3 outputs; their gradients share the layout) starts at
 * element b·sb + group·sg + (h % r)·sh + i·ss with t's strides at i[6 + 4t ..]; keys and
 * values have sh = 0. So one kernel reads Megatron's packed [s, b, groups, r + 2, d]
 * projection in place, and also plain [z, s, d] arrays.
 *
 * Common slots: i0 B, i1 H, i2 r, i3 query rows sq, i4 key rows sk, i5 head dim d,
 * i6..i21 strides, i22 q/k/v's format, i23 the output's format, i24 causal
 * (key j seen by query i iff j <= i + i25), i25 the causal offset, i26 dropout (0: none),
 * i27 its seed (bits), i28 its threshold (a draw is kept iff its 53 bits >= i28), i29 the
 * gradients' format, i30 dO's, i31 a planted fault (tests only: 1 drops the forward's
 * barrier before restaging keys, 2 stages the sequence's last row as zeros); f0 scale,
 * f1 dropout's 1/(1 - p).
 *
 * Cooperative: blocks of ATT_THREADS (two warps) over a tile of ATT_TILE rows of their own
 * side (queries, or keys in the key/value backward) against tiles of ATT_TILE rows of the
 * other side, every operand tile staged in padded shared memory, widened to `real`. Each
 * product is register-blocked: thread (ty, tx) = (THREAD_IDX / 8, THREAD_IDX % 8) holds
 * rows ty·4 .. ty·4 + 3 of its side, the score columns tx·4 .. tx·4 + 3 and the output
 * columns tx + 8·c, so a step over the head dimension reads 8 values for 16 products. A
 * row's eight threads are lanes of one warp: row maxima and sums are three xor shuffles,
 * and a tile of probabilities passes between them with a warp barrier. The head
 * dimension is at most ATT_DMAX (64 in f32, 32 in f64, so that four tiles fit 48 KiB of
 * static shared memory); the host falls back to the unfused path above it. */

#define ATT_TILE 32
#define ATT_THREADS 64
#define ATT_R 4
#define ATT_DMAX (sizeof(real) == 4 ? 64 : 32)
#define ATT_CC (ATT_DMAX / 8)
#define ATT_PAD (ATT_DMAX + 1)
#define ATT_SPAD (ATT_TILE + 1)
#define ATT_NEG_INF ((real)bits_float(0xff800000u))

/* Element offset of row i of tensor t (0 q, 1 k, 2 v, 3 o) for query head z. */
DEVFN i64 SFX(att_row)(const KernelArgs* A, int t, i64 z, i64 i) {
    i64 h = z % A->i[1], r = A->i[2];
    const i64* s = &A->i[6 + 4 * t];
    return (z / A->i[1]) * s[0] + (h / r) * s[1] + (h % r) * s[2] + i * s[3];
}

/* Whether query i sees key j. */
DEVFN int SFX(att_sees)(const KernelArgs* A, i64 i, i64 j) {
    return i < A->i[3] && j < A->i[4] && (A->i[24] == 0 || j <= i + A->i[25]);
}

/* Whether dropout keeps probability (z, i, j): SplitMix64 of the seed and the element's
 * index in a [B·H, sq, sk] mask, its top 53 bits against the threshold. */
DEVFN int SFX(att_keep)(const KernelArgs* A, i64 z, i64 i, i64 j) {
    if (A->i[26] == 0) return 1;
    u64 index = ((u64)z * (u64)A->i[3] + (u64)i) * (u64)A->i[4] + (u64)j;
    u64 x = (u64)A->i[27] + (index + 1ull) * 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return (x >> 11) >= (u64)A->i[28];
}

/* Stages rows first, first + 1, ... (ATT_TILE of them) of tensor t for head z into a
 * shared tile, widened; rows past `rows` are zeros. Row by row, the threads across its
 * columns: no integer division per element (64-bit division is a long instruction
 * sequence on a GPU, and dividing here cost more than the products). */
DEVFN void SFX(att_stage)(THREAD_PARAM, const KernelArgs* A, real* tile, int t, i64 z,
                          i64 first, i64 rows, const void* x, int format) {
    i64 d = A->i[5], base = SFX(att_row)(A, t, z, first), step = A->i[6 + 4 * t + 3];
    rows -= A->i[31] == 2;
    for (i64 j = 0; j < ATT_TILE; ++j)
        for (i64 c = THREAD_IDX; c < d; c += BLOCK_DIM) {
            real v = (real)0;
            if (first + j < rows) v = SFX(load)(x, base + j * step + c, format);
            SHARED_STORE(tile, j * ATT_PAD + c, v);
        }
}

/* This thread's 4 × 4 block of a·bᵀ over two staged tiles: s[a][b] = Σ_c a[ty·4 + a][c] ·
 * b[tx·4 + b][c]. */
DEVFN void SFX(att_scores)(THREAD_PARAM, const real* a, const real* b, i64 d,
                           real s[ATT_R][ATT_R]) {
    i64 ty = THREAD_IDX / 8, tx = THREAD_IDX % 8;
    for (int x = 0; x < ATT_R; ++x)
        for (int y = 0; y < ATT_R; ++y) s[x][y] = (real)0;
    for (i64 c = 0; c < d; ++c) {
        real ax[ATT_R], by[ATT_R];
        for (int x = 0; x < ATT_R; ++x) {
            ax[x] = SHARED_LOAD(a, (ty * ATT_R + x) * ATT_PAD + c);
            by[x] = SHARED_LOAD(b, (tx * ATT_R + x) * ATT_PAD + c);
        }
        for (int x = 0; x < ATT_R; ++x)
            for (int y = 0; y < ATT_R; ++y) s[x][y] += ax[x] * by[y];
    }
}

/* acc[x][c] += Σ_j p[ty·4 + x][j] · b[j][tx + 8c] over a staged tile b and this warp's
 * rows of the probability tile p. */
DEVFN void SFX(att_accumulate)(THREAD_PARAM, const real* p, const real* b, i64 d,
                               real acc[ATT_R][ATT_CC]) {
    i64 ty = THREAD_IDX / 8, tx = THREAD_IDX % 8;
    for (i64 j = 0; j < ATT_TILE; ++j) {
        real px[ATT_R], bc[ATT_CC];
        for (int x = 0; x < ATT_R; ++x) px[x] = SHARED_LOAD(p, (ty * ATT_R + x) * ATT_SPAD + j);
        for (int c = 0; c < ATT_CC; ++c)
            bc[c] = tx + 8 * c < d ? SHARED_LOAD(b, j * ATT_PAD + tx + 8 * c) : (real)0;
        for (int x = 0; x < ATT_R; ++x)
            for (int c = 0; c < ATT_CC; ++c) acc[x][c] += px[x] * bc[c];
    }
}

/* Stores this thread's rows of a probability tile: p[ty·4 + x][tx·4 + y] = v[x][y]. */
DEVFN void SFX(att_put)(THREAD_PARAM, real* p, real v[ATT_R][ATT_R]) {
    i64 ty = THREAD_IDX / 8, tx = THREAD_IDX % 8;
    for (int x = 0; x < ATT_R; ++x)
        for (int y = 0; y < ATT_R; ++y)
            SHARED_STORE(p, (ty * ATT_R + x) * ATT_SPAD + tx * ATT_R + y, v[x][y]);
}

/* The maximum and the sum over a row's eight threads (lanes 8k .. 8k + 7). */
DEVFN real SFX(att_row_max)(THREAD_PARAM, real v) {
    for (int mask = 1; mask < 8; mask *= 2) {
        real other = SHFL_XOR(v, mask);
        v = other > v ? other : v;
    }
    return v;
}
DEVFN real SFX(att_row_sum)(THREAD_PARAM, real v) {
    for (int mask = 1; mask < 8; mask *= 2) v += SHFL_XOR(v, mask);
    return v;
}

/* Writes this thread's output columns of its rows: row ty·4 + x of tensor t (head z, rows
 * from r0) gets acc[x] · factor. */
DEVFN void SFX(att_write)(THREAD_PARAM, const KernelArgs* A, void* out, int format, int t,
                          i64 z, i64 r0, i64 rows, real acc[ATT_R][ATT_CC], real factor) {
    i64 ty = THREAD_IDX / 8, tx = THREAD_IDX % 8;
    for (int x = 0; x < ATT_R; ++x) {
        i64 i = r0 + ty * ATT_R + x;
        if (i >= rows) break;
        i64 at = SFX(att_row)(A, t, z, i);
        for (int c = 0; c < ATT_CC; ++c)
            if (tx + 8 * c < A->i[5]) SFX(store)(out, at + tx + 8 * c, format, acc[x][c] * factor);
    }
}

/* The keys a query tile starting at row q0 sees: [0, end). */
DEVFN i64 SFX(att_key_end)(const KernelArgs* A, i64 q0) {
    i64 sk = A->i[4];
    if (A->i[24] == 0) return sk;
    i64 last_row = q0 + ATT_TILE - 1 < A->i[3] - 1 ? q0 + ATT_TILE - 1 : A->i[3] - 1;
    i64 end = last_row + A->i[25] + 1;
    return end < 0 ? 0 : end < sk ? end : sk;
}

/* Forward: out = softmax(f0 · q·kᵀ)·v (dropout on the probabilities), lse = each row's
 * log-sum-exp of the scaled scores.  p0 out, p1 lse [B·H·sq] (real), p2 q, p3 k, p4 v;
 * a block per (head z, query tile); keys and then values pass through one staged tile. */
BLOCK_KERNEL(SFX(attention_forward)) {
    const KernelArgs* A = ARGS;
    i64 sq = A->i[3], d = A->i[5];
    int fin = (int)A->i[22];
    real scale = (real)A->f[0], kept = (real)A->f[1];
    i64 tiles = (sq + ATT_TILE - 1) / ATT_TILE;
    i64 z = BLOCK_IDX / tiles, q0 = (BLOCK_IDX % tiles) * ATT_TILE;
    i64 ty = THREAD_IDX / 8, tx = THREAD_IDX % 8;
    SHARED(real, qs, ATT_TILE * ATT_PAD);
    SHARED(real, kvs, ATT_TILE * ATT_PAD);
    SHARED(real, ps, ATT_TILE * ATT_SPAD);
    real m[ATT_R], l[ATT_R], acc[ATT_R][ATT_CC];
    for (int x = 0; x < ATT_R; ++x) {
        m[x] = ATT_NEG_INF;
        l[x] = (real)0;
        for (int c = 0; c < ATT_CC; ++c) acc[x][c] = (real)0;
    }
    SFX(att_stage)(THREAD, A, qs, 0, z, q0, sq, (const void*)A->p[2], fin);
    i64 end = SFX(att_key_end)(A, q0);
    for (i64 k0 = 0; k0 < end; k0 += ATT_TILE) {
        if (A->i[31] != 1) SYNC_THREADS(); /* the previous tile's reads of kvs are done */
        SFX(att_stage)(THREAD, A, kvs, 1, z, k0, A->i[4], (const void*)A->p[3], fin);
        SYNC_THREADS();
        real s[ATT_R][ATT_R];
        SFX(att_scores)(THREAD, qs, kvs, d, s);
        for (int x = 0; x < ATT_R; ++x) {
            i64 i = q0 + ty * ATT_R + x;
            real top = ATT_NEG_INF;
            for (int y = 0; y < ATT_R; ++y) {
                int seen = SFX(att_sees)(A, i, k0 + tx * ATT_R + y);
                s[x][y] = seen ? MUL_RN(s[x][y], scale) : ATT_NEG_INF;
                top = s[x][y] > top ? s[x][y] : top;
            }
            top = SFX(att_row_max)(THREAD, top);
            real m_new = top > m[x] ? top : m[x];
            real base = m_new == ATT_NEG_INF ? (real)0 : m_new;
            real sum = (real)0;
            for (int y = 0; y < ATT_R; ++y) {
                i64 key = k0 + tx * ATT_R + y;
                real p = s[x][y] == ATT_NEG_INF ? (real)0 : EXP(s[x][y] - base);
                sum += p;
                if (p != (real)0 && !SFX(att_keep)(A, z, i, key)) p = (real)0;
                else if (A->i[26] != 0) p *= kept;
                s[x][y] = p;
            }
            real alpha = EXP(m[x] - base);
            l[x] = l[x] * alpha + SFX(att_row_sum)(THREAD, sum);
            m[x] = m_new;
            for (int c = 0; c < ATT_CC; ++c) acc[x][c] *= alpha;
        }
        SFX(att_put)(THREAD, ps, s);
        SYNC_THREADS(); /* the keys' reads are done before the values replace them */
        SFX(att_stage)(THREAD, A, kvs, 2, z, k0, A->i[4], (const void*)A->p[4], fin);
        SYNC_THREADS();
        SFX(att_accumulate)(THREAD, ps, kvs, d, acc);
    }
    real inv[ATT_R];
    for (int x = 0; x < ATT_R; ++x) {
        inv[x] = l[x] > (real)0 ? (real)1 / l[x] : (real)0;
        for (int c = 0; c < ATT_CC; ++c) acc[x][c] *= inv[x];
        i64 i = q0 + ty * ATT_R + x;
        if (tx == 0 && i < sq)
            ((real*)A->p[1])[z * sq + i] = l[x] > (real)0 ? m[x] + LOG(l[x]) : ATT_NEG_INF;
    }
    SFX(att_write)(THREAD, A, (void*)A->p[0], (int)A->i[23], 3, z, q0, sq, acc, (real)1);
}

/* The backward's per-row correction delta = Σ dO ⊙ out (a warp per row).  p0 delta
 * [B·H·sq] (real), p1 out, p2 dO (out's layout). */
BLOCK_KERNEL(SFX(attention_delta)) {
    const KernelArgs* A = ARGS;
    i64 rows = A->i[0] * A->i[1] * A->i[3], d = A->i[5];
    for (i64 row = BLOCK_IDX * (BLOCK_DIM / 32) + THREAD_IDX / 32; row < rows;
         row += GRID_DIM * (BLOCK_DIM / 32)) {
        i64 at = SFX(att_row)(A, 3, row / A->i[3], row % A->i[3]);
        real acc = (real)0;
        for (i64 c = THREAD_IDX % 32; c < d; c += 32)
            acc += SFX(load)((const void*)A->p[1], at + c, (int)A->i[23]) *
                   SFX(load)((const void*)A->p[2], at + c, (int)A->i[30]);
        acc = WARP_SUM(acc);
        if (THREAD_IDX % 32 == 0) ((real*)A->p[0])[row] = acc;
    }
}

/* The probability of (z, i, key) recomputed from the scaled score and the row's lse, and
 * dropout's factor for it (0 dropped, 1/(1 - p) kept, 1 without dropout). */
DEVFN real SFX(att_prob)(const KernelArgs* A, real score, real lse, int seen) {
    return seen ? EXP(MUL_RN(score, (real)A->f[0]) - lse) : (real)0;
}
DEVFN real SFX(att_factor)(const KernelArgs* A, i64 z, i64 i, i64 j) {
    if (A->i[26] == 0) return (real)1;
    return SFX(att_keep)(A, z, i, j) ? (real)A->f[1] : (real)0;
}

/* Backward for the queries: dQ = f0 · Σ_keys dS·k with dS = P ⊙ (dP − delta), dP the
 * gradient of the (dropped) probabilities, dO·vᵀ through dropout.  p0 dQ (q's layout),
 * p1 q, p2 k, p3 v, p4 dO (out's layout), p5 lse, p6 delta;
 * a block per (head z, query tile). */
BLOCK_KERNEL(SFX(attention_backward_q)) {
    const KernelArgs* A = ARGS;
    const real *lse = (const real*)A->p[5], *delta = (const real*)A->p[6];
    i64 sq = A->i[3], d = A->i[5];
    int fin = (int)A->i[22];
    i64 tiles = (sq + ATT_TILE - 1) / ATT_TILE;
    i64 z = BLOCK_IDX / tiles, q0 = (BLOCK_IDX % tiles) * ATT_TILE;
    i64 ty = THREAD_IDX / 8, tx = THREAD_IDX % 8;
    SHARED(real, qs, ATT_TILE * ATT_PAD);
    SHARED(real, dos, ATT_TILE * ATT_PAD);
    SHARED(real, ks, ATT_TILE * ATT_PAD);
    SHARED(real, vs, ATT_TILE * ATT_PAD);
    SHARED(real, ps, ATT_TILE * ATT_SPAD);
    real acc[ATT_R][ATT_CC], row_lse[ATT_R], row_delta[ATT_R];
    for (int x = 0; x < ATT_R; ++x) {
        i64 i = q0 + ty * ATT_R + x;
        row_lse[x] = i < sq ? lse[z * sq + i] : (real)0;
        row_delta[x] = i < sq ? delta[z * sq + i] : (real)0;
        for (int c = 0; c < ATT_CC; ++c) acc[x][c] = (real)0;
    }
    SFX(att_stage)(THREAD, A, qs, 0, z, q0, sq, (const void*)A->p[1], fin);
    SFX(att_stage)(THREAD, A, dos, 3, z, q0, sq, (const void*)A->p[4], (int)A->i[30]);
    i64 end = SFX(att_key_end)(A, q0);
    for (i64 k0 = 0; k0 < end; k0 += ATT_TILE) {
        SYNC_THREADS();
        SFX(att_stage)(THREAD, A, ks, 1, z, k0, A->i[4], (const void*)A->p[2], fin);
        SFX(att_stage)(THREAD, A, vs, 2, z, k0, A->i[4], (const void*)A->p[3], fin);
        SYNC_THREADS();
        real s[ATT_R][ATT_R], dp[ATT_R][ATT_R];
        SFX(att_scores)(THREAD, qs, ks, d, s);
        SFX(att_scores)(THREAD, dos, vs, d, dp);
        for (int x = 0; x < ATT_R; ++x)
            for (int y = 0; y < ATT_R; ++y) {
                i64 i = q0 + ty * ATT_R + x, key = k0 + tx * ATT_R + y;
                int seen = SFX(att_sees)(A, i, key);
                real p = SFX(att_prob)(A, s[x][y], row_lse[x], seen);
                s[x][y] = seen ? p * (dp[x][y] * SFX(att_factor)(A, z, i, key) - row_delta[x])
                               : (real)0;
            }
        SFX(att_put)(THREAD, ps, s);
        SYNC_WARP();
        SFX(att_accumulate)(THREAD, ps, ks, d, acc);
    }
    SFX(att_write)(THREAD, A, (void*)A->p[0], (int)A->i[29], 0, z, q0, sq, acc, (real)A->f[0]);
}

/* Backward for the keys and values of one group: over its r query heads and their query
 * tiles, dV = Σ P'ᵀ·dO (P' the dropped probabilities) and dK = f0 · Σ dSᵀ·q.  p0 dK, p1 dV
 * (k's and v's layouts), p2 q, p3 k, p4 v, p5 dO, p6 lse, p7 delta; a block per (batch,
 * group, key tile), its own side the keys (scores transposed: rows keys, columns queries). */
BLOCK_KERNEL(SFX(attention_backward_kv)) {
    const KernelArgs* A = ARGS;
    const real *lse = (const real*)A->p[6], *delta = (const real*)A->p[7];
    i64 H = A->i[1], r = A->i[2], sq = A->i[3], sk = A->i[4], d = A->i[5];
    int fin = (int)A->i[22], fout = (int)A->i[29];
    i64 tiles = (sk + ATT_TILE - 1) / ATT_TILE;
    i64 kv = BLOCK_IDX / tiles, k0 = (BLOCK_IDX % tiles) * ATT_TILE;
    i64 ty = THREAD_IDX / 8, tx = THREAD_IDX % 8;
    /* Query head 0 of the group: batch kv / (H / r), group kv % (H / r). */
    i64 z0 = (kv / (H / r)) * H + (kv % (H / r)) * r;
    SHARED(real, ks, ATT_TILE * ATT_PAD);
    SHARED(real, vs, ATT_TILE * ATT_PAD);
    SHARED(real, qs, ATT_TILE * ATT_PAD);
    SHARED(real, dos, ATT_TILE * ATT_PAD);
    SHARED(real, ps, ATT_TILE * ATT_SPAD);
    real dk[ATT_R][ATT_CC], dv[ATT_R][ATT_CC];
    for (int x = 0; x < ATT_R; ++x)
        for (int c = 0; c < ATT_CC; ++c) dk[x][c] = dv[x][c] = (real)0;
    SFX(att_stage)(THREAD, A, ks, 1, z0, k0, sk, (const void*)A->p[3], fin);
    SFX(att_stage)(THREAD, A, vs, 2, z0, k0, sk, (const void*)A->p[4], fin);
    /* The first query row that sees key k0 under the causal mask. */
    i64 first = A->i[24] != 0 && k0 - A->i[25] > 0 ? (k0 - A->i[25]) / ATT_TILE * ATT_TILE : 0;
    for (i64 head = 0; head < r; ++head) {
        i64 z = z0 + head;
        for (i64 q0 = first; q0 < sq; q0 += ATT_TILE) {
            SYNC_THREADS();
            SFX(att_stage)(THREAD, A, qs, 0, z, q0, sq, (const void*)A->p[2], fin);
            SFX(att_stage)(THREAD, A, dos, 3, z, q0, sq, (const void*)A->p[5], (int)A->i[30]);
            SYNC_THREADS();
            real p[ATT_R][ATT_R], dp[ATT_R][ATT_R], kept[ATT_R][ATT_R];
            SFX(att_scores)(THREAD, ks, qs, d, p);
            SFX(att_scores)(THREAD, vs, dos, d, dp);
            for (int x = 0; x < ATT_R; ++x)
                for (int y = 0; y < ATT_R; ++y) {
                    i64 key = k0 + ty * ATT_R + x, i = q0 + tx * ATT_R + y;
                    int seen = SFX(att_sees)(A, i, key);
                    real factor = seen ? SFX(att_factor)(A, z, i, key) : (real)0;
                    p[x][y] = seen ? SFX(att_prob)(A, p[x][y], lse[z * sq + i], seen) : (real)0;
                    dp[x][y] *= factor;
                    kept[x][y] = p[x][y] * factor;
                }
            SFX(att_put)(THREAD, ps, kept);
            SYNC_WARP();
            SFX(att_accumulate)(THREAD, ps, dos, d, dv);
            SYNC_WARP(); /* every lane read the kept probabilities before dS replaces them */
            for (int x = 0; x < ATT_R; ++x)
                for (int y = 0; y < ATT_R; ++y) {
                    i64 i = q0 + tx * ATT_R + y;
                    real correction = i < sq ? delta[z * sq + i] : (real)0;
                    p[x][y] = p[x][y] * (dp[x][y] - correction);
                }
            SFX(att_put)(THREAD, ps, p);
            SYNC_WARP();
            SFX(att_accumulate)(THREAD, ps, qs, d, dk);
        }
    }
    SFX(att_write)(THREAD, A, (void*)A->p[0], fout, 1, z0, k0, sk, dk, (real)A->f[0]);
    SFX(att_write)(THREAD, A, (void*)A->p[1], fout, 2, z0, k0, sk, dv, (real)1);
}
