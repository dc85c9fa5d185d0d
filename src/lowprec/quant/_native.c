/* lowprec's fused CPU kernels for the eager round-to-nearest route (see _native.py and _elementwise.py).
 *
 * Built at first use with the system C compiler, with -ffp-contract=off so that no multiply-add is fused: every
 * float operation below is one IEEE float32 operation, in the same order as the tensor operations of
 * _elementwise.round_nearest_fast and _scaled._tensorwise_fast, so the results are the same bits.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <float.h>

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

/* y[i] = bfloat16 round-to-nearest-even of x[i] on the bits, one pass for every input (no amax pass first):
 * bfloat16 is float32 with the low 16 bits dropped (same exponent field, subnormals included), so RNE is
 * (b + 0x7fff + bit16) & 0xffff0000 on the bits b; the carry steps the magnitude to the next bfloat16 up, or from
 * the largest finite one to inf (IEEE overflow), and never reaches the sign.  saturate: finite magnitudes above
 * bfloat16's max (bits 0x7f7f0000) become +-max first (clamping before rounding = rounding then saturating: max
 * is on the grid).  NaN and inf pass unchanged (inf stays inf even when saturating), as in the integer route
 * (_round.quantize_f32).  Branch-free selects: the loop vectorizes.  y may be x (in place). */
void lp_round_bf16(const uint32_t *x, uint32_t *y, int64_t n, int saturate)
{
    if (saturate) {
        for (int64_t i = 0; i < n; i++) {
            uint32_t b = x[i], a = b & 0x7fffffffu;
            uint32_t v = (a > 0x7f7f0000u && a < 0x7f800000u) ? ((b & 0x80000000u) | 0x7f7f0000u) : b;
            uint32_t r = (v + 0x7fffu + ((v >> 16) & 1u)) & 0xffff0000u;
            y[i] = a < 0x7f800000u ? r : b;
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            uint32_t b = x[i];
            uint32_t r = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
            y[i] = (b & 0x7fffffffu) < 0x7f800000u ? r : b;
        }
    }
}

/* y[i] = round-to-nearest-even of x[i] onto an IEEE float format with inf and -0 (float16, float8_e5m2) in one
 * pass for every input, by the float32 route below on |x| clamped to 2 * fmax (v + c stays finite; anything above
 * fmax is overflow either way): r = (v + c) - c, then r > fmax overflows to inf, or to fmax when saturating, the
 * sign of x goes back on (zeros included), and NaN and inf pass unchanged (the integer route's rules for formats
 * with inf: _round.quantize_f32).  The caller checks that 2 * fmax passes route_fits.  y may be x (in place). */
void lp_round_ieee(const uint32_t *x, uint32_t *y, int64_t n, float k, float cmin, float fmax, int saturate)
{
    const uint32_t fmb = f2u(fmax), ovb = saturate ? fmb : 0x7f800000u;
    const float lim = 2.0f * fmax;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b = x[i], a = b & 0x7fffffffu;
        float v = u2f(a);
        v = v < lim ? v : lim;  /* (NaN: any value, replaced below) */
        float c = u2f(f2u(v) & 0x7f800000u) * k;
        c = c < cmin ? cmin : c;
        uint32_t rb = f2u((v + c) - c);
        rb = rb > fmb ? ovb : rb;
        y[i] = a < 0x7f800000u ? (rb | (b & 0x80000000u)) : b;
    }
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

/* lp_stats' first loop over one chunk of at most 2^24 elements (32-bit counters, so it vectorizes). */
static __attribute__((noinline)) void extrema_chunk(const uint32_t *xb, int64_t n, uint32_t *bmax_io, uint32_t *bmin_io,
                                                    uint32_t *nonzero_out, uint32_t *nonfinite_out)
{
    uint32_t bmax = 0, bmin = 0x7f800000u, c_nonzero = 0, c_nonfinite = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b = xb[i] & 0x7fffffffu;  /* the float's bits (read as integers: see -fno-strict-aliasing) */
        c_nonzero += b != 0u;  /* NaN counts as nonzero */
        c_nonfinite += b >= 0x7f800000u;
        uint32_t bf = b < 0x7f800000u ? b : 0u;  /* finite magnitudes, else 0 */
        uint32_t bn = b - 1u < 0x7f7fffffu ? b : 0x7f800000u;  /* finite nonzero (b in 1..0x7f7fffff), else inf */
        bmax = bf > bmax ? bf : bmax;
        bmin = bn < bmin ? bn : bmin;
    }
    *bmax_io = bmax > *bmax_io ? bmax : *bmax_io;
    *bmin_io = bmin < *bmin_io ? bmin : *bmin_io;
    *nonzero_out = c_nonzero;
    *nonfinite_out = c_nonfinite;
}

/* lp_stats' quantized counts over one chunk of at most 2^24 elements, for one v_mode (a compile-time constant
 * after inlining into count_quantized's switch: the loop has no branches and vectorizes). */
static inline __attribute__((always_inline)) void count_chunk(
    const float *x, const float *v, const float *q, int64_t n, const int v_mode, float v_scale, float pos_bound,
    int pos_incl, float neg_bound, int neg_incl, uint32_t *under_out, uint32_t *over_out)
{
    uint32_t c_under = 0, c_over = 0;
    for (int64_t i = 0; i < n; i++) {
        float xi = x[i], qi = q[i];
        float vi = v_mode == 0 ? v[i] : v_mode == 1 ? xi * v_scale : v_mode == 2 ? xi / v_scale : xi;
        float av = fabsf(vi);
        uint32_t neg = vi < 0.0f;
        float b = neg ? neg_bound : pos_bound;
        uint32_t incl = neg ? (uint32_t)neg_incl : (uint32_t)pos_incl;
        uint32_t past = (av > b) | (incl & (av == b));
        uint32_t finite = fabsf(xi) <= FLT_MAX, nonzero = xi != 0.0f;
        c_under += nonzero & (qi == 0.0f);
        c_over += finite & nonzero & (past | !(fabsf(qi) <= FLT_MAX));
    }
    *under_out = c_under;
    *over_out = c_over;
}

#define LP_COUNT_MODE(m) static __attribute__((noinline)) void count_mode_##m(const float *x, const float *v, \
    const float *q, int64_t n, float s, float pb, int pi, float nb, int ni, uint32_t *u, uint32_t *o) \
    { count_chunk(x, v, q, n, m, s, pb, pi, nb, ni, u, o); }
LP_COUNT_MODE(0)
LP_COUNT_MODE(1)
LP_COUNT_MODE(2)
LP_COUNT_MODE(3)
#undef LP_COUNT_MODE

/* Underflow count (returned) and overflow count (*n_over_out) of lp_stats, chunk by chunk. */
static int64_t count_quantized(const float *x, const float *v, const float *q, int64_t n, int v_mode, float v_scale,
                               float pos_bound, int pos_incl, float neg_bound, int neg_incl, int64_t *n_over_out)
{
    int64_t n_under = 0, n_over = 0;
    for (int64_t start = 0; start < n; start += 1 << 24) {
        int64_t len = n - start < (1 << 24) ? n - start : (1 << 24);
        const float *vs = v ? v + start : v;
        uint32_t u = 0, o = 0;
        switch (v_mode) {
        case 0: count_mode_0(x + start, vs, q + start, len, v_scale, pos_bound, pos_incl, neg_bound, neg_incl, &u, &o); break;
        case 1: count_mode_1(x + start, vs, q + start, len, v_scale, pos_bound, pos_incl, neg_bound, neg_incl, &u, &o); break;
        case 2: count_mode_2(x + start, vs, q + start, len, v_scale, pos_bound, pos_incl, neg_bound, neg_incl, &u, &o); break;
        default: count_mode_3(x + start, vs, q + start, len, v_scale, pos_bound, pos_incl, neg_bound, neg_incl, &u, &o);
        }
        n_under += u;
        n_over += o;
    }
    *n_over_out = n_over;
    return n_under;
}

/* sum x^2 and sum (x - q)^2 in double, as eight interleaved partial sums added pairwise at the end (a fixed
 * order, independent of the compiler). */
static void sums_of_squares(const float *x, const float *q, int64_t n, double *tx, double *td)
{
    typedef float v4f __attribute__((vector_size(16)));
    typedef double v4d __attribute__((vector_size(32)));
    v4d xa = {0, 0, 0, 0}, xb = xa, da = xa, db = xa;  /* lanes: partial sums of elements i % 8 == 0..3, 4..7 */
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v4f x0, x1, q0, q1;
        memcpy(&x0, x + i, 16); memcpy(&x1, x + i + 4, 16);
        memcpy(&q0, q + i, 16); memcpy(&q1, q + i + 4, 16);
        v4d a0 = __builtin_convertvector(x0, v4d), a1 = __builtin_convertvector(x1, v4d);
        v4d e0 = a0 - __builtin_convertvector(q0, v4d), e1 = a1 - __builtin_convertvector(q1, v4d);
        xa += a0 * a0; xb += a1 * a1; da += e0 * e0; db += e1 * e1;
    }
    for (; i < n; i++) {
        double a = (double)x[i], d = a - (double)q[i];
        xa[0] += a * a;
        da[0] += d * d;
    }
    *tx = ((xa[0] + xa[1]) + (xa[2] + xa[3])) + ((xb[0] + xb[1]) + (xb[2] + xb[3]));
    *td = ((da[0] + da[1]) + (da[2] + da[3])) + ((db[0] + db[1]) + (db[2] + db[3]));
}

/* Tensor statistics in one pass over x (the tensor), v (the scaled values the quantizer rounds, same layout) and
 * q (the fake-quantized tensor), for numerics._tensor_stats.  out[0..7]:
 *   amax over finite |x|, min over finite nonzero |x| (inf if none), count of nonzero x (NaN counts),
 *   count of non-finite x, underflow count (x != 0 and q == 0), overflow count (x finite and nonzero, and v
 *   past the bound for its sign or q non-finite), sum x^2 and sum (x - q)^2 in double.
 * q == NULL skips the quantized part (out[4..7] = 0).  The bounds: |v| > bound, or >= when *_incl.  v_mode says
 * where v comes from: the array v (0), or computed here from x as the quantizer does for one tensor-wide scale:
 * x * v_scale (1, float32 multipliers), x / v_scale (2, other scales), x itself (3, no scaling). */
void lp_stats(const float *x, const float *v, const float *q, int64_t n, float pos_bound, int pos_incl,
              float neg_bound, int neg_incl, int v_mode, float v_scale, double *out)
{
    /* Three branch-free loops that vectorize: extrema and counts of x, the quantized counts, the double sums of
     * squares (eight interleaved partial sums in a fixed order, so the result does not depend on the compiler). */
    /* extrema on the bits of |x|: for non-negative floats the unsigned order is the value order, and inf/NaN
     * are exactly the patterns >= 0x7f800000 (so every test below is integer arithmetic, which vectorizes) */
    uint32_t bmax = 0, bmin = 0x7f800000u;
    int64_t n_nonzero = 0, n_nonfinite = 0, n_under = 0, n_over = 0;
    for (int64_t start = 0; start < n; start += 1 << 24) {  /* 32-bit counters per chunk (they vectorize) */
        uint32_t c_nonzero = 0, c_nonfinite = 0;
        extrema_chunk((const uint32_t *)(const void *)(x + start), n - start < (1 << 24) ? n - start : (1 << 24), &bmax, &bmin, &c_nonzero,
                      &c_nonfinite);
        n_nonzero += c_nonzero;
        n_nonfinite += c_nonfinite;
    }
    float amax = u2f(bmax), amin = u2f(bmin);
    double tx = 0.0, td = 0.0;
    if (q) {
        n_under = count_quantized(x, v, q, n, v_mode, v_scale, pos_bound, pos_incl, neg_bound, neg_incl, &n_over);
        sums_of_squares(x, q, n, &tx, &td);
    }
    out[0] = amax; out[1] = amin; out[2] = (double)n_nonzero; out[3] = (double)n_nonfinite;
    out[4] = (double)n_under; out[5] = (double)n_over; out[6] = tx; out[7] = td;
}
