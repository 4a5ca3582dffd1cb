/* cbnb: paged attention on CPU, float32 (built on first use by cbnb/runner/cpu/cpu_kernels.py): decode rows below,
 * prefill chunks (causal) after them.
 *
 * One query token per decode row; its keys and values are read in place from the row's pages (no gather copy), and
 * all rows of a layer are computed in one call: one OpenMP parallel region over the rows instead of one attention
 * call per row. GQA: the H / Hkv query heads of a KV head share each key and value load.
 *
 * For row b: keys are the first lens[b] slots of the concatenation of its pages tables[b, 0..], slot j in page
 * tables[b, j / page] at offset j % page (for sliding layers the pages form a ring; attention does not depend on the
 * order of the keys). Per query head: s_j = scale * <q, k_j>, p = softmax(s), out = sum_j p_j v_j (exact softmax:
 * max subtracted, two passes over the scores). exp is Cephes' expf polynomial written inline (within 2e-7 relative of
 * libm's on [-87, 0]), so the softmax loop vectorizes, where libm's expf is a scalar call per score.
 * A task is a row's KV heads (all of them once rows outnumber the threads 4 to 1), keys outer and query heads inner:
 * each key's K (then V) floats of the task are read once, contiguously, with a software prefetch PF keys ahead. The
 * step is bound by memory (fp32 K/V of every row, every layer), so the reads are what matters: 30 layers of a cpu-32
 * decode step (32 rows, 48-290 keys, page 256, K/V out of cache: 232 MB) 34.3 -> 19.2 ms, 7 -> 12 GB/s of a 21 GB/s
 * read bandwidth (2026-12-07, Xeon Sapphire Rapids, 2 threads; 36.1 -> 20.3 ms built with -mno-avx512f; a lone row
 * 2.1 -> 1.5 ms), where one task per (row, KV head) read 256 of every 768 bytes of a key, strided (a microbenchmark
 * of the kernel alone; `python -m cbnb.bench` measures the end-to-end effect).
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

/* Prefetch distance in keys: the hardware prefetchers see a KV head's 64 floats of each key as short strided runs;
 * asking for the keys PF ahead keeps enough lines in flight to stream near the machine's bandwidth. */
#define PF 8

/* One (row, KV heads kh0 .. kh0 + nkh): for each of their nkh * G query heads, scores, exact softmax and PV.
 * Keys outer, heads inner: each key's K (then V) vectors of the group are read once, contiguously, for all its
 * query heads; the accumulators (nkh * G * D floats) stay in L1. s holds nkh * G * n scores, inv their 1 / sums. */
static inline __attribute__((always_inline)) void task(const float *qb, int64_t q_head, const float *k, const float *v,
        int64_t blk, int64_t tok, int64_t head, int64_t page, const int64_t *tb, int64_t n, int64_t nkh,
        const int64_t G, const int64_t D, float scale, float *s, float *inv, float *acc, float *ob, int64_t o_head) {
    const int64_t R = nkh * G;
    const int64_t span = (nkh - 1) * head + D;  /* floats of one key the group reads */
    for (int64_t j0 = 0, p = 0; j0 < n; j0 += page, p++) {
        const int64_t m = n - j0 < page ? n - j0 : page;
        const float *kp = k + tb[p] * blk;
        for (int64_t t = 0; t < m; t++) {
            const float *kt = kp + t * tok;
            if (t + PF < m)
                for (int64_t c = 0; c < span; c += 16) __builtin_prefetch(kt + PF * tok + c);
            for (int64_t h = 0; h < nkh; h++) {
                const float *kj = kt + h * head;
                for (int64_t g = 0; g < G; g++) {
                    const float *qg = qb + (h * G + g) * q_head;
                    float a = 0.f;
#pragma omp simd reduction(+ : a)
                    for (int64_t d = 0; d < D; d++) a += qg[d] * kj[d];
                    s[(h * G + g) * n + j0 + t] = a * scale;
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        float *sr = s + r * n;
        float mx = sr[0];
        for (int64_t j = 1; j < n; j++) mx = sr[j] > mx ? sr[j] : mx;
        inv[r] = 1.f / exp_shifted_sum(sr, n, mx);
    }
    for (int64_t i = 0; i < R * D; i++) acc[i] = 0.f;
    for (int64_t j0 = 0, p = 0; j0 < n; j0 += page, p++) {
        const int64_t m = n - j0 < page ? n - j0 : page;
        const float *vp = v + tb[p] * blk;
        for (int64_t t = 0; t < m; t++) {
            const float *vt = vp + t * tok;
            if (t + PF < m)
                for (int64_t c = 0; c < span; c += 16) __builtin_prefetch(vt + PF * tok + c);
            for (int64_t h = 0; h < nkh; h++) {
                const float *vj = vt + h * head;
                for (int64_t g = 0; g < G; g++) {
                    const float pj = s[(h * G + g) * n + j0 + t];
                    float *a = acc + (h * G + g) * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) a[d] += pj * vj[d];
                }
            }
        }
    }
    for (int64_t h = 0; h < nkh; h++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = h * G + g;
            float *o = ob + r * o_head;
            for (int64_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv[r];
        }
}

int cbnb_paged_decode_f32(const float *q, int64_t q_row, int64_t q_head, const float *k, const float *v, int64_t blk,
                          int64_t tok, int64_t head, int64_t page, const int64_t *rows, const int64_t *tables,
                          int64_t W, const int64_t *lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale,
                          float *out, int64_t o_row, int64_t o_head, int64_t max_len, int nthreads) {
    if (Hkv <= 0 || H % Hkv != 0 || page <= 0 || max_len < 0 || D <= 0) return 1;
    const int64_t G = H / Hkv;
    /* A task is a row's KV heads, all of them when there are rows enough to keep every thread busy (contiguous
     * reads of whole keys), else one KV head (a lone request's decode still uses every thread). */
    const int64_t nkh = B >= 4 * (int64_t)nthreads ? Hkv : 1, groups = Hkv / nkh;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        /* scores, then 1 / sums, then the accumulators */
        float *s = (float *)malloc(sizeof(float) * (size_t)(nkh * G * (max_len + 1 + D)));
        if (s == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task_id = 0; task_id < B * groups; task_id++) {
            const int64_t b = task_id / groups, kh = (task_id % groups) * nkh;
            const int64_t n = lens[b];
            if (s == NULL || n <= 0 || n > max_len) {
                failed = 1;
                continue;
            }
            const float *qb = q + rows[b] * q_row + kh * G * q_head;
            float *ob = out + rows[b] * o_row + kh * G * o_head;
            const int64_t *tb = tables + b * W;
            float *inv = s + nkh * G * max_len, *acc = inv + nkh * G;
            if (D == 64 && G == 3)
                task(qb, q_head, k + kh * head, v + kh * head, blk, tok, head, page, tb, n, nkh, 3, 64, scale, s, inv, acc, ob, o_head);
            else if (D == 64)
                task(qb, q_head, k + kh * head, v + kh * head, blk, tok, head, page, tb, n, nkh, G, 64, scale, s, inv, acc, ob, o_head);
            else
                task(qb, q_head, k + kh * head, v + kh * head, blk, tok, head, page, tb, n, nkh, G, D, scale, s, inv, acc, ob, o_head);
        }
        free(s);
    }
    return failed ? 2 : 0;
}

/* ------------------------------------------------------------------------------------------- prefill (causal)
 * Multi-token rows (a prompt chunk, with or without a past) attend causally over their pages, after the chunk's own
 * K/V were written there: query i of row b sits at position starts[b] + i and reads keys 0..starts[b] + i. One task
 * is (row, KV head, block of QB queries): its G x QB query heads stream the row's keys in blocks of KB keys (read
 * through each key's offset in the pool, so a block may span pages of any size), with an online softmax (running max and sum per query head, the accumulator rescaled when
 * the max grows; the formulation of FlashAttention, Dao et al. 2022, section 3.1). Per block the keys are transposed
 * into a KB-wide scratch so QK^T runs over KB keys per vector FMA; PV runs over D per FMA. Causality skips the key
 * blocks a whole task never reads and bounds each query's keys in the last ones. */
#define QB 32
#define KB 64

/* The vector type: one register of the widest ISA the build targets (16 floats with AVX-512, else 8: AVX2). The
 * loops below keep NVQ / NVP of them per head in registers and make as many passes as the 64 keys or dims need (one
 * with AVX-512, two with AVX2). A 16-float vector type without AVX-512 (this kernel's first version) made GCC keep
 * the accumulators in memory: the prefill attention of a cpu-32 chunk step ran 5-8x slower built with -mno-avx512f
 * than with AVX-512 on the same Xeon, and as fast with these passes. No pass changes the order of a sum: every build
 * gives the same bits (tests/runner/test_cpu_kernels_isa.py). */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#define NVQ 4 /* vectors per head and pass in QK^T (keys) and PV (dims): 4 was the fastest on AVX2 as on AVX-512 */
#define NVP 4
typedef float vf __attribute__((vector_size(VW * sizeof(float))));

static inline __attribute__((always_inline)) vf loadv(const float *p) {
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* One query head's block of scores p[0..valid): scaled, folded into the head's running max and sum, and turned into
 * exp(score - max). Returns the factor the head's accumulator must be multiplied by first (1: the max held). */
static inline __attribute__((always_inline)) float online_softmax(float *p, int64_t valid, float scale, float *mx,
                                                                   float *sum) {
    float bm = -INFINITY;
#pragma omp simd reduction(max : bm)
    for (int64_t t = 0; t < valid; t++) {
        p[t] *= scale;
        bm = p[t] > bm ? p[t] : bm;
    }
    const float m_new = bm > *mx ? bm : *mx;
    float corr = 1.f;
    if (m_new > *mx && *sum > 0.f) {
        corr = exp_nonpos(*mx - m_new);
        *sum *= corr;
    }
    *mx = m_new;
    *sum += exp_shifted_sum(p, valid, m_new);
    return corr;
}

/* D = 64: up to 4 query heads of one position through QK^T and PV together, each transposed key column and each
 * value row loaded once per pass for all of them, scores and outputs in registers. `nh` is a constant at every
 * call, so the loops over heads unroll. */
static inline __attribute__((always_inline)) void heads64(const float *qb, int64_t q_head, const float *kt,
        const float *v, const int64_t *off, int64_t valid, float scale, int64_t r0, const int nh, float *acc,
        float *mx, float *sum) {
    float p[4][KB];
    for (int k0 = 0; k0 < KB; k0 += NVQ * VW) {
        vf s[4][NVQ];
        for (int c = 0; c < nh; c++)
            for (int j = 0; j < NVQ; j++) s[c][j] = (vf){0};
        for (int64_t d = 0; d < 64; d++) {
            const float *kd = kt + d * KB + k0;
            vf kv[NVQ];
            for (int j = 0; j < NVQ; j++) kv[j] = loadv(kd + VW * j);
            for (int c = 0; c < nh; c++) {
                const float qd = qb[c * q_head + d];
                for (int j = 0; j < NVQ; j++) s[c][j] += qd * kv[j];
            }
        }
        for (int c = 0; c < nh; c++) memcpy(p[c] + k0, s[c], sizeof s[c]);
    }
    float corr[4];
    for (int c = 0; c < nh; c++) corr[c] = online_softmax(p[c], valid, scale, mx + r0 + c, sum + r0 + c);
    for (int d0 = 0; d0 < 64; d0 += NVP * VW) {
        vf o[4][NVP];
        for (int c = 0; c < nh; c++)
            for (int j = 0; j < NVP; j++) o[c][j] = loadv(acc + (r0 + c) * 64 + d0 + VW * j) * corr[c];
        for (int64_t t = 0; t < valid; t++) {
            const float *vt = v + off[t] + d0;
            vf x[NVP];
            for (int j = 0; j < NVP; j++) x[j] = loadv(vt + VW * j);
            for (int c = 0; c < nh; c++) {
                const float pc = p[c][t];
                for (int j = 0; j < NVP; j++) o[c][j] += pc * x[j];
            }
        }
        for (int c = 0; c < nh; c++) memcpy(acc + (r0 + c) * 64 + d0, o[c], sizeof o[c]);
    }
}

/* Any D: one query head at a time, its accumulator in memory. */
static void head_any(const float *qv, const float *kt, const float *v, const int64_t *off, int64_t valid, float scale,
                     int64_t D, float *a, float *mx, float *sum) {
    vf s[KB / VW] = {{0}};
    for (int64_t d = 0; d < D; d++)
        for (int j = 0; j < KB / VW; j++) s[j] += qv[d] * loadv(kt + d * KB + VW * j);
    float p[KB];
    memcpy(p, s, sizeof p);
    const float corr = online_softmax(p, valid, scale, mx, sum);
    if (corr != 1.f)
        for (int64_t d = 0; d < D; d++) a[d] *= corr;
    for (int64_t t = 0; t < valid; t++) {
        const float pt = p[t], *vt = v + off[t];
#pragma omp simd
        for (int64_t d = 0; d < D; d++) a[d] += pt * vt[d];
    }
}

/* One task; `first` is the position of its first query, so its last query reads keys [0, first + nq). */
static inline __attribute__((always_inline)) void ptask(const float *qb, int64_t q_row, int64_t q_head,
        const float *k, const float *v, int64_t blk, int64_t tok, int64_t page, const int64_t *tb, int64_t first,
        int64_t nq, int64_t G, const int64_t D, float scale, float *kt, float *acc, float *mx, float *sum, float *ob,
        int64_t o_row, int64_t o_head, int64_t *off) {
    const int64_t R = nq * G, n_keys = first + nq;
    for (int64_t r = 0; r < R; r++) {
        mx[r] = -INFINITY;
        sum[r] = 0.f;
        memset(acc + r * D, 0, (size_t)D * sizeof(float));
    }
    for (int64_t j0 = 0; j0 < n_keys; j0 += KB) {
        const int64_t kb = n_keys - j0 < KB ? n_keys - j0 : KB;
        for (int64_t t = 0; t < kb;) {  /* each key's offset in the pool: a block may span pages */
            const int64_t pos = j0 + t, in_page = pos % page, base = tb[pos / page] * blk;
            const int64_t run = page - in_page < kb - t ? page - in_page : kb - t;
            for (int64_t u = 0; u < run; u++) off[t + u] = base + (in_page + u) * tok;
            t += run;
        }
        for (int64_t d = 0; d < D; d++) {
            float *row = kt + d * KB;
            for (int64_t t = 0; t < kb; t++) row[t] = k[off[t] + d];
            for (int64_t t = kb; t < KB; t++) row[t] = 0.f;
        }
        for (int64_t i = 0; i < nq; i++) {
            int64_t valid = first + i + 1 - j0;  /* keys of this block the query may read */
            if (valid <= 0) continue;
            valid = valid < kb ? valid : kb;
            const float *qi = qb + i * q_row;
            if (D == 64) {
                for (int64_t g = 0; g < G; g += 4) {
                    const float *qg = qi + g * q_head;
                    const int64_t r0 = i * G + g;
                    switch (G - g < 4 ? G - g : 4) {
                        case 4: heads64(qg, q_head, kt, v, off, valid, scale, r0, 4, acc, mx, sum); break;
                        case 3: heads64(qg, q_head, kt, v, off, valid, scale, r0, 3, acc, mx, sum); break;
                        case 2: heads64(qg, q_head, kt, v, off, valid, scale, r0, 2, acc, mx, sum); break;
                        default: heads64(qg, q_head, kt, v, off, valid, scale, r0, 1, acc, mx, sum); break;
                    }
                }
            } else {
                for (int64_t g = 0; g < G; g++) {
                    const int64_t r = i * G + g;
                    head_any(qi + g * q_head, kt, v, off, valid, scale, D, acc + r * D, mx + r, sum + r);
                }
            }
        }
    }
    for (int64_t i = 0; i < nq; i++)
        for (int64_t g = 0; g < G; g++) {
            const float w = 1.f / sum[i * G + g], *a = acc + (i * G + g) * D;
            float *o = ob + i * o_row + g * o_head;
            for (int64_t d = 0; d < D; d++) o[d] = a[d] * w;
        }
}

int cbnb_paged_prefill_f32(const float *q, int64_t q_row, int64_t q_head, const float *k, const float *v, int64_t blk,
                           int64_t tok, int64_t head, int64_t page, const int64_t *rows, const int64_t *starts,
                           const int64_t *counts, const int64_t *tables, int64_t W, int64_t B, int64_t H, int64_t Hkv,
                           int64_t D, float scale, float *out, int64_t o_row, int64_t o_head, int nthreads) {
    if (Hkv <= 0 || H % Hkv != 0 || page <= 0 || D <= 0) return 1;
    const int64_t G = H / Hkv;
    /* tasks: (row, KV head, query block); the prefix sums give each row's first task */
    int64_t *first_task = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1));
    if (first_task == NULL) return 3;
    first_task[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        if (counts[b] <= 0 || starts[b] < 0 || starts[b] + counts[b] > W * page) {
            free(first_task);
            return 2;
        }
        first_task[b + 1] = first_task[b] + Hkv * ((counts[b] + QB - 1) / QB);
    }
    const int64_t n_tasks = first_task[B];
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *kt = (float *)malloc(sizeof(float) * (size_t)(D * KB + 2 * QB * G + QB * G * D));
        int64_t *off = (int64_t *)malloc(sizeof(int64_t) * KB);
        if (kt == NULL || off == NULL) failed = 1;
        float *mx = kt + D * KB, *sum = mx + QB * G, *acc = sum + QB * G;
        int64_t b = 0;
        /* from the last task down: within a (row, KV head), later query blocks read more keys, so they go first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = n_tasks - 1; task >= 0; task--) {
            if (kt == NULL || off == NULL) continue;
            while (b > 0 && task < first_task[b]) b--;
            while (task >= first_task[b + 1]) b++;
            const int64_t local = task - first_task[b], blocks = (counts[b] + QB - 1) / QB;
            const int64_t kh = local / blocks, qi = (local % blocks) * QB;
            const int64_t nq = counts[b] - qi < QB ? counts[b] - qi : QB;
            const int64_t row = rows[b] + qi;
            const float *qb = q + row * q_row + kh * G * q_head;
            float *ob = out + row * o_row + kh * G * o_head;
            const int64_t *tb = tables + b * W;
            if (D == 64)
                ptask(qb, q_row, q_head, k + kh * head, v + kh * head, blk, tok, page, tb, starts[b] + qi, nq, G, 64,
                      scale, kt, acc, mx, sum, ob, o_row, o_head, off);
            else
                ptask(qb, q_row, q_head, k + kh * head, v + kh * head, blk, tok, page, tb, starts[b] + qi, nq, G, D,
                      scale, kt, acc, mx, sum, ob, o_row, o_head, off);
        }
        free(kt);
        free(off);
    }
    free(first_task);
    return failed ? 3 : 0;
}
