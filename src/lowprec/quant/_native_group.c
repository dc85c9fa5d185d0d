/* lowprec's fused CPU kernel for scaled fake quantization of any spec (see _native_group.py).
 *
 * One call does what _scaled._scales + _scaled._fake_kernel do as tensor operations: per-group amax, the group's
 * scale (float32 multiplier, E8M0 power of two, or a scale rounded into a float scale format, optionally over a
 * float32 tensor scale), the element rounding of _round.quantize_f32 (round_magnitude's integer arithmetic, then
 * the format's overflow, signed-zero and non-finite rules) with nearest, toward-zero or stochastic rounding (the
 * counter-based lowbias32 words of _random.py, computed in the same pass), and the dequantizing product.  Every
 * float operation is the IEEE float32 operation the tensor route performs, in the same order; the build uses
 * -ffp-contract=off (no fused multiply-add), so the results are the same bits.
 *
 * Layout: x is a float32 array viewed as [B, R, C] with row stride ld (C for a whole contiguous tensor; a range of
 * columns of one passes the full width); a group is gr consecutive rows by gc consecutive columns of one b (edge
 * groups are smaller).  The random counter of element (b, r, c) is off + b * sb + r * sr + c * sc (mod 2^32): its
 * row-major index in the tensor the caller quantizes (which may be a transposed view of x); a caller that splits
 * the tensor into ranges passes each range's own first counter as off.
 */
#include <stdint.h>
#include <string.h>

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

typedef struct {
    int32_t kind;        /* 0: float32 itself (no rounding), 1: signed float format, 2: integer format */
    int32_t mbits, emin; /* the grid (_round.round_magnitude) */
    int32_t rounding;    /* 0 nearest (ties to even; ties away when ties_away), 1 toward zero, 2 stochastic, 3 away */
    int32_t ties_away;
    int32_t clamp_over;  /* overflow gives +-fmax (saturate, a "finite" format, or toward zero) */
    int32_t neg_zero;    /* the format has a negative zero: results keep v's sign bit */
    int32_t special;     /* non-finite v: 0 stays (a format with inf), 1 +-fmax and NaN stays, 2 NaN */
    float fmax, fmin;    /* largest finite value; the integer format's most negative value */
    float over_value;    /* overflow without clamp_over: inf or NaN */
    int32_t float_route; /* round to nearest by the float route (round_float_route; integers: round_int_route)
                          * where the group is finite */
    float k, cmin;       /* its constants: 1.5 * 2^(23 - M), 1.5 * 2^(23 + emin - M) (integers: k = 1.5 * 2^23 * step) */
} lp_elem;

typedef struct {
    int32_t rule;        /* 0 no scale, 1 float32 multiplier m = fmax / amax, 2 power of two (E8M0; its exponent
                          * range within [-127, 127], no tensor scale), 3 float scale */
    int32_t pow2_mode;   /* rule 2: 0 floor, 1 ceil, 2 nearest */
    int32_t margin;      /* rule 2: added to the exponent */
    int32_t has_margin;  /* rules 1 and 3: multiply by margin_mul */
    float margin_mul;    /* rule 1: 2^-margin, rule 3: 2^margin */
    float elem_max;      /* the element format's largest value */
    int32_t elem_emax, elem_max_mant; /* rule 2: its exponent and 23 mantissa bits */
    int32_t s_emin, s_emax;           /* rule 2: the scale format's exponent range */
    float s_min, s_max;  /* rule 3: clamp to the scale format's positive range (TE's rule: no lower bound) */
    int32_t two_level;   /* rule 3: a float32 tensor scale first (NVFP4): 1 lowprec's division rule, 2 TE's */
    float denom;         /* rule 3: elem_max * scale format max */
    float inv_elem_max;  /* rule 3, TE: fl(1 / elem_max) */
    int32_t clamp_v;     /* rule 3, TE: clamp x * m to +-elem max before rounding (the spec saturates) */
    lp_elem sfmt;        /* rule 3: rounding of the scale into its format (kind 0: float32, no rounding) */
} lp_scale;

#define M1 0x7feb352du
#define M2 0x846ca68bu
static inline uint32_t h32(uint32_t x)
{
    x ^= x >> 16; x *= M1; x ^= x >> 15; x *= M2; x ^= x >> 16;
    return x;
}

/* 2.0f ** k for k in [-149, 127], built from bits (_round._pow2) */
static inline float pow2f(int32_t k)
{
    int32_t sh = k + 149; sh = sh < 0 ? 0 : (sh > 22 ? 22 : sh);
    uint32_t normal = (uint32_t)(k + 127) << 23, sub = 1u << sh;  /* both, then a select: the loops vectorize */
    return u2f(k >= -126 ? normal : sub);
}

/* _round.round_magnitude + quantize_f32's rules for one float32 value v (rb: its random word).  KIND and ROUND
 * are compile-time constants where the element loops call it (so the loops have no branches and vectorize). */
static inline __attribute__((always_inline)) float q_elem_k(float v, const lp_elem *e, uint32_t rb, const int KIND,
                                                            const int ROUND_FIN)
{
    /* ROUND_FIN 5 / 6 / 7: stochastic / nearest / toward-zero rounding of values the caller knows to be finite (no
     * special-value rules: the loops calling it vectorize, which those with the special-value selects do not) */
    const int FIN = ROUND_FIN >= 5 && ROUND_FIN <= 7;
    const int ROUND = ROUND_FIN == 5 ? 2 : (ROUND_FIN == 6 ? 0 : (ROUND_FIN == 7 ? 1 : ROUND_FIN));
    if (KIND == 0) return v;
    uint32_t bits = f2u(v), a = bits & 0x7fffffffu;
    int finite = FIN || a < 0x7f800000u;
    int32_t af = finite ? (int32_t)a : 0;
    int32_t ex = af >> 23, eff_e = ex < 1 ? 1 : ex;
    int32_t sig = ex > 0 ? ((af & 0x7fffff) | 0x800000) : af;
    int32_t sub = (e->emin + 127) - eff_e;
    int32_t d = (23 - e->mbits) + (sub > 0 ? sub : 0);
    int32_t dc = d > 30 ? 30 : d;
    int32_t n = sig >> dc, mask = (int32_t)((1u << dc) - 1u), rem = sig & mask;
    int32_t up = 0;
    if (ROUND == 0) {
        int32_t half = (int32_t)((1u << dc) >> 1);
        int32_t bias = e->ties_away ? half : half - 1 + (n & 1);
        up = (rem + bias) > mask;
    } else if (ROUND == 2) {
        int32_t u = (int32_t)((rb >> 1) & 0x7fffffffu);
        int32_t s1 = 31 - d; s1 = s1 < 0 ? 0 : (s1 > 31 ? 31 : s1);
        int32_t s2 = d - 31; s2 = s2 < 0 ? 0 : (s2 > 31 ? 31 : s2);
        int32_t thr = d <= 31 ? (int32_t)((uint32_t)rem << s1) : (sig >> s2);
        up = u < thr;
    } else if (ROUND == 3) {
        up = rem != 0;
    }
    n += up;
    int32_t big_e = eff_e - 127 < e->emin ? e->emin : eff_e - 127;
    float mag = (float)n * pow2f(big_e - e->mbits);
    int neg = (int32_t)bits < 0;
    if (KIND == 2) {  /* integers: one zero, clamp to the code range; inf saturates, NaN stays */
        float s = neg ? -mag : mag;
        s = s < e->fmin ? e->fmin : s;  /* (two selects, each one vmaxps / vminps) */
        s = s > e->fmax ? e->fmax : s;
        float out = s + 0.0f;
        if (FIN) return out;
        float special = v != v ? v : (v < e->fmin ? e->fmin : (v > e->fmax ? e->fmax : v));
        return finite ? out : special;
    }
    /* In integer arithmetic on the bits from here (so that every select is an integer select and the loop
     * vectorizes): mag >= 0 is finite, so mag > fmax is the unsigned order of their bits.  zero: added to the
     * signed result (+0 turns -0 into +0 for formats without a negative zero; -0 changes nothing). */
    uint32_t fmb = f2u(e->fmax), sgn = bits & 0x80000000u;
    uint32_t ovb = e->clamp_over ? fmb : f2u(e->over_value);
    float zero = e->neg_zero ? -0.0f : 0.0f;
    uint32_t mb = f2u(mag);
    if (ROUND == 2) {
        /* The same magnitude on the bits, in fewer operations.  With d <= 23 the d dropped bits lie in the mantissa
         * field and up = u < rem * 2^(31-d) is r < rem for r = u >> (31 - d), the top d bits of u: adding
         * mask - r = mask ^ r to the bits carries into bit d exactly when up, and clearing the low d bits leaves
         * (n + up) * 2^(E - M) (a carry out of the mantissa field steps the exponent: the next float up).  With
         * d >= 24, n = 0 and the magnitude is 0 or the format's smallest step 2^(emin - M), up when
         * u < thr = floor(|v| * 2^(31 - emin + M)) (sig << (31 - d), or sig >> (d - 31)): |v| times two powers of
         * two, exact, below 2^31 (formats whose emin is below float32's have d <= 23 always). */
        int32_t dl = d < 23 ? d : 23, kexp = 31 - e->emin + e->mbits;
        uint32_t u = rb >> 1, lm = (1u << dl) - 1u;
        uint32_t fast = ((uint32_t)af + (lm ^ (u >> (31 - dl)))) & ~lm;
        float t = (u2f((uint32_t)af) * pow2f(kexp >> 1)) * pow2f(kexp - (kexp >> 1));
        t = t < 0x1.fffffep30f ? t : 0x1.fffffep30f;
        uint32_t tiny = (int32_t)u < (int32_t)t ? f2u(pow2f(e->emin - e->mbits)) : 0u;
        mb = d <= 23 ? fast : tiny;
    }
    mb = mb > fmb ? ovb : mb;
    uint32_t outb = f2u(u2f(mb | sgn) + zero);
    if (FIN) return u2f(outb);
    uint32_t sp = a > 0x7f800000u ? bits : (fmb | sgn);  /* "finite" formats: NaN stays, inf -> +-fmax */
    sp = e->special == 0 ? bits : sp;
    sp = e->special == 2 ? 0x7fc00000u : sp;
    return u2f(finite ? outb : sp);
}

/* _scale._log2_parts: floor(log2 v) and the 23 mantissa bits of finite v >= 0 (subnormals normalised) */
static inline void log2_parts(float v, int32_t *ex, int32_t *mant)
{
    /* both candidates, then integer selects: the loops that call it have no branches and vectorize */
    uint32_t b0 = f2u(v), b1 = f2u(v * 0x1p64f);  /* (exact) */
    int32_t sub = b0 < 0x00800000u;
    uint32_t b = sub ? b1 : b0;
    *ex = (int32_t)(b >> 23) - (sub ? 127 + 64 : 127);
    *mant = (int32_t)(b & 0x7fffffu);
}

/* The tensor scales of a two-level spec from the tensor's finite amax at (_scale.tensor_scale_from_amax): s_t (the
 * stored decode scale), and for TE's rule m6 = fl(S_enc * fl(1/elem_max)) and S_dec = fl(1 / S_enc) */
static void tensor_scales(float at, const lp_scale *s, float *s_t, float *m6, float *s_dec)
{
    float t = at / s->denom;
    if (s->two_level == 1) {
        *s_t = at > 0.0f ? (t < 0x1p-126f ? 0x1p-126f : t) : 1.0f;
        return;
    }
    float enc = at > 0.0f ? s->denom / at : 1.0f;  /* TE's compute_global_encode_scaling_factor_FP4 */
    enc = enc > 0x1.fffffep127f ? 0x1.fffffep127f : enc;
    *m6 = enc * s->inv_elem_max;
    *s_dec = 1.0f / enc;
    *s_t = at > 0.0f ? (t == 0.0f ? 0x1p-149f : t) : 1.0f;
}

/* One group's (divisor or multiplier, dequantization factor) from its finite amax (_scale.group_scale).  RULE: 1
 * float32 multiplier, 2 power of two, 3 float scale (divided by the tensor scale s_t of a two-level spec, else
 * s_t = 1), 4 float scale by TE's two-level rule; SK, SR: the scale format's kind and rounding (rules 3 and 4).  mm:
 * the margin's multiplier, or 1.  A multiplication or division by 1 is exact, so these stand for the tensor route's
 * "if" without one; with RULE, SK, SR compile-time constants (block_scales' loops) the loops have no branches and
 * vectorize. */
static inline __attribute__((always_inline)) void group_scale(float amax, const lp_scale *s, float s_t, float m6,
                                                              float s_dec, float mm, float *q, float *deq,
                                                              const int RULE, const int SK, const int SR)
{
    if (RULE == 1) {
        float m = s->elem_max / amax;  /* amax 0 -> inf -> float32 max */
        m = m > 0x1.fffffep127f ? 0x1.fffffep127f : m;
        m = m * mm;
        *q = m;
        *deq = 1.0f / m;
    } else if (RULE == 2) {  /* SK: pow2_mode, floor, ceil or nearest (0, 1, 2) */
        int32_t ex, mant, rex, rmant;
        log2_parts(amax, &ex, &mant);
        log2_parts(amax / s->elem_max, &rex, &rmant);
        int32_t kf = ex - s->elem_emax, kc = kf + (mant > s->elem_max_mant), kn = rex + (rmant >= 0x400000);
        int32_t k = (SK == 0 ? kf : (SK == 1 ? kc : kn)) + s->margin;
        k = k < s->s_emin ? s->s_emin : (k > s->s_emax ? s->s_emax : k);
        *q = pow2f(-k);  /* x / 2^k is x * 2^-k (exact for |k| <= 127): both are the exact value rounded once */
        *deq = pow2f(k);
    } else if (RULE == 4) {  /* TE: no lower bound; codes = Q(clamp(x * m)), m = fl(1 / fl(sc * S_dec)) */
        float raw = q_elem_k((amax * m6) * mm, &s->sfmt, 0u, SK, SR);
        float sc = raw > s->s_max ? s->s_max : raw;
        float m = 1.0f / (sc * s_dec);
        *q = m > 0x1.fffffep127f ? 0x1.fffffep127f : m;
        *deq = sc * s_t;
    } else {
        float raw = q_elem_k(((amax / s->elem_max) / s_t) * mm, &s->sfmt, 0u, SK, SR);
        float sc = raw < s->s_min ? s->s_min : (raw > s->s_max ? s->s_max : raw);
        float eff = sc * s_t;
        *q = eff;
        *deq = eff;
    }
}

typedef void (*scales_fn)(const uint32_t *, int64_t, const lp_scale *, float, float, float, float *, float *);

#define LP_SCALES(RULE, SK, SR)                                                                                     \
    static __attribute__((noinline)) void scales_##RULE##SK##SR(const uint32_t *amax, int64_t n,                    \
                                                                 const lp_scale *s0, float s_t, float m6,           \
                                                                 float s_dec, float *qs, float *deq)                \
    {                                                                                                               \
        lp_scale s = *s0;                                                                                           \
        float mm = s.has_margin ? s.margin_mul : 1.0f;                                                              \
        _Pragma("omp simd")                                                                                         \
        for (int64_t i = 0; i < n; i++)                                                                             \
            group_scale(u2f(amax[i]), &s, s_t, m6, s_dec, mm, qs + i, deq + i, RULE, SK, SR);                       \
    }
#define LP_SCALES_K(RULE, SK) LP_SCALES(RULE, SK, 0) LP_SCALES(RULE, SK, 1) LP_SCALES(RULE, SK, 3)
#define LP_SCALES_R(RULE) LP_SCALES_K(RULE, 0) LP_SCALES_K(RULE, 1) LP_SCALES_K(RULE, 2)
LP_SCALES(1, 0, 0)
LP_SCALES(2, 0, 0)
LP_SCALES(2, 1, 0)
LP_SCALES(2, 2, 0)
LP_SCALES_R(3)
LP_SCALES_R(4)
#undef LP_SCALES_R
#undef LP_SCALES_K
#undef LP_SCALES

/* The scale loop for s: its rule, and for float scales the scale format's kind and rounding (0, 1 or 3).  The
 * loops take s_t = 1 where there is no tensor scale. */
static scales_fn scales_for(const lp_scale *s)
{
#define LP_ROW(RULE, SK) {scales_##RULE##SK##0, scales_##RULE##SK##1, 0, scales_##RULE##SK##3}
    static const scales_fn FLOAT[2][3][4] = {{LP_ROW(3, 0), LP_ROW(3, 1), LP_ROW(3, 2)},
                                             {LP_ROW(4, 0), LP_ROW(4, 1), LP_ROW(4, 2)}};
#undef LP_ROW
    if (s->rule == 1) return scales_100;
    if (s->rule == 2) return s->pow2_mode == 0 ? scales_200 : (s->pow2_mode == 1 ? scales_210 : scales_220);
    return FLOAT[s->two_level == 2][s->sfmt.kind][s->sfmt.rounding];
}

/* block_amax's update of nb whole blocks of GC elements of one row (GC a compile-time constant: no loop set-up per
 * block, one vector per block); returns nb */
#define LP_AMAX(GC)                                                                                                 \
    static __attribute__((noinline)) int64_t amax_##GC(const uint32_t *row, int64_t nb, uint32_t *amax)             \
    {                                                                                                               \
        for (int64_t cb = 0; cb < nb; cb++) {                                                                       \
            uint32_t m = amax[cb];                                                                                  \
            for (int64_t c = 0; c < GC; c++) {                                                                      \
                uint32_t v = row[cb * GC + c] & 0x7fffffffu;                                                        \
                m = v > m ? v : m;                                                                                  \
            }                                                                                                       \
            amax[cb] = m;                                                                                           \
        }                                                                                                           \
        return nb;                                                                                                  \
    }
LP_AMAX(16)
LP_AMAX(32)
#undef LP_AMAX

/* max |x| over each of the nc column groups of one row block (rows rows of C elements, row stride ld) into amax,
 * as float bits (NaN/inf have bits >= 0x7f800000); returns the largest. */
static uint32_t block_amax(const float *x, int64_t rows, int64_t C, int64_t ld, int64_t gc, uint32_t *amax)
{
    int64_t nc = (C + gc - 1) / gc;
    memset(amax, 0, (size_t)nc * sizeof(uint32_t));
    const uint32_t *xb = (const uint32_t *)(const void *)x;
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *row = xb + r * ld;
        if (gc == 1) {
            for (int64_t c = 0; c < C; c++) {
                uint32_t v = row[c] & 0x7fffffffu;
                amax[c] = v > amax[c] ? v : amax[c];
            }
        } else {
            int64_t cb = 0;
            if (gc == 16) cb = amax_16(row, C / 16, amax);
            else if (gc == 32) cb = amax_32(row, C / 32, amax);
            for (; cb < nc; cb++) {
                int64_t c0 = cb * gc, c1 = c0 + gc < C ? c0 + gc : C;
                uint32_t m = amax[cb];
                for (int64_t c = c0; c < c1; c++) {
                    uint32_t v = row[c] & 0x7fffffffu;
                    m = v > m ? v : m;
                }
                amax[cb] = m;
            }
        }
    }
    uint32_t top = 0;
    for (int64_t cb = 0; cb < nc; cb++) top = amax[cb] > top ? amax[cb] : top;
    return top;
}

/* max |x| over a whole [B, R, C] array (row stride ld) as float bits */
static uint32_t all_amax(const float *x, int64_t B, int64_t R, int64_t C, int64_t ld)
{
    const uint32_t *xb = (const uint32_t *)(const void *)x;
    uint32_t m = 0;
    for (int64_t r = 0; r < B * R; r++) {
        const uint32_t *row = xb + r * ld;
        for (int64_t c = 0; c < C; c++) {
            uint32_t v = row[c] & 0x7fffffffu;
            m = v > m ? v : m;
        }
    }
    return m;
}

/* Round-to-nearest-even of a finite v by the float32 route of _elementwise.round_nearest_fast (the same
 * operations as _native.c's lp_round_nearest): clamp to +-fmax (the format saturates, so clamping first equals
 * rounding then saturating), c = max(2^E(v) * k, cmin), r = (v + c) - c, the sign of v on zero results for formats
 * with a negative zero.  ROUND 4: only for finite groups, signed float formats with 1..20 mantissa bits and
 * float32's exponent range, round to nearest, clamp_over (the caller checks). */
static inline __attribute__((always_inline)) float round_float_route(float v, const lp_elem *e)
{
    v = v < -e->fmax ? -e->fmax : v;  /* (two selects, each one vmaxps / vminps; NaN passes either way) */
    v = v > e->fmax ? e->fmax : v;
    float c = u2f(f2u(v) & 0x7f800000u) * e->k;
    c = c < e->cmin ? e->cmin : c;
    float r = (v + c) - c;
    uint32_t rb = e->neg_zero ? ((f2u(r) & 0x7fffffffu) | (f2u(v) & 0x80000000u)) : f2u(r);
    return u2f(rb);
}

/* Round-to-nearest-even of a finite v onto an integer format's codes (ROUND 4 with KIND 2): clamp to the code range
 * [fmin, fmax] (on the grid: clamping first equals rounding then clamping), then r = (v + k) - k with k = 1.5 * 2^23
 * * step, the one grid step 2^(emin - M) of every code (the caller checks max |code| < 2^(emin + 1)); v + k lies in
 * [2^23 step, 2^24 step), where float32's spacing is the step, so the addition rounds to nearest-even (k / step is
 * even) and the subtraction is exact.  Zero results are +0 (x - x), as integers have one zero. */
static inline __attribute__((always_inline)) float round_int_route(float v, const lp_elem *e)
{
    v = v < e->fmin ? e->fmin : v;
    v = v > e->fmax ? e->fmax : v;
    return (v + e->k) - e->k;
}

/* The rounded, dequantized elements of one row segment: one scale for all (qs: multiplier or divisor, deq) when
 * PER_COL is 0, else one per element (the arrays qsv, deqv).  RULE: 0 no scale, 1 multiply, 2 divide, 3 multiply
 * and clamp to +-fmax (TE's NVFP4 rule: x times a zero scale's multiplier, float32 max, may be inf). */
static inline __attribute__((always_inline)) void segment(const float *x, float *y, int64_t n, const lp_elem *e,
                                                          float qs, float deq, const float *qsv, const float *deqv,
                                                          uint32_t cnt0, uint32_t cstep, uint32_t k1, uint32_t k2,
                                                          const int RULE, const int ROUND, const int KIND,
                                                          const int PER_COL)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float m = PER_COL ? qsv[i] : qs, dq = PER_COL ? deqv[i] : deq;
        float v = RULE == 0 ? x[i] : (RULE == 2 ? x[i] / m : x[i] * m);
        if (RULE == 3) {  /* two selects, each one vmaxps / vminps (NaN passes either way) */
            v = v < -e->fmax ? -e->fmax : v;
            v = v > e->fmax ? e->fmax : v;
        }
        uint32_t rb = ROUND == 2 || ROUND == 5 ? h32(h32(cnt0 + (uint32_t)i * cstep + k1) ^ k2) : 0u;
        float q = ROUND == 4 ? (KIND == 2 ? round_int_route(v, e) : round_float_route(v, e))
                             : q_elem_k(v, e, rb, KIND, ROUND);
        y[i] = RULE == 0 ? q : q * dq;
    }
}

typedef void (*seg_fn)(const float *, float *, int64_t, const lp_elem *, float, float, const float *, const float *,
                       uint32_t, uint32_t, uint32_t, uint32_t);

#define LP_SEG(RULE, ROUND, KIND, PC)                                                                               \
    static __attribute__((noinline)) void seg_##RULE##ROUND##KIND##PC(                                                \
        const float *x, float *y, int64_t n, const lp_elem *e0, float qs, float deq, const float *qsv,               \
        const float *deqv, uint32_t cnt0, uint32_t cstep, uint32_t k1, uint32_t k2)                                  \
    {                                                                                                               \
        lp_elem e = *e0;                                                                                            \
        segment(x, y, n, &e, qs, deq, qsv, deqv, cnt0, cstep, k1, k2, RULE, ROUND, KIND, PC);                        \
    }
#define LP_SEG_K(RULE, ROUND, PC) LP_SEG(RULE, ROUND, 1, PC) LP_SEG(RULE, ROUND, 2, PC)
#define LP_SEG_R(RULE, PC) LP_SEG_K(RULE, 0, PC) LP_SEG_K(RULE, 1, PC) LP_SEG_K(RULE, 2, PC)
LP_SEG_R(0, 0)
LP_SEG_R(1, 0)
LP_SEG_R(2, 0)
LP_SEG_R(1, 1)
LP_SEG_R(2, 1)
LP_SEG_R(3, 0)
LP_SEG_R(3, 1)
LP_SEG_K(1, 4, 0)
LP_SEG_K(1, 4, 1)
LP_SEG_K(2, 4, 0)
LP_SEG_K(2, 4, 1)
LP_SEG_K(0, 5, 0)
LP_SEG_K(0, 6, 0)
LP_SEG_K(0, 7, 0)
LP_SEG_K(1, 5, 0)
LP_SEG_K(1, 5, 1)
LP_SEG_K(2, 5, 0)
LP_SEG_K(2, 5, 1)
LP_SEG_K(3, 5, 0)
LP_SEG_K(3, 5, 1)
#define LP_ROW(RULE, PC) {{seg_##RULE##01##PC, seg_##RULE##02##PC}, {seg_##RULE##11##PC, seg_##RULE##12##PC}, \
                          {seg_##RULE##21##PC, seg_##RULE##22##PC}}
static const seg_fn SEGS[4][3][2] = {LP_ROW(0, 0), LP_ROW(1, 0), LP_ROW(2, 0), LP_ROW(3, 0)};
static const seg_fn COLS[4][3][2] = {LP_ROW(0, 0), LP_ROW(1, 1), LP_ROW(2, 1), LP_ROW(3, 1)};
#undef LP_ROW
/* stochastic rounding of finite scaled values (ROUND_FIN 5), [rule][kind] */
#define LP_ROW(RULE, PC) {seg_##RULE##51##PC, seg_##RULE##52##PC}
static const seg_fn SEGS_FIN[4][2] = {LP_ROW(0, 0), LP_ROW(1, 0), LP_ROW(2, 0), LP_ROW(3, 0)};
/* unscaled rounding of finite values, [rounding: nearest, toward zero, stochastic][kind] */
static const seg_fn UNSCALED_FIN[3][2] = {{seg_0610, seg_0620}, {seg_0710, seg_0720}, {seg_0510, seg_0520}};
static const seg_fn COLS_FIN[4][2] = {{0, 0}, LP_ROW(1, 1), LP_ROW(2, 1), LP_ROW(3, 1)};
#undef LP_ROW
#undef LP_SEG_R
#undef LP_SEG_K
#undef LP_SEG

/* A row of blocks of GC elements along it (GC 16 or 32, a compile-time constant), the block scales qsv / deqv one per
 * block (not spread over the row): each whole block is one fully vectorized loop with its scale broadcast, the
 * partial last block (n not a multiple of GC) a loop of its own.  Same signature as the seg_ functions. */
#define LP_BLK(RULE, ROUND, KIND, GC)                                                                               \
    static __attribute__((noinline)) void blk_##RULE##ROUND##KIND##_##GC(                                           \
        const float *x, float *y, int64_t n, const lp_elem *e0, float qs, float deq, const float *qsv,               \
        const float *deqv, uint32_t cnt0, uint32_t cstep, uint32_t k1, uint32_t k2)                                  \
    {                                                                                                               \
        lp_elem e = *e0;                                                                                            \
        int64_t nb = n / GC;                                                                                        \
        (void)qs; (void)deq;                                                                                        \
        for (int64_t b = 0; b < nb; b++)                                                                            \
            segment(x + b * GC, y + b * GC, GC, &e, qsv[b], deqv[b], 0, 0, cnt0 + (uint32_t)(b * GC) * cstep,       \
                    cstep, k1, k2, RULE, ROUND, KIND, 0);                                                           \
        if (n > nb * GC)                                                                                            \
            segment(x + nb * GC, y + nb * GC, n - nb * GC, &e, qsv[nb], deqv[nb], 0, 0,                             \
                    cnt0 + (uint32_t)(nb * GC) * cstep, cstep, k1, k2, RULE, ROUND, KIND, 0);                       \
    }
#define LP_BLK_K(RULE, ROUND, GC) LP_BLK(RULE, ROUND, 1, GC) LP_BLK(RULE, ROUND, 2, GC)
#define LP_BLK_R(RULE, GC) LP_BLK_K(RULE, 0, GC) LP_BLK_K(RULE, 1, GC) LP_BLK_K(RULE, 2, GC)
#define LP_BLK_G(GC) LP_BLK_R(1, GC) LP_BLK_R(2, GC) LP_BLK_R(3, GC) LP_BLK_K(1, 4, GC) LP_BLK_K(2, 4, GC) \
    LP_BLK_K(1, 5, GC) LP_BLK_K(2, 5, GC) LP_BLK_K(3, 5, GC)
LP_BLK_G(16)
LP_BLK_G(32)
#define LP_ROW(RULE, GC) {{blk_##RULE##01_##GC, blk_##RULE##02_##GC}, {blk_##RULE##11_##GC, blk_##RULE##12_##GC}, \
                          {blk_##RULE##21_##GC, blk_##RULE##22_##GC}}
static const seg_fn BLKS[2][4][3][2] = {{{{0, 0}, {0, 0}, {0, 0}}, LP_ROW(1, 16), LP_ROW(2, 16), LP_ROW(3, 16)},
                                        {{{0, 0}, {0, 0}, {0, 0}}, LP_ROW(1, 32), LP_ROW(2, 32), LP_ROW(3, 32)}};
#undef LP_ROW
#define LP_ROW(RULE, GC) {blk_##RULE##51_##GC, blk_##RULE##52_##GC}
static const seg_fn BLKS_FIN[2][4][2] = {{{0, 0}, LP_ROW(1, 16), LP_ROW(2, 16), LP_ROW(3, 16)},
                                         {{0, 0}, LP_ROW(1, 32), LP_ROW(2, 32), LP_ROW(3, 32)}};
#undef LP_ROW
/* the float (integer) route, [divide][kind]: one scale, one per element, per block of 16 or 32 */
static const seg_fn ROUTE_SEG[2][2] = {{seg_1410, seg_1420}, {seg_2410, seg_2420}};
static const seg_fn ROUTE_COL[2][2] = {{seg_1411, seg_1421}, {seg_2411, seg_2421}};
static const seg_fn ROUTE_BLK[2][2][2] = {{{blk_141_16, blk_142_16}, {blk_241_16, blk_242_16}},
                                          {{blk_141_32, blk_142_32}, {blk_241_32, blk_242_32}}};
#undef LP_BLK_G
#undef LP_BLK_R
#undef LP_BLK_K
#undef LP_BLK

/* Stochastic rounding of finite values onto a float format with float32's exponent range or more (emin <= -126:
 * bfloat16 and the other e8 formats): there the d = 23 - M dropped bits always lie in the mantissa field, so
 * q_elem_k's ROUND_FIN 5 result is its "fast" branch alone: the bits plus (mask ^ top d bits of u), the low d bits
 * cleared, then the overflow and zero rules (the same bits in a third of the operations).  Same signature as the
 * seg_ functions; the scale arguments are unused. */
static __attribute__((noinline)) void seg_sr_wide(const float *x, float *y, int64_t n, const lp_elem *e0, float qs,
                                                  float deq, const float *qsv, const float *deqv, uint32_t cnt0,
                                                  uint32_t cstep, uint32_t k1, uint32_t k2)
{
    (void)qs; (void)deq; (void)qsv; (void)deqv;
    const uint32_t *xb = (const uint32_t *)(const void *)x;
    uint32_t *yb = (uint32_t *)(void *)y;
    int32_t d = 23 - e0->mbits;
    uint32_t lm = (1u << d) - 1u, fmb = f2u(e0->fmax), ovb = e0->clamp_over ? fmb : f2u(e0->over_value);
    float zero = e0->neg_zero ? -0.0f : 0.0f;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = xb[i], a = bits & 0x7fffffffu, sgn = bits & 0x80000000u;
        uint32_t u = h32(h32(cnt0 + (uint32_t)i * cstep + k1) ^ k2) >> 1;
        uint32_t mb = (a + (lm ^ (u >> (31 - d)))) & ~lm;
        mb = mb > fmb ? ovb : mb;
        yb[i] = f2u(u2f(mb | sgn) + zero);
    }
}

/* Unscaled rounding of n elements: pieces of 1024, each by the loop without special-value rules where the piece is
 * finite (one integer max over its bits, which also brings it into cache), else the full loop. */
/* max |bits| of n floats (an integer max: NaN and inf compare above every finite value) */
static inline uint32_t max_abs_bits(const float *x, int64_t n)
{
    const uint32_t *xb = (const uint32_t *)(const void *)x;
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t v = xb[i] & 0x7fffffffu;
        m = v > m ? v : m;
    }
    return m;
}

static void unscaled_pieces(const float *x, float *y, int64_t n, const lp_elem *e, seg_fn full, seg_fn fin, uint32_t cnt,
                        uint32_t cstep, uint32_t k1, uint32_t k2)
{
    for (int64_t c0 = 0; c0 < n; c0 += 1024) {
        int64_t len = n - c0 < 1024 ? n - c0 : 1024;
        uint32_t m = max_abs_bits(x + c0, len);
        (m < 0x7f800000u ? fin : full)(x + c0, y + c0, len, e, 1.0f, 1.0f, 0, 0, cnt + (uint32_t)c0 * cstep, cstep,
                                       k1, k2);
    }
}

/* Fake-quantize x into y (module comment): one row block (gr rows, all C columns, of one b) at a time, its group
 * amaxes, scales and elements together, so that the element pass reads the block from cache.  ld: the row stride
 * of x and y in elements (C for a whole tensor; the caller's split into column ranges passes the full width), the
 * b stride is R * ld.  amax_mode: 0 every amax from x (a two-level spec's tensor amax by one pass first); 1
 * amax_in is the tensor amax of a two-level spec (the caller's split into row or column ranges, having read the
 * whole tensor), the group amaxes from x; 2 every group's amax is amax_in (one group spans the caller's whole
 * tensor: tensor scaling, split).  work: 3 * ceil(C/gc) + 2 * C floats.  Returns 0, having written nothing
 * meaningful, when a group holds NaN or inf (the caller runs the tensor route), else 1. */
int lp_group_fake(const float *x, float *y, int64_t B, int64_t R, int64_t C, int64_t ld, int64_t gr, int64_t gc,
                  const lp_elem *e, const lp_scale *s, uint32_t k1, uint32_t k2, uint32_t off, int64_t sb,
                  int64_t sr, int64_t sc, int32_t amax_mode, float amax_in, float *work)
{
    int64_t nr = (R + gr - 1) / gr, nc = (C + gc - 1) / gc;
    float *qs = work, *deq = work + nc, *rowq = work + 3 * nc, *rowd = rowq + C;
    uint32_t *amax = (uint32_t *)(void *)(work + 2 * nc);
    float s_t = 1.0f, m6 = 0.0f, s_dec = 0.0f;
    int te = s->rule == 3 && s->two_level == 2;
    if (s->rule != 0 && s->two_level) {  /* _scale.tensor_scale_from_amax on the max of the group amaxes */
        uint32_t top = amax_mode ? f2u(amax_in) : all_amax(x, B, R, C, ld);
        if (top >= 0x7f800000u) return 0;
        tensor_scales(u2f(top), s, &s_t, &m6, &s_dec);
    }
    /* the float route needs every scaled value finite: max |v| of a group is its amax scaled (rounding is
     * monotonic); a degenerate scale (an infinite multiplier from a subnormal amax and a negative margin) keeps the
     * exact route, whose special-value rules then apply.  Decided per row block (it gives the exact route's bits
     * wherever it is taken).  TE's rule with saturation clamps x * m to +-max before rounding (rule 3), as the
     * float route does first: there every product may be taken, inf included. */
    int clamped = te && s->clamp_v;
    /* power-of-two scales multiply by 2^-k; TE's rule multiplies by fl(1 / fl(sc * S_dec)) */
    int rule = s->rule == 0 ? 0 : (s->rule == 3 && !te ? 2 : (clamped ? 3 : 1));
    int rnd = e->rounding == 2 ? 2 : (e->rounding == 1 ? 1 : 0);
    int kind = e->kind == 2 ? 1 : 0;
    scales_fn scales = s->rule != 0 ? scales_for(s) : 0;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t rb = 0; rb < nr; rb++) {
            int64_t r0 = rb * gr, r1 = r0 + gr < R ? r0 + gr : R;
            const float *xblk = x + (b * R + r0) * ld;
            int fixed = rule != 0 && nc > 1 && (gc == 16 || gc == 32);  /* blocks of 16 or 32 along the row */
            seg_fn seg = SEGS[rule][rnd][kind];
            seg_fn col = fixed ? BLKS[gc == 32][rule][rnd][kind] : COLS[rule][rnd][kind];
            if (rule != 0) {
                if (amax_mode == 2) {
                    for (int64_t cb = 0; cb < nc; cb++) amax[cb] = f2u(amax_in);
                } else if (block_amax(xblk, r1 - r0, C, ld, gc, amax) >= 0x7f800000u) {
                    return 0;
                }
                scales(amax, nc, s, s_t, m6, s_dec, qs, deq);
                int fin = 1;  /* every scaled value of the block finite */
                for (int64_t cb = 0; fin && !clamped && cb < nc; cb++) {
                    float a = u2f(amax[cb]), vmax = rule == 2 ? a / qs[cb] : a * qs[cb];
                    fin = vmax <= 0x1.fffffep127f;
                }
                /* (TE's clamp to +-fmax is not the integer route's clamp to [fmin, fmax]) */
                int route = e->float_route && fin && !(clamped && e->kind == 2);
                if (fin && rnd == 2) {
                    seg = SEGS_FIN[rule][kind];
                    col = fixed ? BLKS_FIN[gc == 32][rule][kind] : COLS_FIN[rule][kind];
                }
                if (route) {  /* rule 3: the float route clamps first */
                    seg = ROUTE_SEG[rule == 2][kind];
                    col = fixed ? ROUTE_BLK[gc == 32][rule == 2][kind] : ROUTE_COL[rule == 2][kind];
                }
                if (gc > 1 && nc > 1 && !fixed) {  /* other blocks along the row: their scales spread over the row
                                                    * once per row block, so that one vectorized loop runs over it */
                    for (int64_t cb = 0; cb < nc; cb++) {
                        int64_t c0 = cb * gc, c1 = c0 + gc < C ? c0 + gc : C;
                        for (int64_t c = c0; c < c1; c++) {
                            rowq[c] = qs[cb];
                            rowd[c] = deq[cb];
                        }
                    }
                }
            }
            for (int64_t r = r0; r < r1; r++) {
                const float *xr = x + (b * R + r) * ld;
                float *yr = y + (b * R + r) * ld;
                uint32_t cnt = off + (uint32_t)((uint64_t)b * (uint64_t)sb + (uint64_t)r * (uint64_t)sr);
                if (rule == 0) {
                    int wide = rnd == 2 && kind == 0 && e->emin <= -126 && e->mbits >= 1;
                    unscaled_pieces(xr, yr, C, e, seg, wide ? seg_sr_wide : UNSCALED_FIN[rnd][kind], cnt, (uint32_t)sc,
                                    k1, k2);
                } else if (gc == 1 && nc > 1) {
                    col(xr, yr, C, e, 0.0f, 0.0f, qs, deq, cnt, (uint32_t)sc, k1, k2);
                } else if (nc > 1) {
                    col(xr, yr, C, e, 0.0f, 0.0f, fixed ? qs : rowq, fixed ? deq : rowd, cnt, (uint32_t)sc, k1, k2);
                } else {
                    seg(xr, yr, C, e, qs[0], deq[0], 0, 0, cnt, (uint32_t)sc, k1, k2);
                }
            }
        }
    }
    return 1;
}

/* One Kahan-compensated weight update (optim._optimizer "kahan"), all in place, e describing the weight format with
 * round-to-nearest (e->kind 1 or 2):  y = (p - old) - c;  t = Q(old + y);  c = Q((t - old) - y);  p = t.
 * ROUND 0 applies the special-value rules; ROUND 6 (it vectorizes) is for pieces whose values are all finite and at
 * most fmax / 4 in magnitude: then |old + y| <= 4 max <= fmax, so t is finite, and (t - old) - y is a finite float32
 * (fmax <= 2^128): every value rounded is finite, the case where both modes give the same bits. */
static inline __attribute__((always_inline)) void kahan(float *p, const float *old, float *c, int64_t n,
                                                        const lp_elem *e, const int KIND, const int ROUND)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float y = (p[i] - old[i]) - c[i];
        float t = q_elem_k(old[i] + y, e, 0u, KIND, ROUND);
        c[i] = q_elem_k((t - old[i]) - y, e, 0u, KIND, ROUND);
        p[i] = t;
    }
}

/* bfloat16's round-to-nearest-even of a finite v that does not overflow, on the bits (as _native.c's lp_round_bf16):
 * adding 0x7fff plus the lowest kept bit carries into bit 16 exactly when the dropped half is above a tie, or a
 * tie with an odd kept part; the sign bit rides along (-0 stays -0) and float32 subnormals round the same way,
 * bfloat16 sharing float32's exponent range.  q_elem_k's bits for kind 1, nearest, bfloat16's grid, in 4 operations
 * instead of its ~30 (Kahan's update rounds twice per element). */
static inline float bf16_rne(float v)
{
    uint32_t b = f2u(v);
    return u2f((b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u);
}

/* kahan() for bfloat16 on pieces whose values are all finite and at most fmax / 4 (ROUND 6's case) */
static __attribute__((noinline)) void kahan_bf16_fin(float *p, const float *old, float *c, int64_t n,
                                                     const lp_elem *e)
{
    (void)e;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float y = (p[i] - old[i]) - c[i];
        float t = bf16_rne(old[i] + y);
        c[i] = bf16_rne((t - old[i]) - y);
        p[i] = t;
    }
}

#define LP_KAHAN(NAME, KIND, ROUND)                                                                               \
    static __attribute__((noinline)) void NAME(float *p, const float *old, float *c, int64_t n, const lp_elem *e0) \
    {                                                                                                             \
        lp_elem e = *e0;                                                                                          \
        kahan(p, old, c, n, &e, KIND, ROUND);                                                                     \
    }
LP_KAHAN(kahan_float, 1, 0)
LP_KAHAN(kahan_int, 2, 0)
LP_KAHAN(kahan_float_fin, 1, 6)
LP_KAHAN(kahan_int_fin, 2, 6)
#undef LP_KAHAN

void lp_kahan_update(float *p, const float *old, float *c, int64_t n, const lp_elem *e)
{
    typedef void (*kahan_fn)(float *, const float *, float *, int64_t, const lp_elem *);
    kahan_fn full = e->kind == 2 ? kahan_int : kahan_float, fin = e->kind == 2 ? kahan_int_fin : kahan_float_fin;
    if (e->kind == 1 && e->mbits == 7 && e->emin == -126 && e->rounding == 0 && !e->ties_away)
        fin = kahan_bf16_fin;  /* bfloat16: the same bits by the bit route */
    uint32_t lim = f2u(e->fmax * 0.25f);
    for (int64_t c0 = 0; c0 < n; c0 += 1024) {  /* pieces of 1024: the checks bring them into cache */
        int64_t len = n - c0 < 1024 ? n - c0 : 1024;
        uint32_t m = max_abs_bits(p + c0, len), mo = max_abs_bits(old + c0, len), mc = max_abs_bits(c + c0, len);
        m = mo > m ? mo : m;
        m = mc > m ? mc : m;
        (m <= lim ? fin : full)(p + c0, old + c0, c + c0, len, e);
    }
}
