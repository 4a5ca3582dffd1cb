/* The integer part of cbnb's counter-based Gumbel noise (cbnb.runner.noise), in one pass: for row r and token j,
 * h = mix31(mix31(token_hash[j] ^ lo[r]) ^ hi[r]), written as u = ((h >> 8) + 0.5) * 2^-23, a float32 in (0, 1)
 * that is exact (23 bits). The same bits as the torch passes it replaces (about 26 int32 passes); the logs of
 * -log(-log u) stay in torch, so the noise equals the reference `gumbel_noise` bit for bit.
 */
#include <stdint.h>

#define M31 0x7FFFFFFFu
#define MUL 0x45D9F3Bu

/* The low 31 bits of the product are those of the exact (int64) product, so uint32 arithmetic gives mix31's values. */
static inline uint32_t mix31(uint32_t x) {
    x = ((x ^ (x >> 16)) * MUL) & M31;
    x = ((x ^ (x >> 16)) * MUL) & M31;
    return x ^ (x >> 16);
}

/* out [S, V] (row stride V) from token_hash [V] and the rows' 31-bit key halves lo [S], hi [S] (all values in
 * [0, 2^31)). Returns 0, or 1 for a size that is not positive. */
int cbnb_noise_uniform(float *out, const int32_t *token_hash, const int32_t *lo, const int32_t *hi, int64_t S,
                       int64_t V, int nthreads) {
    if (S <= 0 || V <= 0) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (S * V >= 65536)
    for (int64_t r = 0; r < S; r++) {
        const uint32_t a = (uint32_t)lo[r], b = (uint32_t)hi[r];
        float *o = out + r * V;
#pragma omp simd
        for (int64_t j = 0; j < V; j++) {
            const uint32_t h = mix31(mix31((uint32_t)token_hash[j] ^ a) ^ b);
            o[j] = ((float)(h >> 8) + 0.5f) * (1.0f / 8388608.0f);
        }
    }
    return 0;
}
