/* Step 13 - the C kernels' shared part, for the files of csrc/ that cpu_kernels
   (tinyllm/ext/cpu_kernels.py, whose docstring describes each kernel) compiles once per machine
   with its flags (-march=native, -fopenmp where they work) and links with ops.cpp, the kernels'
   PyTorch operators. A file a family, as ggml-cpu lays out its sources: f32.c (float32
   products), int8.c (int8 a row, and 8 bits in groups: GGUF's Q8_0), int4.c (4-bit groups:
   GGUF's Q4), attention.c (a decode step's attention), layer.c (a decoder layer's decode step).
   Each loop is AVX2 (AVX-512's 16-float vectors for float32, VNNI for the integer products)
   where the compiler targets it, plain C that it vectorizes anywhere else. This header holds
   the includes, the feature macros and the helpers more than one family calls. Each file, this
   one too, lays its loops out as ggml-cpu does: the vector bodies first, under one #ifdef AVX2,
   then the portable loops and the kernels, which come after the vector bodies they call (an
   #ifdef left inside such a body picks its vector path). */
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define AVX2 1
#endif

/* ---- the vector bodies (AVX2, AVX-512 where the compiler targets it) ---- */

#ifdef AVX2
static inline float half_to_float(uint16_t h) {       /* IEEE float16 bits -> float */
    return _cvtsh_ss(h);
}

/* the sum of a vector's 8 floats */
static inline float hsum(__m256 s) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

/* The integer products' step: 32 unsigned bytes u times 32 signed bytes v, multiplied in
   place and summed by fours into 8 int32 lanes added to acc. VNNI does it in one instruction
   (dpbusd: AVX-512's VNNI on 256-bit vectors, or AVX-VNNI); AVX2 in two (maddubs multiplies
   and adds pairs into int16, exact here since |u| <= 128 and |v| <= 127 keep a pair within
   int16; madd by ones adds pairs of those into int32). The sums are exact on every path. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1
static inline __m256i dot32_add(__m256i acc, __m256i u, __m256i v) {
    return _mm256_dpbusd_epi32(acc, u, v);
}
#elif defined(__AVXVNNI__)
#define VNNI 1
static inline __m256i dot32_add(__m256i acc, __m256i u, __m256i v) {
    return _mm256_dpbusd_avx_epi32(acc, u, v);
}
#else
static inline __m256i dot32_add(__m256i acc, __m256i u, __m256i v) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, v),
                                                   _mm256_set1_epi16(1)));
}
#endif

/* the sum of a vector's 8 int32 lanes */
static inline int32_t hsum_i32(__m256i s) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    return _mm_cvtsi128_si32(h);
}

/* quantize_groups' work for one group of n values, n a multiple of 8, 8 at a time: the same
   step, the same quotients rounded the same way (ties to even), the same sum */
static inline int32_t quantize8(const float *x, int64_t n, float *step, int8_t *xq) {
    __m256 amax = _mm256_setzero_ps(), abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t i = 0; i < n; i += 8)
        amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(x + i), abs));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float a = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    *step = (a > 1e-30f ? a : 1e-30f) / 127.0f;
    __m256 s = _mm256_set1_ps(*step);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t i = 0; i < n; i += 8) {
        __m256i v = _mm256_cvtps_epi32(_mm256_round_ps(
            _mm256_div_ps(_mm256_loadu_ps(x + i), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        sum = _mm256_add_epi32(sum, v);
        __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i *)(xq + i), _mm_packs_epi16(w, w));
    }
    return hsum_i32(sum);
}

/* The float32 products' vectors: 16 floats where the compiler targets AVX-512 (its loads
   stream a weight faster on CPUs that have it), else 8. A build adds in one order for every
   float32 product, whatever the rows or the tile. */
#ifdef __AVX512F__
typedef __m512 vf;
#define VL 16
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
static inline float vsum(__m512 a, __m512 b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
#else
typedef __m256 vf;
#define VL 8
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float vsum(__m256 a, __m256 b) { return hsum(_mm256_add_ps(a, b)); }
#endif

/* y[r * ldy] = x's row r . w (K floats) for R rows of x, each weight vector loaded once for
   the R rows: two vectors of partial sums a row (alternate VL floats of K, so that two chains
   of multiply-adds overlap), then their sum, then K's last K % VL terms (finish_f32) */
#define ROWS_F32(R)                                                                         \
static void dot_f32_##R(const float *x, const float *w, float *y, int64_t K, int64_t ldy) { \
    vf a[R], b[R];                                                                          \
    for (int r = 0; r < R; r++) a[r] = b[r] = vzero();                                      \
    int64_t k = 0;                                                                          \
    for (; k + 2 * VL <= K; k += 2 * VL) {                                                  \
        vf w0 = vload(w + k), w1 = vload(w + k + VL);                                       \
        for (int r = 0; r < R; r++) {                                                       \
            a[r] = vfma(w0, vload(x + r * K + k), a[r]);                                    \
            b[r] = vfma(w1, vload(x + r * K + k + VL), b[r]);                               \
        }                                                                                   \
    }                                                                                       \
    if (k + VL <= K) {                                                                      \
        vf w0 = vload(w + k);                                                               \
        for (int r = 0; r < R; r++) a[r] = vfma(w0, vload(x + r * K + k), a[r]);            \
        k += VL;                                                                            \
    }                                                                                       \
    for (int r = 0; r < R; r++)                                                             \
        y[r * ldy] = finish_f32(vsum(a[r], b[r]), x + r * K, w, k, K);                      \
}
#endif

/* ---- the portable loops ---- */

#ifndef AVX2
static inline float half_to_float(uint16_t h) {       /* IEEE float16 bits -> float */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000 | (man << 13);                /* inf, nan */
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);          /* normal */
    else if (!man) bits = sign;                                              /* zero */
    else {                                                                   /* subnormal */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

/* the sum of 8 floats in one order, the order of a vector's sum (hsum): lanes i and i + 4,
   then those of 0 and 2, 1 and 3, then the two */
static inline float sum8(const float l[8]) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* the int8 step of x (n) float: its largest magnitude / 127, at least 1e-30; a value becomes
   x / step rounded to the nearest (ties to even), within -127 .. 127 */
static inline float int8_step(const float *x, int64_t n) {
    float amax = 0;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;                   /* a max the compiler keeps in line */
    }
    return (amax > 1e-30f ? amax : 1e-30f) / 127.0f;
}

/* x's MG groups of n values, each quantized to int8 by its own step sx (int8_step), into
   xq; xs (where not NULL): each group's rounded sum, times its step */
static inline void quantize_groups(const float *x, int64_t MG, int64_t n, int8_t *xq,
                                   float *sx, float *xs) {
    for (int64_t mg = 0; mg < MG; mg++) {
        const float *xg = x + mg * n;
        int32_t sum = 0;
#ifdef AVX2
        if (n % 8 == 0) {
            sum = quantize8(xg, n, sx + mg, xq + mg * n);
            if (xs) xs[mg] = sx[mg] * (float)sum;
            continue;
        }
#endif
        sx[mg] = int8_step(xg, n);
        for (int64_t j = 0; j < n; j++) {
            int32_t v = (int32_t)nearbyintf(xg[j] / sx[mg]);
            xq[mg * n + j] = (int8_t)v;
            sum += v;
        }
        if (xs) xs[mg] = sx[mg] * (float)sum;
    }
}

/* asks for n bytes at p to be brought into the cache, a cache line (64 bytes) at a time,
   without waiting for them */
static inline void prefetch_bytes(const void *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) __builtin_prefetch((const char *)p + i, 0, 3);
}

/* The integer products share a weight's rows among the threads, rows SHARE(N, t, T) ..
   SHARE(N, t + 1, T) to thread t of T, each share one call of a function that takes all it
   reads as arguments: a loop written inside the parallel region reads them through the
   region's shared variables, and ran a quarter slower. */
#define SHARE(N, t, T) ((N) * (t) / (T))

/* A grouped row's float part, in one order on every path. Each group brings its integer sum p
   (exact, however it was computed). The groups go 8 at a time, group g into lane g % 8:
   lane += (scale * sx) p and zero lane += zero * xs, fused multiply-adds (a vector's lanes on
   the vector paths); the groups past the last 8 go one by one into acc the same way. The row
   is acc + sum8(lanes + zero lanes). */

/* lanes (8) and zero lanes (8, or NULL) += a block's 8 sums p at its scales, zeros, steps and
   sums (each 8): the plain path's lanes */
static inline void lanes_add(float *lanes, float *zl, const int32_t *p,
                             const uint16_t *scale, const uint16_t *zero, const float *sx,
                             const float *xs) {
    for (int i = 0; i < 8; i++) {
        lanes[i] = fmaf(half_to_float(scale[i]) * sx[i], (float)p[i], lanes[i]);
        if (zl) zl[i] = fmaf(half_to_float(zero[i]), xs[i], zl[i]);
    }
}

/* acc + a group past the last 8: its sum p at its scale and step, and (zero not NULL) its
   zero point times x's sum */
static inline float group_add(float acc, int32_t p, uint16_t scale, float sx,
                              const uint16_t *zero, float xs) {
    acc = fmaf(half_to_float(scale) * sx, (float)p, acc);
    return zero ? fmaf(half_to_float(*zero), xs, acc) : acc;
}

/* float32: the terms k .. K of x . w added to s, one by one (the ones a vector loop leaves) */
static inline float finish_f32(float s, const float *x, const float *w, int64_t k, int64_t K) {
    for (; k < K; k++) s = fmaf(x[k], w[k], s);
    return s;
}

/* the kernels one family's file defines and another's calls (layer.c's decode step) */
void float_gemv(int64_t M, int64_t W, const int64_t *Ns, int64_t K, const float *x,
                const float **w, float *y, int threads);
void int8_gemv(int64_t M, int64_t W, const int64_t *Ns, int64_t K, const float *x,
               const int8_t **q, const uint16_t **scale, float *y, int threads);
void int4_gemv(int64_t M, int64_t W, const int64_t *Ns, int64_t G, int64_t h, const float *x,
               const uint8_t **q, const uint16_t **scale, const uint16_t **zero, float *y,
               int threads);
void int8g_gemv(int64_t M, int64_t W, const int64_t *Ns, int64_t G, int64_t g, const float *x,
                const int8_t **q, const uint16_t **scale, float *y, int threads);
int decode_attention_f32(int64_t B, int64_t n_kv, int64_t g, int64_t hd, int64_t W,
                         int64_t rows, int64_t hs, const float *q, const float *k,
                         const float *v, float *kc, float *vc, const int64_t *write,
                         const int64_t *read, const float *mask, double scale, float *y,
                         int threads);
int decode_attention_f64(int64_t B, int64_t n_kv, int64_t g, int64_t hd, int64_t W,
                         int64_t rows, int64_t hs, const double *q, const double *k,
                         const double *v, double *kc, double *vc, const int64_t *write,
                         const int64_t *read, const double *mask, double scale, double *y,
                         int threads);
