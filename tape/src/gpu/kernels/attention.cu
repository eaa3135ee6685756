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
 * Cooperative: blocks of ATT_THREADS (two warps), each warp 16 rows of the block's tile
 * and each lane one column of the 32-wide tile of the other side; per-tile operands the
 * lanes read column-wise are staged in padded shared memory (no bank conflicts), those
 * every lane reads alike (a broadcast) come from global memory. The head dimension is at
 * most ATT_DMAX (128 in f32, 64 in f64, so that the tiles fit 48 KiB of static shared
 * memory); the host falls back to the unfused path above it. */

#define ATT_TILE 32
#define ATT_WARP_ROWS 16
#define ATT_THREADS 64
#define ATT_DMAX (sizeof(real) == 4 ? 128 : 64)
#define ATT_COLS (ATT_DMAX / 32)
#define ATT_PAD (ATT_DMAX + 1)
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

/* q_i · row `row` of a shared tile (each lane its own row), in column order. */
DEVFN real SFX(att_dot_shared)(THREAD_PARAM, const KernelArgs* A, const void* x, i64 at,
                               const real* tile, i64 row) {
    real acc = (real)0;
    for (i64 c = 0; c < A->i[5]; ++c)
        acc += SFX(load)(x, at + c, (int)A->i[22]) * SHARED_LOAD(tile, row * ATT_PAD + c);
    return acc;
}

/* Stages rows first, first + 1, ... (ATT_TILE of them) of tensor t for head z into a
 * shared tile, widened; rows past `rows` are zeros. */
DEVFN void SFX(att_stage)(THREAD_PARAM, const KernelArgs* A, real* tile, int t, i64 z,
                          i64 first, i64 rows, const void* x, int format) {
    i64 d = A->i[5];
    rows -= A->i[31] == 2;
    for (i64 e = THREAD_IDX; e < ATT_TILE * d; e += BLOCK_DIM) {
        i64 j = e / d, c = e % d;
        real v = (real)0;
        if (first + j < rows) v = SFX(load)(x, SFX(att_row)(A, t, z, first + j) + c, format);
        SHARED_STORE(tile, j * ATT_PAD + c, v);
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
 * a block per (head z, query tile). */
BLOCK_KERNEL(SFX(attention_forward)) {
    const KernelArgs* A = ARGS;
    const void *q = (const void*)A->p[2], *k = (const void*)A->p[3];
    const void* v = (const void*)A->p[4];
    i64 sq = A->i[3], d = A->i[5];
    int fin = (int)A->i[22];
    real scale = (real)A->f[0], kept = (real)A->f[1];
    i64 tiles = (sq + ATT_TILE - 1) / ATT_TILE;
    i64 z = BLOCK_IDX / tiles, q0 = (BLOCK_IDX % tiles) * ATT_TILE;
    i64 warp = THREAD_IDX / 32, lane = THREAD_IDX % 32;
    i64 row0 = q0 + warp * ATT_WARP_ROWS;
    SHARED(real, ks, ATT_TILE * ATT_PAD);
    SHARED(real, ps, ATT_TILE * (ATT_TILE + 1));
    real m[ATT_WARP_ROWS], l[ATT_WARP_ROWS], acc[ATT_WARP_ROWS][ATT_COLS];
    for (int rr = 0; rr < ATT_WARP_ROWS; ++rr) {
        m[rr] = ATT_NEG_INF;
        l[rr] = (real)0;
        for (int t = 0; t < ATT_COLS; ++t) acc[rr][t] = (real)0;
    }
    i64 end = SFX(att_key_end)(A, q0);
    for (i64 k0 = 0; k0 < end; k0 += ATT_TILE) {
        if (A->i[31] != 1) SYNC_THREADS(); /* the previous tile's reads of ks are done */
        SFX(att_stage)(THREAD, A, ks, 1, z, k0, A->i[4], k, fin);
        SYNC_THREADS();
        i64 key = k0 + lane;
        for (int rr = 0; rr < ATT_WARP_ROWS; ++rr) {
            i64 i = row0 + rr;
            int seen = SFX(att_sees)(A, i, key);
            real s = (real)0;
            if (seen) s = MUL_RN(SFX(att_dot_shared)(THREAD, A, q, SFX(att_row)(A, 0, z, i), ks, lane), scale);
            real top = WARP_MAX(seen ? s : ATT_NEG_INF);
            real m_new = top > m[rr] ? top : m[rr];
            real base = m_new == ATT_NEG_INF ? (real)0 : m_new;
            real p = seen ? EXP(s - base) : (real)0;
            real alpha = EXP(m[rr] - base);
            l[rr] = l[rr] * alpha + WARP_SUM(p);
            m[rr] = m_new;
            for (int t = 0; t < ATT_COLS; ++t) acc[rr][t] *= alpha;
            if (seen && !SFX(att_keep)(A, z, i, key)) p = (real)0;
            else if (A->i[26] != 0) p *= kept;
            SHARED_STORE(ps, (warp * ATT_WARP_ROWS + rr) * (ATT_TILE + 1) + lane, p);
        }
        SYNC_WARP();
        i64 width = A->i[4] - k0 < ATT_TILE ? A->i[4] - k0 : ATT_TILE;
        for (i64 j = 0; j < width; ++j) {
            i64 at = SFX(att_row)(A, 2, z, k0 + j);
            real vj[ATT_COLS];
            for (int t = 0; t < ATT_COLS; ++t) {
                i64 c = lane + 32 * t;
                vj[t] = c < d ? SFX(load)(v, at + c, fin) : (real)0;
            }
            for (int rr = 0; rr < ATT_WARP_ROWS; ++rr) {
                real pj = SHARED_LOAD(ps, (warp * ATT_WARP_ROWS + rr) * (ATT_TILE + 1) + j);
                for (int t = 0; t < ATT_COLS; ++t) acc[rr][t] += pj * vj[t];
            }
        }
        SYNC_WARP(); /* every lane read ps before the next tile writes it */
    }
    for (int rr = 0; rr < ATT_WARP_ROWS; ++rr) {
        i64 i = row0 + rr;
        if (i >= sq) break;
        real inv = l[rr] > (real)0 ? (real)1 / l[rr] : (real)0;
        i64 at = SFX(att_row)(A, 3, z, i);
        for (int t = 0; t < ATT_COLS; ++t) {
            i64 c = lane + 32 * t;
            if (c < d) SFX(store)((void*)A->p[0], at + c, (int)A->i[23], acc[rr][t] * inv);
        }
        if (lane == 0)
            ((real*)A->p[1])[z * sq + i] = l[rr] > (real)0 ? m[rr] + LOG(l[rr]) : ATT_NEG_INF;
    }
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
    const void *q = (const void*)A->p[1], *dout = (const void*)A->p[4];
    const real *lse = (const real*)A->p[5], *delta = (const real*)A->p[6];
    i64 sq = A->i[3], d = A->i[5];
    int fin = (int)A->i[22], fdo = (int)A->i[30];
    i64 tiles = (sq + ATT_TILE - 1) / ATT_TILE;
    i64 z = BLOCK_IDX / tiles, q0 = (BLOCK_IDX % tiles) * ATT_TILE;
    i64 warp = THREAD_IDX / 32, lane = THREAD_IDX % 32;
    i64 row0 = q0 + warp * ATT_WARP_ROWS;
    SHARED(real, ks, ATT_TILE * ATT_PAD);
    SHARED(real, vs, ATT_TILE * ATT_PAD);
    SHARED(real, ps, ATT_TILE * (ATT_TILE + 1));
    real acc[ATT_WARP_ROWS][ATT_COLS];
    for (int rr = 0; rr < ATT_WARP_ROWS; ++rr)
        for (int t = 0; t < ATT_COLS; ++t) acc[rr][t] = (real)0;
    i64 end = SFX(att_key_end)(A, q0);
    for (i64 k0 = 0; k0 < end; k0 += ATT_TILE) {
        SYNC_THREADS();
        SFX(att_stage)(THREAD, A, ks, 1, z, k0, A->i[4], (const void*)A->p[2], fin);
        SFX(att_stage)(THREAD, A, vs, 2, z, k0, A->i[4], (const void*)A->p[3], fin);
        SYNC_THREADS();
        i64 key = k0 + lane;
        for (int rr = 0; rr < ATT_WARP_ROWS; ++rr) {
            i64 i = row0 + rr;
            int seen = SFX(att_sees)(A, i, key);
            real ds = (real)0;
            if (seen) {
                i64 zi = z * sq + i;
                real s = SFX(att_dot_shared)(THREAD, A, q, SFX(att_row)(A, 0, z, i), ks, lane);
                real dp = (real)0;
                i64 at = SFX(att_row)(A, 3, z, i);
                for (i64 c = 0; c < d; ++c)
                    dp += SFX(load)(dout, at + c, fdo) * SHARED_LOAD(vs, lane * ATT_PAD + c);
                real p = SFX(att_prob)(A, s, lse[zi], seen);
                ds = p * (dp * SFX(att_factor)(A, z, i, key) - delta[zi]);
            }
            SHARED_STORE(ps, (warp * ATT_WARP_ROWS + rr) * (ATT_TILE + 1) + lane, ds);
        }
        SYNC_WARP();
        for (i64 j = 0; j < ATT_TILE; ++j) {
            real kj[ATT_COLS];
            for (int t = 0; t < ATT_COLS; ++t) {
                i64 c = lane + 32 * t;
                kj[t] = c < d ? SHARED_LOAD(ks, j * ATT_PAD + c) : (real)0;
            }
            for (int rr = 0; rr < ATT_WARP_ROWS; ++rr) {
                real g = SHARED_LOAD(ps, (warp * ATT_WARP_ROWS + rr) * (ATT_TILE + 1) + j);
                for (int t = 0; t < ATT_COLS; ++t) acc[rr][t] += g * kj[t];
            }
        }
        SYNC_WARP();
    }
    for (int rr = 0; rr < ATT_WARP_ROWS; ++rr) {
        i64 i = row0 + rr;
        if (i >= sq) break;
        i64 at = SFX(att_row)(A, 0, z, i);
        for (int t = 0; t < ATT_COLS; ++t) {
            i64 c = lane + 32 * t;
            if (c < d) SFX(store)((void*)A->p[0], at + c, (int)A->i[29], acc[rr][t] * (real)A->f[0]);
        }
    }
}

/* Backward for the keys and values of one group: over its r query heads and their query
 * tiles, dV = Σ P'ᵀ·dO (P' the dropped probabilities) and dK = f0 · Σ dSᵀ·q.  p0 dK, p1 dV
 * (k's and v's layouts), p2 q, p3 k, p4 v, p5 dO, p6 lse, p7 delta; a
 * block per (batch, group, key tile), each warp 16 keys and each lane a query of the
 * tile. */
BLOCK_KERNEL(SFX(attention_backward_kv)) {
    const KernelArgs* A = ARGS;
    const void *k = (const void*)A->p[3], *v = (const void*)A->p[4];
    const real *lse = (const real*)A->p[6], *delta = (const real*)A->p[7];
    i64 H = A->i[1], r = A->i[2], sq = A->i[3], sk = A->i[4], d = A->i[5];
    int fin = (int)A->i[22], fout = (int)A->i[29];
    i64 tiles = (sk + ATT_TILE - 1) / ATT_TILE;
    i64 kv = BLOCK_IDX / tiles, k0 = (BLOCK_IDX % tiles) * ATT_TILE;
    i64 warp = THREAD_IDX / 32, lane = THREAD_IDX % 32;
    i64 key0 = k0 + warp * ATT_WARP_ROWS;
    /* Query head 0 of the group: batch kv / (H / r), group kv % (H / r). */
    i64 z0 = (kv / (H / r)) * H + (kv % (H / r)) * r;
    SHARED(real, qs, ATT_TILE * ATT_PAD);
    SHARED(real, dos, ATT_TILE * ATT_PAD);
    SHARED(real, ps, ATT_TILE * (ATT_TILE + 1));
    real dk[ATT_WARP_ROWS][ATT_COLS], dv[ATT_WARP_ROWS][ATT_COLS];
    for (int rr = 0; rr < ATT_WARP_ROWS; ++rr)
        for (int t = 0; t < ATT_COLS; ++t) dk[rr][t] = dv[rr][t] = (real)0;
    /* The first query row that sees key k0 under the causal mask. */
    i64 first = A->i[24] != 0 && k0 - A->i[25] > 0 ? (k0 - A->i[25]) / ATT_TILE * ATT_TILE : 0;
    for (i64 head = 0; head < r; ++head) {
        i64 z = z0 + head;
        for (i64 q0 = first; q0 < sq; q0 += ATT_TILE) {
            SYNC_THREADS();
            SFX(att_stage)(THREAD, A, qs, 0, z, q0, sq, (const void*)A->p[2], fin);
            SFX(att_stage)(THREAD, A, dos, 3, z, q0, sq, (const void*)A->p[5], (int)A->i[30]);
            SYNC_THREADS();
            i64 i = q0 + lane;
            real p[ATT_WARP_ROWS], dp[ATT_WARP_ROWS];
            for (int rr = 0; rr < ATT_WARP_ROWS; ++rr) {
                i64 key = key0 + rr;
                int seen = SFX(att_sees)(A, i, key);
                p[rr] = dp[rr] = (real)0;
                real factor = (real)0;
                if (seen) {
                    i64 kat = SFX(att_row)(A, 1, z, key), vat = SFX(att_row)(A, 2, z, key);
                    real s = (real)0, g = (real)0;
                    for (i64 c = 0; c < d; ++c) {
                        s += SFX(load)(k, kat + c, fin) * SHARED_LOAD(qs, lane * ATT_PAD + c);
                        g += SFX(load)(v, vat + c, fin) * SHARED_LOAD(dos, lane * ATT_PAD + c);
                    }
                    p[rr] = SFX(att_prob)(A, s, lse[z * sq + i], seen);
                    factor = SFX(att_factor)(A, z, i, key);
                    dp[rr] = g * factor;
                }
                SHARED_STORE(ps, (warp * ATT_WARP_ROWS + rr) * (ATT_TILE + 1) + lane, p[rr] * factor);
            }
            SYNC_WARP();
            for (i64 j = 0; j < ATT_TILE; ++j) {
                real gj[ATT_COLS];
                for (int t = 0; t < ATT_COLS; ++t) {
                    i64 c = lane + 32 * t;
                    gj[t] = c < d ? SHARED_LOAD(dos, j * ATT_PAD + c) : (real)0;
                }
                for (int rr = 0; rr < ATT_WARP_ROWS; ++rr) {
                    real pj = SHARED_LOAD(ps, (warp * ATT_WARP_ROWS + rr) * (ATT_TILE + 1) + j);
                    for (int t = 0; t < ATT_COLS; ++t) dv[rr][t] += pj * gj[t];
                }
            }
            SYNC_WARP();
            real correction = i < sq ? delta[z * sq + i] : (real)0;
            for (int rr = 0; rr < ATT_WARP_ROWS; ++rr)
                SHARED_STORE(ps, (warp * ATT_WARP_ROWS + rr) * (ATT_TILE + 1) + lane,
                             p[rr] * (dp[rr] - correction));
            SYNC_WARP();
            for (i64 j = 0; j < ATT_TILE; ++j) {
                real qj[ATT_COLS];
                for (int t = 0; t < ATT_COLS; ++t) {
                    i64 c = lane + 32 * t;
                    qj[t] = c < d ? SHARED_LOAD(qs, j * ATT_PAD + c) : (real)0;
                }
                for (int rr = 0; rr < ATT_WARP_ROWS; ++rr) {
                    real g = SHARED_LOAD(ps, (warp * ATT_WARP_ROWS + rr) * (ATT_TILE + 1) + j);
                    for (int t = 0; t < ATT_COLS; ++t) dk[rr][t] += g * qj[t];
                }
            }
            SYNC_WARP();
        }
    }
    for (int rr = 0; rr < ATT_WARP_ROWS; ++rr) {
        i64 key = key0 + rr;
        if (key >= sk) break;
        i64 kat = SFX(att_row)(A, 1, z0, key), vat = SFX(att_row)(A, 2, z0, key);
        for (int t = 0; t < ATT_COLS; ++t) {
            i64 c = lane + 32 * t;
            if (c >= d) continue;
            SFX(store)((void*)A->p[0], kat + c, fout, dk[rr][t] * (real)A->f[0]);
            SFX(store)((void*)A->p[1], vat + c, fout, dv[rr][t]);
        }
    }
}
