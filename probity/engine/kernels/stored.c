/* Weights as stored: 16-bit and GGUF-quantized weights expanded to float32 exactly as the
 * reference de-quantization does it (gguf-py's de-quantizers, the exact bf16/f16 upcast),
 * then reduced by the same FMA chains as the float32 linear (kernels.c's tile()).
 *
 * Layout (probity/engine/stored.py packs it): a weight [N, K] is cut into panels of PANEL
 * (16) rows, and each panel's K into groups of 32 values; a group of 16 rows x 32 values is
 * stored with the 16 rows side by side, so one vector op decodes the same position of 16 rows:
 *
 *   kind A  w = s * q                 s = f16 d                          (Q8_0, Q4_0, Q5_0)
 *   kind B  w = (s * q) + m           s = f16 d, m = f16 m               (Q4_1, Q5_1)
 *   kind C  w = (s * q) - t           s = f16 d * sc, t = f16 dmin * mn  (Q4_K, Q5_K)
 *   kind D  w = s * q                 s = f16 d * int8 scale per 16      (Q6_K)
 *   kind E  w = the 16-bit value      f16 or bf16
 *
 * each product and sum rounded to float32 on its own (no contraction: -ffp-contract=off),
 * which is what the reference computes in numpy. Group bytes, in order:
 *   header   A: d[16] f16 | B: d[16], m[16] f16 | C: d[16], dmin[16] f16, sc[16], mn[16] u8
 *            D: d[16] f16, sc0[16], sc1[16] int8 (scales of values 0-15 and 16-31)
 *   values   8-bit: q[32][16] int8 | 4/5/6-bit: lo[16][16] u8 (low nibble: bits 0-3 of value j,
 *            high nibble: bits 0-3 of value j+16), then 5-bit: hb[16] u32 (bit j: bit 4 of value
 *            j), 6-bit: h0[16], h1[16] u32 (bits 2j, 2j+1: bits 4-5 of value j, resp. j+16)
 *            16-bit: h[32][16]
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int probity_cpu_avx512(void);   /* kernels.c: whether the AVX-512 code runs on this CPU */
int64_t probity_tile_rows(int64_t M, int64_t i);   /* kernels.c: the rows of a call's row tile i */
/* bytes ahead of the group it decodes that fused512 prefetches in each panel, in calls of more
 * than 6 rows: in a step the weights stream from memory (30 layers' 85 MB > L3), and at 8 rows
 * the 30 layers' linears took 11.2-11.9 ms without it, 9.9-10.7 with it (AMD EPYC Zen 4,
 * alternating runs; 512-4096 bytes measured alike). One row, and fused256, run as fast without. */
#define FUSED_AHEAD 1024

#ifndef PANEL
#error "compile through probity/engine/kernels/build.py"
#endif

enum { T_F16 = 1, T_BF16 = 2, T_Q8_0 = 3, T_Q4_0 = 4, T_Q4_1 = 5, T_Q5_0 = 6, T_Q5_1 = 7, T_Q4_K = 8,
       T_Q5_K = 9, T_Q6_K = 10, T_F32 = 11 };   /* T_F32: a float32 weight packed by kernels.pack (wide calls only) */

/* bytes of one group of 16 rows x 32 values */
int64_t probity_group_bytes(int type)
{
    switch (type) {
    case T_F16: case T_BF16: return 1024;
    case T_F32: return 2048;
    case T_Q8_0: return 32 + 512;
    case T_Q4_0: return 32 + 256;
    case T_Q4_1: return 64 + 256;
    case T_Q5_0: return 32 + 64 + 256;
    case T_Q5_1: return 64 + 64 + 256;
    case T_Q4_K: return 96 + 256;
    case T_Q5_K: return 96 + 64 + 256;
    case T_Q6_K: return 64 + 128 + 256;
    default: return 0;
    }
}

static inline __m256 f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline __m256 u8x8(const uint8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __m256 i8x8(const int8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* One group into out[32][16] (row stride 16 floats). */
static void decode_group(int type, const uint8_t *g, float *out)
{
    __m256 s[2], m[2], s1[2];
    const uint8_t *vals = g;
    switch (type) {
    case T_F16: case T_BF16: {
        const uint16_t *h = (const uint16_t *)g;
        for (int j = 0; j < 32; j++)
            for (int v = 0; v < 2; v++) {
                const uint16_t *p = h + j * 16 + v * 8;
                __m256 w;
                if (type == T_F16)
                    w = f16x8(p);
                else
                    w = _mm256_castsi256_ps(_mm256_slli_epi32(
                        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
                _mm256_storeu_ps(out + j * 16 + v * 8, w);
            }
        return;
    }
    case T_Q8_0: case T_Q4_0: case T_Q5_0:
        for (int v = 0; v < 2; v++) s[v] = f16x8((const uint16_t *)g + v * 8);
        vals = g + 32;
        break;
    case T_Q4_1: case T_Q5_1:
        for (int v = 0; v < 2; v++) {
            s[v] = f16x8((const uint16_t *)g + v * 8);
            m[v] = f16x8((const uint16_t *)g + 16 + v * 8);
        }
        vals = g + 64;
        break;
    case T_Q4_K: case T_Q5_K:
        for (int v = 0; v < 2; v++) {
            s[v] = _mm256_mul_ps(f16x8((const uint16_t *)g + v * 8), u8x8(g + 64 + v * 8));
            m[v] = _mm256_mul_ps(f16x8((const uint16_t *)g + 16 + v * 8), u8x8(g + 80 + v * 8));
        }
        vals = g + 96;
        break;
    case T_Q6_K:
        for (int v = 0; v < 2; v++) {
            const __m256 d = f16x8((const uint16_t *)g + v * 8);
            s[v] = _mm256_mul_ps(d, i8x8((const int8_t *)g + 32 + v * 8));
            s1[v] = _mm256_mul_ps(d, i8x8((const int8_t *)g + 48 + v * 8));
        }
        vals = g + 64;
        break;
    default:
        return;
    }
    if (type == T_Q8_0) {
        for (int j = 0; j < 32; j++)
            for (int v = 0; v < 2; v++)
                _mm256_storeu_ps(out + j * 16 + v * 8,
                                 _mm256_mul_ps(s[v], i8x8((const int8_t *)vals + j * 16 + v * 8)));
        return;
    }
    const uint8_t *lo = vals;
    const uint32_t *hb = (const uint32_t *)(vals + 256);
    const __m256i nib = _mm256_set1_epi32(0x0F), one = _mm256_set1_epi32(1), three = _mm256_set1_epi32(3);
    for (int j = 0; j < 16; j++)
        for (int v = 0; v < 2; v++) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(lo + j * 16 + v * 8)));
            __m256i q0 = _mm256_and_si256(b, nib), q1 = _mm256_srli_epi32(b, 4);
            if (type == T_Q5_0 || type == T_Q5_1 || type == T_Q5_K) {
                const __m256i h = _mm256_loadu_si256((const __m256i *)(hb + v * 8));
                q0 = _mm256_or_si256(q0, _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, _mm_cvtsi32_si128(j)), one), 4));
                q1 = _mm256_or_si256(q1, _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, _mm_cvtsi32_si128(j + 16)), one), 4));
            } else if (type == T_Q6_K) {
                const __m256i h0 = _mm256_loadu_si256((const __m256i *)(hb + v * 8));
                const __m256i h1 = _mm256_loadu_si256((const __m256i *)(hb + 16 + v * 8));
                q0 = _mm256_or_si256(q0, _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h0, _mm_cvtsi32_si128(2 * j)), three), 4));
                q1 = _mm256_or_si256(q1, _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h1, _mm_cvtsi32_si128(2 * j)), three), 4));
            }
            __m256 w0, w1;
            switch (type) {
            case T_Q4_0:
                w0 = _mm256_mul_ps(s[v], _mm256_cvtepi32_ps(_mm256_sub_epi32(q0, _mm256_set1_epi32(8))));
                w1 = _mm256_mul_ps(s[v], _mm256_cvtepi32_ps(_mm256_sub_epi32(q1, _mm256_set1_epi32(8))));
                break;
            case T_Q5_0:
                w0 = _mm256_mul_ps(s[v], _mm256_cvtepi32_ps(_mm256_sub_epi32(q0, _mm256_set1_epi32(16))));
                w1 = _mm256_mul_ps(s[v], _mm256_cvtepi32_ps(_mm256_sub_epi32(q1, _mm256_set1_epi32(16))));
                break;
            case T_Q4_1: case T_Q5_1:
                w0 = _mm256_add_ps(_mm256_mul_ps(s[v], _mm256_cvtepi32_ps(q0)), m[v]);
                w1 = _mm256_add_ps(_mm256_mul_ps(s[v], _mm256_cvtepi32_ps(q1)), m[v]);
                break;
            case T_Q4_K: case T_Q5_K:
                w0 = _mm256_sub_ps(_mm256_mul_ps(s[v], _mm256_cvtepi32_ps(q0)), m[v]);
                w1 = _mm256_sub_ps(_mm256_mul_ps(s[v], _mm256_cvtepi32_ps(q1)), m[v]);
                break;
            default: /* T_Q6_K */
                w0 = _mm256_mul_ps(s[v], _mm256_cvtepi32_ps(_mm256_sub_epi32(q0, _mm256_set1_epi32(32))));
                w1 = _mm256_mul_ps(s1[v], _mm256_cvtepi32_ps(_mm256_sub_epi32(q1, _mm256_set1_epi32(32))));
                break;
            }
            _mm256_storeu_ps(out + j * 16 + v * 8, w0);
            _mm256_storeu_ps(out + (j + 16) * 16 + v * 8, w1);
        }
}

/* one panel (16 rows, all of K) into out[K][16]: the float32 kernel's packed layout */
static void decode_panel(int type, const uint8_t *panel, int64_t K, float *out)
{
    const int64_t gb = probity_group_bytes(type);
    for (int64_t g = 0; g < K / 32; g++)
        decode_group(type, panel + g * gb, out + g * 32 * 16);
}

/* The expanded weights, row-major [N][K] (wide calls run oneDNN on them; tests compare them
 * with the reference de-quantization). */
void probity_expand(int type, const uint8_t *packed, int64_t N, int64_t K, float *out)
{
    const int64_t panels = (N + 15) / 16, pb = K / 32 * probity_group_bytes(type);
#pragma omp parallel
    {
        float *buf = aligned_alloc(64, K * 16 * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            decode_panel(type, packed + p * pb, K, buf);
            const int64_t rows = N - p * 16 < 16 ? N - p * 16 : 16;
            for (int64_t r = 0; r < rows; r++)
                for (int64_t k = 0; k < K; k++) out[(p * 16 + r) * K + k] = buf[k * 16 + r];
        }
        free(buf);
    }
}

/* Rows `ids` of the expanded weight (an embedding lookup), out [n][K]. */
void probity_expand_rows(int type, const uint8_t *packed, int64_t K, const int64_t *ids, int64_t n, float *out)
{
    const int64_t pb = K / 32 * probity_group_bytes(type);
    float *buf = aligned_alloc(64, K * 16 * sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        const int64_t p = ids[i] / 16, r = ids[i] % 16;
        decode_panel(type, packed + p * pb, K, buf);
        for (int64_t k = 0; k < K; k++) out[i * K + k] = buf[k * 16 + r];
    }
    free(buf);
}

void probity_linear_tile(int mr, const float *x, int64_t ldx, const float *w, int64_t K, int64_t kb,
                         const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int ncols);

/* ---- AVX2: up to 6 rows over np panels, each position of 16 rows decoded into two registers
 * right before the FMAs use it (no expanded copy in memory): decode_group's values (one IEEE op
 * per element, in the reference's order; (s * q) + m as one FMA, exact as in pos512) and the
 * float32 kernel's FMA chains, so the same bits. */
static inline __attribute__((always_inline)) void pos256(const int type, const uint8_t *g, const int j,
                                                         const __m256 *s, const __m256 *m, const __m256 *s1, __m256 *w)
{
    for (int v = 0; v < 2; v++) {
        if (type == T_F16) { w[v] = f16x8((const uint16_t *)(g + j * 32) + v * 8); continue; }
        if (type == T_BF16) {
            w[v] = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(g + j * 32 + v * 16))), 16));
            continue;
        }
        if (type == T_Q8_0) { w[v] = _mm256_mul_ps(s[v], i8x8((const int8_t *)g + 32 + j * 16 + v * 8)); continue; }
        const int hdr = (type == T_Q4_0 || type == T_Q5_0) ? 32 : (type == T_Q4_K || type == T_Q5_K) ? 96 : 64;
        const uint8_t *vals = g + hdr;
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(vals + (j & 15) * 16 + v * 8)));
        __m256i q = j < 16 ? _mm256_and_si256(b, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(b, 4);
        if (type == T_Q5_0 || type == T_Q5_1 || type == T_Q5_K) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(vals + 256 + v * 32));
            q = _mm256_or_si256(q, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, j), _mm256_set1_epi32(1)), 4));
        } else if (type == T_Q6_K) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(vals + 256 + (j < 16 ? 0 : 64) + v * 32));
            q = _mm256_or_si256(q, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2 * (j & 15)),
                                                                      _mm256_set1_epi32(3)), 4));
        }
        switch (type) {
        case T_Q4_0: w[v] = _mm256_mul_ps(s[v], _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8)))); break;
        case T_Q5_0: w[v] = _mm256_mul_ps(s[v], _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(16)))); break;
        case T_Q4_1: case T_Q5_1: w[v] = _mm256_fmadd_ps(s[v], _mm256_cvtepi32_ps(q), m[v]); break;
        case T_Q4_K: case T_Q5_K: w[v] = _mm256_fmsub_ps(s[v], _mm256_cvtepi32_ps(q), m[v]); break;
        default: w[v] = _mm256_mul_ps(j < 16 ? s[v] : s1[v], _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(32)))); break;
        }
    }
}

static inline __attribute__((always_inline)) void scales256(const int type, const uint8_t *g, __m256 *s, __m256 *m,
                                                            __m256 *s1)
{
    for (int v = 0; v < 2; v++) {
        switch (type) {
        case T_Q8_0: case T_Q4_0: case T_Q5_0: s[v] = f16x8((const uint16_t *)g + v * 8); break;
        case T_Q4_1: case T_Q5_1:
            s[v] = f16x8((const uint16_t *)g + v * 8);
            m[v] = f16x8((const uint16_t *)g + 16 + v * 8);
            break;
        case T_Q4_K: case T_Q5_K:
            s[v] = _mm256_mul_ps(f16x8((const uint16_t *)g + v * 8), u8x8(g + 64 + v * 8));
            m[v] = _mm256_mul_ps(f16x8((const uint16_t *)g + 16 + v * 8), u8x8(g + 80 + v * 8));
            break;
        case T_Q6_K: {
            const __m256 d = f16x8((const uint16_t *)g + v * 8);
            s[v] = _mm256_mul_ps(d, i8x8((const int8_t *)g + 32 + v * 8));
            s1[v] = _mm256_mul_ps(d, i8x8((const int8_t *)g + 48 + v * 8));
            break;
        }
        default: break;
        }
    }
}

static inline __attribute__((always_inline)) void fused256(
    const int type, const int mr, const int np, const float *x, int64_t ldx, const uint8_t *panel, int64_t pb,
    int64_t K, int64_t kb, const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int ncols)
{
    const int64_t gb = probity_group_bytes(type);
    __m256 c[4][6][2];
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
        const int64_t k1 = k0 + kb < K ? k0 + kb : K;
        __m256 a[4][6][2];
        for (int p = 0; p < np; p++)
            for (int r = 0; r < mr; r++) { a[p][r][0] = _mm256_setzero_ps(); a[p][r][1] = _mm256_setzero_ps(); }
        for (int64_t k = k0; k < k1; k += 32) {
            const uint8_t *g[4];
            __m256 s[4][2], m[4][2], s1[4][2];
            for (int p = 0; p < np; p++) {
                g[p] = panel + p * pb + (k / 32) * gb;
                scales256(type, g[p], s[p], m[p], s1[p]);
            }
#pragma GCC unroll 4
            for (int j = 0; j < 32; j++)
                for (int p = 0; p < np; p++) {
                    __m256 w[2];
                    pos256(type, g[p], j, s[p], m[p], s1[p], w);
                    for (int r = 0; r < mr; r++) {
                        const __m256 b = _mm256_broadcast_ss(x + r * ldx + k + j);
                        a[p][r][0] = _mm256_fmadd_ps(b, w[0], a[p][r][0]);
                        a[p][r][1] = _mm256_fmadd_ps(b, w[1], a[p][r][1]);
                    }
                }
        }
        for (int p = 0; p < np; p++)
            for (int r = 0; r < mr; r++)
                for (int v = 0; v < 2; v++) c[p][r][v] = k0 == 0 ? a[p][r][v] : _mm256_add_ps(c[p][r][v], a[p][r][v]);
    }
    float buf[16];
    for (int p = 0; p < np; p++) {
        const int nc = p == np - 1 ? ncols : 16;
        for (int r = 0; r < mr; r++) {
            _mm256_storeu_ps(buf, c[p][r][0]);
            _mm256_storeu_ps(buf + 8, c[p][r][1]);
            for (int j = 0; j < nc; j++) {
                float o = buf[j];
                if (bias) o = o + bias[p * 16 + j];
                if (res) o = o + res[r * ldr + p * 16 + j];
                y[r * ldy + p * 16 + j] = o;
            }
        }
    }
}

#define FUSED256_TYPES(mr, np) \
    switch (type) { \
    case T_F16: fused256(T_F16, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    case T_BF16: fused256(T_BF16, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    case T_Q8_0: fused256(T_Q8_0, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    case T_Q4_0: fused256(T_Q4_0, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    case T_Q4_1: fused256(T_Q4_1, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    case T_Q5_0: fused256(T_Q5_0, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    case T_Q5_1: fused256(T_Q5_1, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    case T_Q4_K: fused256(T_Q4_K, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    case T_Q5_K: fused256(T_Q5_K, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    default: fused256(T_Q6_K, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    }

static void fused_tile256(int type, int mr, int np, const float *x, int64_t ldx, const uint8_t *panel, int64_t pb,
                          int64_t K, int64_t kb, const float *bias, const float *res, int64_t ldr, float *y,
                          int64_t ldy, int ncols)
{
    switch (mr * 8 + np) {
    case 1 * 8 + 4: FUSED256_TYPES(1, 4) break;
    case 2 * 8 + 2: FUSED256_TYPES(2, 2) break;
    case 3 * 8 + 2: FUSED256_TYPES(3, 2) break;
    case 1 * 8 + 1: FUSED256_TYPES(1, 1) break;
    case 2 * 8 + 1: FUSED256_TYPES(2, 1) break;
    case 3 * 8 + 1: FUSED256_TYPES(3, 1) break;
    case 4 * 8 + 1: FUSED256_TYPES(4, 1) break;
    case 5 * 8 + 1: FUSED256_TYPES(5, 1) break;
    default: FUSED256_TYPES(6, 1) break;
    }
}

/* ---- AVX-512: a row tile of up to 12 rows over a panel, each position of 16 rows decoded into
 * one register right before the tile's FMAs use it (no expanded copy). The same values (one
 * IEEE op per element, in the reference's order) and the same FMA chains, so the same bits. */
#define A512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
#define FUSED_MR 12   /* the most rows fused512 takes (its 32 zmm registers hold 12 rows' chains) */

A512 static inline __m512 h16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
A512 static inline __m512 u8f(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
A512 static inline __m512 i8f(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }

/* the 16 rows' value at position j (0..31) of group g, as float32 */
A512 static inline __attribute__((always_inline)) __m512 pos512(const int type, const uint8_t *g, const int j,
                                                                const __m512 s, const __m512 m, const __m512 s1)
{
    if (type == T_F32) return _mm512_loadu_ps((const float *)(g + j * 64));
    if (type == T_F16) return h16(g + j * 32);
    if (type == T_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + j * 32))), 16));
    if (type == T_Q8_0) return _mm512_mul_ps(s, i8f(g + 32 + j * 16));
    const int hdr = (type == T_Q4_0 || type == T_Q5_0) ? 32 : (type == T_Q4_K || type == T_Q5_K) ? 96 : 64;
    const uint8_t *vals = g + hdr;
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(vals + (j & 15) * 16)));
    __m512i q = j < 16 ? _mm512_and_si512(b, _mm512_set1_epi32(0x0F)) : _mm512_srli_epi32(b, 4);
    if (type == T_Q5_0 || type == T_Q5_1 || type == T_Q5_K) {
        const __m512i h = _mm512_loadu_si512((const void *)(vals + 256));
        q = _mm512_or_si512(q, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, j), _mm512_set1_epi32(1)), 4));
    } else if (type == T_Q6_K) {
        const __m512i h = _mm512_loadu_si512((const void *)(vals + 256 + (j < 16 ? 0 : 64)));
        q = _mm512_or_si512(q, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2 * (j & 15)), _mm512_set1_epi32(3)), 4));
    }
    switch (type) {
    case T_Q4_0: return _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(8))));
    case T_Q5_0: return _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(16))));
    /* (s * q) + m in one FMA: s * q is exact in float32 (s: an f16, 11 significant bits, or an
     * f16 times a 6-bit scale, 17 bits; q: 4 or 5 bits; at most 22 bits of a float's 24), so
     * rounding s * q + m once, as the FMA does, is rounding it after an exact product, as the
     * reference's two operations do: the same float for every input (tests/test_stored.py). */
    case T_Q4_1: case T_Q5_1: return _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(q), m);
    case T_Q4_K: case T_Q5_K: return _mm512_fmsub_ps(s, _mm512_cvtepi32_ps(q), m);
    default: return _mm512_mul_ps(j < 16 ? s : s1, _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(32))));
    }
}

/* the group's scales: s (and m or s1) per row, as the reference computes them */
A512 static inline __attribute__((always_inline)) void scales512(const int type, const uint8_t *g, __m512 *s, __m512 *m,
                                                                 __m512 *s1)
{
    switch (type) {
    case T_Q8_0: case T_Q4_0: case T_Q5_0: *s = h16(g); break;
    case T_Q4_1: case T_Q5_1: *s = h16(g); *m = h16(g + 32); break;
    case T_Q4_K: case T_Q5_K:
        *s = _mm512_mul_ps(h16(g), u8f(g + 64));
        *m = _mm512_mul_ps(h16(g + 32), u8f(g + 80));
        break;
    case T_Q6_K: {
        const __m512 d = h16(g);
        *s = _mm512_mul_ps(d, i8f(g + 32));
        *s1 = _mm512_mul_ps(d, i8f(g + 48));
        break;
    }
    default: break;
    }
}

/* Up to 12 rows (FUSED_MR) over np panels side by side (np x 16 outputs): np x mr independent FMA chains in
 * flight. One row over one panel is a single chain, whose FMA latency (4 cycles per 16 weights)
 * and not memory set a decode step's pace; four panels at once hide it. Each output's chain is
 * the same whatever np, so the bits are too. `ncols`: outputs of the last of the np panels. */
A512 static inline __attribute__((always_inline)) void fused512(
    const int type, const int mr, const int np, const float *x, int64_t ldx, const uint8_t *panel, int64_t pb,
    int64_t K, int64_t kb, const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, int ncols)
{
    const int64_t gb = probity_group_bytes(type);
    __m512 c[4][FUSED_MR];
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
        const int64_t k1 = k0 + kb < K ? k0 + kb : K;
        __m512 a[4][FUSED_MR];
        for (int p = 0; p < np; p++)
            for (int r = 0; r < mr; r++) a[p][r] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k += 32) {
            const uint8_t *g[4];
            __m512 s[4], m[4], s1[4];
            for (int p = 0; p < np; p++) {
                g[p] = panel + p * pb + (k / 32) * gb;
                if (mr > 6)
                    for (int64_t o = 0; o < gb; o += 64) _mm_prefetch((const char *)g[p] + FUSED_AHEAD + o, _MM_HINT_T0);
                s[p] = _mm512_setzero_ps(); m[p] = s[p]; s1[p] = s[p];
                scales512(type, g[p], &s[p], &m[p], &s1[p]);
            }
#pragma GCC unroll 4
            for (int j = 0; j < 32; j++)
                for (int p = 0; p < np; p++) {
                    const __m512 w = pos512(type, g[p], j, s[p], m[p], s1[p]);
                    for (int r = 0; r < mr; r++)
                        a[p][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k + j]), w, a[p][r]);
                }
        }
        for (int p = 0; p < np; p++)
            for (int r = 0; r < mr; r++) c[p][r] = k0 == 0 ? a[p][r] : _mm512_add_ps(c[p][r], a[p][r]);
    }
    for (int p = 0; p < np; p++) {
        const __mmask16 keep = (__mmask16)(p == np - 1 ? (1u << ncols) - 1 : 0xFFFF);
        for (int r = 0; r < mr; r++) {
            __m512 o = c[p][r];
            if (bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(keep, bias + p * 16));
            if (res) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(keep, res + r * ldr + p * 16));
            _mm512_mask_storeu_ps(y + r * ldy + p * 16, keep, o);
        }
    }
}

#define FUSED_TYPES(mr, np) \
    switch (type) { \
    case T_F16: fused512(T_F16, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    case T_BF16: fused512(T_BF16, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    case T_Q8_0: fused512(T_Q8_0, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    case T_Q4_0: fused512(T_Q4_0, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    case T_Q4_1: fused512(T_Q4_1, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    case T_Q5_0: fused512(T_Q5_0, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    case T_Q5_1: fused512(T_Q5_1, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    case T_Q4_K: fused512(T_Q4_K, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    case T_Q5_K: fused512(T_Q5_K, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    default: fused512(T_Q6_K, mr, np, x, ldx, panel, pb, K, kb, bias, res, ldr, y, ldy, ncols); break; \
    }

/* panels side by side for a row count: enough chains in flight (np x mr >= 4) */
static inline int fused_panels(int mr) { return mr == 1 ? 4 : mr <= 3 ? 2 : 1; }

A512 static void fused_tile512(int type, int mr, int np, const float *x, int64_t ldx, const uint8_t *panel, int64_t pb,
                               int64_t K, int64_t kb, const float *bias, const float *res, int64_t ldr, float *y,
                               int64_t ldy, int ncols)
{
    switch (mr * 8 + np) {
    case 1 * 8 + 4: FUSED_TYPES(1, 4) break;
    case 2 * 8 + 2: FUSED_TYPES(2, 2) break;
    case 3 * 8 + 2: FUSED_TYPES(3, 2) break;
    case 1 * 8 + 1: FUSED_TYPES(1, 1) break;
    case 2 * 8 + 1: FUSED_TYPES(2, 1) break;
    case 3 * 8 + 1: FUSED_TYPES(3, 1) break;
    case 4 * 8 + 1: FUSED_TYPES(4, 1) break;
    case 5 * 8 + 1: FUSED_TYPES(5, 1) break;
    case 6 * 8 + 1: FUSED_TYPES(6, 1) break;
    case 7 * 8 + 1: FUSED_TYPES(7, 1) break;
    case 8 * 8 + 1: FUSED_TYPES(8, 1) break;
    case 9 * 8 + 1: FUSED_TYPES(9, 1) break;
    case 10 * 8 + 1: FUSED_TYPES(10, 1) break;
    case 11 * 8 + 1: FUSED_TYPES(11, 1) break;
    default: FUSED_TYPES(12, 1) break;
    }
}

/* ---- AVX-512: calls of more than 6 rows (batched decode, prefill, scoring) -------------
 * Rows go in chunks of at most WIDE_MC, whose inputs stay in L2. Per chunk, per pair of panels
 * (32 outputs), per k-block of kb values (the blocks of the FMA chains), the pair's block is
 * decoded once into a per-thread buffer [kb][32] (each position of 16 rows by pos512, the fused
 * kernel's decode) and every row tile of up to 12 rows runs its chains over it. A block's chain
 * sums wait in a per-thread staging buffer between blocks (= block 0, then + block i, then
 * + bias, then + residual: the adds of fused512 in the same order, so the same bits); only
 * where the running sum waits changes. The staged rows are then written to y once. */
#define WIDE_MR 12
#define WIDE_MC 256   /* at most this many rows per chunk: their inputs (256 x K floats) stay in L2 */
#define WIDE_LDS 32   /* the row stride of a pair's staged outputs */

A512 static inline __attribute__((always_inline)) void decode_block512(const int type, const uint8_t *panel,
                                                                       int64_t k0, int64_t k1, float *out, int ld)
{
    const int64_t gb = probity_group_bytes(type);
    for (int64_t k = k0; k < k1; k += 32) {
        const uint8_t *g = panel + (k / 32) * gb;
        __m512 s = _mm512_setzero_ps(), m = s, s1 = s;
        scales512(type, g, &s, &m, &s1);
#pragma GCC unroll 4
        for (int j = 0; j < 32; j++) _mm512_store_ps(out + (k - k0 + j) * ld, pos512(type, g, j, s, m, s1));
    }
}

A512 static inline __attribute__((always_inline)) void wide_tile512(
    const int mr, const int two, const float *x, int64_t ldx, const float *w, int64_t kl, int first, int last,
    const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy, __mmask16 keep0, __mmask16 keep1,
    const char *pf0, const char *pf1, int64_t pf_lines)
{
    __m512 a0[WIDE_MR], a1[WIDE_MR];
    for (int r = 0; r < mr; r++) { a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps(); }
    /* the next block's stored bytes (pf0, pf1: pf_lines cache lines each), a line of each every
     * `every` steps of k: in a step the weights come from L3 or memory, and this thread's next
     * block would otherwise wait on them line by line (gate_up at 32 rows: 311 us with its
     * weights in L2, 367 us without) */
    const int64_t every = pf_lines && kl / pf_lines > 0 ? kl / pf_lines : 1;
    int64_t wait = 0, line = 0;
    for (int64_t k = 0; k < kl; k++) {
        if (pf_lines && wait-- == 0) {
            wait = every - 1;
            if (line < pf_lines) {
                _mm_prefetch(pf0 + line * 64, _MM_HINT_T1);
                _mm_prefetch(pf1 + line * 64, _MM_HINT_T1);
                line++;
            }
        }
        const __m512 w0 = _mm512_load_ps(w + k * 32);
        const __m512 w1 = two ? _mm512_load_ps(w + k * 32 + 16) : w0;
        for (int r = 0; r < mr; r++) {
            const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
            a0[r] = _mm512_fmadd_ps(b, w0, a0[r]);
            if (two) a1[r] = _mm512_fmadd_ps(b, w1, a1[r]);
        }
    }
    for (int r = 0; r < mr; r++) {
        for (int h = 0; h < 1 + two; h++) {
            const __mmask16 keep = h ? keep1 : keep0;
            float *yo = y + r * ldy + h * 16;
            __m512 o = h ? a1[r] : a0[r];
            if (!first) o = _mm512_add_ps(_mm512_maskz_loadu_ps(keep, yo), o);
            if (last && bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(keep, bias + h * 16));
            if (last && res) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(keep, res + r * ldr + h * 16));
            _mm512_mask_storeu_ps(yo, keep, o);
        }
    }
}

#define WIDE_ROWS(two, lines) \
    switch (mr) { \
    case 12: wide_tile512(12, two, xm, ldx, buf, k1 - k0, k0 == 0, k1 == K, bj, rm, ldr, ym, WIDE_LDS, keep0, keep1, pf0, pf1, lines); break; \
    case 11: wide_tile512(11, two, xm, ldx, buf, k1 - k0, k0 == 0, k1 == K, bj, rm, ldr, ym, WIDE_LDS, keep0, keep1, pf0, pf1, lines); break; \
    case 10: wide_tile512(10, two, xm, ldx, buf, k1 - k0, k0 == 0, k1 == K, bj, rm, ldr, ym, WIDE_LDS, keep0, keep1, pf0, pf1, lines); break; \
    case 9: wide_tile512(9, two, xm, ldx, buf, k1 - k0, k0 == 0, k1 == K, bj, rm, ldr, ym, WIDE_LDS, keep0, keep1, pf0, pf1, lines); break; \
    case 8: wide_tile512(8, two, xm, ldx, buf, k1 - k0, k0 == 0, k1 == K, bj, rm, ldr, ym, WIDE_LDS, keep0, keep1, pf0, pf1, lines); break; \
    case 7: wide_tile512(7, two, xm, ldx, buf, k1 - k0, k0 == 0, k1 == K, bj, rm, ldr, ym, WIDE_LDS, keep0, keep1, pf0, pf1, lines); break; \
    case 6: wide_tile512(6, two, xm, ldx, buf, k1 - k0, k0 == 0, k1 == K, bj, rm, ldr, ym, WIDE_LDS, keep0, keep1, pf0, pf1, lines); break; \
    case 5: wide_tile512(5, two, xm, ldx, buf, k1 - k0, k0 == 0, k1 == K, bj, rm, ldr, ym, WIDE_LDS, keep0, keep1, pf0, pf1, lines); break; \
    case 4: wide_tile512(4, two, xm, ldx, buf, k1 - k0, k0 == 0, k1 == K, bj, rm, ldr, ym, WIDE_LDS, keep0, keep1, pf0, pf1, lines); break; \
    case 3: wide_tile512(3, two, xm, ldx, buf, k1 - k0, k0 == 0, k1 == K, bj, rm, ldr, ym, WIDE_LDS, keep0, keep1, pf0, pf1, lines); break; \
    case 2: wide_tile512(2, two, xm, ldx, buf, k1 - k0, k0 == 0, k1 == K, bj, rm, ldr, ym, WIDE_LDS, keep0, keep1, pf0, pf1, lines); break; \
    default: wide_tile512(1, two, xm, ldx, buf, k1 - k0, k0 == 0, k1 == K, bj, rm, ldr, ym, WIDE_LDS, keep0, keep1, pf0, pf1, lines); break; \
    }

#define WIDE_DECODE(T) \
    case T: decode_block512(T, packed + j * pb, k0, k1, buf, 32); \
            if (two) decode_block512(T, packed + (j + 1) * pb, k0, k1, buf + 16, 32); break;

A512 static void wide512(int type, const float *x, int64_t ldx, int64_t M, const uint8_t *packed, int64_t N, int64_t K,
                         int64_t kb, const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy)
{
    const int64_t gb = probity_group_bytes(type), panels = (N + 15) / 16, pairs = (panels + 1) / 2, pb = K / 32 * gb;
    /* equal chunks of whole tiles: with collapse(2) static, each thread gets an equal share */
    const int64_t chunks = (M + WIDE_MC - 1) / WIDE_MC;
    const int64_t mc = ((M + chunks - 1) / chunks + WIDE_MR - 1) / WIDE_MR * WIDE_MR;
#pragma omp parallel
    {
        float *buf = aligned_alloc(64, kb * 32 * sizeof(float));
        /* a pair's outputs for the chunk's rows, staged contiguously between blocks: in y itself
         * rows N floats apart can all fall in one cache set (the head's 49152 floats = 3 x 64 KiB
         * put every row in the same L1 and L2 set) and evict one another between blocks */
        float *stage = aligned_alloc(64, mc * WIDE_LDS * sizeof(float));
        /* rows in chunks of at most WIDE_MC, whose inputs stay in L2 while every pair runs over
         * them (each pair's blocks decoded once per chunk) */
#pragma omp for collapse(2) schedule(static)
        for (int64_t c = 0; c < chunks; c++)
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t j = 2 * p, n0 = j * 16;
            const int two = j + 1 < panels;
            const int64_t left = N - n0;
            const __mmask16 keep0 = (__mmask16)(left >= 16 ? 0xFFFF : (1u << left) - 1);
            const __mmask16 keep1 = (__mmask16)(left >= 32 ? 0xFFFF : left <= 16 ? 0 : (1u << (left - 16)) - 1);
            const float *bj = bias ? bias + n0 : 0;
            const int64_t m1 = (c + 1) * mc < M ? (c + 1) * mc : M;   /* the chunk's rows: c * mc .. m1 */
            for (int64_t k0 = 0; k0 < K; k0 += kb) {
                const int64_t k1 = k0 + kb < K ? k0 + kb : K;
                switch (type) {
                WIDE_DECODE(T_F16) WIDE_DECODE(T_BF16) WIDE_DECODE(T_Q8_0) WIDE_DECODE(T_Q4_0)
                WIDE_DECODE(T_Q4_1) WIDE_DECODE(T_Q5_0) WIDE_DECODE(T_Q5_1) WIDE_DECODE(T_Q4_K)
                WIDE_DECODE(T_Q5_K) WIDE_DECODE(T_Q6_K) WIDE_DECODE(T_F32)
                default: break;
                }
                /* what this thread reads next: the pair's next block, or the next pair's first */
                const int64_t nk0 = k1 < K ? k1 : 0, nj = k1 < K ? j : j + 2;
                const int64_t nk1 = nk0 + kb < K ? nk0 + kb : K;
                const char *pf0 = (const char *)(packed + nj * pb + nk0 / 32 * gb);
                const char *pf1 = nj + 1 < panels ? pf0 + pb : pf0;
                int64_t pfn = nj < panels ? ((nk1 - nk0) / 32 * gb + 63) / 64 : 0;
                for (int64_t m0 = c * mc; m0 < m1; m0 += WIDE_MR, pfn = 0) {
                    const int mr = m1 - m0 >= WIDE_MR ? WIDE_MR : (int)(m1 - m0);
                    const float *xm = x + m0 * ldx + k0;
                    const float *rm = res ? res + m0 * ldr + n0 : 0;
                    float *ym = stage + (m0 - c * mc) * WIDE_LDS;
                    /* the tile that prefetches, and the others: their k loop without it (a
                     * constant 0 removes it; a run-time test cost prefill ~3%) */
                    if (pfn && two) { WIDE_ROWS(1, pfn) } else if (pfn) { WIDE_ROWS(0, pfn) }
                    else if (two) { WIDE_ROWS(1, 0) } else { WIDE_ROWS(0, 0) }
                }
            }
            for (int64_t m = c * mc; m < m1; m++) {
                const float *so = stage + (m - c * mc) * WIDE_LDS;
                _mm512_mask_storeu_ps(y + m * ldy + n0, keep0, _mm512_load_ps(so));
                if (two) _mm512_mask_storeu_ps(y + m * ldy + n0 + 16, keep1, _mm512_load_ps(so + 16));
            }
        }
        free(stage);
        free(buf);
    }
}

int probity_stored_wide(void) { return probity_cpu_avx512(); }

/* a float32 weight packed [ceil(N/16)][K][16] (kernels.pack; K a multiple of 32) through the wide
 * kernel: its panels are T_F32 groups of 32 positions x 16 outputs */
void probity_wide_f32(const float *x, int64_t ldx, int64_t M, const float *wp, int64_t N, int64_t K, int64_t kb,
                      const float *bias, const float *res, int64_t ldr, float *y, int64_t ldy)
{
    wide512(T_F32, x, ldx, M, (const uint8_t *)wp, N, K, kb, bias, res, ldr, y, ldy);
}


/* y = x W^T (+ b) (+ r) for x [M, K] and W stored as `type`: up to 12 rows fused (fused512),
 * more rows by wide512 — both AVX-512; without AVX-512 up to 6 rows fused (fused256), more each
 * panel expanded into a per-thread buffer and the float32 kernel's own tile run over it. Every
 * output is the same FMA chain as with the float32 weights. */
void probity_linear_stored(int type, const float *x, int64_t ldx, int64_t M, const uint8_t *packed, int64_t N,
                           int64_t K, int64_t kb, const float *bias, const float *res, int64_t ldr, float *y,
                           int64_t ldy)
{
    const int64_t panels = (N + 15) / 16, pb = K / 32 * probity_group_bytes(type);
    const int wide = probity_cpu_avx512();
    if (M <= (wide ? FUSED_MR : 6)) {   /* in registers: AVX-512 where it runs, else AVX2 */
        const int np = fused_panels((int)M);
        const int64_t groups = (panels + np - 1) / np;
#pragma omp parallel for schedule(static)
        for (int64_t gi = 0; gi < groups; gi++) {
            const int64_t j0 = gi * np, cnt = panels - j0 < np ? panels - j0 : np;
            /* a short last group runs its panels one at a time */
            for (int64_t j = j0; j < j0 + cnt; j += cnt == np ? np : 1) {
                const int64_t n0 = j * 16, last = j + (cnt == np ? np : 1) - 1;
                const int ncols = N - last * 16 < 16 ? (int)(N - last * 16) : 16;
                if (wide)
                    fused_tile512(type, (int)M, cnt == np ? np : 1, x, ldx, packed + j * pb, pb, K, kb,
                                  bias ? bias + n0 : 0, res ? res + n0 : 0, ldr, y + n0, ldy, ncols);
                else
                    fused_tile256(type, (int)M, cnt == np ? np : 1, x, ldx, packed + j * pb, pb, K, kb,
                                  bias ? bias + n0 : 0, res ? res + n0 : 0, ldr, y + n0, ldy, ncols);
            }
        }
        return;
    }
    if (wide) {
        wide512(type, x, ldx, M, packed, N, K, kb, bias, res, ldr, y, ldy);
        return;
    }
#pragma omp parallel
    {
        float *buf = aligned_alloc(64, K * 16 * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t j = 0; j < panels; j++) {
            if (j + 1 < panels)
                for (int64_t o = 0; o < pb; o += 64)
                    _mm_prefetch((const char *)(packed + (j + 1) * pb + o), _MM_HINT_T1);
            decode_panel(type, packed + j * pb, K, buf);
            const int64_t n0 = j * 16;
            const int ncols = N - n0 < 16 ? (int)(N - n0) : 16;
            for (int64_t m0 = 0, i = 0, mr; m0 < M; m0 += mr, i++) {
                mr = probity_tile_rows(M, i);
                probity_linear_tile((int)mr, x + m0 * ldx, ldx, buf, K, kb, bias ? bias + n0 : 0,
                                    res ? res + m0 * ldr + n0 : 0, ldr, y + m0 * ldy + n0, ldy, ncols);
            }
        }
        free(buf);
    }
}
