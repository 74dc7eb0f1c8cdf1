/* probity's own CPU kernels, vector build (built and called by probity/engine/kernels/): the
 * linear, attention's sliced GEMMs, a decode group's attention, the RMS norm and the rotary
 * embedding. Each computes one documented order (docs/engine.md, "One order on every path"),
 * the same in its AVX2 and AVX-512 forms and in portable.c.
 *
 * The linear: y = x W^T (+ b) (+ r), every output one fused multiply-add chain over k,
 * starting from zero, restarted every `kb` values of k (kernels.KB; the block partial sums
 * then added in order), then the bias, then the residual. The weights are laid out as
 * [ceil(N/16)][K][16] so each k reads 64 contiguous bytes for 16 outputs; up to 6 rows x 16
 * outputs are held in registers (wider calls on AVX-512: stored.c's wide kernel). Bits are set
 * by the order of the FMAs of each output alone, so tiling, threads and prefetching change none.
 */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The shared constants come from kernels/build.py (-D), which takes them from the Python side,
 * so each is written once: PANEL (outputs per packed weight panel), SLICE (attention's key
 * slice), HD_MAX (largest head dim), G_MAX (largest query-head group). */
#if !defined(PANEL) || !defined(SLICE) || !defined(HD_MAX) || !defined(G_MAX)
#error "compile through probity/engine/kernels/build.py: it defines PANEL, SLICE, HD_MAX and G_MAX"
#endif
#if PANEL != 16
#error "the linear kernel holds one panel in two 8-float registers: PANEL must be 16"
#endif
#define NB PANEL
#define MR_MAX 6
#define AHEAD 8192   /* bytes ahead that attention's kernels prefetch keys and values (prefetch_ahead) */

static inline __attribute__((always_inline)) void tile(
    const int mr, const float *x, int64_t ldx, const float *w, int64_t K, int64_t kb,
    const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int ncols, int ahead)
{
    __m256 c0[MR_MAX], c1[MR_MAX];
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
        const int64_t k1 = k0 + kb < K ? k0 + kb : K;
        __m256 a0[MR_MAX], a1[MR_MAX];
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
        const float *wk = w + k0 * NB;
        for (int64_t k = k0; k < k1; k++, wk += NB) {
            if (ahead)   /* the next panel's line for this k: into L2 while this panel's tiles run */
                _mm_prefetch((const char *)(wk + K * NB), _MM_HINT_T1);
            const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
#pragma GCC unroll 6
            for (int r = 0; r < mr; r++) {
                const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
                a0[r] = _mm256_fmadd_ps(b, w0, a0[r]);
                a1[r] = _mm256_fmadd_ps(b, w1, a1[r]);
            }
        }
        if (k0 == 0) {
#pragma GCC unroll 6
            for (int r = 0; r < mr; r++) { c0[r] = a0[r]; c1[r] = a1[r]; }
        } else {
#pragma GCC unroll 6
            for (int r = 0; r < mr; r++) { c0[r] = _mm256_add_ps(c0[r], a0[r]); c1[r] = _mm256_add_ps(c1[r], a1[r]); }
        }
    }
    float buf[NB];
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        __m256 o0 = c0[r], o1 = c1[r];
        if (ncols == NB) {
            if (bias) { o0 = _mm256_add_ps(o0, _mm256_loadu_ps(bias)); o1 = _mm256_add_ps(o1, _mm256_loadu_ps(bias + 8)); }
            if (res) { o0 = _mm256_add_ps(o0, _mm256_loadu_ps(res + r * ldr)); o1 = _mm256_add_ps(o1, _mm256_loadu_ps(res + r * ldr + 8)); }
            _mm256_storeu_ps(y + r * ldy, o0);
            _mm256_storeu_ps(y + r * ldy + 8, o1);
        } else {
            _mm256_storeu_ps(buf, o0);
            _mm256_storeu_ps(buf + 8, o1);
            for (int j = 0; j < ncols; j++) {
                float v = buf[j];
                if (bias) v = v + bias[j];
                if (res) v = v + res[r * ldr + j];
                y[r * ldy + j] = v;
            }
        }
    }
}

/* The rows of row tile i of a call of M rows: the fewest tiles of at most MR_MAX rows, their
 * sizes as equal as can be (8 rows: 4 + 4, not 6 + 2, whose 2-row tile has too few chains in
 * flight to keep the FMA units busy). Row tiling changes no chain, so no bit. */
int64_t probity_tile_rows(int64_t M, int64_t i)
{
    const int64_t tiles = (M + MR_MAX - 1) / MR_MAX, base = M / tiles;
    return base + (i < M % tiles);
}

int probity_cpu_avx512(void);
void probity_wide_f32(const float *x, int64_t ldx, int64_t M, const float *wp, int64_t N, int64_t K, int64_t kb,
                      const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy);

/* x [M, K] (row stride ldx), wp packed [ceil(N/16)][K][16], bias [N] or NULL,
 * res [M, N] (row stride ldr) or NULL, y [M, N] (row stride ldy). Calls of more than 32 rows go
 * to stored.c's wide AVX-512 kernel where it runs (the same chains, a tile of 12 rows x 32
 * outputs in zmm registers). */
void probity_linear(const float *x, int64_t ldx, int64_t M, const float *wp, int64_t N, int64_t K,
                    int64_t kb, const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy)
{
    if (M > 32 && K % 32 == 0 && probity_cpu_avx512()) {
        probity_wide_f32(x, ldx, M, wp, N, K, kb, bias, res, ldr, y, ldy);
        return;
    }
    const int64_t nblocks = (N + NB - 1) / NB;
    /* With more than one row tile the first streams the panel from memory and the others
     * read it from cache, leaving memory idle: prefetching the next panel keeps it busy
     * (8 rows: 29 -> 24 ms for the default model's linears; with one tile it costs ~5%). */
    const int ahead = M > MR_MAX;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < nblocks; j++) {
        const float *w = wp + j * K * NB;
        const int64_t n0 = j * NB;
        const int ncols = N - n0 < NB ? (int)(N - n0) : NB;
        const float *bj = bias ? bias + n0 : 0;
        for (int64_t m0 = 0, i = 0, mr; m0 < M; m0 += mr, i++) {
            mr = probity_tile_rows(M, i);
            const float *xm = x + m0 * ldx;
            const float *rm = res ? res + m0 * ldr + n0 : 0;
            float *ym = y + m0 * ldy + n0;
            switch (mr) {
            case 6: tile(6, xm, ldx, w, K, kb, bj, rm, ldr, ym, ldy, ncols, ahead); break;
            case 5: tile(5, xm, ldx, w, K, kb, bj, rm, ldr, ym, ldy, ncols, ahead); break;
            case 4: tile(4, xm, ldx, w, K, kb, bj, rm, ldr, ym, ldy, ncols, ahead); break;
            case 3: tile(3, xm, ldx, w, K, kb, bj, rm, ldr, ym, ldy, ncols, ahead); break;
            case 2: tile(2, xm, ldx, w, K, kb, bj, rm, ldr, ym, ldy, ncols, ahead); break;
            default: tile(1, xm, ldx, w, K, kb, bj, rm, ldr, ym, ldy, ncols, ahead); break;
            }
        }
    }
}

/* One row tile over a packed float32 panel already in cache (stored.c expands its weights into
 * one): the same FMA chains as probity_linear, no prefetch. */
void probity_linear_tile(int mr, const float *x, int64_t ldx, const float *w, int64_t K, int64_t kb,
                         const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int ncols)
{
    switch (mr) {
    case 6: tile(6, x, ldx, w, K, kb, bias, res, ldr, y, ldy, ncols, 0); break;
    case 5: tile(5, x, ldx, w, K, kb, bias, res, ldr, y, ldy, ncols, 0); break;
    case 4: tile(4, x, ldx, w, K, kb, bias, res, ldr, y, ldy, ncols, 0); break;
    case 3: tile(3, x, ldx, w, K, kb, bias, res, ldr, y, ldy, ncols, 0); break;
    case 2: tile(2, x, ldx, w, K, kb, bias, res, ldr, y, ldy, ncols, 0); break;
    default: tile(1, x, ldx, w, K, kb, bias, res, ldr, y, ldy, ncols, 0); break;
    }
}

/* ---- attention's two GEMMs, in slices of 64 keys, for calls of any row count -------------
 * kernels.score_gemm / value_gemm: each output one FMA chain from zero over its reduction
 * index in order (the head dim for a score, the slice's 64 keys for a value column). */

/* 8 rows of 8 floats (row stride ld) -> out[t * SLICE + r] = in[r * ld + t] */
static inline void transpose8(const float *in, int64_t ld, float *out)
{
    __m256 r0 = _mm256_loadu_ps(in), r1 = _mm256_loadu_ps(in + ld), r2 = _mm256_loadu_ps(in + 2 * ld),
           r3 = _mm256_loadu_ps(in + 3 * ld), r4 = _mm256_loadu_ps(in + 4 * ld), r5 = _mm256_loadu_ps(in + 5 * ld),
           r6 = _mm256_loadu_ps(in + 6 * ld), r7 = _mm256_loadu_ps(in + 7 * ld);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
           t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
           t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
           u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
           u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
           u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_store_ps(out + 0 * SLICE, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_store_ps(out + 1 * SLICE, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_store_ps(out + 2 * SLICE, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_store_ps(out + 3 * SLICE, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_store_ps(out + 4 * SLICE, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_store_ps(out + 5 * SLICE, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_store_ps(out + 6 * SLICE, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_store_ps(out + 7 * SLICE, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* the `bytes` bytes AHEAD bytes on from `at` into L1: attention's keys and values come from
 * memory in a step (the weights stream through the caches between layers), the hardware
 * prefetcher stops at each 4 KiB page, and AHEAD on lies the next slice's (then the next
 * item's: items are contiguous) */
static inline __attribute__((always_inline)) void prefetch_ahead(const void *at, int64_t bytes)
{
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)at + AHEAD + b, _MM_HINT_T0);
}

/* a slice's keys kb [SLICE][hd] -> kt [hd][SLICE], prefetching as it reads (8 keys' 8 dims:
 * 256 bytes per step) */
static inline void transpose_slice(const float *kb, int64_t hd, float *kt)
{
    for (int64_t j = 0; j < SLICE; j += 8)
        for (int64_t d = 0; d < hd; d += 8) {
            prefetch_ahead(kb + j * hd + d * 8, 256);
            transpose8(kb + j * hd + d, hd, kt + d * SLICE + j);
        }
}

/* one slice's scores: ob[c][j] = sum_d qb[c][d] * kb[j][d] for its 64 keys, each one chain
 * over d in order (kt: scratch for the keys as columns) */
static inline void score_slice(const float *qb, int64_t C, const float *kb, int64_t hd, float *ob, float *kt)
{
    transpose_slice(kb, hd, kt);
    for (int64_t c = 0; c < C; c++) {
        __m256 a[8];
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) a[v] = _mm256_setzero_ps();
        const float *qc = qb + c * hd;
        for (int64_t d = 0; d < hd; d++) {
            const __m256 x = _mm256_set1_ps(qc[d]);
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) a[v] = _mm256_fmadd_ps(x, _mm256_load_ps(kt + d * SLICE + v * 8), a[v]);
        }
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) _mm256_storeu_ps(ob + c * SLICE + v * 8, a[v]);
    }
}

/* scores out[b][s][c][j] = sum_d q[b][c][d] * keys[b][s*64 + j][d], for a head dim that is a
 * multiple of 8 up to HD_MAX: q [B][C][hd], keys [B][S*64][hd], out [B][S][C][64] */
#define K512 __attribute__((target("avx512f,avx512vl,avx2,fma")))
K512 static void score_slice512(const float *qb, int64_t C, const float *kb, int64_t hd, float *ob, float *kt);
K512 static void value_rows512(const float *ec, int64_t C, const float *vb, float *oc, int64_t W);

void probity_score(const float *q, const float *keys, float *out, int64_t B, int64_t S, int64_t C, int64_t hd)
{
    const int wide = probity_cpu_avx512();
#pragma omp parallel for schedule(static) if (B * S * C >= 96)
    for (int64_t bs = 0; bs < B * S; bs++) {
        float kt[HD_MAX * SLICE] __attribute__((aligned(64)));
        if (wide)
            score_slice512(q + bs / S * C * hd, C, keys + bs * SLICE * hd, hd, out + bs * C * SLICE, kt);
        else
            score_slice(q + bs / S * C * hd, C, keys + bs * SLICE * hd, hd, out + bs * C * SLICE, kt);
    }
}

/* one row of a slice's values: oc[j] = sum_n ec[n] * vb[n][j] over its 64 keys, each one
 * chain over n in order */
static inline void value_row(const float *ec, const float *vb, float *oc, int64_t W, const int ahead)
{
    const int64_t wv = W / 8 * 8;
    for (int64_t j0 = 0; j0 < wv || j0 == 0; j0 += 64) {
        const int nv = wv - j0 >= 64 ? 8 : (int)((wv - j0) / 8);
        const int tail = j0 == 0;   /* the columns past the last whole vector, in the first pass */
        __m256 a[8];
        float at[7] = {0}, t1 = 0.0f;
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) a[v] = _mm256_setzero_ps();
        for (int64_t n = 0; n < SLICE; n++) {
            const float en = ec[n];
            const __m256 x = _mm256_set1_ps(en);
            const float *vn = vb + n * W + j0;
            if (j0 == 0 && ahead)
                prefetch_ahead(vb + n * W, W * 4);
            if (nv == 8) {
#pragma GCC unroll 8
                for (int v = 0; v < 8; v++) a[v] = _mm256_fmadd_ps(x, _mm256_loadu_ps(vn + v * 8), a[v]);
            } else {
                for (int v = 0; v < nv; v++) a[v] = _mm256_fmadd_ps(x, _mm256_loadu_ps(vn + v * 8), a[v]);
            }
            if (tail) {
                if (W - wv == 1)   /* the usual case (V carries one column of ones): kept in a register */
                    t1 = __builtin_fmaf(en, vb[n * W + wv], t1);
                else
                    for (int64_t j = wv; j < W; j++) at[j - wv] = __builtin_fmaf(en, vb[n * W + j], at[j - wv]);
            }
        }
        for (int v = 0; v < nv; v++) _mm256_storeu_ps(oc + j0 + v * 8, a[v]);
        if (tail && W - wv == 1)
            oc[wv] = t1;
        else if (tail)
            for (int64_t j = wv; j < W; j++) oc[j] = at[j - wv];
        if (wv == 0) break;
    }
}

/* values out[b][s][c][j] = sum_n e[b][s][c][n] * vals[b][s*64 + n][j]:
 * e [B][S][C][64], vals [B][S*64][W], out [B][S][C][W] */
void probity_value(const float *e, const float *vals, float *out, int64_t B, int64_t S, int64_t C, int64_t W)
{
    const int wide = probity_cpu_avx512() && (W - 1) % 16 == 0;
#pragma omp parallel for schedule(static) if (B * S * C >= 96)
    for (int64_t bs = 0; bs < B * S; bs++) {
        if (wide) {
            value_rows512(e + bs * C * SLICE, C, vals + bs * SLICE * W, out + bs * C * W, W);
            continue;
        }
        for (int64_t c = 0; c < C; c++)
            value_row(e + (bs * C + c) * SLICE, vals + bs * SLICE * W, out + (bs * C + c) * W, W, c == 0);
    }
}

/* ---- a decode group's attention in two calls, the kernels' exp between them ------------------
 * The same operations in the same order as attention.attend's general path for a group of
 * sequences with one query row each (so the same bits; the invariance tests compare them with
 * prefills): scaled queries, sliced scores, the maximum over visible keys, s - max clamped
 * at `floor`, masked keys past `lead` times 0; [exp]; masked keys times 0 again, the sliced
 * value chains, their pairwise tree over the slices, and the division by the ones column. */

/* AVX-512 forms of a decode slice's two GEMMs: the same chain for every score and every value
 * column (over d, resp. n, in order, from 0), so the same bits as score_slice and value_row;
 * what changes is the grouping: up to 4 query rows at once over 16 keys (or 16 value columns)
 * per vector, so 12-16 independent chains hide the FMA latency that one row's chains of 64
 * steps cannot, and a key or value vector is loaded once for all the rows. */

/* whether the AVX-512 code of both sources (stored.c's kernels too) runs: this CPU has it and
 * PROBITY_ISA (engine/isa.py) does not hold the engine to a narrower path */
int probity_cpu_avx512(void)
{
    static int known = -1;
    if (known < 0) {
        const char *isa = getenv("PROBITY_ISA");
        known = (isa == NULL || *isa == 0 || strcmp(isa, "avx512") == 0)
                && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                && __builtin_cpu_supports("avx512vl");
    }
    return known;
}

/* rows query rows (a constant where it is called, so the accumulators stay in registers)
 * against a slice's transposed keys kt */
K512 static inline __attribute__((always_inline)) void score_tile512(
    const int rows, const float *qb, const float *kt, int64_t hd, float *ob)
{
    __m512 a[4][SLICE / 16];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < SLICE / 16; v++) a[r][v] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d++) {
        __m512 k[SLICE / 16];
        for (int v = 0; v < SLICE / 16; v++) k[v] = _mm512_loadu_ps(kt + d * SLICE + v * 16);
        for (int r = 0; r < rows; r++) {
            const __m512 x = _mm512_set1_ps(qb[r * hd + d]);
            for (int v = 0; v < SLICE / 16; v++) a[r][v] = _mm512_fmadd_ps(x, k[v], a[r][v]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < SLICE / 16; v++) _mm512_storeu_ps(ob + r * SLICE + v * 16, a[r][v]);
}

K512 static void score_slice512(const float *qb, int64_t C, const float *kb, int64_t hd, float *ob, float *kt)
{
    transpose_slice(kb, hd, kt);
    for (int64_t c0 = 0; c0 < C; c0 += 4) {
        const float *q = qb + c0 * hd;
        float *o = ob + c0 * SLICE;
        switch (C - c0 >= 4 ? 4 : (int)(C - c0)) {
        case 4: score_tile512(4, q, kt, hd, o); break;
        case 3: score_tile512(3, q, kt, hd, o); break;
        case 2: score_tile512(2, q, kt, hd, o); break;
        default: score_tile512(1, q, kt, hd, o); break;
        }
    }
}

/* value_row for C rows of one slice (ec [C][SLICE] -> oc [C][W]) when W - 1 is a multiple of 16
 * (V's columns, then its column of ones: a scalar chain per row, as in value_row). value_tile512
 * is one tile of `rows` rows x `nv` vectors of 16 columns from column j0; called with constant
 * rows and nv, its accumulators stay in registers. */
K512 static inline __attribute__((always_inline)) void value_tile512(
    const int rows, const int nv, const float *ec, const float *vb, float *oc, int64_t W, int64_t j0,
    const int ahead)
{
    const int64_t wv = W - 1;
    __m512 a[3][4];
    float t1[3] = {0.0f, 0.0f, 0.0f};
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < nv; v++) a[r][v] = _mm512_setzero_ps();
    for (int64_t n = 0; n < SLICE; n++) {
        const float *vn = vb + n * W + j0;
        if (j0 == 0 && ahead)
            prefetch_ahead(vb + n * W, W * 4);
        __m512 w[4];
        for (int v = 0; v < nv; v++) w[v] = _mm512_loadu_ps(vn + v * 16);
        for (int r = 0; r < rows; r++) {
            const float en = ec[r * SLICE + n];
            const __m512 x = _mm512_set1_ps(en);
            for (int v = 0; v < nv; v++) a[r][v] = _mm512_fmadd_ps(x, w[v], a[r][v]);
            if (j0 == 0) t1[r] = __builtin_fmaf(en, vb[n * W + wv], t1[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(oc + r * W + j0 + v * 16, a[r][v]);
        if (j0 == 0) oc[r * W + wv] = t1[r];
    }
}

K512 static void value_rows512(const float *ec, int64_t C, const float *vb, float *oc, int64_t W)
{
    const int64_t wv = W - 1;
    for (int64_t j0 = 0; j0 < wv; j0 += 64) {
        const int nv = wv - j0 >= 64 ? 4 : (int)((wv - j0) / 16);
        for (int64_t c0 = 0; c0 < C; c0 += 3) {
            const int rows = C - c0 >= 3 ? 3 : (int)(C - c0);
            const float *e = ec + c0 * SLICE;
            float *o = oc + c0 * W;
#define VALUE_TILE(R) \
            switch (nv) { \
            case 4: value_tile512(R, 4, e, vb, o, W, j0, c0 == 0); break; \
            case 3: value_tile512(R, 3, e, vb, o, W, j0, c0 == 0); break; \
            case 2: value_tile512(R, 2, e, vb, o, W, j0, c0 == 0); break; \
            default: value_tile512(R, 1, e, vb, o, W, j0, c0 == 0); break; \
            }
            if (rows == 3) { VALUE_TILE(3) } else if (rows == 2) { VALUE_TILE(2) } else { VALUE_TILE(1) }
#undef VALUE_TILE
        }
    }
}

/* the scores' post-processing for one item and one query row's slices (o [S][G][SLICE] at
 * row g): the maximum over keys 0..p, then s - max clamped at `floor`, and keys past `lead`
 * times 1 where visible, 0 where not */
static void scores_post(float *o, int64_t S, int64_t G, int64_t g, int64_t p, int64_t lead, float floor)
{
    float top = -INFINITY;
    for (int64_t s = 0; s < S; s++)
        for (int64_t k = 0; k < SLICE && s * SLICE + k <= p; k++) {
            const float v = o[(s * G + g) * SLICE + k];
            top = v > top ? v : top;
        }
    for (int64_t s = 0; s < S; s++)
        for (int64_t k = 0; k < SLICE; k++) {
            const int64_t i = s * SLICE + k;
            float v = o[(s * G + g) * SLICE + k] - top;
            v = v < floor ? floor : v;
            if (i >= lead) v = v * (i <= p ? 1.0f : 0.0f);
            o[(s * G + g) * SLICE + k] = v;
        }
}

/* which of 16 keys are visible when the first of them lies `left` positions before the row's
 * own (left < 0: none; left >= 15: all), and v times 1 where visible, 0 where not */
K512 static inline __mmask16 visible16(int64_t left)
{
    return left >= 15 ? (__mmask16)0xFFFF : left < 0 ? (__mmask16)0 : (__mmask16)((1u << (left + 1)) - 1);
}

K512 static inline __m512 times_visible16(__m512 v, int64_t left)
{
    return _mm512_mul_ps(v, _mm512_mask_blend_ps(visible16(left), _mm512_setzero_ps(), _mm512_set1_ps(1.0f)));
}

/* scores_post 16 keys per vector. A maximum is exact, so its order changes no bit (a
 * lane never keeps a NaN: `v > top ? v : top`, as the scalar loop). */
K512 static void scores_post512(float *o, int64_t S, int64_t G, int64_t g, int64_t p, int64_t lead, float floor)
{
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t s = 0; s < S && s * SLICE <= p; s++)
        for (int64_t k0 = 0; k0 < SLICE && s * SLICE + k0 <= p; k0 += 16) {
            const __m512 v = _mm512_loadu_ps(o + (s * G + g) * SLICE + k0);
            top = _mm512_mask_max_ps(top, visible16(p - (s * SLICE + k0)), v, top);
        }
    const __m512 t = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    const __m512 fl = _mm512_set1_ps(floor);
    for (int64_t s = 0; s < S; s++)
        for (int64_t k0 = 0; k0 < SLICE; k0 += 16) {
            float *at = o + (s * G + g) * SLICE + k0;
            __m512 v = _mm512_max_ps(fl, _mm512_sub_ps(_mm512_loadu_ps(at), t));  /* v < floor ? floor : v */
            const int64_t i0 = s * SLICE + k0;
            if (i0 >= lead)   /* lead is a multiple of SLICE: a vector is wholly past it or not */
                v = times_visible16(v, p - i0);
            _mm512_storeu_ps(at, v);
        }
}

/* probity_decode_values' second masking of one slice's numerators ec [SLICE] (keys i0..): times
 * 1 where visible (i <= p), 0 where not */
K512 static void mask_slice512(float *ec, int64_t i0, int64_t p)
{
    for (int64_t k0 = 0; k0 < SLICE; k0 += 16)
        _mm512_storeu_ps(ec + k0, times_visible16(_mm512_loadu_ps(ec + k0), p - (i0 + k0)));
}

/* q [T][KV*G][hd] (item j's row: row[j]), keys [KV][items][L][hd], pos[j]: item j sees keys
 * 0..pos[j]; out [KV][items][S][G][64] */
void probity_decode_scores(const float *q, const int64_t *row, const float *keys, const int64_t *pos,
                           float *out, int64_t KV, int64_t items, int64_t G, int64_t L, int64_t hd,
                           float scale, int64_t lead, float floor)
{
    const int64_t S = L / SLICE;
#pragma omp parallel for schedule(static) if (KV * items >= 2)
    for (int64_t hj = 0; hj < KV * items; hj++) {
        const int64_t h = hj / items, j = hj % items;
        float kt[HD_MAX * SLICE] __attribute__((aligned(32)));
        float qs[G_MAX * HD_MAX];
        const float *qr = q + (row[j] * KV * G + h * G) * hd;
        for (int64_t i = 0; i < G * hd; i++) qs[i] = qr[i] * scale;
        float *o = out + hj * S * G * SLICE;
        const int wide = probity_cpu_avx512();
        for (int64_t s = 0; s < S; s++) {
            if (wide)
                score_slice512(qs, G, keys + (hj * L + s * SLICE) * hd, hd, o + s * G * SLICE, kt);
            else
                score_slice(qs, G, keys + (hj * L + s * SLICE) * hd, hd, o + s * G * SLICE, kt);
        }
        const int64_t p = pos[j];
        for (int64_t g = 0; g < G; g++) {
            if (wide)
                scores_post512(o, S, G, g, p, lead, floor);
            else
                scores_post(o, S, G, g, p, lead, floor);
        }
    }
}

/* e [KV][items][S][G][64] (after exp), vals [KV][items][L][hd+1], part: scratch
 * [KV][items][S][G][hd+1]; out [items][KV*G][hd] */
void probity_decode_values(float *e, const float *vals, const int64_t *pos, float *part, float *out,
                           int64_t KV, int64_t items, int64_t G, int64_t L, int64_t hd, int64_t lead)
{
    const int64_t S = L / SLICE, W = hd + 1;
#pragma omp parallel for schedule(static) if (KV * items >= 2)
    for (int64_t hj = 0; hj < KV * items; hj++) {
        const int64_t h = hj / items, j = hj % items;
        const int64_t p = pos[j];
        float *eh = e + hj * S * G * SLICE;
        float *ph = part + hj * S * G * W;
        const int wide = probity_cpu_avx512() && (W - 1) % 16 == 0;
        for (int64_t s = 0; s < S; s++) {
            const float *vb = vals + (hj * L + s * SLICE) * W;
            if (wide) {
                for (int64_t g = 0; g < G && s * SLICE >= lead; g++)
                    mask_slice512(eh + (s * G + g) * SLICE, s * SLICE, p);
                value_rows512(eh + s * G * SLICE, G, vb, ph + s * G * W, W);
                continue;
            }
            for (int64_t g = 0; g < G; g++) {
                float *ec = eh + (s * G + g) * SLICE;
                for (int64_t k = 0; k < SLICE; k++) {
                    const int64_t i = s * SLICE + k;
                    if (i >= lead) ec[k] = ec[k] * (i <= p ? 1.0f : 0.0f);
                }
                value_row(ec, vb, ph + (s * G + g) * W, W, g == 0);
            }
        }
        /* attention.tree_sum: halves folded onto the first, a count that is not a power of two
         * treated as zero-padded to one */
        int64_t n = S, pw = 1;
        while (pw < n) pw <<= 1;
        while (pw > 1) {
            const int64_t half = pw / 2;
            if (n > half) {
                for (int64_t i = 0; i < n - half; i++)
                    for (int64_t x = 0; x < G * W; x++)
                        ph[i * G * W + x] = ph[i * G * W + x] + ph[(half + i) * G * W + x];
                n = half;
            }
            pw = half;
        }
        for (int64_t g = 0; g < G; g++) {
            const float *o = ph + g * W;
            float *dst = out + (j * KV * G + h * G + g) * hd;
            for (int64_t d = 0; d < hd; d++) dst[d] = o[d] / o[hd];
        }
    }
}

/* ---- RMS norm: y = (x * (1 / sqrt(mean(x^2) + eps))) * w, row by row -----------------------
 * Each row's sum of squares in one fixed order, whatever the row count: element i goes to lane
 * i % 8 of accumulator (i / 8) % 4 (FMA chains), the four accumulators added as (0+1)+(2+3),
 * the eight lanes as ((0+4)+(2+6))+((1+5)+(3+7)), then the elements past the last 32 in order.
 * x, y [T][D] contiguous, w [D]. */
void probity_rms_norm(const float *x, const float *w, float *y, int64_t T, int64_t D, float eps)
{
    const int64_t D32 = D / 32 * 32;
#pragma omp parallel for schedule(static) if (T >= 32)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * D;
        float *yr = y + t * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (int64_t i = 0; i < D32; i += 32) {
            const __m256 v0 = _mm256_loadu_ps(xr + i), v1 = _mm256_loadu_ps(xr + i + 8);
            const __m256 v2 = _mm256_loadu_ps(xr + i + 16), v3 = _mm256_loadu_ps(xr + i + 24);
            a0 = _mm256_fmadd_ps(v0, v0, a0);
            a1 = _mm256_fmadd_ps(v1, v1, a1);
            a2 = _mm256_fmadd_ps(v2, v2, a2);
            a3 = _mm256_fmadd_ps(v3, v3, a3);
        }
        const __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));   /* lanes (0+4) (1+5) (2+6) (3+7) */
        const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));                                   /* (0+4)+(2+6), (1+5)+(3+7) */
        float sum = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
        for (int64_t i = D32; i < D; i++) sum = __builtin_fmaf(xr[i], xr[i], sum);
        const float r = 1.0f / sqrtf(sum / (float)D + eps);
        const __m256 rv = _mm256_set1_ps(r);
        int64_t i = 0;
        for (; i + 8 <= D; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), rv), _mm256_loadu_ps(w + i)));
        for (; i < D; i++) yr[i] = (xr[i] * r) * w[i];
    }
}

/* ---- rotary embedding: out = x * cos + rotate_half(x) * signed_sin, as kernels.rotate's torch path does it
 * (two rounded products, one rounded sum: the same bits). x: T rows of `heads` x hd floats
 * (row stride ldx, heads contiguous), cos/sin [T][hd], out [T][heads][hd] contiguous. */
void probity_rotate(const float *x, int64_t ldx, const float *cos_, const float *sin_, float *out,
                    int64_t T, int64_t heads, int64_t hd)
{
    const int64_t half = hd / 2;
#pragma omp parallel for schedule(static) if (T >= 64)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_ + t * hd, *s = sin_ + t * hd;
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + t * ldx + h * hd;
            float *o = out + (t * heads + h) * hd;
            for (int64_t i = 0; i < hd; i++) {
                const float a = xr[i] * c[i];
                const float b = xr[i < half ? i + half : i - half] * s[i];
                o[i] = a + b;
            }
        }
    }
}
