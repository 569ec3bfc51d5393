/* Step 13 - a decoder layer's decode step in one call (decode_layer_f32, _f64 and _q): its
   norms, products (f32.c's, int8.c's, int4.c's or plain float64), RoPE and attention. */

#include "common.h"

/* ---- the portable loops (no vector bodies of its own: its products are f32.c's, int8.c's
   and int4.c's, its attention attention.c's) ---- */

/* y (M, N) = x (M, K) @ W^T in float64 for the W weights w[i] (Ns[i], K) stacked, in plain C:
   each output summed in the order of k (the float64 twin of float_gemv, for the oracle) */
static void double_gemv(int64_t M, int64_t W, const int64_t *Ns, int64_t K, const double *x,
                        const double **w, double *y, int threads) {
    int64_t N = 0;
    (void)threads;
    for (int64_t i = 0; i < W; i++) N += Ns[i];
    for (int64_t i = 0, first = 0; i < W; first += Ns[i++])
        for (int64_t n = 0; n < Ns[i]; n++)
            for (int64_t m = 0; m < M; m++) {
                double s = 0;
                for (int64_t k = 0; k < K; k++) s += x[m * K + k] * w[i][n * K + k];
                y[m * N + first + n] = s;
            }
}

/* A decoder layer's decode step, one new token a row, for M rows of the residual stream x
   (M, d), updated in place: the layer as the model computes it, each step one loop here.
     h = rms_norm(x) ln1;  q, k, v = h Wq^T, h Wk^T, h Wv^T (one product);  RoPE on q and k;
     y = decode_attention(q, k, v) in the cache;  x += y Wo^T;
     h = rms_norm(x) ln2;  g, u = h Wg^T, h Wu^T (one product);  x += (silu(g) u) Wd^T.
   ln1, ln2: the norms' weights (d); w: the products' Wq (H hd, d), Wk, Wv (n_kv hd, d), Wo
   (d, H hd), Wg, Wu (ff, d), Wd (d, ff), of type WT (float pointers, or QWeight's), each
   product by GEMV.
   cos, sin: (rope_rows, hd), a row for each row of x or one for all. The cache's arguments
   are decode_attention's. Returns 0, or (nothing written, x as it was) 1 where an index of
   the cache lies outside its rows, 2 where its scratch memory cannot be had. The norm and
   RoPE are LAYER_PARTS', one pair for each dtype. */
#define LAYER_PARTS(T, S, SQRT)                                                               \
static void rms_norm_##S(const T *x, const T *w, int64_t M, int64_t d, double eps, T *h) {    \
    for (int64_t m = 0; m < M; m++) {                                                         \
        const T *xm = x + m * d;                                                              \
        T ss = 0;                                                                             \
        for (int64_t i = 0; i < d; i++) ss += xm[i] * xm[i];                                  \
        T r = 1 / SQRT(ss / (T)d + (T)eps);                                                   \
        for (int64_t i = 0; i < d; i++) h[m * d + i] = w[i] * (xm[i] * r);                    \
    }                                                                                         \
}                                                                                             \
static void rope_##S(T *x, int64_t heads, int64_t hd, const T *c, const T *s) {               \
    int64_t h2 = hd / 2;                                                                      \
    for (int64_t j = 0; j < heads; j++, x += hd)                                              \
        for (int64_t i = 0; i < h2; i++) {                                                    \
            T a = x[i], b = x[i + h2];                                                        \
            x[i] = a * c[i] - b * s[i];                                                       \
            x[i + h2] = b * c[i + h2] + a * s[i + h2];                                        \
        }                                                                                     \
}
LAYER_PARTS(float, f32, sqrtf)
LAYER_PARTS(double, f64, sqrt)

#define DECODE_LAYER(NAME, T, S, WT, GEMV, EXP)                                              \
int NAME(int64_t M, int64_t d, int64_t H, int64_t n_kv, int64_t hd, int64_t ff, T *x,         \
         const T *ln1, const T *ln2, WT w, const T *cos, const T *sin, int64_t rope_rows,     \
         T *kc, T *vc, int64_t rows, int64_t hs, const int64_t *write, const int64_t *read,        \
         const T *mask, int64_t W, double eps, int threads) {                                 \
    int64_t nq = H * hd, nk = n_kv * hd, nqkv = nq + 2 * nk;                                  \
    T *h = malloc(M * (d + nqkv + nq + 2 * nk + nq + d + 3 * ff) * sizeof(T));                \
    if (h == NULL) return 2;                                                                  \
    T *qkv = h + M * d, *q = qkv + M * nqkv, *k = q + M * nq, *v = k + M * nk;                \
    T *y = v + M * nk, *o = y + M * nq, *gu = o + M * d, *act = gu + 2 * M * ff;              \
    int64_t Nqkv[3] = {nq, nk, nk}, Nd[1] = {d}, Ngu[2] = {ff, ff};                           \
    rms_norm_##S(x, ln1, M, d, eps, h);                                                       \
    GEMV(M, 3, Nqkv, d, h, w, qkv, threads);                                                  \
    for (int64_t m = 0; m < M; m++) {                                                         \
        const T *c = cos + (rope_rows > 1 ? m : 0) * hd, *s = sin + (rope_rows > 1 ? m : 0) * hd; \
        memcpy(q + m * nq, qkv + m * nqkv, nq * sizeof(T));                                   \
        memcpy(k + m * nk, qkv + m * nqkv + nq, nk * sizeof(T));                              \
        memcpy(v + m * nk, qkv + m * nqkv + nq + nk, nk * sizeof(T));                         \
        rope_##S(q + m * nq, H, hd, c, s);                                                    \
        rope_##S(k + m * nk, n_kv, hd, c, s);                                                 \
    }                                                                                         \
    if (decode_attention_##S(M, n_kv, H / n_kv, hd, W, rows, hs, q, k, v, kc, vc, write,      \
                             read, mask, pow((double)hd, -0.5), y, threads)) {                \
        free(h);                                                                              \
        return 1;                                                                             \
    }                                                                                         \
    GEMV(M, 1, Nd, nq, y, w + 3, o, threads);                                                 \
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];                                         \
    rms_norm_##S(x, ln2, M, d, eps, h);                                                       \
    GEMV(M, 2, Ngu, d, h, w + 4, gu, threads);                                                \
    for (int64_t m = 0; m < M; m++)                                                           \
        for (int64_t i = 0; i < ff; i++) {                                                    \
            T g = gu[m * 2 * ff + i];                                                         \
            act[m * ff + i] = g / (1 + EXP(-g)) * gu[m * 2 * ff + ff + i];                    \
        }                                                                                     \
    GEMV(M, 1, Nd, ff, act, w + 6, o, threads);                                               \
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];                                         \
    free(h);                                                                                  \
    return 0;                                                                                 \
}
DECODE_LAYER(decode_layer_f32, float, f32, const float **, float_gemv, expf)
DECODE_LAYER(decode_layer_f64, double, f64, const double **, double_gemv, exp)

/* A quantized weight as the integer products read it: q, with scale and zero (NULL where it
   has none) by group of `group` along K. zero: 4 bits in groups (int4_gemv); no zero and one
   group the row's width: int8 with a scale a row (int8_gemv); else 8 bits in groups
   (int8g_gemv). */
typedef struct {
    const void *q;
    const uint16_t *scale, *zero;
    int64_t group;
} QWeight;

/* y (M, N) = x (M, K) @ W^T for the W quantized weights w[i] (Ns[i], K) stacked, all of one
   kind (QWeight's), by that kind's product: the same call, and the same result bit for bit,
   as a QuantLinear's C product of the same weights */
static void quant_gemv(int64_t M, int64_t W, const int64_t *Ns, int64_t K, const float *x,
                       const QWeight *w, float *y, int threads) {
    const void *q[3];
    const uint16_t *scale[3], *zero[3];
    for (int64_t i = 0; i < W; i++) q[i] = w[i].q, scale[i] = w[i].scale, zero[i] = w[i].zero;
    int64_t g = w[0].group;
    if (w[0].zero != NULL)
        int4_gemv(M, W, Ns, K / g, g / 2, x, (const uint8_t **)q, scale, zero, y, threads);
    else if (g == K)
        int8_gemv(M, W, Ns, K, x, (const int8_t **)q, scale, y, threads);
    else
        int8g_gemv(M, W, Ns, K / g, g, x, (const int8_t **)q, scale, y, threads);
}
DECODE_LAYER(decode_layer_q, float, f32, const QWeight *, quant_gemv, expf)
