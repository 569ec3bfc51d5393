/* Step 13 - the C kernels, loaded by tinyllm/cpu_kernels.py (whose docstring describes each):
   matrix-vector products in float32, int8, int4 and 8-bit groups, a decode step's attention
   and a whole decoder layer's decode step. AVX2 loops (and AVX-512's 16-float vectors for
   float32) where the compiler targets them, plain C that it vectorizes anywhere else.
   cpu_kernels compiles this file once per machine with its flags (-march=native, -fopenmp
   where they work) and links it with ops.cpp, the kernels' PyTorch operators. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define AVX2 1
#endif

static float half_to_float(uint16_t h) {              /* IEEE float16 bits -> float */
#ifdef AVX2
    return _cvtsh_ss(h);
#else
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
#endif
}

#ifdef AVX2
/* the sum of a vector's 8 floats */
static inline float hsum(__m256 s) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}
#endif

#ifdef AVX2
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

/* 32 int8 weights at w . 32 int8 values at x, into acc's 8 lanes: the products take an
   unsigned side, so the weights' magnitudes meet x with the weights' signs (|w| * sign(w) x
   = w x; -128's magnitude is 128, whose byte reads as unsigned) */
static inline __m256i dot32_q8(__m256i acc, const int8_t *x, const int8_t *w) {
    __m256i wv = _mm256_loadu_si256((const __m256i *)w);
    return dot32_add(acc, _mm256_abs_epi8(wv),
                     _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), wv));
}

/* the sum of a vector's 8 int32 lanes */
static int32_t hsum_i32(__m256i s) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    return _mm_cvtsi128_si32(h);
}

/* the 8 lanes' sums of 8 vectors p[0..7], in one vector: lane i holds the sum of p[i] */
static __m256i sums8_i32(const __m256i p[8]) {
    __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
    __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
    __m256i h03 = _mm256_hadd_epi32(h01, h23), h47 = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(h03, h47, 0x20),   /* each half's */
                            _mm256_permute2x128_si256(h03, h47, 0x31));  /* sums, added */
}
#endif

#ifdef AVX2
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
#endif

/* x (K) int8 . w (K) int8, exact in int32 */
static int32_t dot_q8(const int8_t *x, const int8_t *w, int64_t K) {
    int64_t k = 0;
    int32_t acc = 0;
#ifdef AVX2
    acc = hsum_i32(dot_q8_lanes(x, w, K));
    k = K / 32 * 32;
#endif
    for (; k < K; k++) acc += (int32_t)x[k] * (int32_t)w[k];
    return acc;
}

/* the sum of 8 floats in one order, the order of a vector's sum (hsum): lanes i and i + 4,
   then those of 0 and 2, 1 and 3, then the two */
static float sum8(const float l[8]) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* the int8 step of x (n) float: its largest magnitude / 127, at least 1e-30; a value becomes
   x / step rounded to the nearest (ties to even), within -127 .. 127 */
static float int8_step(const float *x, int64_t n) {
    float amax = 0;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;                   /* a max the compiler keeps in line */
    }
    return (amax > 1e-30f ? amax : 1e-30f) / 127.0f;
}

#ifdef AVX2
/* quantize_groups' work for one group of n values, n a multiple of 8, 8 at a time: the same
   step, the same quotients rounded the same way (ties to even), the same sum */
static int32_t quantize8(const float *x, int64_t n, float *step, int8_t *xq) {
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
#endif

/* x's MG groups of n values, each quantized to int8 by its own step sx (int8_step), into
   xq; xs (where not NULL): each group's rounded sum, times its step */
static void quantize_groups(const float *x, int64_t MG, int64_t n, int8_t *xq, float *sx,
                            float *xs) {
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

/* float32: the terms k .. K of x . w added to s, one by one (the ones a vector loop leaves) */
static float finish_f32(float s, const float *x, const float *w, int64_t k, int64_t K) {
    for (; k < K; k++) s = fmaf(x[k], w[k], s);
    return s;
}

#ifdef AVX2
/* The float32 products' vectors: 16 floats where the compiler targets AVX-512 (its loads
   stream a weight faster on CPUs that have it), else 8. A build adds in one order for every
   float32 product, whatever the rows or the tile. */
#ifdef __AVX512F__
typedef __m512 vf;
#define VL 16
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
static float vsum(__m512 a, __m512 b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
#else
typedef __m256 vf;
#define VL 8
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
static float vsum(__m256 a, __m256 b) { return hsum(_mm256_add_ps(a, b)); }
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
ROWS_F32(1) ROWS_F32(2) ROWS_F32(4)
#endif

/* columns n0 .. n1 of y (rows ldy apart) for R rows of x (R = 4, 2 or 1) and a float32
   weight w (N, K) */
static void rows_f32(int R, const float *x, const float *w, float *y, int64_t n0, int64_t n1,
                     int64_t K, int64_t ldy) {
    for (int64_t n = n0; n < n1; n++) {
#ifdef AVX2
        if (R == 4) dot_f32_4(x, w + n * K, y + n, K, ldy);
        else if (R == 2) dot_f32_2(x, w + n * K, y + n, K, ldy);
        else dot_f32_1(x, w + n * K, y + n, K, ldy);
#else
        for (int r = 0; r < R; r++) y[r * ldy + n] = finish_f32(0, x + r * K, w + n * K, 0, K);
#endif
    }
}

/* asks for a weight row (K floats) to be brought into the cache, without waiting for it */
static void prefetch_row(const float *w, int64_t K) {
    for (int64_t k = 0; k < K; k += 16) __builtin_prefetch(w + k, 0, 2);
}

/* the same for n bytes at p, a cache line (64 bytes) at a time */
static void prefetch_bytes(const void *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) __builtin_prefetch((const char *)p + i, 0, 3);
}

/* y (M, N) = x (M, K) @ W^T for the W float32 weights w[w] (Ns[w], K) stacked (N = their Ns'
   sum). Every output is one row of x . one row of w, summed in one order whatever the tile
   (dot_f32_R's), one weight row at a time: a CPU streams one row fastest. With several rows
   of x, the weight is read a tile of rows at a time, about 64 KB, so that every 4 rows of x
   (then 2, 1) pass over it in the cache. While the first rows of x pass over a tile, each
   weight row computed asks for the same row of the next tile (a prefetch): the memory
   fetches the next tile while the multiply-adds run on this one, where otherwise the two
   would take turns */
void float_gemv(int64_t M, int64_t W, const int64_t *Ns, int64_t K, const float *x,
                const float **w, float *y, int threads) {
    int64_t N = 0;
    for (int64_t i = 0; i < W; i++) N += Ns[i];
    for (int64_t i = 0, first = 0; i < W; first += Ns[i++]) {
        const float *wi = w[i];
        int64_t Ni = Ns[i], tile = M > 1 ? 1 + 64 * 1024 / (4 * K) : (Ni + threads - 1) / threads;
        int R = M >= 4 ? 4 : 2;                      /* the rows of x that pass first */
        for (int64_t n = 0; M > 1 && n < tile && n < Ni; n++) prefetch_row(wi + n * K, K);
        #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t n0 = 0; n0 < Ni; n0 += tile) {
            int64_t n1 = n0 + tile < Ni ? n0 + tile : Ni, m = 0;
            if (M == 1) {
                rows_f32(1, x, wi, y + first, n0, n1, K, N);
                continue;
            }
            for (int64_t n = n0; n < n1; n++) {
                if (n + tile < Ni) prefetch_row(wi + (n + tile) * K, K);
                rows_f32(R, x, wi, y + first, n, n + 1, K, N);
            }
            float *ym = y + first;
            for (m = R; m + 4 <= M; m += 4) rows_f32(4, x + m * K, wi, ym + m * N, n0, n1, K, N);
            for (; m + 2 <= M; m += 2) rows_f32(2, x + m * K, wi, ym + m * N, n0, n1, K, N);
            for (; m < M; m++) rows_f32(1, x + m * K, wi, ym + m * N, n0, n1, K, N);
        }
    }
}

/* The integer products share a weight's rows among the threads, rows SHARE(N, t, T) ..
   SHARE(N, t + 1, T) to thread t of T, each share one call of a function that takes all it
   reads as arguments: a loop written inside the parallel region reads them through the
   region's shared variables, and ran a quarter slower. */
#define SHARE(N, t, T) ((N) * (t) / (T))

/* The int8 loops rows_q8 calls are compiled on their own, never inlined into it: inlined,
   GCC kept a loop's vectors on the stack, stored and loaded again every 32 weights, and the
   one-row loop ran at two thirds of its speed on weights in the cache */
#define ON_ITS_OWN __attribute__((noinline)) static

/* rows of x from which the int8 products of AVX2 without VNNI go by tiles (rows4_q8_tiles) */
#define TILE_ROWS 2

#ifdef AVX2
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
#endif

#if defined(AVX2) && !defined(VNNI)
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

/* the integer dot product of a group of 2h 4-bit values (h bytes: the low nibble of byte j is
   value j, the high one value j + h) with 2h int8 values */
static int32_t dot_q4(const uint8_t *q, const int8_t *x, int64_t h) {
    int32_t acc = 0;
    for (int64_t j = 0; j < h; j++) acc += (q[j] & 15) * (int32_t)x[j] + (q[j] >> 4) * (int32_t)x[h + j];
    return acc;
}

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
#endif

/* A grouped row's float part, in one order on every path. Each group brings its integer sum p
   (exact, however it was computed). The groups go 8 at a time, group g into lane g % 8:
   lane += (scale * sx) p and zero lane += zero * xs, fused multiply-adds (a vector's lanes on
   the vector paths); the groups past the last 8 go one by one into acc the same way. The row
   is acc + sum8(lanes + zero lanes). */

/* lanes (8) and zero lanes (8, or NULL) += a block's 8 sums p at its scales, zeros, steps and
   sums (each 8): the plain path's lanes */
static void lanes_add(float *lanes, float *zl, const int32_t *p, const uint16_t *scale,
                      const uint16_t *zero, const float *sx, const float *xs) {
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

#ifdef AVX2
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

#ifdef AVX2
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
/* decode attention's three loops over a row's W keys, for one query head q and one KV head
   (its rows at[j] + off), in float32 (AVX2 where it applies) and float64 (plain C). Each key's
   score, weight and share of y is the same arithmetic wherever the key sits among the W, so a
   row's result does not depend on the batch. scores: s[j] = q . key * scale + mask[j]
   (dot_f32_1's order; four keys at a time), -inf where the mask hides the key -> the top */
#ifdef AVX2
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
#endif

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

#ifdef AVX2
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
