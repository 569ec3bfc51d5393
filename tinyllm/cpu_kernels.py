"""Step 13 - matrix-vector kernels in C, for a decode step on a CPU.

A decode step at batch 1 reads each weight once and does two operations with it, so its time
is the weights' bytes over the memory's speed, if the loop keeps up. PyTorch's own int8
products (`torch._int_mm`, the weight-only `_weight_int8pack_mm`, fbgemm's dynamic linear) and
the loops torch.compile writes reach about 8 GB/s on one thread of a CPU that streams 16-22:
one accumulator a row, each addition waiting for the one before. The math library's float32
product of a few rows reads its weights at 6-10 GB/s there. llama.cpp keeps up with
hand-written loops, and so do these, in C with AVX2 (the float32 ones with AVX-512's 16-float
vectors where the compiler targets it: their loads stream a weight about a tenth faster) and
in plain C, which the compiler vectorizes, anywhere else. The quantized ones quantize the
activations too and multiply integers, as llama.cpp's products do:

- `float_gemv`: y = x @ W^T in float32, one weight row at a time (a CPU streams one row
  fastest), each weight vector multiplied with up to 4 rows of x; with several rows the
  weight passes through the cache a tile at a time, so it comes from memory once, and the
  next tile is asked for (prefetched) while this one is multiplied.
- `int8_gemv`: y[m, n] = (xq[m] . q[n]) * (sx[m] * scale[n]), each row of x quantized to int8
  by its largest magnitude (quant.int8_matmul's product): 16 weights widened to int16 and
  multiplied in pairs into int32 (`_mm256_madd_epi16`), two accumulators. The integer sum is
  exact, so the result is torch._int_mm's, bit for bit, for any number of rows.
- `int4_gemv`: each group of x rounded to int8 steps (quant.rounded_activations), then
  y[m, n] = sum over groups g of scale[n, g] sx[m, g] (xq's group . the group's 4-bit values)
  + zero[n, g] sx[m, g] (the sum of xq's group): the nibbles of GGUF's layout (quant.py) and
  the int8 activations multiplied as integers (`_mm256_maddubs_epi16`), the float16 scales and
  zeros of 8 groups converted at once.
- `int8g_gemv`: the same for 8-bit weights in groups (GGUF's Q8_0), without zero points.
  The three integer products ask for the weight rows about 2 KB ahead (a prefetch) as they
  go: their arithmetic per byte is heavier than float32's, and without it the loop and the
  memory take turns. On one core of an Intel Xeon with AVX-512, SmolLM2's int4 layers at one
  row went from 15.6 to 9 ms a step that way.
- `decode_attention`: a decode step's attention in one layer, read where the cache holds the
  keys and values (a slot's rows, a paged pool's blocks: the cache's `decode_layout`), as
  vLLM's paged attention reads them, with no gather: the new key and value written, then for
  each query head the scores four keys at a time, their exponentials eight at a time, and the
  weighted values with the output in registers. One call a layer replaces the update's writes
  and gathers and scaled_dot_product_attention: at batch 1 and a short context, about 20
  microseconds a layer against 60; float64 too, in plain C, so the float64 oracle tests run it.
- `decode_layer`: a whole decoder layer's decode step in one call (fused_layer.py): the norms,
  the q, k and v product, RoPE, decode_attention, the output product, the SwiGLU MLP and the
  residuals, with float_gemv's loops (float32) or plain C's (float64), so a step of SmolLM2
  makes 30 calls instead of about 300.

Each product takes a list of weights that read the same x (q, k and v; gate and up:
quant.projections), their outputs side by side: x is read (and quantized) once, and the
call's cost is paid once. Each output is one loop over one row, the same loop for any batch,
list or thread count, so every row's result depends on that row alone. The C source is
compiled once per machine at first use (`library()`, into the cache directory), with a few
lines of C++ (BINDINGS) that make each kernel a PyTorch operator (`torch.ops.tinyllm.int8_gemv`
and the rest), compiled against torch's own headers by the C++ compiler torch.compile also
needs. An operator is what a compiled piece calls like any of torch's, and a call costs about
6 microseconds beyond its arithmetic; the same operator written in Python around a ctypes call
cost about 18, 121 times a step of SmolLM2. Where nothing compiles, `library()` is None and
quant.py uses PyTorch's products.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from functools import cache

import torch
from torch import Tensor

from tinyllm.config import cache_dir

SOURCE = r"""
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
static float hsum(__m256 s) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}
#endif

#ifdef AVX2
/* 16 int8 values as int16 at x . 16 int8 values at w: widened to int16 and multiplied in pairs
   into 8 int32 partial sums, exact */
static __m256i dot16_q8(const int16_t *x, const int8_t *w) {
    return _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w)),
                             _mm256_loadu_si256((const __m256i *)x));
}
#endif

/* x (K) int8 values as int16 . w (K) int8, exact in int32 */
static int32_t dot_q8(const int16_t *x, const int8_t *w, int64_t K) {
    int64_t k = 0;
    int32_t acc = 0;
#ifdef AVX2
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_add_epi32(a0, dot16_q8(x + k, w + k));
        a1 = _mm256_add_epi32(a1, dot16_q8(x + k + 16, w + k + 16));
    }
    __m256i s = _mm256_add_epi32(a0, a1);
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    acc = _mm_cvtsi128_si32(h);
#endif
    for (; k < K; k++) acc += (int32_t)x[k] * (int32_t)w[k];
    return acc;
}

/* the int8 step of x (n) float: its largest magnitude / 127, at least 1e-30; a value becomes
   x / step rounded to the nearest (ties to even), within -127 .. 127 */
static float int8_step(const float *x, int64_t n) {
    float amax = 0;
    for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    return fmaxf(amax, 1e-30f) / 127.0f;
}

/* x's MG groups of n values, each quantized to int8 by its own step sx (int8_step), into
   xq (int8) or xq16 (the same values as int16, where not NULL); xs (where not NULL): each
   group's rounded sum, times its step */
static void quantize_groups(const float *x, int64_t MG, int64_t n, int8_t *xq, int16_t *xq16,
                            float *sx, float *xs) {
    for (int64_t mg = 0; mg < MG; mg++) {
        const float *xg = x + mg * n;
        int32_t sum = 0;
        sx[mg] = int8_step(xg, n);
        for (int64_t j = 0; j < n; j++) {
            int32_t v = (int32_t)nearbyintf(xg[j] / sx[mg]);
            if (xq) xq[mg * n + j] = (int8_t)v;
            if (xq16) xq16[mg * n + j] = (int16_t)v;
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

/* y (M, N) = x (M, K) @ W^T for the W weights W_w = q[w] (Ns[w], K) int8 times scale[w]
   (Ns[w]) float16 stacked (N = their Ns' sum: weights that read the same x, as q, k and v
   do), with each row of x quantized to int8 first, once for all:
   (xq[m] . q[n]) * (sx[m] * scale[n]) */
void int8_gemv(int64_t M, int64_t W, const int64_t *Ns, int64_t K, const float *x,
               const int8_t **q, const uint16_t **scale, float *y, int threads) {
    int16_t *xq = malloc(M * K * sizeof(int16_t));
    float *sx = malloc(M * sizeof(float));
    int64_t N = 0;
    for (int64_t w = 0; w < W; w++) N += Ns[w];
    quantize_groups(x, M, K, NULL, xq, sx, NULL);              /* each row, one step */
    int64_t ahead = 1 + 2048 / K;                      /* rows ahead, as in int4_gemv */
    for (int64_t w = 0, first = 0; w < W; first += Ns[w++]) {
        const int8_t *qw = q[w];
        const uint16_t *sw = scale[w];
        #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t n = 0; n < Ns[w]; n++) {
            if (n + ahead < Ns[w]) prefetch_bytes(qw + (n + ahead) * K, K);
            for (int64_t m = 0; m < M; m++)
                y[m * N + first + n] = (float)dot_q8(xq + m * K, qw + n * K, K)
                                       * (sx[m] * half_to_float(sw[n]));
        }
    }
    free(xq);
    free(sx);
}

/* the integer dot product of a group of 2h 4-bit values (h bytes: the low nibble of byte j is
   value j, the high one value j + h) with 2h int8 values */
static int32_t dot_q4(const uint8_t *q, const int8_t *x, int64_t h) {
    int64_t j = 0;
    int32_t acc = 0;
#ifdef AVX2
    const __m128i low = _mm_set1_epi8(15);
    if (h % 16 == 0) {
        __m256i a = _mm256_setzero_si256();
        for (; j < h; j += 16) {
            __m128i b = _mm_loadu_si128((const __m128i *)(q + j));
            __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low),
                                         _mm_and_si128(b, low));
            __m256i xv = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(x + h + j)),
                                          _mm_loadu_si128((const __m128i *)(x + j)));
            a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(v, xv),
                                                      _mm256_set1_epi16(1)));
        }
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
        return _mm_cvtsi128_si32(s);
    }
    if (h == 8) {
        __m128i b = _mm_loadl_epi64((const __m128i *)q);
        __m128i v = _mm_unpacklo_epi64(_mm_and_si128(b, low),
                                       _mm_and_si128(_mm_srli_epi16(b, 4), low));
        __m128i s = _mm_madd_epi16(_mm_maddubs_epi16(v, _mm_loadu_si128((const __m128i *)x)),
                                   _mm_set1_epi16(1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
        return _mm_cvtsi128_si32(s);
    }
#endif
    for (; j < h; j++) acc += (q[j] & 15) * (int32_t)x[j] + (q[j] >> 4) * (int32_t)x[h + j];
    return acc;
}

#ifdef AVX2
/* a group of 32 4-bit values (16 bytes at q: low nibbles, then high) . 32 int8 values at x,
   as 8 int32 partial sums */
static __m256i dot_group_q4(const uint8_t *q, const int8_t *x) {
    __m128i b = _mm_loadu_si128((const __m128i *)q), low = _mm_set1_epi8(15);
    __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(v, _mm256_loadu_si256((const __m256i *)x)),
                             _mm256_set1_epi16(1));
}
#endif

/* one output: row n of a 4-bit weight (G groups, h bytes each; scale and zero (G)) . one row
   of x quantized by group (xq, sx (G)), plus the zero points times its groups' sums xs (G,
   of the rounded values) */
static float row_q4(const uint8_t *q, const uint16_t *scale, const uint16_t *zero,
                    const int8_t *xq, const float *sx, const float *xs, int64_t G, int64_t h) {
    float acc = 0;
    int64_t g = 0;
#ifdef AVX2
    if (h == 16) {                      /* groups of 32, one 256-bit product each */
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), az = _mm256_setzero_ps();
        for (; g + 8 <= G; g += 8) {    /* 8 groups: their scales and zeros in one vector */
            float f[8];                                          /* scale * sx, a group each */
            __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + g)));
            __m256 z8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(zero + g)));
            _mm256_storeu_ps(f, _mm256_mul_ps(s8, _mm256_loadu_ps(sx + g)));
            az = _mm256_fmadd_ps(z8, _mm256_loadu_ps(xs + g), az);
            for (int i = 0; i < 8; i += 2) {
                __m256i p0 = dot_group_q4(q + (g + i) * 16, xq + (g + i) * 32);
                __m256i p1 = dot_group_q4(q + (g + i + 1) * 16, xq + (g + i + 1) * 32);
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(f[i]), _mm256_cvtepi32_ps(p0), a0);
                a1 = _mm256_fmadd_ps(_mm256_set1_ps(f[i + 1]), _mm256_cvtepi32_ps(p1), a1);
            }
        }
        for (; g < G; g++) {                                     /* the last groups, one by one */
            __m256i p = dot_group_q4(q + g * 16, xq + g * 32);
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(scale[g]) * sx[g]),
                                 _mm256_cvtepi32_ps(p), a0);
            acc += half_to_float(zero[g]) * xs[g];
        }
        return acc + hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), az));
    }
#endif
    for (; g < G; g++)
        acc += half_to_float(scale[g]) * sx[g] * (float)dot_q4(q + g * h, xq + g * 2 * h, h)
             + half_to_float(zero[g]) * xs[g];
    return acc;
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
    quantize_groups(x, M * G, 2 * h, xq, NULL, sx, xs);
    int64_t ahead = 1 + 2048 / (G * h);          /* rows ahead: about 2 KB of nibbles */
    for (int64_t w = 0, first = 0; w < W; first += Ns[w++]) {
        const uint8_t *qw = q[w];
        const uint16_t *sw = scale[w], *zw = zero[w];
        #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t n = 0; n < Ns[w]; n++) {
            if (n + ahead < Ns[w]) {                  /* asked for now, multiplied later */
                prefetch_bytes(qw + (n + ahead) * G * h, G * h);
                prefetch_bytes(sw + (n + ahead) * G, 2 * G);
                prefetch_bytes(zw + (n + ahead) * G, 2 * G);
            }
            for (int64_t m = 0; m < M; m++)
                y[m * N + first + n] = row_q4(qw + n * G * h, sw + n * G, zw + n * G,
                                              xq + m * K, sx + m * G, xs + m * G, G, h);
        }
    }
    free(xq);
    free(sx);
    free(xs);
}

/* one output: row n of an 8-bit weight in G groups of g (q (G g) int8, scale (G) float16)
   . one row of x quantized by group (xq (G g) int8 values as int16, sx (G)) */
static float row_q8(const int8_t *q, const uint16_t *scale, const int16_t *xq,
                    const float *sx, int64_t G, int64_t g) {
    float acc = 0;
    int64_t k = 0;
#ifdef AVX2
    if (g == 32) {                      /* groups of 32 (GGUF's Q8_0 blocks) */
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (; k < G; k++) {
            const int8_t *qk = q + k * 32;
            const int16_t *xk = xq + k * 32;
            __m256i p = _mm256_add_epi32(dot16_q8(xk, qk), dot16_q8(xk + 16, qk + 16));
            __m256 f = _mm256_set1_ps(half_to_float(scale[k]) * sx[k]);
            if (k & 1) a1 = _mm256_fmadd_ps(f, _mm256_cvtepi32_ps(p), a1);
            else a0 = _mm256_fmadd_ps(f, _mm256_cvtepi32_ps(p), a0);
        }
        return hsum(_mm256_add_ps(a0, a1));
    }
#endif
    for (; k < G; k++)
        acc += half_to_float(scale[k]) * sx[k] * (float)dot_q8(xq + k * g, q + k * g, g);
    return acc;
}

/* y (M, N) = x (M, K) @ W^T for the W weights W_w = q[w] (Ns[w], K = G g) int8 times
   scale[w] (Ns[w], G) float16 in groups of g (GGUF's Q8_0) stacked (N = their Ns' sum),
   x quantized to int8 by group, once for all: y[m, n] = sum over groups of
   scale[n, k] sx[m, k] (xq[m]'s group . the group's integers) */
void int8g_gemv(int64_t M, int64_t W, const int64_t *Ns, int64_t G, int64_t g, const float *x,
                const int8_t **q, const uint16_t **scale, float *y, int threads) {
    int64_t K = G * g, N = 0;
    for (int64_t w = 0; w < W; w++) N += Ns[w];
    int16_t *xq = malloc(M * K * sizeof(int16_t));
    float *sx = malloc(M * G * sizeof(float));
    quantize_groups(x, M * G, g, NULL, xq, sx, NULL);
    int64_t ahead = 1 + 2048 / K;
    for (int64_t w = 0, first = 0; w < W; first += Ns[w++]) {
        const int8_t *qw = q[w];
        const uint16_t *sw = scale[w];
        #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t n = 0; n < Ns[w]; n++) {
            if (n + ahead < Ns[w]) {                  /* as in int4_gemv */
                prefetch_bytes(qw + (n + ahead) * K, K);
                prefetch_bytes(sw + (n + ahead) * G, 2 * G);
            }
            for (int64_t m = 0; m < M; m++)
                y[m * N + first + n] = row_q8(qw + n * K, sw + n * G, xq + m * K, sx + m * G,
                                              G, g);
        }
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
   w: ln1, Wq (H hd, d), Wk, Wv (n_kv hd, d), Wo (d, H hd), ln2, Wg, Wu (ff, d), Wd (d, ff).
   cos, sin: (rope_rows, hd), a row for each row of x or one for all. The cache's arguments
   are decode_attention's. Returns 0, or (nothing written, x as it was) 1 where an index of
   the cache lies outside its rows, 2 where its scratch memory cannot be had. */
#define DECODE_LAYER(NAME, T, S, GEMV, SQRT, EXP)                                              \
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
}                                                                                             \
int NAME(int64_t M, int64_t d, int64_t H, int64_t n_kv, int64_t hd, int64_t ff, T *x,         \
         const T **w, const T *cos, const T *sin, int64_t rope_rows, T *kc, T *vc,            \
         int64_t rows, int64_t hs, const int64_t *write, const int64_t *read, const T *mask,  \
         int64_t W, double eps, int threads) {                                                \
    int64_t nq = H * hd, nk = n_kv * hd, nqkv = nq + 2 * nk;                                  \
    T *h = malloc(M * (d + nqkv + nq + 2 * nk + nq + d + 3 * ff) * sizeof(T));                \
    if (h == NULL) return 2;                                                                  \
    T *qkv = h + M * d, *q = qkv + M * nqkv, *k = q + M * nq, *v = k + M * nk;                \
    T *y = v + M * nk, *o = y + M * nq, *gu = o + M * d, *act = gu + 2 * M * ff;              \
    int64_t Nqkv[3] = {nq, nk, nk}, Nd[1] = {d}, Ngu[2] = {ff, ff};                           \
    rms_norm_##S(x, w[0], M, d, eps, h);                                                      \
    GEMV(M, 3, Nqkv, d, h, w + 1, qkv, threads);                                              \
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
    GEMV(M, 1, Nd, nq, y, w + 4, o, threads);                                                 \
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];                                         \
    rms_norm_##S(x, w[5], M, d, eps, h);                                                      \
    GEMV(M, 2, Ngu, d, h, w + 6, gu, threads);                                                \
    for (int64_t m = 0; m < M; m++)                                                           \
        for (int64_t i = 0; i < ff; i++) {                                                    \
            T g = gu[m * 2 * ff + i];                                                         \
            act[m * ff + i] = g / (1 + EXP(-g)) * gu[m * 2 * ff + ff + i];                    \
        }                                                                                     \
    GEMV(M, 1, Nd, ff, act, w + 8, o, threads);                                               \
    for (int64_t i = 0; i < M * d; i++) x[i] += o[i];                                         \
    free(h);                                                                                  \
    return 0;                                                                                 \
}
DECODE_LAYER(decode_layer_f32, float, f32, float_gemv, sqrtf, expf)
DECODE_LAYER(decode_layer_f64, double, f64, double_gemv, sqrt, exp)

"""


BINDINGS = r"""
/* The kernels above as PyTorch operators, in the build's namespace (TINYLLM_NS: tinyllm for
   library()): each checks what it is given (a wrong dtype, shape or layout is an error, not a
   crash), makes its output and runs the C loop on torch's thread count. A call costs a few
   microseconds from Python, as any operator of torch's own does. */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <cmath>
#include <torch/library.h>
#include <vector>

extern "C" {
void float_gemv(int64_t, int64_t, const int64_t *, int64_t, const float *, const float **,
                float *, int);
void int8_gemv(int64_t, int64_t, const int64_t *, int64_t, const float *, const int8_t **,
               const uint16_t **, float *, int);
void int4_gemv(int64_t, int64_t, const int64_t *, int64_t, int64_t, const float *,
               const uint8_t **, const uint16_t **, const uint16_t **, float *, int);
void int8g_gemv(int64_t, int64_t, const int64_t *, int64_t, int64_t, const float *,
                const int8_t **, const uint16_t **, float *, int);
int decode_attention_f32(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         const float *, const float *, const float *, float *, float *,
                         const int64_t *, const int64_t *, const float *, double, float *, int);
int decode_attention_f64(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         const double *, const double *, const double *, double *, double *,
                         const int64_t *, const int64_t *, const double *, double, double *, int);
int decode_layer_f32(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float *, const float **,
                     const float *, const float *, int64_t, float *, float *, int64_t, int64_t,
                     const int64_t *, const int64_t *, const float *, int64_t, double, int);
int decode_layer_f64(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double *,
                     const double **, const double *, const double *, int64_t, double *,
                     double *, int64_t, int64_t, const int64_t *, const int64_t *,
                     const double *, int64_t, double, int);
}

/* x (M, K) float32 on the CPU, contiguous (a copy where it is not) */
static at::Tensor input(const at::Tensor &x) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "x must be (M, K) float32 on the CPU, got ", x.scalar_type(), " ", x.sizes());
    return x.contiguous();
}

/* the data of each weight ws[i]: a contiguous CPU tensor of dtype, Ns[i] rows of per_row */
template <typename T>
static std::vector<const T *> rows(at::TensorList ws, const std::vector<int64_t> &Ns,
                                   int64_t per_row, at::ScalarType dtype, const char *what) {
    TORCH_CHECK(ws.size() == Ns.size(), what, ": ", Ns.size(), " tensors expected, got ",
                ws.size());
    std::vector<const T *> data;
    for (size_t i = 0; i < ws.size(); i++) {
        const at::Tensor &w = ws[i];
        TORCH_CHECK(w.scalar_type() == dtype, what, "[", i, "] must be ", dtype, ", got ",
                    w.scalar_type());
        TORCH_CHECK(w.device().is_cpu() && w.is_contiguous(), what, "[", i,
                    "] must be a contiguous CPU tensor");
        TORCH_CHECK(w.dim() >= 1 && w.size(0) == Ns[i] && w.numel() == Ns[i] * per_row, what,
                    "[", i, "] must hold ", Ns[i], " rows of ", per_row, " values, got ",
                    w.sizes());
        data.push_back(static_cast<const T *>(w.data_ptr()));
    }
    return data;
}

/* each weight's rows (N_i), and the output (M, N_1 + N_2 + ...) */
static std::vector<int64_t> counts(at::TensorList ws) {
    TORCH_CHECK(!ws.empty(), "the list of weights is empty");
    std::vector<int64_t> Ns;
    for (const at::Tensor &w : ws) Ns.push_back(w.dim() ? w.size(0) : 0);
    return Ns;
}
static at::Tensor output(const at::Tensor &x, const std::vector<int64_t> &Ns) {
    int64_t N = 0;
    for (int64_t n : Ns) N += n;
    return at::empty({x.size(0), N}, x.options());
}

static at::Tensor float_gemv_op(const at::Tensor &x_, at::TensorList w) {
    at::Tensor x = input(x_);
    std::vector<int64_t> Ns = counts(w);
    std::vector<const float *> wd = rows<float>(w, Ns, x.size(1), at::kFloat, "w");
    at::Tensor y = output(x, Ns);
    float_gemv(x.size(0), Ns.size(), Ns.data(), x.size(1), x.data_ptr<float>(), wd.data(),
               y.data_ptr<float>(), at::get_num_threads());
    return y;
}

static at::Tensor int8_gemv_op(const at::Tensor &x_, at::TensorList q, at::TensorList scale) {
    at::Tensor x = input(x_);
    std::vector<int64_t> Ns = counts(q);
    std::vector<const int8_t *> qd = rows<int8_t>(q, Ns, x.size(1), at::kChar, "q");
    std::vector<const uint16_t *> sd = rows<uint16_t>(scale, Ns, 1, at::kHalf, "scale");
    at::Tensor y = output(x, Ns);
    int8_gemv(x.size(0), Ns.size(), Ns.data(), x.size(1), x.data_ptr<float>(), qd.data(),
              sd.data(), y.data_ptr<float>(), at::get_num_threads());
    return y;
}

static at::Tensor int4_gemv_op(const at::Tensor &x_, at::TensorList q, at::TensorList scale,
                               at::TensorList zero) {
    at::Tensor x = input(x_);
    std::vector<int64_t> Ns = counts(q);
    TORCH_CHECK(q[0].dim() == 3, "q must be (N, G, h) bytes, got ", q[0].sizes());
    int64_t G = q[0].size(1), h = q[0].size(2);
    TORCH_CHECK(2 * h * G == x.size(1), "x's ", x.size(1), " columns are not the weights' ",
                2 * h * G);
    std::vector<const uint8_t *> qd = rows<uint8_t>(q, Ns, G * h, at::kByte, "q");
    std::vector<const uint16_t *> sd = rows<uint16_t>(scale, Ns, G, at::kHalf, "scale");
    std::vector<const uint16_t *> zd = rows<uint16_t>(zero, Ns, G, at::kHalf, "zero");
    at::Tensor y = output(x, Ns);
    int4_gemv(x.size(0), Ns.size(), Ns.data(), G, h, x.data_ptr<float>(), qd.data(), sd.data(),
              zd.data(), y.data_ptr<float>(), at::get_num_threads());
    return y;
}

static at::Tensor int8g_gemv_op(const at::Tensor &x_, at::TensorList q, at::TensorList scale) {
    at::Tensor x = input(x_);
    std::vector<int64_t> Ns = counts(q);
    int64_t K = x.size(1), G = scale.empty() || scale[0].dim() < 2 ? 0 : scale[0].size(1);
    TORCH_CHECK(G > 0 && K % G == 0, "scale must be (N, G) with G dividing x's ", K,
                " columns");
    std::vector<const int8_t *> qd = rows<int8_t>(q, Ns, K, at::kChar, "q");
    std::vector<const uint16_t *> sd = rows<uint16_t>(scale, Ns, G, at::kHalf, "scale");
    at::Tensor y = output(x, Ns);
    int8g_gemv(x.size(0), Ns.size(), Ns.data(), G, K / G, x.data_ptr<float>(), qd.data(),
               sd.data(), y.data_ptr<float>(), at::get_num_threads());
    return y;
}

/* The cache's arguments of a decode step of B rows, n_kv KV heads of hd values each, as
   decode_attention and decode_layer take them (their dtype checked by each op) */
static void check_cache(const at::Tensor &keys, const at::Tensor &values, const at::Tensor &write,
                        const at::Tensor &read, const at::Tensor &mask, int64_t B, int64_t n_kv,
                        int64_t hd) {
    TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && hd > 0 &&
                keys.numel() == values.numel() && keys.numel() % hd == 0,
                "keys and values must be contiguous rows of ", hd, " values");
    TORCH_CHECK(write.scalar_type() == at::kLong && write.numel() == B * n_kv,
                "write must be (B, n_kv) int64");
    TORCH_CHECK(read.scalar_type() == at::kLong && read.dim() == 2 && read.size(0) == B &&
                mask.sizes() == read.sizes(), "read and mask must be (B, W), read int64");
}

static at::Tensor decode_attention_op(const at::Tensor &q_, const at::Tensor &k_,
                                      const at::Tensor &v_, at::Tensor &keys, at::Tensor &values,
                                      const at::Tensor &write_, const at::Tensor &read_,
                                      int64_t head_stride, const at::Tensor &mask_) {
    at::ScalarType dtype = keys.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
                "decode_attention runs in float32 or float64, not ", dtype);
    TORCH_CHECK(q_.dim() == 4, "q must be (B, n_kv, g, hd), got ", q_.sizes());
    int64_t B = q_.size(0), n_kv = q_.size(1), g = q_.size(2), hd = q_.size(3);
    for (const at::Tensor *t : std::initializer_list<const at::Tensor *>{&q_, &k_, &v_, &keys,
                                                                       &values, &mask_})
        TORCH_CHECK(t->scalar_type() == dtype && t->device().is_cpu(),
                    "q, k, v, the cache and the mask must be CPU tensors of one dtype");
    check_cache(keys, values, write_, read_, mask_, B, n_kv, hd);
    TORCH_CHECK(k_.numel() == B * n_kv * hd && v_.numel() == B * n_kv * hd,
                "k and v must be (B, n_kv, 1, hd) = (", B, ", ", n_kv, ", 1, ", hd, ")");
    at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
    at::Tensor write = write_.contiguous(), read = read_.contiguous(), mask = mask_.contiguous();
    at::Tensor y = at::empty(q.sizes(), q.options());
    int64_t W = read.size(1), cached = keys.numel() / hd, threads = at::get_num_threads();
    double scale = std::pow((double)hd, -0.5);
    int outside = dtype == at::kFloat
        ? decode_attention_f32(B, n_kv, g, hd, W, cached, head_stride, q.data_ptr<float>(),
                               k.data_ptr<float>(), v.data_ptr<float>(), keys.data_ptr<float>(),
                               values.data_ptr<float>(), write.data_ptr<int64_t>(),
                               read.data_ptr<int64_t>(), mask.data_ptr<float>(), scale,
                               y.data_ptr<float>(), threads)
        : decode_attention_f64(B, n_kv, g, hd, W, cached, head_stride, q.data_ptr<double>(),
                               k.data_ptr<double>(), v.data_ptr<double>(),
                               keys.data_ptr<double>(), values.data_ptr<double>(),
                               write.data_ptr<int64_t>(), read.data_ptr<int64_t>(),
                               mask.data_ptr<double>(), scale, y.data_ptr<double>(), threads);
    TORCH_CHECK_INDEX(!outside, "decode_attention: a row to write or read lies outside the "
                      "cache's ", cached, " rows");
    return y;
}

static at::Tensor decode_layer_op(const at::Tensor &x_, at::TensorList w, const at::Tensor &cos_,
                                  const at::Tensor &sin_, at::Tensor &keys, at::Tensor &values,
                                  const at::Tensor &write_, const at::Tensor &read_,
                                  int64_t head_stride, const at::Tensor &mask_, int64_t n_heads,
                                  double eps) {
    at::ScalarType dtype = x_.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
                "decode_layer runs in float32 or float64, not ", dtype);
    TORCH_CHECK(x_.dim() == 2 && x_.device().is_cpu(), "x must be (M, d) on the CPU, got ",
                x_.sizes());
    TORCH_CHECK(w.size() == 9, "w must hold the layer's 9 weights (ln1, q, k, v, o, ln2, gate, "
                "up, down), got ", w.size());
    int64_t M = x_.size(0), d = x_.size(1), hd = cos_.size(-1);
    int64_t n_kv = w[2].dim() == 2 && hd > 0 ? w[2].size(0) / hd : 0;
    int64_t ff = w[6].dim() == 2 ? w[6].size(0) : 0, H = n_heads;
    TORCH_CHECK(H > 0 && n_kv > 0 && H % n_kv == 0 && hd > 0 && hd % 2 == 0,
                "n_heads must be a multiple of n_kv and head_dim even");
    const std::vector<std::vector<int64_t>> shapes = {{d}, {H * hd, d}, {n_kv * hd, d},
        {n_kv * hd, d}, {d, H * hd}, {d}, {ff, d}, {ff, d}, {d, ff}};
    std::vector<const void *> wd;
    for (size_t i = 0; i < 9; i++) {
        TORCH_CHECK(w[i].scalar_type() == dtype && w[i].device().is_cpu() &&
                    w[i].is_contiguous() && w[i].sizes() == at::IntArrayRef(shapes[i]),
                    "w[", i, "] must be a contiguous CPU tensor of x's dtype, shaped ",
                    at::IntArrayRef(shapes[i]), ", got ", w[i].scalar_type(), " ", w[i].sizes());
        wd.push_back(w[i].data_ptr());
    }
    for (const at::Tensor *t : std::initializer_list<const at::Tensor *>{&cos_, &sin_, &keys,
                                                                       &values, &mask_})
        TORCH_CHECK(t->scalar_type() == dtype && t->device().is_cpu(),
                    "cos, sin, the cache and the mask must be CPU tensors of x's dtype");
    at::Tensor cos = cos_.contiguous(), sin = sin_.contiguous();
    int64_t rope_rows = cos.numel() / hd;
    TORCH_CHECK(sin.sizes() == cos.sizes() && (rope_rows == 1 || rope_rows == M),
                "cos and sin must hold one row of head_dim for every row of x, or one for all");
    check_cache(keys, values, write_, read_, mask_, M, n_kv, hd);
    at::Tensor x = x_.contiguous().clone(), read = read_.contiguous(), mask = mask_.contiguous();
    at::Tensor write = write_.contiguous();
    int64_t W = read.size(1), cached = keys.numel() / hd, threads = at::get_num_threads();
    int outside = dtype == at::kFloat
        ? decode_layer_f32(M, d, H, n_kv, hd, ff, x.data_ptr<float>(), (const float **)wd.data(),
                           cos.data_ptr<float>(), sin.data_ptr<float>(), rope_rows,
                           keys.data_ptr<float>(), values.data_ptr<float>(), cached,
                           head_stride, write.data_ptr<int64_t>(), read.data_ptr<int64_t>(),
                           mask.data_ptr<float>(), W, eps, threads)
        : decode_layer_f64(M, d, H, n_kv, hd, ff, x.data_ptr<double>(),
                           (const double **)wd.data(), cos.data_ptr<double>(),
                           sin.data_ptr<double>(), rope_rows, keys.data_ptr<double>(),
                           values.data_ptr<double>(), cached, head_stride,
                           write.data_ptr<int64_t>(), read.data_ptr<int64_t>(),
                           mask.data_ptr<double>(), W, eps, threads);
    TORCH_CHECK(outside != 2, "decode_layer: no memory for the step's ", M, " rows");
    TORCH_CHECK_INDEX(!outside, "decode_layer: a row to write or read lies outside the cache's ",
                      cached, " rows");
    return x;
}

#define DEFINE(ns) TORCH_LIBRARY(ns, m)      /* TINYLLM_NS expanded first */
#define IMPLEMENT(ns) TORCH_LIBRARY_IMPL(ns, CPU, m)
DEFINE(TINYLLM_NS) {
    m.def("float_gemv(Tensor x, Tensor[] w) -> Tensor");
    m.def("int8_gemv(Tensor x, Tensor[] q, Tensor[] scale) -> Tensor");
    m.def("int4_gemv(Tensor x, Tensor[] q, Tensor[] scale, Tensor[] zero) -> Tensor");
    m.def("int8g_gemv(Tensor x, Tensor[] q, Tensor[] scale) -> Tensor");
    m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) keys, Tensor(b!) values, "
          "Tensor write, Tensor read, int head_stride, Tensor mask) -> Tensor");
    m.def("decode_layer(Tensor x, Tensor[] w, Tensor cos, Tensor sin, Tensor(a!) keys, "
          "Tensor(b!) values, Tensor write, Tensor read, int head_stride, Tensor mask, "
          "int n_heads, float eps) -> Tensor");
}
IMPLEMENT(TINYLLM_NS) {
    m.impl("float_gemv", float_gemv_op);
    m.impl("int8_gemv", int8_gemv_op);
    m.impl("int4_gemv", int4_gemv_op);
    m.impl("int8g_gemv", int8g_gemv_op);
    m.impl("decode_attention", decode_attention_op);
    m.impl("decode_layer", decode_layer_op);
}
"""


FAILURES: list[str] = []  # what the compiler said of each build that failed, in this process


def compilers() -> tuple[str, str] | None:
    """The C and C++ compilers: $CC, else cc, gcc or clang, and $CXX, else c++, g++ or
    clang++, on the PATH (None: either is missing). torch.compile needs the C++ one too."""
    found = [next((shutil.which(n) for n in names if n and shutil.which(n)), None)
             for names in ((os.environ.get("CC"), "cc", "gcc", "clang"),
                           (os.environ.get("CXX"), "c++", "g++", "clang++"))]
    return None if None in found else (found[0], found[1])


FLAGS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])


def build(flags: list[str], namespace: str = "tinyllm"):
    """The kernels compiled with these C flags and bound as operators of torch.ops.namespace,
    once: the C source (SOURCE) and its bindings (BINDINGS, C++ against torch's headers, about
    ten seconds) kept under the cache directory by a hash of both, the flags, the compilers
    and torch's version, so a second process loads them in milliseconds -> torch.ops.namespace,
    or None where they do not compile. A namespace is bound once a process."""
    found = compilers()
    if found is None:
        return None
    cc, cxx = found
    key = "\0".join([SOURCE, BINDINGS, cc, cxx, *flags, namespace, torch.__version__])
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"{namespace}-{key}.so"
    if not path.is_file():
        print(f"tinyllm: compiling the C kernels ({' '.join(flags)}), once for this machine: "
              f"about ten seconds", file=sys.stderr)
        torch_dir = os.path.dirname(torch.__file__)
        openmp = ["-fopenmp"] if "-fopenmp" in flags else []
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src, obj, cpp, out = (os.path.join(tmp, f) for f in ("k.c", "k.o", "ops.cpp", "k.so"))
            for name, text in ((src, SOURCE), (cpp, BINDINGS)):
                with open(name, "w") as f:
                    f.write(text)
            steps = ([cc, *flags, "-fPIC", "-c", src, "-o", obj],
                     [cxx, "-O2", "-std=c++17", "-w", "-fPIC", "-shared", cpp, obj, "-o", out,
                      *openmp, f"-DTINYLLM_NS={namespace}",
                      f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
                      f"-I{torch_dir}/include", f"-L{torch_dir}/lib", "-lc10", "-ltorch_cpu",
                      f"-Wl,-rpath,{torch_dir}/lib", "-lm"])
            for step in steps:
                done = subprocess.run(step, capture_output=True, text=True)
                if done.returncode != 0:
                    FAILURES.append(f"{' '.join(flags)}: {done.stderr.strip()[-300:]}")
                    return None
            shutil.move(out, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)  # whole, even with a neighbour
    try:
        torch.ops.load_library(str(path))
    except OSError:
        return None
    for name in OPS:
        torch.library.register_fake(f"{namespace}::{name}")(_fake(name))
    return getattr(torch.ops, namespace)


@cache
def library():
    """The kernels for this machine, as torch.ops.tinyllm: the first of FLAGS that compiles
    (-march=native: the machine's own vector instructions; OpenMP where the compiler has it),
    or None (no compilers, none compiled: a warning says why; or $TINYLLM_NO_C_KERNELS=1)."""
    if os.environ.get("TINYLLM_NO_C_KERNELS") == "1":
        return None
    ops = next((ops for ops in map(build, FLAGS) if ops is not None), None)
    if ops is None:
        warnings.warn("tinyllm: the C kernels did not compile here, so PyTorch's products run "
                      "instead: " + (FAILURES[-1] if FAILURES else "no C and C++ compilers"),
                      stacklevel=2)
    return ops


_built: bool | None = None  # available()'s answer, once asked


def available() -> bool:
    """Whether the kernels compiled here. Asked first outside compiled code (a QuantLinear
    asks when it is made), the answer is then a module global that torch.compile reads as a
    constant, tracing no compiler run."""
    global _built
    if _built is None:
        _built = library() is not None
    return _built


def int8_gemv(x: Tensor, q: list[Tensor], scale: list[Tensor], ops=None) -> Tensor:
    """x (M, K) float32 @ [W_1; W_2; ...]^T -> (M, N_1 + N_2 + ...) float32, each W_i = q[i]
    (N_i, K) int8 times scale[i] (N_i, 1) float16: the products of layers that read the same
    x, in one call, with each row of x quantized to int8 once; each one quant.int8_matmul's
    result, bit for bit. CPU tensors, the weights contiguous; ops: a build() of the kernels
    (None: library())."""
    return (ops or library()).int8_gemv(x, q, scale)


def int4_gemv(x: Tensor, q: list[Tensor], scale: list[Tensor], zero: list[Tensor],
              ops=None) -> Tensor:
    """x (M, K) float32 @ [W_1; W_2; ...]^T -> (M, N_1 + N_2 + ...) float32 for 4-bit weights
    W_i held as quant.dequantize reads them (q[i] (N_i, G, h) uint8, K = 2 h G; scale[i] and
    zero[i] (N_i, G) float16), each group of x quantized to int8 once:
    F.linear(quant.rounded_activations(x, 2 h), W_i) up to the order of additions.
    CPU tensors, the weights contiguous; ops: a build() of the kernels (None: library())."""
    return (ops or library()).int4_gemv(x, q, scale, zero)


def int8g_gemv(x: Tensor, q: list[Tensor], scale: list[Tensor], ops=None) -> Tensor:
    """x (M, K) float32 @ [W_1; W_2; ...]^T -> (M, N_1 + N_2 + ...) float32 for 8-bit weights
    in groups (GGUF's Q8_0): W_i = q[i] (N_i, K) int8 times scale[i] (N_i, G) float16, a scale
    per group of K / G, each group of x quantized to int8 once:
    F.linear(quant.rounded_activations(x, K / G), W_i) up to the order of additions.
    CPU tensors, the weights contiguous; ops: a build() of the kernels (None: library())."""
    return (ops or library()).int8g_gemv(x, q, scale)


def float_gemv(x: Tensor, w: list[Tensor], ops=None) -> Tensor:
    """x (M, K) float32 @ [W_1; W_2; ...]^T -> (M, N_1 + N_2 + ...) float32 for float32
    weights W_i (N_i, K): F.linear's product up to the order of additions, the same order for
    any M. CPU tensors, the weights contiguous; ops: a build() of the kernels (None:
    library())."""
    return (ops or library()).float_gemv(x, w)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor,
                     write: Tensor, read: Tensor, head_stride: int, mask: Tensor,
                     ops=None) -> Tensor:
    """A decode step's attention in one layer, reading the cache where it lies: the new keys
    and values k, v (B, n_kv, 1, hd) are written to rows write (B, n_kv) of keys and values
    (a layer's cache: contiguous rows of hd values), then the g query heads of each KV head h,
    q (B, n_kv, g, hd), attend to the W keys at rows read (B, W) + h * head_stride, with the
    additive mask (B, W) (-inf: hidden) -> y (B, n_kv, g, hd): scaled_dot_product_attention's
    result up to the order of additions, each row's the same in any batch. float32 or float64,
    on the CPU; an index outside the cache raises IndexError and writes nothing."""
    return (ops or library()).decode_attention(q, k, v, keys, values, write, read, head_stride,
                                               mask)


def decode_layer(x: Tensor, w: list[Tensor], cos: Tensor, sin: Tensor, keys: Tensor,
                 values: Tensor, write: Tensor, read: Tensor, head_stride: int, mask: Tensor,
                 n_heads: int, eps: float, ops=None) -> Tensor:
    """A decoder layer's decode step in one call: the residual stream x (M, d) of M rows, one
    new token each -> the layer's output (M, d), what Block computes (its norms, q, k and v,
    RoPE by cos and sin (M or 1 rows of hd), decode_attention on the cache as there, the output
    projection, the SwiGLU MLP, both residuals) up to the order of additions. w: the layer's
    weights, [input norm, q, k, v, o, post-attention norm, gate, up, down], contiguous, in x's
    dtype (float32 or float64, on the CPU); the cache's arguments are decode_attention's. An
    index outside the cache raises IndexError and writes nothing."""
    return (ops or library()).decode_layer(x, w, cos, sin, keys, values, write, read,
                                           head_stride, mask, n_heads, eps)


def _fake(name: str):
    """What an operator returns, for torch.compile and make_fx to trace: (M, N_1 + N_2 + ...)
    for a product, q's shape for attention, x's for a layer."""
    if name in ("decode_attention", "decode_layer"):
        return lambda x, *rest: torch.empty_like(x)
    return lambda x, q, *rest: x.new_empty((x.size(0), sum(t.size(0) for t in q)))


OPS = ("float_gemv", "int8_gemv", "int4_gemv", "int8g_gemv", "decode_attention",
       "decode_layer")
