/* probity's small-row linear: y = x W^T (+ b) (+ r) for a few rows, with every output
 * element reduced in the order oneDNN's fp32 GEMM reduces it on the CPUs measured so far:
 * one fused multiply-add chain over k, starting from zero, restarted every `kb` values of k
 * (the block partial sums are then added in order), then the bias, then the residual.
 * Equal order means equal bits: the engine checks that at startup, shape by shape, against
 * oneDNN itself (probity/engine/narrow.py) and uses this kernel only where they agree.
 *
 * Why: below ~16 rows oneDNN runs far under the memory bound (a decode step streams every
 * weight once for a handful of rows). This kernel streams the weights once per call, laid
 * out as [ceil(N/16)][K][16] so each k reads 64 contiguous bytes for 16 outputs, and holds
 * up to 6 rows x 16 outputs in registers. Bits are set by the order of the FMAs of each
 * output alone, so tiling, threads and prefetching change none.
 */
#include <immintrin.h>
#include <stdint.h>

#define NB 16
#define MR_MAX 6

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

/* x [M, K] (row stride ldx), wp packed [ceil(N/16)][K][16], bias [N] or NULL,
 * res [M, N] (row stride ldr) or NULL, y [M, N] (row stride ldy). */
void probity_linear(const float *x, int64_t ldx, int64_t M, const float *wp, int64_t N, int64_t K,
                    int64_t kb, const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy)
{
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
        for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
            const int64_t left = M - m0;
            const float *xm = x + m0 * ldx;
            const float *rm = res ? res + m0 * ldr + n0 : 0;
            float *ym = y + m0 * ldy + n0;
            switch (left >= MR_MAX ? MR_MAX : left) {
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
