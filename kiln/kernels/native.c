/* Kiln's single-pass CPU loops for the elementwise kernels (kiln/kernels/native.py builds and loads this).
 *
 * Each kernel walks its rows once: a row is read (converted to fp32 in a small buffer when it is bf16),
 * computed in fp32 and written in its output dtype, rounded once. The ATen compositions in norms.py,
 * rope.py and activations.py read and write every full-size temporary again; these loops do not.
 *
 * Plain C with no torch headers: it compiles in about a second. Rows are split over OpenMP threads, the
 * same OpenMP runtime torch uses (libgomp.so.1, already loaded by torch). Reductions over a row or over
 * rows accumulate in double; the rows each thread takes are fixed by the thread count, and per-thread
 * partial sums are added in thread order, so results do not depend on timing.
 *
 * dtype codes: 0 float32, 1 bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define F32 0
#define BF16 1
#define ROW_MAX 8192 /* the Python side sends longer rows to ATen */

/* ---- bf16 <-> fp32, as ATen converts (round to nearest even, NaN stays NaN) ---------------------- */
/* one value each way (loops that read and write bf16 in registers call these directly) */
static inline float bf16_f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(f != f ? 0x7FC0u : rounded);
}

static inline void load(float *restrict dst, const void *restrict src, int dt, int64_t n) {
    if (dt == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_f(s[i]);
}

static inline void store(void *restrict dst, int dt, const float *restrict src, int64_t n) {
    if (dt == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = (uint16_t *)dst;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) d[i] = f_bf16(src[i]);
}

/* x rounded to the precision of dt, in place (the value a tensor of that dtype would hold) */
static inline void round_to(float *restrict x, int dt, int64_t n) {
    if (dt == F32) return;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        uint32_t r = ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16;
        float f;
        memcpy(&f, &r, 4);
        x[i] = x[i] != x[i] ? x[i] : f;
    }
}

static inline size_t esize(int dt) { return dt == F32 ? 4 : 2; }

/* element `at` of an array of dtype dt */
static inline const void *elem(const void *base, int dt, int64_t at) {
    return (const char *)base + (size_t)at * esize(dt);
}

static inline void *elem_out(void *base, int dt, int64_t at) { return (char *)base + (size_t)at * esize(dt); }

/* n values at src as fp32: src itself when it is fp32, else converted into buf */
static inline const float *in_row(float *buf, const void *src, int dt, int64_t n) {
    if (dt == F32) return (const float *)src;
    load(buf, src, dt, n);
    return buf;
}

/* where to compute an output row: the destination itself when it is fp32, else buf (then `out_done`) */
static inline float *out_row(float *buf, void *dst, int dt) { return dt == F32 ? (float *)dst : buf; }

static inline void out_done(void *dst, int dt, const float *buf, int64_t n) {
    if (dt != F32) store(dst, dt, buf, n);
}

/* this thread's index in its parallel region (0 without OpenMP) */
static inline int thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* this thread's share [lo, hi) of n items (contiguous, fixed by the thread count) */
static inline void share(int64_t n, int64_t *lo, int64_t *hi) {
    int64_t me = 0, all = 1;
#ifdef _OPENMP
    me = omp_get_thread_num();
    all = omp_get_num_threads();
#endif
    *lo = n * me / all;
    *hi = n * (me + 1) / all;
}

/* ---- exp with plain arithmetic (vectorizes; within 2 ulp of expf over the range that matters) ---- */
/* exp(x) for x in [-87.3, 88.3] (2^n stays a normal number) */
static inline float exp_in_range(float x) {
    /* n = round(x / ln 2) by the 1.5 * 2^23 trick (floorf would keep the loop from vectorizing) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = fmaf(n, -0.693359375f, x);      /* ln 2 split in two: r = x - n ln2, exact high part */
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p * r, r, r) + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return p * scale;
}

static inline float exp_approx(float x) {
    float c = x < -87.3f ? -87.3f : x;         /* fminf/fmaxf would not vectorize */
    c = c > 88.3f ? 88.3f : c;
    x = x != x ? x : c;                        /* NaN stays NaN; said outright, gcc turns the clamps into */
                                               /* min/max and the loops vectorize on AVX2 too */
    return exp_in_range(x);
}

/* ---- rotary embedding (rotate_half): out1 = t1 c1 - t2 s1, out2 = t2 c2 + t1 s2 ---------------------
 * The backward is the transpose: g1' = g1 c1 + g2 s2, g2' = g2 c2 - g1 s1, which is the forward with the sine
 * halves swapped and negated (exactly: x - (-y) is x + y), so one loop does both: out1 = t1 c1 - t2 p, out2 = t2
 * c2 + t1 q with (p, q) = (s1, s2) forward and (-s2, -s1) backward, made once per table row. Rows are indexed by
 * up to 3 leading sizes; t, the tables (cos and sin alike; 0 where they broadcast, as over the heads: the row
 * converted for one serves the next) and out have their own strides over those, and a dense last dimension of d. */
int kiln_rope(const void *t, int t_dt, const int64_t *t_strides, const void *cs, const void *sn, int tab_dt,
              const int64_t *tab_strides, void *out, int out_dt, const int64_t *out_strides, const int64_t *sizes,
              int64_t d, int backward, int threads) {
    if (d > ROW_MAX || d % 2) return -1;
    int64_t rows = sizes[0] * sizes[1] * sizes[2], h = d / 2;
#pragma omp parallel num_threads(threads)
    {
        float xb[ROW_MAX], cb[ROW_MAX], sb[ROW_MAX], pq[ROW_MAX], ob[ROW_MAX];
        int64_t lo, hi;
        share(rows, &lo, &hi);
        /* walk the three indices along this thread's rows: no division per row */
        int64_t i2 = lo % sizes[2], i1 = (lo / sizes[2]) % sizes[1], i0 = lo / (sizes[2] * sizes[1]);
        int64_t tab_at = -1;                      /* the table row in c and pq */
        const float *c = NULL, *ps = pq, *qs = pq + h;
        const int bf16_rows = t_dt == BF16 && out_dt == BF16;
        for (int64_t r = lo; r < hi; r++) {
#define AT(st) (i0 * (st)[0] + i1 * (st)[1] + i2 * (st)[2])
            if (AT(tab_strides) != tab_at) {
                tab_at = AT(tab_strides);
                c = in_row(cb, elem(cs, tab_dt, tab_at), tab_dt, d);
                const float *sv = in_row(sb, elem(sn, tab_dt, tab_at), tab_dt, d);
                for (int64_t j = 0; j < h; j++) {
                    pq[j] = backward ? -sv[j + h] : sv[j];
                    pq[j + h] = backward ? -sv[j] : sv[j + h];
                }
            }
            if (bf16_rows) {                      /* converted in registers: no staged fp32 rows */
                const uint16_t *x = (const uint16_t *)t + AT(t_strides);
                uint16_t *o = (uint16_t *)out + AT(out_strides);
#pragma omp simd
                for (int64_t j = 0; j < h; j++) {
                    float a = bf16_f(x[j]), b = bf16_f(x[j + h]);
                    o[j] = f_bf16(a * c[j] - b * ps[j]);
                    o[j + h] = f_bf16(b * c[j + h] + a * qs[j]);
                }
            } else {
                const float *x = in_row(xb, elem(t, t_dt, AT(t_strides)), t_dt, d);
                float *o = out_row(ob, elem_out(out, out_dt, AT(out_strides)), out_dt);
#pragma omp simd
                for (int64_t j = 0; j < h; j++) {
                    float a = x[j], b = x[j + h];
                    o[j] = a * c[j] - b * ps[j];
                    o[j + h] = b * c[j + h] + a * qs[j];
                }
                out_done(elem_out(out, out_dt, AT(out_strides)), out_dt, o, d);
            }
#undef AT
            if (++i2 == sizes[2]) {
                i2 = 0;
                if (++i1 == sizes[1]) {
                    i1 = 0;
                    i0++;
                }
            }
        }
    }
    return 0;
}

/* ---- SwiGLU: out = silu(gate) * up; backward: grad_gate = grad up silu'(gate), grad_up = grad silu(gate)
 * rows x cols with a row stride per tensor (gate and up may be the halves of one [gate | up] product),
 * processed in blocks of a row. */
#define BLOCK 2048

static inline float sigmoid(float a) { return 1.0f / (1.0f + exp_approx(-a)); }

static inline float swiglu_f(float a, float b) { return a * sigmoid(a) * b; }

/* d out / d gate times the gradient g, sig = sigmoid(a) */
static inline float swiglu_dgate(float g, float a, float b, float sig) {
    return g * b * (sig * (1.0f + a * (1.0f - sig)));
}

/* the exp-bound loops in AVX-512 intrinsics where the build has AVX-512 (the same values; -DKILN_PLAIN_LOOPS
 * builds the plain C instead: benchmarks/exp_loops.py compares the two) */
#if defined(__AVX512F__) && !defined(KILN_PLAIN_LOOPS)
#define KILN_VEC512 1
#include "native_vec512.c"
#endif

/* where every operand of an elementwise loop is bf16, it converts in registers (the staged fp32 blocks of
 * in_row / out_done cost about as much again as the arithmetic: swiglu on 2048 x 1408, 1.0 against 1.2-1.5 ms) */
#define ALL_BF16(...) all_bf16((int[]){__VA_ARGS__}, sizeof((int[]){__VA_ARGS__}) / sizeof(int))
static inline int all_bf16(const int *dts, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (dts[i] != BF16) return 0;
    return 1;
}

int kiln_swiglu(const void *gate, int g_dt, int64_t g_s, const void *up, int u_dt, int64_t u_s, void *out, int o_dt,
                int64_t o_s, int64_t rows, int64_t cols, int threads) {
    int64_t per_row = (cols + BLOCK - 1) / BLOCK, tasks = rows * per_row;
#pragma omp parallel num_threads(threads)
    {
        float ab[BLOCK], bb[BLOCK], ob[BLOCK];
#pragma omp for schedule(static)
        for (int64_t k = 0; k < tasks; k++) {
            int64_t r = k / per_row, lo = (k % per_row) * BLOCK, m = cols - lo < BLOCK ? cols - lo : BLOCK;
            if (ALL_BF16(g_dt, u_dt, o_dt)) {
                const uint16_t *a = (const uint16_t *)gate + r * g_s + lo, *b = (const uint16_t *)up + r * u_s + lo;
                uint16_t *o = (uint16_t *)out + r * o_s + lo;
#ifdef KILN_VEC512
                swiglu16_bf16(a, b, o, m);
                continue;
#endif
#pragma omp simd
                for (int64_t j = 0; j < m; j++) o[j] = f_bf16(swiglu_f(bf16_f(a[j]), bf16_f(b[j])));
                continue;
            }
            const float *a = in_row(ab, elem(gate, g_dt, r * g_s + lo), g_dt, m);
            const float *b = in_row(bb, elem(up, u_dt, r * u_s + lo), u_dt, m);
            float *o = out_row(ob, elem_out(out, o_dt, r * o_s + lo), o_dt);
#pragma omp simd
            for (int64_t j = 0; j < m; j++) o[j] = swiglu_f(a[j], b[j]);
            out_done(elem_out(out, o_dt, r * o_s + lo), o_dt, o, m);
        }
    }
    return 0;
}

int kiln_swiglu_backward(const void *grad, int gr_dt, int64_t gr_s, const void *gate, int g_dt, int64_t g_s,
                         const void *up, int u_dt, int64_t u_s, void *grad_gate, int gg_dt, int64_t gg_s,
                         void *grad_up, int gu_dt, int64_t gu_s, int64_t rows, int64_t cols, int threads) {
    int64_t per_row = (cols + BLOCK - 1) / BLOCK, tasks = rows * per_row;
#pragma omp parallel num_threads(threads)
    {
        float grb[BLOCK], ab[BLOCK], bb[BLOCK], ogb[BLOCK], oub[BLOCK];
#pragma omp for schedule(static)
        for (int64_t k = 0; k < tasks; k++) {
            int64_t r = k / per_row, lo = (k % per_row) * BLOCK, m = cols - lo < BLOCK ? cols - lo : BLOCK;
            if (ALL_BF16(gr_dt, g_dt, u_dt, gg_dt, gu_dt)) {
                const uint16_t *gr = (const uint16_t *)grad + r * gr_s + lo, *a = (const uint16_t *)gate + r * g_s + lo;
                const uint16_t *b = (const uint16_t *)up + r * u_s + lo;
                uint16_t *og = (uint16_t *)grad_gate + r * gg_s + lo, *ou = (uint16_t *)grad_up + r * gu_s + lo;
#ifdef KILN_VEC512
                swiglu_backward16_bf16(gr, a, b, og, ou, m);
                continue;
#endif
#pragma omp simd
                for (int64_t j = 0; j < m; j++) {
                    float x = bf16_f(a[j]), g = bf16_f(gr[j]), sig = sigmoid(x);
                    og[j] = f_bf16(swiglu_dgate(g, x, bf16_f(b[j]), sig));
                    ou[j] = f_bf16(g * (x * sig));
                }
                continue;
            }
            const float *gr = in_row(grb, elem(grad, gr_dt, r * gr_s + lo), gr_dt, m);
            const float *a = in_row(ab, elem(gate, g_dt, r * g_s + lo), g_dt, m);
            const float *b = in_row(bb, elem(up, u_dt, r * u_s + lo), u_dt, m);
            float *og = out_row(ogb, elem_out(grad_gate, gg_dt, r * gg_s + lo), gg_dt);
            float *ou = out_row(oub, elem_out(grad_up, gu_dt, r * gu_s + lo), gu_dt);
#pragma omp simd
            for (int64_t j = 0; j < m; j++) {
                float sig = sigmoid(a[j]);
                og[j] = swiglu_dgate(gr[j], a[j], b[j], sig);
                ou[j] = gr[j] * (a[j] * sig);
            }
            out_done(elem_out(grad_gate, gg_dt, r * gg_s + lo), gg_dt, og, m);
            out_done(elem_out(grad_up, gu_dt, r * gu_s + lo), gu_dt, ou, m);
        }
    }
    return 0;
}

/* ---- GELU, tanh approximation --------------------------------------------------------------------------
 * gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed as x * sigmoid(2u) (the same
 * function: 0.5 (1 + tanh(u)) = sigmoid(2u)), which needs one exp and no tanh, and loses nothing to
 * cancellation where tanh(u) is near -1. The backward: d gelu / dx = s + 2 x s (1 - s) u', s = sigmoid(2u),
 * u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2). n contiguous elements in, n out (grad_in may be grad itself). */
#define GELU_K 0.7978845608028654f
#define GELU_C 0.044715f

static inline float gelu_f(float v) {
    float u = GELU_K * (v + GELU_C * v * v * v);
    return v * sigmoid(2.0f * u);
}

static inline float gelu_backward_f(float g, float v) {
    /* 1 - s as e s (e = exp(-2u)): no cancellation where s is near 1 */
    float v2 = v * v, u = GELU_K * (v + GELU_C * v2 * v);
    float e = exp_approx(-2.0f * u), sg = 1.0f / (1.0f + e), du = GELU_K * (1.0f + 3.0f * GELU_C * v2);
    return g * (sg + 2.0f * v * sg * (e * sg) * du);
}

int kiln_gelu_tanh(const void *x, int x_dt, void *out, int o_dt, int64_t n, int threads) {
    int64_t tasks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel num_threads(threads)
    {
        float xb[BLOCK], ob[BLOCK];
#pragma omp for schedule(static)
        for (int64_t k = 0; k < tasks; k++) {
            int64_t lo = k * BLOCK, m = n - lo < BLOCK ? n - lo : BLOCK;
            if (ALL_BF16(x_dt, o_dt)) {
                const uint16_t *a = (const uint16_t *)x + lo;
                uint16_t *o = (uint16_t *)out + lo;
#pragma omp simd
                for (int64_t j = 0; j < m; j++) o[j] = f_bf16(gelu_f(bf16_f(a[j])));
                continue;
            }
            const float *a = in_row(xb, elem(x, x_dt, lo), x_dt, m);
            float *o = out_row(ob, elem_out(out, o_dt, lo), o_dt);
#pragma omp simd
            for (int64_t j = 0; j < m; j++) o[j] = gelu_f(a[j]);
            out_done(elem_out(out, o_dt, lo), o_dt, o, m);
        }
    }
    return 0;
}

int kiln_gelu_tanh_backward(const void *grad, int g_dt, const void *x, int x_dt, void *grad_in, int gi_dt, int64_t n,
                            int threads) {
    int64_t tasks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel num_threads(threads)
    {
        float gb[BLOCK], xb[BLOCK], ob[BLOCK];
#pragma omp for schedule(static)
        for (int64_t k = 0; k < tasks; k++) {
            int64_t lo = k * BLOCK, m = n - lo < BLOCK ? n - lo : BLOCK;
            if (ALL_BF16(g_dt, x_dt, gi_dt)) {
                const uint16_t *g = (const uint16_t *)grad + lo, *a = (const uint16_t *)x + lo;
                uint16_t *o = (uint16_t *)grad_in + lo;
#pragma omp simd
                for (int64_t j = 0; j < m; j++) o[j] = f_bf16(gelu_backward_f(bf16_f(g[j]), bf16_f(a[j])));
                continue;
            }
            const float *g = in_row(gb, elem(grad, g_dt, lo), g_dt, m);
            const float *a = in_row(xb, elem(x, x_dt, lo), x_dt, m);
            float *o = out_row(ob, elem_out(grad_in, gi_dt, lo), gi_dt);
#pragma omp simd
            for (int64_t j = 0; j < m; j++) o[j] = gelu_backward_f(g[j], a[j]);
            out_done(elem_out(grad_in, gi_dt, lo), gi_dt, o, m);
        }
    }
    return 0;
}

/* ---- GELU's backward with its result's column sums (a bias's gradient) ------------------------------------
 * out = grad * gelu'(x) over rows x cols (dense), and sums[c] = the sum over rows of out[r][c] as out's dtype holds
 * it (what aten.sum over out's leading dims reads: the gradient of the bias added before the GELU), summed in fp32
 * over blocks of 64 rows, the blocks of each thread's rows then the threads added in order. `approximate` 1: the
 * tanh form (gelu_backward_f); 0: the exact one, gelu'(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi),
 * with Phi from the same exp: erfc(z) = t (a1 + t (a2 + .. + t a5)) exp(-z^2), t = 1 / (1 + p z), z = |x| / sqrt 2
 * (Abramowitz and Stegun 7.1.26, error below 1.5e-7), Phi = erfc(z) / 2 for x < 0 (no cancellation in the tail)
 * and 1 - erfc(z) / 2 otherwise: one exp where gelu'(x) written with erf takes two. `table` (bf16 only, else
 * NULL): gelu'(x) for every bf16 x (native_lut.c), read instead of computed. */
static inline float gelu_erf_backward_f(float g, float v) {
    float e = exp_approx(-0.5f * v * v), t = 1.0f / (1.0f + 0.3275911f * 0.70710678118654752f * fabsf(v));
    float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
    float half_erfc = 0.5f * poly * e;
    float cdf = v < 0.0f ? half_erfc : 1.0f - half_erfc;
    return g * (cdf + v * e * 0.39894228040143268f);
}

#define SUM_ROWS 64

int kiln_gelu_backward_sums(const void *grad, int g_dt, const void *x, int x_dt, void *out, int o_dt, int64_t rows,
                            int64_t cols, int approximate, float *sums, const float *table, int threads) {
    if (cols <= 0 || cols > (1 << 20)) return 2;
    int bf = ALL_BF16(g_dt, x_dt, o_dt);
    if (!bf && (g_dt != F32 || x_dt != F32 || o_dt != F32)) return 2;
    float *part = calloc((size_t)threads * (size_t)cols, sizeof(float));
    int bad = part == NULL, used = 1;
#pragma omp parallel num_threads(threads) reduction(| : bad)
    {
        int64_t lo, hi;
        share(rows, &lo, &hi);
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#pragma omp single
        used = omp_get_num_threads();
#endif
        float *blk = malloc((size_t)cols * sizeof(float));
        if (!blk) bad = 1;
        float *tot = part ? part + (size_t)me * (size_t)cols : NULL;
        for (int64_t r0 = lo; r0 < hi && tot && blk; r0 += SUM_ROWS) {
            int64_t r1 = hi - r0 < SUM_ROWS ? hi : r0 + SUM_ROWS;
            memset(blk, 0, (size_t)cols * sizeof(float));
            for (int64_t r = r0; r < r1; r++) {
                if (bf) {
                    const uint16_t *gr = (const uint16_t *)grad + r * cols, *xr = (const uint16_t *)x + r * cols;
                    uint16_t *o = (uint16_t *)out + r * cols;
                    if (table) {            /* the derivative by table (native_lut.c) */
#pragma omp simd
                        for (int64_t c = 0; c < cols; c++) {
                            o[c] = f_bf16(bf16_f(gr[c]) * table[xr[c]]);
                            blk[c] += bf16_f(o[c]);
                        }
                    } else if (approximate) {
#pragma omp simd
                        for (int64_t c = 0; c < cols; c++) {
                            o[c] = f_bf16(gelu_backward_f(bf16_f(gr[c]), bf16_f(xr[c])));
                            blk[c] += bf16_f(o[c]);
                        }
                    } else {
#pragma omp simd
                        for (int64_t c = 0; c < cols; c++) {
                            o[c] = f_bf16(gelu_erf_backward_f(bf16_f(gr[c]), bf16_f(xr[c])));
                            blk[c] += bf16_f(o[c]);
                        }
                    }
                } else {
                    const float *gr = (const float *)grad + r * cols, *xr = (const float *)x + r * cols;
                    float *o = (float *)out + r * cols;
                    if (approximate) {
#pragma omp simd
                        for (int64_t c = 0; c < cols; c++) blk[c] += o[c] = gelu_backward_f(gr[c], xr[c]);
                    } else {
#pragma omp simd
                        for (int64_t c = 0; c < cols; c++) blk[c] += o[c] = gelu_erf_backward_f(gr[c], xr[c]);
                    }
                }
            }
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) tot[c] += blk[c];
        }
        free(blk);
    }
    if (!bad) {
        for (int64_t c = 0; c < cols; c++) sums[c] = part[c];
        for (int th = 1; th < used; th++)
            for (int64_t c = 0; c < cols; c++) sums[c] += part[(size_t)th * (size_t)cols + c];
    }
    free(part);
    return bad ? 3 : 0;
}

/* ---- AdamW out of place (ZeRO) -----------------------------------------------------------------------
 * kiln_adamw_param: the new parameter from p, g and the moments as they will be after this step, written to
 * p_out; the moments themselves are not written (the step may still fail before its commit).
 * kiln_adamw_moments: the moments' own update, in place, at the commit. Both compute the new moments with
 * the same float operations (adamw_moments below), so the committed moments are bit for bit the ones the new
 * parameter was computed from. The formula is torch.optim.AdamW's: p *= 1 - lr wd; m = lerp(m, g, 1 - b1);
 * v = v b2 + (1 - b2) g^2; p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps), each step rounded as its
 * single-tensor implementation rounds it (bit for bit the same on the CPUs tried). fp32 contiguous. */
static inline void adamw_moments(float g, float *m, float *v, float w1, float b2, float w2) {
    /* lerp(m, g, w1) as ATen's vectorized kernel computes it (one fused multiply-add) */
    *m = w1 < 0.5f ? fmaf(w1, g - *m, *m) : fmaf(w1 - 1.0f, g - *m, g);
    *v = fmaf(w2 * g, g, *v * b2);                                         /* v.mul_(b2).addcmul_(g, g, value=w2) */
}

/* lr, b1, b2, eps, wd in double as Python holds them; weights rounded to float as ATen's scalar ops do */
int kiln_adamw_param(const float *p, const float *g, const float *m, const float *v, float *p_out, int64_t n,
                     double lr, double b1, double b2, double eps, double wd, double bc1, double bc2_sqrt,
                     int threads) {
    float decay = (float)(1.0 - lr * wd), step = (float)(lr / bc1), root = (float)bc2_sqrt, e = (float)eps;
    float w1 = (float)(1.0 - b1), fb2 = (float)b2, w2 = (float)(1.0 - b2);
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float mi = m[i], vi = v[i];
        adamw_moments(g[i], &mi, &vi, w1, fb2, w2);
        float denom = sqrtf(vi) / root + e;
        p_out[i] = p[i] * decay - step * mi / denom;         /* addcdiv: (value * m) / denom */
    }
    return 0;
}

int kiln_adamw_moments(const float *g, float *m, float *v, int64_t n, double b1, double b2, int threads) {
    float w1 = (float)(1.0 - b1), fb2 = (float)b2, w2 = (float)(1.0 - b2);
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) adamw_moments(g[i], &m[i], &v[i], w1, fb2, w2);
    return 0;
}

/* kiln_adamw_step: the same update in place (single process: staged, run at the commit), reading the gradient
 * in g_dt (a bf16 gradient of a bf16 weight copy is widened as it is read, exactly: no fp32 copy of it
 * exists). The parameter is computed from the moments as they will be, with the same float operations as
 * kiln_adamw_param, then the moments are written. */
#define ADAMW_STEP_LOOP(GRAD)                                                          \
    _Pragma("omp parallel for simd num_threads(threads) schedule(static)")           \
    for (int64_t i = 0; i < n; i++) {                                                  \
        float gi = GRAD, mi = m[i], vi = v[i];                                         \
        adamw_moments(gi, &mi, &vi, w1, fb2, w2);                                      \
        float denom = sqrtf(vi) / root + e;                                            \
        p[i] = p[i] * decay - step * mi / denom;                                       \
        m[i] = mi;                                                                     \
        v[i] = vi;                                                                     \
    }

int kiln_adamw_step(float *p, const void *g, int g_dt, float *m, float *v, int64_t n, double lr, double b1,
                    double b2, double eps, double wd, double bc1, double bc2_sqrt, int threads) {
    float decay = (float)(1.0 - lr * wd), step = (float)(lr / bc1), root = (float)bc2_sqrt, e = (float)eps;
    float w1 = (float)(1.0 - b1), fb2 = (float)b2, w2 = (float)(1.0 - b2);
    if (g_dt == F32) {
        const float *gf = (const float *)g;
        ADAMW_STEP_LOOP(gf[i])
    } else {
        const uint16_t *gb = (const uint16_t *)g;
        ADAMW_STEP_LOOP(bf16_f(gb[i]))
    }
    return 0;
}

/* the row reductions (exp_or_zero, block_max, ...) and the cross-entropy loops: native_loss.c; attention's row
 * passes and its bf16 products: native_attention.c; whole-tensor sweeps (the non-finite guard's scan, a scaled
 * copy): native_sweeps.c; a tied embedding's gradient: native_embedding.c; functions of one bf16 value by table:
 * native_lut.c; all compiled as part of this file */
#include "native_loss.c"
#include "native_attention.c"
#include "native_sweeps.c"
#include "native_embedding.c"
#include "native_lut.c"
#include "native_norms.c"
