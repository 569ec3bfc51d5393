/* Step 13 - the float32 products (float_gemv): one weight row at a time, each weight vector
   multiplied with up to 4 rows of x, a tile of the weight at a time, the next one prefetched. */

#include "common.h"

/* ---- the vector bodies (AVX2, AVX-512 where the compiler targets it) ---- */

#ifdef AVX2
ROWS_F32(1) ROWS_F32(2) ROWS_F32(4)

/* columns n0 .. n1 of y (rows ldy apart) for R rows of x (R = 4, 2 or 1) and a float32
   weight w (N, K) */
static void rows_f32(int R, const float *x, const float *w, float *y, int64_t n0, int64_t n1,
                     int64_t K, int64_t ldy) {
    for (int64_t n = n0; n < n1; n++) {
        if (R == 4) dot_f32_4(x, w + n * K, y + n, K, ldy);
        else if (R == 2) dot_f32_2(x, w + n * K, y + n, K, ldy);
        else dot_f32_1(x, w + n * K, y + n, K, ldy);
    }
}
#endif

/* ---- the portable loops ---- */

#ifndef AVX2
/* rows_f32 in plain C: each output one by one, in finish_f32's order */
static void rows_f32(int R, const float *x, const float *w, float *y, int64_t n0, int64_t n1,
                     int64_t K, int64_t ldy) {
    for (int64_t n = n0; n < n1; n++) {
        for (int r = 0; r < R; r++) y[r * ldy + n] = finish_f32(0, x + r * K, w + n * K, 0, K);
    }
}
#endif

/* asks for a weight row (K floats) to be brought into the cache, without waiting for it */
static void prefetch_row(const float *w, int64_t K) {
    for (int64_t k = 0; k < K; k += 16) __builtin_prefetch(w + k, 0, 2);
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
