/* Step 13 - the int8 products: int8 weights with a scale a row (int8_gemv), and in groups
   with a scale a group, GGUF's Q8_0 (int8g_gemv); x quantized to int8, the sums in integers. */

#include "common.h"

/* ---- the vector bodies (AVX2, AVX-512 where the compiler targets it) ---- */

#ifdef AVX2
/* 32 int8 weights at w . 32 int8 values at x, into acc's 8 lanes: the products take an
   unsigned side, so the weights' magnitudes meet x with the weights' signs (|w| * sign(w) x
   = w x; -128's magnitude is 128, whose byte reads as unsigned) */
static inline __m256i dot32_q8(__m256i acc, const int8_t *x, const int8_t *w) {
    __m256i wv = _mm256_loadu_si256((const __m256i *)w);
    return dot32_add(acc, _mm256_abs_epi8(wv),
                     _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), wv));
}

/* the 8 lanes' sums of 8 vectors p[0..7], in one vector: lane i holds the sum of p[i] */
static __m256i sums8_i32(const __m256i p[8]) {
    __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
    __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
    __m256i h03 = _mm256_hadd_epi32(h01, h23), h47 = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(h03, h47, 0x20),   /* each half's */
                            _mm256_permute2x128_si256(h03, h47, 0x31));  /* sums, added */
}

/* x (K) int8 . w (K) int8 over their first K / 32 * 32 values, as 8 int32 partial sums */
static inline __m256i dot_q8_lanes(const int8_t *x, const int8_t *w, int64_t K) {
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        a0 = dot32_q8(a0, x + k, w + k);
        a1 = dot32_q8(a1, x + k + 32, w + k + 32);
    }
    if (k + 32 <= K) a0 = dot32_q8(a0, x + k, w + k);
    return _mm256_add_epi32(a0, a1);
}

/* dot_q8 (the portable loops' below) on the vector path: its first K / 32 * 32 terms by
   dot_q8_lanes, the rest one by one */
static int32_t dot_q8(const int8_t *x, const int8_t *w, int64_t K) {
    int64_t k = 0;
    int32_t acc = 0;
    acc = hsum_i32(dot_q8_lanes(x, w, K));
    k = K / 32 * 32;
    for (; k < K; k++) acc += (int32_t)x[k] * (int32_t)w[k];
    return acc;
}

/* The int8 loops rows_q8 calls are compiled on their own, never inlined into it: inlined,
   GCC kept a loop's vectors on the stack, stored and loaded again every 32 weights, and the
   one-row loop ran at two thirds of its speed on weights in the cache */
#define ON_ITS_OWN __attribute__((noinline)) static

/* 8 rows of the int8 weight q (K apart, K a multiple of 32) at their scales (8) . one row of
   x, xq (K) at step sx -> y (8): rows_q8's outputs, the 8 integer sums in one vector (the
   row's x loaded once for the 8) and scaled as rows_q8 scales one */
ON_ITS_OWN void rows8_q8(const int8_t *q, const uint16_t *scale, const int8_t *xq, float sx,
                         int64_t K, float *y, const int8_t *ahead) {
    __m256i p[8];
    for (int i = 0; i < 8; i++) {
        if (ahead) prefetch_bytes(ahead + i * K, K);
        p[i] = dot_q8_lanes(xq, q + i * K, K);
    }
    __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)scale));
    _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_cvtepi32_ps(sums8_i32(p)),
                                      _mm256_mul_ps(_mm256_set1_ps(sx), s)));
}

#ifndef VNNI
/* rows of x from which the int8 products of AVX2 without VNNI go by tiles (rows4_q8_tiles) */
#define TILE_ROWS 2

/* the sums of 4 vectors' 8 int32 lanes: lane i holds p[i]'s */
static inline __m128i sums4_i32(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* Several rows of x on AVX2 without VNNI: 4 weight rows q (K apart, K a multiple of 16),
   widened once to int16 (w16: 4 K), then for every 2 rows of x, 16 columns at a time, the 8
   products of a 2 x 4 tile by madd (pairs of int16 products summed into int32: exact, as
   |x|, |w| <= 127) in 8 accumulators; an odd last row by dot_q8. maddubs would need each
   pair's signs moved (sign, abs) for every row of x; here a weight is read and widened once
   for all of them. y (M rows, ldy apart) gets the 4 outputs of each row, scaled as rows_q8
   scales one. */
ON_ITS_OWN void rows4_q8_tiles(const int8_t *q, const uint16_t *scale, int64_t M, int64_t K,
                               const int8_t *xq, const float *sx, float *y, int64_t ldy,
                               int16_t *w16) {
    for (int i = 0; i < 4; i++)
        for (int64_t k = 0; k < K; k += 16)
            _mm256_storeu_si256((__m256i *)(w16 + i * K + k),
                                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + i * K + k))));
    __m128 s = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)scale));
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) {
        const int8_t *x0 = xq + m * K, *x1 = x0 + K;
        __m256i a[2][4];
        for (int r = 0; r < 2; r++)
            for (int i = 0; i < 4; i++) a[r][i] = _mm256_setzero_si256();
        for (int64_t k = 0; k < K; k += 16) {
            __m256i u0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x0 + k)));
            __m256i u1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x1 + k)));
            for (int i = 0; i < 4; i++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(w16 + i * K + k));
                a[0][i] = _mm256_add_epi32(a[0][i], _mm256_madd_epi16(u0, w));
                a[1][i] = _mm256_add_epi32(a[1][i], _mm256_madd_epi16(u1, w));
            }
        }
        for (int r = 0; r < 2; r++) {
            __m128i sum = sums4_i32(a[r][0], a[r][1], a[r][2], a[r][3]);
            _mm_storeu_ps(y + (m + r) * ldy, _mm_mul_ps(_mm_cvtepi32_ps(sum),
                                                        _mm_mul_ps(_mm_set1_ps(sx[m + r]), s)));
        }
    }
    for (int i = 0; m < M && i < 4; i++)               /* an odd last row, one dot each */
        y[m * ldy + i] = (float)dot_q8(xq + m * K, q + i * K, K)
                         * (sx[m] * half_to_float(scale[i]));
}
#endif

/* row_q8 for groups of 32 (GGUF's Q8_0 blocks): a 256-bit product a group */
static float row_q8_32(const int8_t *q, const uint16_t *scale, const int8_t *xq,
                       const float *sx, int64_t G) {
    __m256 a = _mm256_setzero_ps();
    float acc = 0;
    int64_t k = 0;
    for (; k + 8 <= G; k += 8) {
        __m256i p[8];
        for (int i = 0; i < 8; i++)
            p[i] = dot32_q8(_mm256_setzero_si256(), xq + (k + i) * 32, q + (k + i) * 32);
        __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + k))),
                                 _mm256_loadu_ps(sx + k));
        a = _mm256_fmadd_ps(f, _mm256_cvtepi32_ps(sums8_i32(p)), a);
    }
    for (; k < G; k++)
        acc = group_add(acc, hsum_i32(dot32_q8(_mm256_setzero_si256(), xq + k * 32, q + k * 32)),
                        scale[k], sx[k], NULL, 0);
    return acc + hsum(a);                                 /* hsum adds in sum8's order */
}
#endif

/* ---- the portable loops ---- */

#ifndef AVX2
/* x (K) int8 . w (K) int8, exact in int32 */
static int32_t dot_q8(const int8_t *x, const int8_t *w, int64_t K) {
    int64_t k = 0;
    int32_t acc = 0;
    for (; k < K; k++) acc += (int32_t)x[k] * (int32_t)w[k];
    return acc;
}
#endif

/* rows n0 .. n1 of y (M rows, ldy apart) for the int8 weight q (N, K), scale (N) and x's
   rows xq (M, K) int8 at steps sx (M), asking for the rows about 2 KB ahead as it goes (as
   int4_gemv does) */
static void rows_q8(int64_t n0, int64_t n1, int64_t M, int64_t K, const int8_t *q,
                    const uint16_t *scale, const int8_t *xq, const float *sx, float *y,
                    int64_t ldy) {
    int64_t ahead = 1 + 2048 / K, n = n0;
#if defined(AVX2) && !defined(VNNI)
    if (M >= TILE_ROWS && K % 16 == 0) {              /* several rows: 4 weight rows a pass */
        int16_t *w16 = malloc(4 * K * sizeof(int16_t));
        for (; n + 4 <= n1; n += 4) {
            if (n + 4 + ahead < n1) prefetch_bytes(q + (n + 4 + ahead) * K, 4 * K);
            rows4_q8_tiles(q + n * K, scale + n, M, K, xq, sx, y + n, ldy, w16);
        }
        free(w16);
    }
#endif
#ifdef AVX2
    for (; K % 32 == 0 && n + 8 <= n1; n += 8) {      /* 8 rows a pass, then one by one */
        for (int64_t m = 0; m < M; m++)
            rows8_q8(q + n * K, scale + n, xq + m * K, sx[m], K, y + m * ldy + n,
                     m == 0 && n + 8 + ahead < n1 ? q + (n + ahead) * K : NULL);
    }
#endif
    for (; n < n1; n++) {
        if (n + ahead < n1) prefetch_bytes(q + (n + ahead) * K, K);
        for (int64_t m = 0; m < M; m++)
            y[m * ldy + n] = (float)dot_q8(xq + m * K, q + n * K, K)
                             * (sx[m] * half_to_float(scale[n]));
    }
}

/* y (M, N) = x (M, K) @ W^T for the W weights W_w = q[w] (Ns[w], K) int8 times scale[w]
   (Ns[w]) float16 stacked (N = their Ns' sum: weights that read the same x, as q, k and v
   do), with each row of x quantized to int8 first, once for all:
   (xq[m] . q[n]) * (sx[m] * scale[n]) */
void int8_gemv(int64_t M, int64_t W, const int64_t *Ns, int64_t K, const float *x,
               const int8_t **q, const uint16_t **scale, float *y, int threads) {
    int8_t *xq = malloc(M * K);
    float *sx = malloc(M * sizeof(float));
    int64_t N = 0;
    for (int64_t w = 0; w < W; w++) N += Ns[w];
    quantize_groups(x, M, K, xq, sx, NULL);                    /* each row, one step */
    for (int64_t w = 0, first = 0; w < W; first += Ns[w++]) {
        #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int t = 0; t < threads; t++)
            rows_q8(SHARE(Ns[w], t, threads), SHARE(Ns[w], t + 1, threads), M, K, q[w],
                    scale[w], xq, sx, y + first, N);
    }
    free(xq);
    free(sx);
}

/* one output: row n of an 8-bit weight in G groups of g (q (G g) int8, scale (G) float16)
   . one row of x quantized by group (xq (G g) int8, sx (G)), in row_q4's order (no zero
   points); the plain path, for any g */
static float row_q8_plain(const int8_t *q, const uint16_t *scale, const int8_t *xq,
                          const float *sx, int64_t G, int64_t g) {
    float lanes[8] = {0}, acc = 0;
    int64_t k = 0;
    for (; k + 8 <= G; k += 8) {
        int32_t p[8];
        for (int i = 0; i < 8; i++) p[i] = dot_q8(xq + (k + i) * g, q + (k + i) * g, g);
        lanes_add(lanes, NULL, p, scale + k, NULL, sx + k, NULL);
    }
    for (; k < G; k++)
        acc = group_add(acc, dot_q8(xq + k * g, q + k * g, g), scale[k], sx[k], NULL, 0);
    return acc + sum8(lanes);
}

/* one output of an 8-bit grouped weight (row_q8_plain's), on the machine's vector path where
   it has one for this g */
static inline float row_q8(const int8_t *q, const uint16_t *scale, const int8_t *xq,
                           const float *sx, int64_t G, int64_t g) {
#ifdef AVX2
    if (g == 32) return row_q8_32(q, scale, xq, sx, G);
#endif
    return row_q8_plain(q, scale, xq, sx, G, g);
}

/* rows n0 .. n1 of y (M rows, ldy apart) for the 8-bit weight q (N, G g) in groups, scale
   (N, G), and x's rows xq (M, G g) int8 at steps sx (M, G), asking ahead as rows_q4 does */
static void rows_q8g(int64_t n0, int64_t n1, int64_t M, int64_t G, int64_t g, const int8_t *q,
                     const uint16_t *scale, const int8_t *xq, const float *sx, float *y,
                     int64_t ldy) {
    int64_t K = G * g, ahead = 1 + 2048 / K;
    for (int64_t n = n0; n < n1; n++) {
        if (n + ahead < n1) {
            prefetch_bytes(q + (n + ahead) * K, K);
            prefetch_bytes(scale + (n + ahead) * G, 2 * G);
        }
        for (int64_t m = 0; m < M; m++)
            y[m * ldy + n] = row_q8(q + n * K, scale + n * G, xq + m * K, sx + m * G, G, g);
    }
}

/* y (M, N) = x (M, K) @ W^T for the W weights W_w = q[w] (Ns[w], K = G g) int8 times
   scale[w] (Ns[w], G) float16 in groups of g (GGUF's Q8_0) stacked (N = their Ns' sum),
   x quantized to int8 by group, once for all: y[m, n] = sum over groups of
   scale[n, k] sx[m, k] (xq[m]'s group . the group's integers) */
void int8g_gemv(int64_t M, int64_t W, const int64_t *Ns, int64_t G, int64_t g, const float *x,
                const int8_t **q, const uint16_t **scale, float *y, int threads) {
    int64_t K = G * g, N = 0;
    for (int64_t w = 0; w < W; w++) N += Ns[w];
    int8_t *xq = malloc(M * K);
    float *sx = malloc(M * G * sizeof(float));
    quantize_groups(x, M * G, g, xq, sx, NULL);
    for (int64_t w = 0, first = 0; w < W; first += Ns[w++]) {
        #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int t = 0; t < threads; t++)
            rows_q8g(SHARE(Ns[w], t, threads), SHARE(Ns[w], t + 1, threads), M, G, g, q[w],
                     scale[w], xq, sx, y + first, N);
    }
    free(xq);
    free(sx);
}
