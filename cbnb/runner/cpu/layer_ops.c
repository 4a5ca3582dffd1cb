/* cbnb's CPU layer ops, float32, for the runner's decoder-layer forward (cbnb.runner.cpu.cpu_layers): rotary embedding
 * of q and k, the K/V write into the cache's token rows, RMSNorm (with the residual add fused in), SiLU * up.
 *
 * Built with -ffp-contract=off (cbnb.runner.cpu.cpu_kernels): the rotary's elements are rounded exactly as torch rounds
 * `q * cos + rotate_half(q) * sin` (one product, the other product, their sum), the residual add and the K/V write
 * are exact, so those give the same bits as the torch code they replace. RMSNorm sums in another order than torch
 * and SiLU uses its own exp: those agree with torch to float32 rounding, not bit for bit. Plain C + OpenMP; the
 * compiler vectorizes the inner loops.
 */
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "cbnb_exp.h"

/* Rotary embedding (transformers' apply_rotary_pos_emb, rotate_half form) of T tokens' q (H heads) and k (Hkv heads)
 * of head size D, read from rows with any stride (e.g. slices of one fused q/k/v projection), written contiguous:
 * qo [T, H, D], ko [T, Hkv, D]. cos and sin: [T, D] rows at stride cs_rs.
 * Returns 0, or 1 when D is odd or a size is not positive. */
int cbnb_rope_qk_f32(const float *q, int64_t q_rs, const float *k, int64_t k_rs, const float *cos_, const float *sin_,
                     int64_t cs_rs, float *qo, float *ko, int64_t T, int64_t H, int64_t Hkv, int64_t D, int nthreads) {
    if (T <= 0 || H <= 0 || Hkv < 0 || D <= 0 || (D & 1)) return 1;
    const int64_t half = D / 2, heads = H + Hkv;
    /* A thread team costs microseconds: worth it only for prefill-sized work. */
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * heads * D >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_ + t * cs_rs, *s = sin_ + t * cs_rs;
        for (int64_t h = 0; h < heads; h++) {
            const float *x = h < H ? q + t * q_rs + h * D : k + t * k_rs + (h - H) * D;
            float *y = h < H ? qo + (t * H + h) * D : ko + (t * Hkv + (h - H)) * D;
            for (int64_t j = 0; j < half; j++) {
                float a = x[j] * c[j], b = x[j + half] * s[j];
                y[j] = a - b;
            }
            for (int64_t j = half; j < D; j++) {
                float a = x[j] * c[j], b = x[j - half] * s[j];
                y[j] = a + b;
            }
        }
    }
    return 0;
}

/* K/V write: token t's key row (W floats at k + t * k_rs) to rows[(slot[t] + k_base) * W], its value row to
 * rows[(slot[t] + v_base) * W]; rows holds n_rows rows of W floats. Rows are written in token order (a slot named
 * twice keeps the later token, as a sequential index_copy_ would). Returns 0, or 2 when a target row is out of
 * range (nothing written). */
int cbnb_write_kv_f32(float *rows, int64_t n_rows, int64_t W, const int64_t *slot, int64_t T, int64_t k_base,
                      int64_t v_base, const float *k, int64_t k_rs, const float *v, int64_t v_rs) {
    for (int64_t t = 0; t < T; t++) {
        int64_t rk = slot[t] + k_base, rv = slot[t] + v_base;
        if (rk < 0 || rk >= n_rows || rv < 0 || rv >= n_rows) return 2;
    }
    for (int64_t t = 0; t < T; t++) {
        memcpy(rows + (slot[t] + k_base) * W, k + t * k_rs, (size_t)W * sizeof(float));
        memcpy(rows + (slot[t] + v_base) * W, v + t * v_rs, (size_t)W * sizeof(float));
    }
    return 0;
}

/* transformers' RMSNorm of one row x (n floats) into y: y = w * (x * 1 / sqrt(mean(x^2) + eps)). */
static inline void rms_row(const float *x, const float *w, float eps, float *y, int64_t n) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < n; j++) ss += x[j] * x[j];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t j = 0; j < n; j++) y[j] = w[j] * (x[j] * r);
}

/* RMSNorm of T rows of n floats (x at row stride x_rs) into y [T, n]. With b given, first sum = a + b row by row
 * (sum [T, n], each element rounded as torch's add), then the norm of sum: the residual add fused with the next
 * norm. Returns 0, or 1 for a size that is not positive. */
int cbnb_add_rms_norm_f32(const float *a, int64_t a_rs, const float *b, int64_t b_rs, const float *w, float eps,
                          float *sum, float *y, int64_t T, int64_t n, int nthreads) {
    if (T <= 0 || n <= 0) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * n >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *x = a + t * a_rs;
        if (b) {
            const float *bt = b + t * b_rs;
            float *st = sum + t * n;
#pragma omp simd
            for (int64_t j = 0; j < n; j++) st[j] = x[j] + bt[j];
            x = st;
        }
        rms_row(x, w, eps, y + t * n, n);
    }
    return 0;
}

/* y = silu(g) * u over T rows of n floats (g, u at their row strides; y [T, n]); silu(x) = x / (1 + exp(-x)),
 * with exp of -|x| only (no overflow). Returns 0, or 1 for a size that is not positive. */
int cbnb_silu_mul_f32(const float *g, int64_t g_rs, const float *u, int64_t u_rs, float *y, int64_t T, int64_t n,
                      int nthreads) {
    if (T <= 0 || n <= 0) return 1;
    /* exp makes this compute-bound: two threads pay off from a decode step's size on. */
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * n >= 16384)
    for (int64_t t = 0; t < T; t++) {
        const float *gt = g + t * g_rs, *ut = u + t * u_rs;
        float *yt = y + t * n;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) {
            const float x = gt[j];
            const float e = exp_nonpos(x >= 0.0f ? -x : x); /* exp(-|x|) */
            const float inv = 1.0f / (1.0f + e);            /* one division: both branches are computed */
            yt[j] = x * (x >= 0.0f ? inv : e * inv) * ut[j];
        }
    }
    return 0;
}
