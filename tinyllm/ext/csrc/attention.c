/* Step 13 - a decode step's attention in one layer (decode_attention_f32, _f64), reading the
   keys and values where the cache holds them. */

#include "common.h"

/* ---- the vector bodies (AVX2, AVX-512 where the compiler targets it) ---- */

#ifdef AVX2
ROWS_F32(1)                  /* dot_f32_1, float_gemv's one-row loop: a key's score in its order */

/* four keys' scores for scores_f32 (below): q . k[r] (hd floats) -> s[r], each in dot_f32_1's
   order */
static void dot4_f32(const float *q, const float *k[4], float *s, int64_t hd) {
    vf a[4], b[4];
    for (int r = 0; r < 4; r++) a[r] = b[r] = vzero();
    int64_t d = 0;
    for (; d + 2 * VL <= hd; d += 2 * VL) {
        vf q0 = vload(q + d), q1 = vload(q + d + VL);
        for (int r = 0; r < 4; r++) {
            a[r] = vfma(q0, vload(k[r] + d), a[r]);
            b[r] = vfma(q1, vload(k[r] + d + VL), b[r]);
        }
    }
    if (d + VL <= hd) {
        vf q0 = vload(q + d);
        for (int r = 0; r < 4; r++) a[r] = vfma(q0, vload(k[r] + d), a[r]);
        d += VL;
    }
    for (int r = 0; r < 4; r++) s[r] = finish_f32(vsum(a[r], b[r]), q, k[r], d, hd);
}

/* e^x for 8 floats: x = n ln 2 + r, e^r by Cephes' polynomial for expf, 2^n in the exponent
   bits; 0 below -87.3 (and for -inf) */
static __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), one = _mm256_set1_ps(1.0f);
    __m256 gone = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, one));
    __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(gone, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}
#endif

/* ---- the portable loops ---- */

/* decode attention's three loops over a row's W keys, for one query head q and one KV head
   (its rows at[j] + off), in float32 (AVX2 where it applies) and float64 (plain C). Each key's
   score, weight and share of y is the same arithmetic wherever the key sits among the W, so a
   row's result does not depend on the batch. scores: s[j] = q . key * scale + mask[j]
   (dot_f32_1's order; four keys at a time), -inf where the mask hides the key -> the top */
static float scores_f32(const float *q, const float *kc, const int64_t *at, int64_t off,
                        const float *mask, int64_t W, int64_t hd, float scale, float *s) {
    int64_t j = 0;
#ifdef AVX2
    for (; j + 4 <= W; j += 4) {
        const float *k[4];
        for (int r = 0; r < 4; r++) k[r] = kc + (at[j + r] + off) * hd;
        dot4_f32(q, k, s + j, hd);
    }
    for (; j < W; j++) dot_f32_1(q, kc + (at[j] + off) * hd, s + j, hd, 1);
#else
    for (; j < W; j++) s[j] = finish_f32(0, q, kc + (at[j] + off) * hd, 0, hd);
#endif
    float top = -INFINITY;
    for (j = 0; j < W; j++) {
        s[j] = mask[j] == -INFINITY ? -INFINITY : s[j] * scale + mask[j];
        top = s[j] > top ? s[j] : top;
    }
    return top;
}

static double scores_f64(const double *q, const double *kc, const int64_t *at, int64_t off,
                         const double *mask, int64_t W, int64_t hd, double scale, double *s) {
    double top = -INFINITY;
    for (int64_t j = 0; j < W; j++) {
        const double *k = kc + (at[j] + off) * hd;
        double dot = 0;
        for (int64_t d = 0; d < hd; d++) dot += q[d] * k[d];
        s[j] = mask[j] == -INFINITY ? -INFINITY : dot * scale + mask[j];
        top = s[j] > top ? s[j] : top;
    }
    return top;
}

/* weights: s[j] = e^(s[j] - top), eight at a time (s has room for W rounded up to 8) -> their
   sum, in the order of j */
static float weights_f32(float *s, int64_t W, float top) {
    int64_t j = 0;
#ifdef AVX2
    for (int64_t pad = W; pad % 8; pad++) s[pad] = -INFINITY;
    for (; j < W; j += 8)
        _mm256_storeu_ps(s + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top))));
#else
    for (; j < W; j++) s[j] = expf(s[j] - top);
#endif
    float sum = 0;
    for (j = 0; j < W; j++) sum += s[j];
    return sum;
}

static double weights_f64(double *s, int64_t W, double top) {
    double sum = 0;
    for (int64_t j = 0; j < W; j++) sum += (s[j] = exp(s[j] - top));
    return sum;
}

/* values: y (hd) = sum over j of s[j] value j, the keys of weight 0 left out, each of y's
   values summed in the order of j; float32 with AVX2: 64 values of y at a time, held in
   registers, then the rest a key at a time (with the multiply-add fused, as the vectors') */
static void values_f32(const float *s, const float *vc, const int64_t *at, int64_t off,
                       int64_t W, int64_t hd, float *y) {
    int64_t d0 = 0;
#ifdef AVX2
    for (; d0 + 64 <= hd; d0 += 64) {
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t j = 0; j < W; j++) {
            if (s[j] == 0) continue;
            const float *v = vc + (at[j] + off) * hd + d0;
            __m256 p = _mm256_set1_ps(s[j]);
            for (int r = 0; r < 8; r++)
                acc[r] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * r), acc[r]);
        }
        for (int r = 0; r < 8; r++) _mm256_storeu_ps(y + d0 + 8 * r, acc[r]);
    }
#endif
    for (int64_t d = d0; d < hd; d++) y[d] = 0;
    for (int64_t j = 0; j < W && d0 < hd; j++) {
        if (s[j] == 0) continue;
        const float *v = vc + (at[j] + off) * hd;
        for (int64_t d = d0; d < hd; d++)
#ifdef AVX2
            y[d] = fmaf(s[j], v[d], y[d]);
#else
            y[d] += s[j] * v[d];
#endif
    }
}

static void values_f64(const double *s, const double *vc, const int64_t *at, int64_t off,
                       int64_t W, int64_t hd, double *y) {
    for (int64_t d = 0; d < hd; d++) y[d] = 0;
    for (int64_t j = 0; j < W; j++)
        if (s[j] != 0)
            for (int64_t d = 0; d < hd; d++) y[d] += s[j] * vc[(at[j] + off) * hd + d];
}

/* A decode step's attention in one layer, one new token a row, with the keys and values read
   where they lie in the cache kc, vc ((rows, hd)): for each row b and KV head h, the new key
   and value (k, v (B, n_kv, hd)) go to row write[b, h]; then each of h's g query heads
   (q (B, n_kv, g, hd)) attends to the W keys at rows read[b, j] + h * hs:
   y[b, h, i] = sum_j p_j vc[read[b, j] + h hs], p = softmax(q . kc[...] * scale + mask[b, j]),
   the keys whose mask is -inf left out: a row's keys end at its last visible one (a shorter
   context than the batch's longest, a prompt's early token), and none after it is read.
   Returns 0, or 1 (nothing written) where an index lies outside the cache's rows. */
#define DECODE_ATTENTION(NAME, T, S)                                                           \
int NAME(int64_t B, int64_t n_kv, int64_t g, int64_t hd, int64_t W, int64_t rows, int64_t hs, \
         const T *q, const T *k, const T *v, T *kc, T *vc, const int64_t *write,              \
         const int64_t *read, const T *mask, double scale, T *y, int threads) {               \
    for (int64_t i = 0; i < B * n_kv; i++)                                                    \
        if (write[i] < 0 || write[i] >= rows) return 1;                                       \
    for (int64_t i = 0; i < B * W; i++)                                                       \
        if (read[i] < 0 || read[i] + (n_kv - 1) * hs >= rows) return 1;                       \
    for (int64_t i = 0; i < B * n_kv; i++) {                   /* the new tokens, first */    \
        memcpy(kc + write[i] * hd, k + i * hd, hd * sizeof(T));                               \
        memcpy(vc + write[i] * hd, v + i * hd, hd * sizeof(T));                               \
    }                                                                                         \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")        \
    for (int64_t bh = 0; bh < B * n_kv; bh++) {                                               \
        int64_t b = bh / n_kv, off = bh % n_kv * hs, n = W;                                   \
        while (n > 1 && mask[b * W + n - 1] == -INFINITY) n--;   /* the keys it may see end */ \
        T *s = malloc((W + 8) * sizeof(T));                                                   \
        for (int64_t i = bh * g; i < (bh + 1) * g; i++) {                                     \
            T top = scores_##S(q + i * hd, kc, read + b * W, off, mask + b * W, n, hd,        \
                               (T)scale, s);                                                  \
            T sum = weights_##S(s, n, top);                                                   \
            values_##S(s, vc, read + b * W, off, n, hd, y + i * hd);                          \
            for (int64_t d = 0; d < hd; d++) y[i * hd + d] /= sum;                            \
        }                                                                                     \
        free(s);                                                                              \
    }                                                                                         \
    return 0;                                                                                 \
}
DECODE_ATTENTION(decode_attention_f32, float, f32)
DECODE_ATTENTION(decode_attention_f64, double, f64)
