/* cbnb: paged decode attention on CPU, float32 (built on first use by cbnb/runner/cpu_kernels.py).
 *
 * One query token per decode row; its keys and values are read in place from the row's pages (no gather copy), and
 * all rows of a layer are computed in one call: one OpenMP parallel region over (row, KV head) instead of one
 * attention call per row. GQA: the H / Hkv query heads of a KV head share each key and value load.
 *
 * For row b: keys are the first lens[b] slots of the concatenation of its pages tables[b, 0..], slot j in page
 * tables[b, j / page] at offset j % page (for sliding layers the pages form a ring; attention does not depend on the
 * order of the keys). Per query head: s_j = scale * <q, k_j>, p = softmax(s), out = sum_j p_j v_j (exact softmax:
 * max subtracted, two passes over the scores). exp is Cephes' expf polynomial written inline (within 2e-7 relative of
 * libm's on [-87, 0]), so the softmax loop vectorizes, where libm's expf is a scalar call per score; the PV pass
 * reads each value vector once for up to GMAX query heads of its KV head (one accumulator each). Together: 30 layers
 * of a cpu-32 decode step (32 rows, 48-290 keys, page 256, cold caches) 34 -> 12.7 ms (2026-12-06, AMD EPYC, 2
 * threads, /tmp microbenchmark of the kernel alone; `python -m cbnb.bench` measures the end-to-end effect).
 *
 * Layouts (element strides; the last dimension is contiguous):
 *   q, out   [T, H, D] with row stride q_row / o_row and head stride q_head / o_head; rows[b] is the row of b.
 *   k, v     the layer's pages: token t of block n, KV head h at  k + n * blk + t * tok + h * head.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cbnb_exp.h"

/* The query heads (G) and head dimensions (D) one PV accumulator block covers (16 KiB on the stack). */
#define GMAX 16
#define DMAX 256

/* One (row, KV head): scores, softmax and PV of its G query heads; s holds G * n scores. Inlined twice, once with
 * D = 64 (a constant: fixed-length vector loops), once generic. */
static inline __attribute__((always_inline)) void task(const float *qb, int64_t q_head, const float *k, const float *v,
        int64_t blk, int64_t tok, int64_t page, const int64_t *tb, int64_t n, int64_t G, const int64_t D, float scale,
        float *s, float *inv, float *ob, int64_t o_head) {
    for (int64_t j0 = 0, p = 0; j0 < n; j0 += page, p++) {
        const int64_t m = n - j0 < page ? n - j0 : page;
        const float *kp = k + tb[p] * blk;
        for (int64_t t = 0; t < m; t++) {
            const float *kj = kp + t * tok;
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qb + g * q_head;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < D; d++) acc += qg[d] * kj[d];
                s[g * n + j0 + t] = acc * scale;
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *sg = s + g * n;
        float mx = sg[0];
        for (int64_t j = 1; j < n; j++) mx = sg[j] > mx ? sg[j] : mx;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; j++) {
            const float e = exp_nonpos(sg[j] - mx);
            sg[j] = e;
            sum += e;
        }
        inv[g] = 1.f / sum;
    }
    /* PV: keys outer, query heads inner, so each value vector is read once per chunk of GMAX heads x DMAX dims. */
    float acc[GMAX * DMAX];
    for (int64_t g0 = 0; g0 < G; g0 += GMAX) {
        const int64_t gn = G - g0 < GMAX ? G - g0 : GMAX;
        for (int64_t d0 = 0; d0 < D; d0 += DMAX) {
            const int64_t dn = D - d0 < DMAX ? D - d0 : DMAX;
            for (int64_t i = 0; i < gn * dn; i++) acc[i] = 0.f;
            for (int64_t j0 = 0, p = 0; j0 < n; j0 += page, p++) {
                const int64_t m = n - j0 < page ? n - j0 : page;
                const float *vp = v + tb[p] * blk + d0;
                for (int64_t t = 0; t < m; t++) {
                    const float *vj = vp + t * tok;
                    for (int64_t g = 0; g < gn; g++) {
                        const float pj = s[(g0 + g) * n + j0 + t];
                        float *a = acc + g * dn;
#pragma omp simd
                        for (int64_t d = 0; d < dn; d++) a[d] += pj * vj[d];
                    }
                }
            }
            for (int64_t g = 0; g < gn; g++) {
                float *o = ob + (g0 + g) * o_head + d0;
                const float w = inv[g0 + g];
                for (int64_t d = 0; d < dn; d++) o[d] = acc[g * dn + d] * w;
            }
        }
    }
}

int cbnb_paged_decode_f32(const float *q, int64_t q_row, int64_t q_head, const float *k, const float *v, int64_t blk,
                          int64_t tok, int64_t head, int64_t page, const int64_t *rows, const int64_t *tables,
                          int64_t W, const int64_t *lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale,
                          float *out, int64_t o_row, int64_t o_head, int64_t max_len, int nthreads) {
    if (Hkv <= 0 || H % Hkv != 0 || page <= 0 || max_len < 0) return 1;
    const int64_t G = H / Hkv;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(G * max_len + G + 1));  /* scores, then 1 / sums */
        if (s == NULL) failed = 1;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t kh = 0; kh < Hkv; kh++) {
                const int64_t n = lens[b];
                if (s == NULL || n <= 0 || n > max_len) {
                    failed = 1;
                    continue;
                }
                const float *qb = q + rows[b] * q_row + kh * G * q_head;
                float *ob = out + rows[b] * o_row + kh * G * o_head;
                const int64_t *tb = tables + b * W;
                if (D == 64)
                    task(qb, q_head, k + kh * head, v + kh * head, blk, tok, page, tb, n, G, 64, scale, s, s + G * max_len, ob, o_head);
                else
                    task(qb, q_head, k + kh * head, v + kh * head, blk, tok, page, tb, n, G, D, scale, s, s + G * max_len, ob, o_head);
            }
        }
        free(s);
    }
    return failed ? 2 : 0;
}
