/* lowprec's fused CPU kernels for the eager round-to-nearest route (see _native.py and _elementwise.py).
 *
 * Built at first use with the system C compiler, with -ffp-contract=off so that no multiply-add is fused: every
 * float operation below is one IEEE float32 operation, in the same order as the tensor operations of
 * _elementwise.round_nearest_fast and _scaled._tensorwise_fast, so the results are the same bits.
 */
#include <stdint.h>
#include <string.h>

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* max |x[i]| into *amax; returns 1 when every x[i] is finite, else 0 (and *amax is not meaningful).
 * On the bits: for non-negative floats the order of the bit patterns as unsigned integers is the order of the
 * values, and every NaN or inf has |bits| >= 0x7f800000, so one integer max decides both. */
int lp_absmax(const float *x, int64_t n, float *amax)
{
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b = f2u(x[i]) & 0x7fffffffu;
        m = b > m ? b : m;
    }
    *amax = u2f(m);
    return m < 0x7f800000u;
}

/* y[i] = RNE(clamp(x[i] * mul)) * post: round-to-nearest-even onto a float format's grid by the float32 route
 *     c = max(2^E(v) * k, cmin),   RNE(v) = (v + c) - c,   E(v) = floor(log2 |v|)
 * (k = 1.5 * 2^(23 - M), cmin = 1.5 * 2^(23 + emin - M); the proof is in _elementwise.py's docstring).
 * scale_in / scale_out say whether the multiplications by mul and post happen (a multiplication by 1 would be
 * exact anyway; skipping it keeps the loop short).  clamp_on: clamp v to [-clampv, clampv] first.  signed_zero:
 * give zero results the sign of v (formats with a negative zero).  The caller guarantees finite inputs and
 * |v| small enough for v + c not to overflow. */
void lp_round_nearest(const float *x, float *y, int64_t n, float mul, int scale_in, float post, int scale_out,
                      float k, float cmin, int clamp_on, float clampv, int signed_zero)
{
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        if (scale_in) v = v * mul;
        if (clamp_on) v = v < -clampv ? -clampv : (v > clampv ? clampv : v);
        float c = u2f(f2u(v) & 0x7f800000u) * k;
        c = c < cmin ? cmin : c;
        float r = (v + c) - c;
        if (signed_zero) r = u2f((f2u(r) & 0x7fffffffu) | (f2u(v) & 0x80000000u));
        if (scale_out) r = r * post;
        y[i] = r;
    }
}
