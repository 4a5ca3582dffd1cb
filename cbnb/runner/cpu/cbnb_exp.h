/* exp(x) for x <= 0, Cephes' expf polynomial written inline (within 2e-7 relative of libm's on [-87, 0]), so loops
 * that call it vectorize, where libm's expf is a scalar call per element. Shared by cbnb's CPU kernels (a source's
 * build key covers this header: cbnb.runner.cpu.cpu_kernels.build_library). */
#ifndef CBNB_EXP_H
#define CBNB_EXP_H
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* x[j] = exp(x[j] - m) for j < n (m >= every x[j]: the softmax's max); returns their sum. */
static inline float exp_shifted_sum(float *x, int64_t n, float m) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; j++) {
        const float e = exp_nonpos(x[j] - m);
        x[j] = e;
        sum += e;
    }
    return sum;
}

#endif
