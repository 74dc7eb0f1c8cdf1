/* probity's elementwise functions and its row reductions, each one defined sequence of IEEE
 * operations whatever instructions run it (docs/engine.md, "One order on every path"):
 *
 *   exp(x)          x clamped to [-88, 88]; n = rint(x log2 e) (by the 1.5 * 2^23 trick, in one
 *                   FMA); r = (x - n * 0.693359375) + n * 2.12194440e-4 (two FMAs); Cephes'
 *                   degree-5 polynomial p(r) by Horner in FMAs, e = fma(p, r * r, r) + 1;
 *                   e * 2^n, 2^n built from its bits (n = -127 gives exactly 0); +inf where the
 *                   input was above 88, 0 at -inf.
 *   silu(g) * u     (g / (1 + exp(-g))) * u
 *   log-softmax     per row: m = max; element i's exp(x_i - m) is added to partial sum i % 16
 *                   (in order of i); the 16 sums are folded as s[i] += s[i + 8], then + 4, + 2,
 *                   + 1; lp_i = (x_i - m) - L, L = log(sum) computed in double by our own series
 *                   and rounded to float once.
 *   cos, sin        of a float angle, in double (Cody-Waite reduction by pi/2 in three parts,
 *                   Taylor series to degree 17/18 on [-pi/4, pi/4]), each rounded to float once.
 *
 * The AVX-512 and AVX2 forms do per lane exactly what the scalar form does (the scalar form is
 * also the portable build's, portable.c, and the tails'); the file is compiled with
 * -ffp-contract=off, so no compiler fuses a product into a sum behind the code's back. */
#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

int probity_cpu_avx512(void);

#define EXP_LO (-88.0f)
#define EXP_HI 88.0f
#define LOG2E 1.44269504088896341f
#define MAGIC 12582912.0f          /* 1.5 * 2^23: x + MAGIC - MAGIC rounds x to an integer */
#define LN2_HI 0.693359375f
#define LN2_LO (-2.12194440e-4f)
#define P0 1.9875691500e-4f
#define P1 1.3981999507e-3f
#define P2 8.3334519073e-3f
#define P3 4.1665795894e-2f
#define P4 1.6666665459e-1f
#define P5 5.0000001201e-1f

static inline float bits_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

float probity_exp1(float x)
{
    float c = x > EXP_LO ? x : EXP_LO;
    c = c < EXP_HI ? c : EXP_HI;
    const float t = __builtin_fmaf(c, LOG2E, MAGIC);
    const float n = t - MAGIC;
    const int32_t ni = (int32_t)(f_bits(t) - f_bits(MAGIC));
    float r = __builtin_fmaf(n, -LN2_HI, c);
    r = __builtin_fmaf(n, -LN2_LO, r);
    float p = P0;
    p = __builtin_fmaf(p, r, P1);
    p = __builtin_fmaf(p, r, P2);
    p = __builtin_fmaf(p, r, P3);
    p = __builtin_fmaf(p, r, P4);
    p = __builtin_fmaf(p, r, P5);
    const float r2 = r * r;
    p = __builtin_fmaf(p, r2, r);
    p = p + 1.0f;
    const float y = p * bits_f((uint32_t)(ni + 127) << 23);
    return x > EXP_HI ? INFINITY : y;
}

#if defined(__AVX2__)
static inline __attribute__((always_inline)) __m256 exp8(__m256 x)
{
    __m256 c = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));    /* x > lo ? x : lo, as exp1 */
    c = _mm256_min_ps(c, _mm256_set1_ps(EXP_HI));
    const __m256 t = _mm256_fmadd_ps(c, _mm256_set1_ps(LOG2E), _mm256_set1_ps(MAGIC));
    const __m256 n = _mm256_sub_ps(t, _mm256_set1_ps(MAGIC));
    const __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(_mm256_set1_ps(MAGIC)));
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), c);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    __m256 p = _mm256_set1_ps(P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
    const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23)));
    return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, _mm256_set1_ps(EXP_HI), _CMP_GT_OQ));
}

#define N512 __attribute__((target("avx512f,avx512vl,avx2,fma")))
N512 static inline __attribute__((always_inline)) __m512 exp16(__m512 x)
{
    __m512 c = _mm512_max_ps(x, _mm512_set1_ps(EXP_LO));
    c = _mm512_min_ps(c, _mm512_set1_ps(EXP_HI));
    const __m512 t = _mm512_fmadd_ps(c, _mm512_set1_ps(LOG2E), _mm512_set1_ps(MAGIC));
    const __m512 n = _mm512_sub_ps(t, _mm512_set1_ps(MAGIC));
    const __m512i ni = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_castps_si512(_mm512_set1_ps(MAGIC)));
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), c);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    __m512 p = _mm512_set1_ps(P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
    p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
    const __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(ni, _mm512_set1_epi32(127)), 23)));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_HI), _CMP_GT_OQ), y, _mm512_set1_ps(INFINITY));
}

N512 static void exp_wide(const float *x, float *y, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, exp16(_mm512_loadu_ps(x + i)));
    for (; i < n; i++) y[i] = probity_exp1(x[i]);
}
#endif

/* y = exp(x), n values (y may be x) */
void probity_exp(const float *x, float *y, int64_t n)
{
    const int64_t chunk = 1 << 14;
#pragma omp parallel for schedule(static) if (n >= 2 * chunk)
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
        const int64_t c1 = c0 + chunk < n ? c0 + chunk : n;
        int64_t i = c0;
#if defined(__AVX2__)
        if (probity_cpu_avx512()) { exp_wide(x + c0, y + c0, c1 - c0); continue; }
        for (; i + 8 <= c1; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
#endif
        for (; i < c1; i++) y[i] = probity_exp1(x[i]);
    }
}

/* out[t][i] = silu(gu[t][i]) * gu[t][I + i]: gu [T][2I] (row stride ld), out [T][I] */
void probity_silu_mul(const float *gu, int64_t ld, float *out, int64_t T, int64_t I)
{
#pragma omp parallel for schedule(static) if (T >= 8)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * ld, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
#if defined(__AVX2__)
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) {
            const float s = g[i] / (1.0f + probity_exp1(0.0f - g[i]));
            o[i] = s * u[i];
        }
    }
}

/* log in double: x = 2^e * m, m in [sqrt(1/2), sqrt(2)); log m = 2 atanh(z), z = (m-1)/(m+1),
 * |z| < 0.172, by its series to z^23 (the next term is below 2^-60 of the sum) */
static double log_d(double x)
{
    int e;
    double m = frexp(x, &e);          /* exact: m in [0.5, 1) */
    if (m < 0.70710678118654752440) { m = m * 2.0; e = e - 1; }
    const double z = (m - 1.0) / (m + 1.0), z2 = z * z;
    double s = 1.0 / 23.0;
    for (int k = 21; k >= 1; k -= 2) s = s * z2 + 1.0 / (double)k;
    return (double)e * 0.69314718055994530942 + 2.0 * z * s;
}

/* y = log_softmax(x) row by row, x and y [R][V] (row strides ldx, ldy) */
void probity_log_softmax(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t R, int64_t V)
{
#pragma omp parallel for schedule(static) if (R >= 2)
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        float m = -INFINITY;
        for (int64_t i = 0; i < V; i++) m = xr[i] > m ? xr[i] : m;
        float s[16] = {0};
        int64_t i = 0;
#if defined(__AVX2__)
        {
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            const __m256 mv = _mm256_set1_ps(m);
            for (; i + 16 <= V; i += 16) {
                a0 = _mm256_add_ps(a0, exp8(_mm256_sub_ps(_mm256_loadu_ps(xr + i), mv)));
                a1 = _mm256_add_ps(a1, exp8(_mm256_sub_ps(_mm256_loadu_ps(xr + i + 8), mv)));
            }
            _mm256_storeu_ps(s, a0);
            _mm256_storeu_ps(s + 8, a1);
        }
#endif
        for (; i < V; i++) s[i % 16] = s[i % 16] + probity_exp1(xr[i] - m);
        for (int w = 8; w >= 1; w /= 2)
            for (int j = 0; j < w; j++) s[j] = s[j] + s[j + w];
        const float L = (float)log_d((double)s[0]);
        i = 0;
#if defined(__AVX2__)
        {
            const __m256 mv = _mm256_set1_ps(m), Lv = _mm256_set1_ps(L);
            for (; i + 8 <= V; i += 8)
                _mm256_storeu_ps(yr + i, _mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(xr + i), mv), Lv));
        }
#endif
        for (; i < V; i++) yr[i] = (xr[i] - m) - L;
    }
}

/* cos and sin of float angles, n of them, computed in double and rounded once */
void probity_cos_sin(const float *a, float *c, float *s, int64_t n)
{
    /* pi/2 in three parts of 33 bits each (fdlibm's pio2_1, pio2_2, pio2_3) and the rest: n times
     * each of the first three is exact for |n| < 2^20 */
    const double P1_ = 1.57079632673412561417e+00, P2_ = 6.07710050630396597660e-11,
                 P3_ = 2.02226624871116645580e-21, P3T = 8.47842766036889956997e-32;
    const double TWO_OVER_PI = 6.36619772367581382433e-01, RND = 6755399441055744.0;   /* 1.5 * 2^52 */
    for (int64_t i = 0; i < n; i++) {
        const double x = (double)a[i];
        const double t = x * TWO_OVER_PI + RND;
        const double q = t - RND;
        double r = x - q * P1_;
        r = r - q * P2_;
        r = r - q * P3_;
        r = r - q * P3T;
        const double r2 = r * r;
        double sn = 1.0 / 355687428096000.0;              /* 1/17! */
        sn = sn * r2 - 1.0 / 1307674368000.0;             /* 1/15! */
        sn = sn * r2 + 1.0 / 6227020800.0;
        sn = sn * r2 - 1.0 / 39916800.0;
        sn = sn * r2 + 1.0 / 362880.0;
        sn = sn * r2 - 1.0 / 5040.0;
        sn = sn * r2 + 1.0 / 120.0;
        sn = sn * r2 - 1.0 / 6.0;
        sn = r + r * r2 * sn;
        double cs = 1.0 / 6402373705728000.0;             /* 1/18! */
        cs = cs * r2 - 1.0 / 20922789888000.0;            /* 1/16! */
        cs = cs * r2 + 1.0 / 87178291200.0;
        cs = cs * r2 - 1.0 / 479001600.0;
        cs = cs * r2 + 1.0 / 3628800.0;
        cs = cs * r2 - 1.0 / 40320.0;
        cs = cs * r2 + 1.0 / 720.0;
        cs = cs * r2 - 1.0 / 24.0;
        cs = cs * r2 + 0.5;
        cs = 1.0 - r2 * cs;
        switch ((int64_t)q & 3) {
        case 0: c[i] = (float)cs; s[i] = (float)sn; break;
        case 1: c[i] = (float)-sn; s[i] = (float)cs; break;
        case 2: c[i] = (float)-cs; s[i] = (float)-sn; break;
        default: c[i] = (float)sn; s[i] = (float)-cs; break;
        }
    }
}

/* ---- keys and values into their slots: copies, so no number changes ----------------------
 * Row t of k and v (row t = rows[t] of the step where rows is given, else t; each row KV heads
 * of hd floats, heads hd apart, rows ldk / ldv apart) goes to slot slots[t] of every head:
 * kdst + h * kstride + slots[t] * hd and vdst + h * vstride + slots[t] * (hd + 1) (the values'
 * extra column, the softmax denominator's ones, is left as it is). One call per layer writes
 * the pool, and another the kept keys: the indexed copies of torch cost ~15 us each here. */
void probity_kv_store(const float *k, int64_t ldk, const float *v, int64_t ldv, const int64_t *rows, int64_t n,
                      int64_t KV, int64_t hd, const int64_t *slots, float *kdst, int64_t kstride, float *vdst,
                      int64_t vstride)
{
    for (int64_t t = 0; t < n; t++) {
        const int64_t r = rows ? rows[t] : t, s = slots[t];
        for (int64_t h = 0; h < KV; h++) {
            memcpy(kdst + h * kstride + s * hd, k + r * ldk + h * hd, (size_t)hd * sizeof(float));
            memcpy(vdst + h * vstride + s * (hd + 1), v + r * ldv + h * hd, (size_t)hd * sizeof(float));
        }
    }
}
