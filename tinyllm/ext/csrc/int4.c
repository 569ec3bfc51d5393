/* Step 13 - the 4-bit products (int4_gemv): GGUF's 4-bit groups with a scale and a zero point
   a group, x quantized to int8 by group, the nibbles multiplied as integers. */

#include "common.h"

/* ---- the vector bodies (AVX2, AVX-512 where the compiler targets it) ---- */

#ifdef AVX2
/* a group of 32 4-bit values (16 bytes at q: low nibbles, then high) . 32 int8 values at x,
   as 8 int32 partial sums: the 16 bytes loaded into both halves of a vector, the upper half
   shifted by a nibble, both masked to 4 bits */
static __m256i dot_group_q4(const uint8_t *q, const int8_t *x) {
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
    __m256i v = _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_set_epi64x(4, 4, 0, 0)),
                                 _mm256_set1_epi8(15));
    return dot32_add(_mm256_setzero_si256(), v, _mm256_loadu_si256((const __m256i *)x));
}

/* Groups of 32 (h = 16) go two at a time: 32 bytes of q hold groups A and B, whose low
   nibbles (one AND) are A's values 0..15 and B's 0..15, the high ones (a shift, an AND) their
   values 16..31. x's groups meet them in that order: each pair of a block of 8 groups laid out
   as A 0..15, B 0..15, A 16..31, B 16..31 (pair_groups, once per x). */
static void pair_groups(int8_t *xq, int64_t M, int64_t G) {
    int8_t t[64];
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G / 8 * 8; g += 2) {
            int8_t *a = xq + (m * G + g) * 32;
            memcpy(t, a, 16), memcpy(t + 16, a + 32, 16);
            memcpy(t + 32, a + 16, 16), memcpy(t + 48, a + 48, 16);
            memcpy(a, t, 64);
        }
}

/* two groups' products, A's in lanes 0..3 and B's in 4..7: their 32 bytes of q unpacked (lo:
   the low nibbles, hi: the high ones) . the 64 paired values at x (pair_groups'). maddubs's
   int16 pairs stay within 2 * 15 * 127, two of them added within int16. */
static inline __m256i dot_pair_q4(__m256i lo, __m256i hi, const int8_t *x) {
    __m256i xlo = _mm256_loadu_si256((const __m256i *)x);
    __m256i xhi = _mm256_loadu_si256((const __m256i *)(x + 32));
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    return dot32_add(dot32_add(_mm256_setzero_si256(), lo, xlo), hi, xhi);
#else
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo),
                                              _mm256_maddubs_epi16(hi, xhi)),
                             _mm256_set1_epi16(1));
#endif
}

/* 8 groups' sums (4 pairs, dot_pair_q4's), lane i group i */
static inline __m256i sums8_pairs(const __m256i p[4]) {
    __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    return _mm256_permutevar8x32_epi32(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* row_q4 for groups of 32 (h = 16) and R rows of x at once (R <= 4; xq's rows K apart, sx's
   and xs's G apart), x's blocks of 8 groups paired (pair_groups) -> out (R): a block's bytes
   unpacked once for the R rows, its products two groups a vector, its sums, scales and zeros
   a vector each. Each row's arithmetic is the same, in the same order, whatever R is. */
static inline __attribute__((always_inline)) void rows_q4_32(
    const uint8_t *q, const uint16_t *scale, const uint16_t *zero, const int8_t *xq,
    const float *sx, const float *xs, int64_t G, int64_t K, int R, float *out) {
    __m256 a[4], az[4];
    __m256i mask = _mm256_set1_epi8(15);
    for (int r = 0; r < R; r++) a[r] = az[r] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
        __m256i p[4][4];
        for (int i = 0; i < 4; i++) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(q + (g + 2 * i) * 16));
            __m256i lo = _mm256_and_si256(b, mask);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
            for (int r = 0; r < R; r++) p[r][i] = dot_pair_q4(lo, hi, xq + r * K + (g + 2 * i) * 32);
        }
        __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + g)));
        __m256 zc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(zero + g)));
        for (int r = 0; r < R; r++) {
            __m256 f = _mm256_mul_ps(sc, _mm256_loadu_ps(sx + r * G + g));
            a[r] = _mm256_fmadd_ps(f, _mm256_cvtepi32_ps(sums8_pairs(p[r])), a[r]);
            az[r] = _mm256_fmadd_ps(zc, _mm256_loadu_ps(xs + r * G + g), az[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float acc = 0;
        for (int64_t t = g; t < G; t++)
            acc = group_add(acc, hsum_i32(dot_group_q4(q + t * 16, xq + r * K + t * 32)),
                            scale[t], sx[r * G + t], zero + t, xs[r * G + t]);
        out[r] = acc + hsum(_mm256_add_ps(a[r], az[r]));   /* hsum adds in sum8's order */
    }
}
#endif

/* ---- the portable loops ---- */

/* the integer dot product of a group of 2h 4-bit values (h bytes: the low nibble of byte j is
   value j, the high one value j + h) with 2h int8 values */
static int32_t dot_q4(const uint8_t *q, const int8_t *x, int64_t h) {
    int32_t acc = 0;
    for (int64_t j = 0; j < h; j++) acc += (q[j] & 15) * (int32_t)x[j] + (q[j] >> 4) * (int32_t)x[h + j];
    return acc;
}

/* one output: row n of a 4-bit weight (G groups, h bytes each; scale and zero (G)) . one row
   of x quantized by group (xq, sx (G)), plus the zero points times its groups' sums xs (G,
   of the rounded values); the plain path, for any h */
static float row_q4_plain(const uint8_t *q, const uint16_t *scale, const uint16_t *zero,
                          const int8_t *xq, const float *sx, const float *xs, int64_t G,
                          int64_t h) {
    float lanes[8] = {0}, zl[8] = {0}, acc = 0;
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
        int32_t p[8];
        for (int i = 0; i < 8; i++) p[i] = dot_q4(q + (g + i) * h, xq + (g + i) * 2 * h, h);
        lanes_add(lanes, zl, p, scale + g, zero + g, sx + g, xs + g);
    }
    for (; g < G; g++)
        acc = group_add(acc, dot_q4(q + g * h, xq + g * 2 * h, h), scale[g], sx[g], zero + g,
                        xs[g]);
    for (int i = 0; i < 8; i++) lanes[i] += zl[i];
    return acc + sum8(lanes);
}

/* one output of a 4-bit weight (row_q4_plain's), on the machine's vector path where it has
   one for this h */
static inline float row_q4(const uint8_t *q, const uint16_t *scale, const uint16_t *zero,
                           const int8_t *xq, const float *sx, const float *xs, int64_t G,
                           int64_t h) {
#ifdef AVX2
    if (h == 16) {
        float y;
        rows_q4_32(q, scale, zero, xq, sx, xs, G, 0, 1, &y);
        return y;
    }
#endif
    return row_q4_plain(q, scale, zero, xq, sx, xs, G, h);
}

/* rows n0 .. n1 of y (M rows, ldy apart) for the 4-bit weight q (N, G, h), scale and zero
   (N, G) and x's rows xq (M, G 2h) int8 at steps sx (M, G) with sums xs (M, G), asking for
   each weight row about 2 KB ahead, with its scales and zeros: asked for now, multiplied
   later */
static void rows_q4(int64_t n0, int64_t n1, int64_t M, int64_t G, int64_t h, const uint8_t *q,
                    const uint16_t *scale, const uint16_t *zero, const int8_t *xq,
                    const float *sx, const float *xs, float *y, int64_t ldy) {
    int64_t ahead = 1 + 2048 / (G * h), K = G * 2 * h;
    for (int64_t n = n0; n < n1; n++) {
        if (n + ahead < n1) {
            prefetch_bytes(q + (n + ahead) * G * h, G * h);
            prefetch_bytes(scale + (n + ahead) * G, 2 * G);
            prefetch_bytes(zero + (n + ahead) * G, 2 * G);
        }
        int64_t m = 0;
#ifdef AVX2
        float out[4];
        for (; h == 16 && m + 4 <= M; m += 4) {          /* 4 rows of x a pass, then 1 */
            rows_q4_32(q + n * G * h, scale + n * G, zero + n * G, xq + m * K, sx + m * G,
                       xs + m * G, G, K, 4, out);
            for (int r = 0; r < 4; r++) y[(m + r) * ldy + n] = out[r];
        }
#endif
        for (; m < M; m++)
            y[m * ldy + n] = row_q4(q + n * G * h, scale + n * G, zero + n * G, xq + m * K,
                                    sx + m * G, xs + m * G, G, h);
    }
}

/* y (M, N) = x (M, K) @ W^T for the W weights W_w (Ns[w], K = G * 2h) in 4 bits (q[w]
   (Ns[w], G, h)) with float16 scale[w] and zero[w] (Ns[w], G) stacked (N = their Ns' sum),
   x quantized to int8 by group, once for all: y[m, n] = sum over groups g of
   scale[n, g] sx[m, g] (xq[m]'s group . the group's values) + zero[n, g] sx[m, g] (the sum
   of xq[m]'s group) */
void int4_gemv(int64_t M, int64_t W, const int64_t *Ns, int64_t G, int64_t h, const float *x,
               const uint8_t **q, const uint16_t **scale, const uint16_t **zero, float *y,
               int threads) {
    int64_t K = G * 2 * h, N = 0;
    for (int64_t w = 0; w < W; w++) N += Ns[w];
    int8_t *xq = malloc(M * K);
    float *sx = malloc(M * G * sizeof(float)), *xs = malloc(M * G * sizeof(float));
    quantize_groups(x, M * G, 2 * h, xq, sx, xs);
#ifdef AVX2
    if (h == 16) pair_groups(xq, M, G);                         /* rows_q4_32's order */
#endif
    for (int64_t w = 0, first = 0; w < W; first += Ns[w++]) {
        #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int t = 0; t < threads; t++)
            rows_q4(SHARE(Ns[w], t, threads), SHARE(Ns[w], t + 1, threads), M, G, h, q[w],
                    scale[w], zero[w], xq, sx, xs, y + first, N);
    }
    free(xq);
    free(sx);
    free(xs);
}
