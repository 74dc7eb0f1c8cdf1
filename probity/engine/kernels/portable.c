/* The portable build of probity's kernels (PROBITY_ISA=generic): plain C for any x86-64 CPU,
 * compiled without AVX, AVX2 or FMA, giving the bits of kernels.c's vector code. Every output
 * is the same sequence of IEEE operations (docs/engine.md, "One order on every path"): the same
 * FMA chains, the same partial sums, the same folds. Built with numerics.c (exp, silu,
 * log-softmax, cos/sin: its scalar forms). No stored weights (a GGUF or 16-bit checkpoint is
 * expanded to float32 once at load) and no fused decode attention (attention.py's general
 * path computes the same operations through probity_score and probity_value).
 *
 * A fused multiply-add rounds a * b + c once. Without the instruction it is computed in double:
 * a * b is exact there (24 + 24 bits < 53) and the sum is rounded to 53 bits, then to 24. The
 * two roundings give the single one's float except where the double lands exactly on a
 * midpoint between two floats (it cannot cross one: a midpoint is a double) or outside the
 * normal float range; those rare cases (about 2^-28 of sums) are recomputed by libm's fmaf,
 * which is exact on every CPU. */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>

#if !defined(PANEL) || !defined(SLICE) || !defined(HD_MAX) || !defined(G_MAX)
#error "compile through probity/engine/kernels/build.py"
#endif

int probity_cpu_avx512(void) { return 0; }
int probity_stored_wide(void) { return 0; }
int64_t probity_group_bytes(int type) { (void)type; return 0; }

/* the double's float is not the single rounding's: a midpoint, or outside the normal range */
static inline int doubtful(double s)
{
    uint64_t u;
    memcpy(&u, &s, 8);
    const uint64_t e = (u >> 52) & 0x7FF;
    return (u & 0x1FFFFFFFu) == 0x10000000u || ((e < 897 || e > 1150) && (u << 1) != 0);
}

static inline float fma1(float a, float b, float c)
{
    const double s = (double)a * (double)b + (double)c;
    return doubtful(s) ? fmaf(a, b, c) : (float)s;
}

/* acc[j] = fma(x, w[j], acc[j]) for j < 16: the double form over all 16 (vectorizable), then
 * the exact one for a doubtful few */
static inline void fma16(float x, const float *w, float *acc)
{
    double s[16];
    int bad = 0;
    for (int j = 0; j < 16; j++) {
        s[j] = (double)x * (double)w[j] + (double)acc[j];
        bad |= doubtful(s[j]);
    }
    if (bad) {
        for (int j = 0; j < 16; j++) acc[j] = fmaf(x, w[j], acc[j]);
        return;
    }
    for (int j = 0; j < 16; j++) acc[j] = (float)s[j];
}

/* kernels.c's probity_linear: per output, an FMA chain over k from zero restarted every kb
 * values, the block sums added in order, then + bias, then + residual */
void probity_linear(const float *x, int64_t ldx, int64_t M, const float *wp, int64_t N, int64_t K,
                    int64_t kb, const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy)
{
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t j = 0; j < panels; j++)
        for (int64_t m = 0; m < M; m++) {
            const float *w = wp + j * K * PANEL, *xm = x + m * ldx;
            float c[PANEL], a[PANEL];
            for (int64_t k0 = 0; k0 < K; k0 += kb) {
                const int64_t k1 = k0 + kb < K ? k0 + kb : K;
                for (int v = 0; v < PANEL; v++) a[v] = 0.0f;
                for (int64_t k = k0; k < k1; k++) fma16(xm[k], w + k * PANEL, a);
                for (int v = 0; v < PANEL; v++) c[v] = k0 == 0 ? a[v] : c[v] + a[v];
            }
            const int64_t n0 = j * PANEL;
            for (int v = 0; v < PANEL && n0 + v < N; v++) {
                float o = c[v];
                if (bias) o = o + bias[n0 + v];
                if (res) o = o + res[m * ldr + n0 + v];
                y[m * ldy + n0 + v] = o;
            }
        }
}

/* scores out[b][s][c][j] = sum_d q[b][c][d] * keys[b][s*64 + j][d], one chain over d */
void probity_score(const float *q, const float *keys, float *out, int64_t B, int64_t S, int64_t C, int64_t hd)
{
#pragma omp parallel for schedule(static)
    for (int64_t bs = 0; bs < B * S; bs++) {
        const float *qb = q + bs / S * C * hd, *kb = keys + bs * SLICE * hd;
        float *ob = out + bs * C * SLICE;
        for (int64_t c = 0; c < C; c++)
            for (int64_t j = 0; j < SLICE; j++) {
                float a = 0.0f;
                for (int64_t d = 0; d < hd; d++) a = fma1(qb[c * hd + d], kb[j * hd + d], a);
                ob[c * SLICE + j] = a;
            }
    }
}

/* values out[b][s][c][j] = sum_n e[b][s][c][n] * vals[b][s*64 + n][j], one chain over n */
void probity_value(const float *e, const float *vals, float *out, int64_t B, int64_t S, int64_t C, int64_t W)
{
#pragma omp parallel for schedule(static)
    for (int64_t bs = 0; bs < B * S; bs++) {
        const float *vb = vals + bs * SLICE * W;
        for (int64_t c = 0; c < C; c++) {
            const float *ec = e + (bs * C + c) * SLICE;
            float *oc = out + (bs * C + c) * W;
            int64_t j0 = 0;
            for (; j0 + 16 <= W; j0 += 16) {
                float a[16] = {0};
                for (int64_t n = 0; n < SLICE; n++) fma16(ec[n], vb + n * W + j0, a);
                memcpy(oc + j0, a, sizeof a);
            }
            for (int64_t j = j0; j < W; j++) {
                float a = 0.0f;
                for (int64_t n = 0; n < SLICE; n++) a = fma1(ec[n], vb[n * W + j], a);
                oc[j] = a;
            }
        }
    }
}

/* kernels.c's probity_rms_norm: element i's square into partial sum i % 32 (FMA chains), the 32
 * folded as lane l of (p[l] + p[8 + l]) + (p[16 + l] + p[24 + l]), then l + 4, then
 * (0 + 2) + (1 + 3), then the elements past the last 32 in order */
void probity_rms_norm(const float *x, const float *w, float *y, int64_t T, int64_t D, float eps)
{
    const int64_t D32 = D / 32 * 32;
#pragma omp parallel for schedule(static) if (T >= 32)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * D;
        float *yr = y + t * D;
        float p[32] = {0};
        for (int64_t i = 0; i < D32; i += 32)
            for (int l = 0; l < 32; l++) p[l] = fma1(xr[i + l], xr[i + l], p[l]);
        float a[8], h[4];
        for (int l = 0; l < 8; l++) a[l] = (p[l] + p[8 + l]) + (p[16 + l] + p[24 + l]);
        for (int l = 0; l < 4; l++) h[l] = a[l] + a[l + 4];
        float sum = (h[0] + h[2]) + (h[1] + h[3]);
        for (int64_t i = D32; i < D; i++) sum = fma1(xr[i], xr[i], sum);
        const float r = 1.0f / sqrtf(sum / (float)D + eps);
        for (int64_t i = 0; i < D; i++) yr[i] = (xr[i] * r) * w[i];
    }
}

/* kernels.c's probity_rotate: x * cos + rotate_half(x) * signed_sin, two rounded products and
 * one rounded sum per element */
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
