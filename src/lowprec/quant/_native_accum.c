/* GEMMs through an emulated limited-precision accumulator (lowprec.nn._accum; the models are documented there and
 * on lowprec.recipes.Accumulator).  out[m, n] = sum_k a[m, k] * b[k, n] with a: [M, K], b: [K, N] (b is the GEMM's
 * second operand transposed, so that a row of N partial sums is updated by one vector loop per reduction index).
 *
 * lp_accum_seq: the sequential model, one rounding into the accumulator format after every addition:
 *     part = Q(fl32(part + fl32(a * b))); every `chunk` products total = fl32(total + part), part = 0;
 *     out = fl32(total + part)
 * The same float32 operations in the same order as the tensor loop it replaces, so the bits are the same (built
 * with -ffp-contract=off: no fused multiply-add).  Q for formats with float32's exponent (8 bits, bias 127, IEEE
 * specials: e8m13, bfloat16, ...) is integer arithmetic on the bit pattern, which gcc vectorizes:
 *     toward zero:      u & ~mask                       (mask = 2^(23 - mbits) - 1)
 *     nearest, ties even: (u + mask/2 + ((u >> (23 - mbits)) & 1)) & ~mask
 * The same operation rounds subnormals (float32's and the format's subnormals share the quantum 2^-149 * 2^(23 -
 * mbits)) and overflows into infinity (the carry reaches the exponent field).  NaNs keep their bits (a NaN whose
 * payload is all ones would otherwise carry into the sign).  Other IEEE formats (fewer exponent bits, e.g. an
 * fp16 accumulator) take q_ieee below, scalar double arithmetic.
 *
 * lp_accum_blocked: the blocked fused multiply-add of tensor cores (Fasi, Higham, Mikaitis and Pranesh,
 * "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021): for each block of n reduction indices the exact
 * products and the accumulator c are aligned to the largest exponent among them, each truncated toward zero to
 * `bits` significant bits relative to that exponent, summed exactly, and the sum rounded once into the accumulator
 * format (float32 unless `format` is set) with `rounding`.  Products are exact in double for float32 operands;
 * the aligned terms are integers below 2^bits, summed exactly in double where bits + log2(n + 1) <= 53 (the
 * vectorized blocked_tile), else as int64 (blocked_block; bits <= 48, n <= 1024).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    int32_t mbits;   /* stored mantissa bits of the accumulator format */
    int32_t emin;    /* exponent of its smallest normal */
    int32_t emax;    /* exponent of its largest binade */
    int32_t toward_zero;
    double maxv;     /* largest finite value */
} lp_acc_fmt;

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* x (finite or not, double) rounded into the IEEE format: quantum 2^(max(e, emin) - mbits) for the binade e of x,
 * rint (ties to even; the default rounding mode) or trunc; overflow to +-inf when rounding to nearest, to +-max
 * toward zero.  Zeros keep their sign. */
static inline double q_ieee(double x, const lp_acc_fmt *f)
{
    if (x != x || x == 0.0 || isinf(x)) return x;
    int e;
    frexp(x, &e); /* |x| in [2^(e-1), 2^e) */
    e -= 1;
    if (e < f->emin) e = f->emin;
    if (e > f->emax) e = f->emax;
    double q = ldexp(1.0, e - f->mbits);
    double r = (f->toward_zero ? trunc(x / q) : rint(x / q)) * q;
    if (fabs(r) > f->maxv) r = f->toward_zero ? copysign(f->maxv, x) : copysign(INFINITY, x);
    if (r == 0.0) r = copysign(0.0, x);
    return r;
}

#define MR 4
#define NR 32

/* One MR x NR tile of outputs; KIND 0: bit-mask rounding (float32's exponent), 1: q_ieee. */
static inline __attribute__((always_inline)) void seq_tile(const float *a, const float *b, float *out, int64_t mr,
                                                           int64_t n0, int64_t N, int64_t ldb, int64_t K,
                                                           int64_t chunk, const lp_acc_fmt *f, const int KIND)
{
    float part[MR][NR], total[MR][NR];
    memset(part, 0, sizeof part);
    memset(total, 0, sizeof total);
    const uint32_t sh = (uint32_t)(23 - f->mbits);
    const uint32_t mask = (sh ? (1u << sh) - 1u : 0u), half = mask >> 1, lsb = sh ? 1u : 0u; /* sh 0: exact */
    const int tz = f->toward_zero;
    int64_t left = chunk;
    for (int64_t k = 0; k < K; ++k) {
        const float *bk = b + k * ldb + n0;
        for (int64_t r = 0; r < mr; ++r) {
            const float av = a[r * K + k];
            float *p = part[r];
            if (KIND == 0) {
                if (tz) {
#pragma omp simd
                    for (int j = 0; j < NR; ++j) {
                        float s = p[j] + av * bk[j];
                        uint32_t u = f2u(s);
                        uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
                        p[j] = u2f(nan ? u : (u & ~mask));
                    }
                } else {
#pragma omp simd
                    for (int j = 0; j < NR; ++j) {
                        float s = p[j] + av * bk[j];
                        uint32_t u = f2u(s);
                        uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
                        uint32_t v = (u + half + ((u >> sh) & lsb)) & ~mask;
                        p[j] = u2f(nan ? u : v);
                    }
                }
            } else {
                for (int j = 0; j < NR; ++j) {
                    float s = p[j] + av * bk[j];
                    p[j] = (float)q_ieee((double)s, f);
                }
            }
        }
        if (--left == 0) {
            left = chunk;
            for (int64_t r = 0; r < mr; ++r)
                for (int j = 0; j < NR; ++j) {
                    total[r][j] = total[r][j] + part[r][j];
                    part[r][j] = 0.0f;
                }
        }
    }
    int64_t nc = N - n0 < NR ? N - n0 : NR;
    for (int64_t r = 0; r < mr; ++r)
        for (int64_t j = 0; j < nc; ++j) out[r * N + n0 + j] = total[r][j] + part[r][j];
}

static __attribute__((noinline)) void seq_mask(const float *a, const float *b, float *out, int64_t M, int64_t N,
                                               int64_t ldb, int64_t K, int64_t chunk, const lp_acc_fmt *f)
{
    for (int64_t m0 = 0; m0 < M; m0 += MR)
        for (int64_t n0 = 0; n0 < N; n0 += NR)
            seq_tile(a + m0 * K, b, out + m0 * N, M - m0 < MR ? M - m0 : MR, n0, N, ldb, K, chunk, f, 0);
}

static __attribute__((noinline)) void seq_ieee(const float *a, const float *b, float *out, int64_t M, int64_t N,
                                               int64_t ldb, int64_t K, int64_t chunk, const lp_acc_fmt *f)
{
    for (int64_t m0 = 0; m0 < M; m0 += MR)
        for (int64_t n0 = 0; n0 < N; n0 += NR)
            seq_tile(a + m0 * K, b, out + m0 * N, M - m0 < MR ? M - m0 : MR, n0, N, ldb, K, chunk, f, 1);
}

/* a: [M, K] contiguous; b: [K, ldb] contiguous with ldb >= N a multiple of NR (padding columns are read, never
 * written); chunk: promotion interval (K or more: never); mask_route: the format has float32's exponent. */
void lp_accum_seq(const float *a, const float *b, float *out, int64_t M, int64_t N, int64_t ldb, int64_t K,
                  int64_t chunk, const lp_acc_fmt *f, int mask_route)
{
    if (mask_route)
        seq_mask(a, b, out, M, N, ldb, K, chunk, f);
    else
        seq_ieee(a, b, out, M, N, ldb, K, chunk, f);
}

/* The exponent of the binade of a nonzero finite double. */
static inline int binade(double x)
{
    int e;
    frexp(x, &e);
    return e - 1;
}

static inline uint64_t d2u(double d) { uint64_t u; memcpy(&u, &d, 8); return u; }
static inline double u2d(uint64_t u) { double d; memcpy(&d, &u, 8); return d; }

/* One output of the blocked model, scalar: the definition, also the route for blocks with an infinite or NaN term
 * and for alignments too wide for the vector route's double sums. */
static double blocked_block(double c, const float *a, const float *b, int64_t ldb, int64_t kn, int32_t bits,
                            const lp_acc_fmt *f)
{
    double t[1025];
    int64_t nt = 0;
    int emax = INT32_MIN, special = 0;
    t[nt++] = c;
    for (int64_t i = 0; i < kn; ++i) t[nt++] = (double)a[i] * (double)b[i * ldb];
    double plain = 0.0; /* the IEEE sum, used only when some term is NaN or infinite */
    for (int64_t i = 0; i < nt; ++i) {
        plain += t[i];
        if (!isfinite(t[i])) special = 1;
        else if (t[i] != 0.0) {
            int e = binade(t[i]);
            if (e > emax) emax = e;
        }
    }
    if (special) return plain; /* inf + finite = inf, inf - inf = NaN, NaN propagates */
    if (emax == INT32_MIN) {
        int neg = signbit(c) != 0; /* every term zero: +0 unless every one of them is -0 */
        for (int64_t i = 1; i < nt; ++i) neg &= signbit(t[i]) != 0;
        return neg ? -0.0 : 0.0;
    }
    int qe = emax - bits + 1;
    int64_t sum = 0;
    for (int64_t i = 0; i < nt; ++i) sum += (int64_t)trunc(ldexp(t[i], -qe));
    return q_ieee(ldexp((double)sum, qe), f);
}

#define NB 16 /* columns per tile of the blocked model */

/* NB outputs of one row, vectorized over the columns: per block, pass 1 finds each column's largest biased
 * exponent among c and the products (every product of two floats is a normal double; a zero has exponent field
 * 0, below all of them), pass 2 forms each aligned term trunc(t * 2^-qe), exact, and sums them in double, exact
 * while bits + log2(n + 1) <= 53 (the caller checks).  A column with an infinite or NaN term (exponent field 2047)
 * is redone by blocked_block. */
static void blocked_tile(const float *a, const float *b, float *out, int64_t nc, int64_t ldb, int64_t K,
                         int64_t chunk, int64_t n, int32_t bits, const lp_acc_fmt *f, int wide)
{
    double c[NB];
    float total[NB];
    const int tz = f->toward_zero;
    const uint64_t dsh = (uint64_t)(52 - f->mbits), dmask = (1ull << dsh) - 1u, dhalf = dmask >> 1;
    const uint64_t dnorm = d2u(ldexp(1.0, f->emin)), dmax = d2u(f->maxv);
    for (int j = 0; j < NB; ++j) { c[j] = 0.0; total[j] = 0.0f; }
    int64_t since = 0;
    for (int64_t k0 = 0; k0 < K; k0 += n) {
        const int64_t kn = K - k0 < n ? K - k0 : n;
        if (wide) { /* sums that double cannot hold exactly: the scalar int64 route, column by column */
            for (int64_t j = 0; j < nc; ++j) c[j] = blocked_block(c[j], a + k0, b + k0 * ldb + j, ldb, kn, bits, f);
            goto promote;
        }
        uint64_t emx[NB], neg[NB];
        for (int j = 0; j < NB; ++j) {
            uint64_t u = d2u(c[j]);
            emx[j] = (u >> 52) & 0x7ff;
            neg[j] = u >> 63;
        }
        for (int64_t i = 0; i < kn; ++i) {
            const double av = (double)a[k0 + i];
            const float *bk = b + (k0 + i) * ldb;
#pragma omp simd
            for (int j = 0; j < NB; ++j) {
                uint64_t u = d2u(av * (double)bk[j]);
                uint64_t e = (u >> 52) & 0x7ff;
                emx[j] = e > emx[j] ? e : emx[j];
                neg[j] &= u >> 63;
            }
        }
        double scale[NB], unscale[NB], sum[NB];
#pragma omp simd
        for (int j = 0; j < NB; ++j) {
            uint64_t e = emx[j] < 600 ? 600 : emx[j]; /* all-zero columns: any scale; 600 keeps both in range */
            scale[j] = u2d((uint64_t)(2045 + bits - (int64_t)e) << 52);   /* 2^-qe, qe = e - 1023 - bits + 1 */
            unscale[j] = u2d((uint64_t)((int64_t)e - bits + 1) << 52);     /* 2^qe */
            sum[j] = (double)(int64_t)(c[j] * scale[j]); /* trunc: the cast rounds toward zero (|x| < 2^53) */
        }
        for (int64_t i = 0; i < kn; ++i) {
            const double av = (double)a[k0 + i];
            const float *bk = b + (k0 + i) * ldb;
#pragma omp simd
            for (int j = 0; j < NB; ++j) sum[j] += (double)(int64_t)(av * (double)bk[j] * scale[j]);
        }
        /* The sums into the format: in its normal range q_ieee is a mask on the double's bits (ties to even by
         * the carry trick, as in seq_tile); zero, subnormal and overflowing results take q_ieee itself. */
        double res[NB];
        uint64_t odd[NB];
#pragma omp simd
        for (int j = 0; j < NB; ++j) {
            uint64_t u = d2u(sum[j] * unscale[j]), mag = u & 0x7fffffffffffffffull;
            uint64_t r = tz ? (mag & ~dmask) : ((mag + dhalf + ((mag >> dsh) & 1u)) & ~dmask);
            res[j] = u2d(r | (u & 0x8000000000000000ull));
            odd[j] = (mag < dnorm) | (r > dmax);
        }
        for (int j = 0; j < NB; ++j) {
            if (j >= nc) break;
            if (emx[j] == 0x7ff) c[j] = blocked_block(c[j], a + k0, b + k0 * ldb + j, ldb, kn, bits, f);
            else if (emx[j] == 0) c[j] = neg[j] ? -0.0 : 0.0;
            else c[j] = odd[j] ? q_ieee(sum[j] * unscale[j], f) : res[j];
        }
    promote:
        since += kn;
        if (chunk > 0 && since >= chunk) {
            for (int j = 0; j < NB; ++j) {
                total[j] = total[j] + (float)c[j];
                c[j] = 0.0;
            }
            since = 0;
        }
    }
    for (int64_t j = 0; j < nc; ++j) out[j] = total[j] + (float)c[j];
}

/* a: [M, K], b: [K, ldb] as above (ldb a multiple of NB); n: block size; bits: significant bits kept at alignment;
 * f: the format the block sum is rounded into (float32: mbits 23, emin -126, emax 127). */
void lp_accum_blocked(const float *a, const float *b, float *out, int64_t M, int64_t N, int64_t ldb, int64_t K,
                      int64_t chunk, int64_t n, int32_t bits, const lp_acc_fmt *f)
{
    int wide = bits + 64 - __builtin_clzll((unsigned long long)n) > 53; /* n + 1 terms below 2^bits: exact sums */
    for (int64_t m = 0; m < M; ++m)
        for (int64_t j0 = 0; j0 < N; j0 += NB)
            blocked_tile(a + m * K, b + j0, out + m * N + j0, N - j0 < NB ? N - j0 : NB, ldb, K, chunk, n, bits, f,
                         wide);
}
