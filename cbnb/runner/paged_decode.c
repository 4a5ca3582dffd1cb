/* cbnb: paged decode attention on CPU, float32 (built on first use by cbnb/runner/cpu_kernels.py).
 *
 * One query token per decode row; its keys and values are read in place from the row's pages (no gather copy), and
 * all rows of a layer are computed in one call: one OpenMP parallel region over (row, KV head) instead of one
 * attention call per row. GQA: the H / Hkv query heads of a KV head share each key and value load.
 *
 * For row b: keys are the first lens[b] slots of the concatenation of its pages tables[b, 0..], slot j in page
 * tables[b, j / page] at offset j % page (for sliding layers the pages form a ring; attention does not depend on the
 * order of the keys). Per query head: s_j = scale * <q, k_j>, p = softmax(s), out = sum_j p_j v_j (exact softmax:
 * max subtracted, two passes over the scores).
 *
 * Layouts (element strides; the last dimension is contiguous):
 *   q, out   [T, H, D] with row stride q_row / o_row and head stride q_head / o_head; rows[b] is the row of b.
 *   k, v     the layer's pages: token t of block n, KV head h at  k + n * blk + t * tok + h * head.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

int cbnb_paged_decode_f32(const float *q, int64_t q_row, int64_t q_head, const float *k, const float *v, int64_t blk,
                          int64_t tok, int64_t head, int64_t page, const int64_t *rows, const int64_t *tables,
                          int64_t W, const int64_t *lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale,
                          float *out, int64_t o_row, int64_t o_head, int64_t max_len, int nthreads) {
    if (Hkv <= 0 || H % Hkv != 0 || page <= 0 || max_len < 0) return 1;
    const int64_t G = H / Hkv;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(G * max_len + 1));
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
                const int64_t *tb = tables + b * W;
                /* scores, page by page */
                for (int64_t j0 = 0, p = 0; j0 < n; j0 += page, p++) {
                    const int64_t m = n - j0 < page ? n - j0 : page;
                    const float *kp = k + tb[p] * blk + kh * head;
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
                        sg[j] = expf(sg[j] - mx);
                        sum += sg[j];
                    }
                    float *o = out + rows[b] * o_row + (kh * G + g) * o_head;
                    for (int64_t d = 0; d < D; d++) o[d] = 0.f;
                    for (int64_t j0 = 0, p = 0; j0 < n; j0 += page, p++) {
                        const int64_t m = n - j0 < page ? n - j0 : page;
                        const float *vp = v + tb[p] * blk + kh * head;
                        for (int64_t t = 0; t < m; t++) {
                            const float pj = sg[j0 + t];
                            const float *vj = vp + t * tok;
#pragma omp simd
                            for (int64_t d = 0; d < D; d++) o[d] += pj * vj[d];
                        }
                    }
                    const float inv = 1.f / sum;
                    for (int64_t d = 0; d < D; d++) o[d] *= inv;
                }
            }
        }
        free(s);
    }
    return failed ? 2 : 0;
}
