/* Attention's native loops (kiln/kernels/attention.py), #included at the end of native.c after native_loss.c (one
 * library, the same helpers: load/store, exp_or_zero, block_max, block_exp_sum).
 *
 * A group of heads' query rows, row r being query i = r % tq of head h = r / tq, and s the fp32 scores q.k
 * (rows x cols, dense). The mask is fp32 with element strides mh (head), mi (query) and a dense last dim, or
 * NULL. `causal` (a query sees keys j <= i, i = r % tq; with or without a mask) computes only those columns of
 * a row and writes p 0 past them (the products skip the rest: kiln_bf16_abt).
 * - kiln_attn_softmax (forward): z = s * scale + mask; lse[r] = log(sum_j exp(z_rj)) and p = exp(z - lse)
 *   in dt; or, given rowscale, p = exp(z - max_j z_rj) and rowscale[r] = 1 / sum_j p_rj (the output is then
 *   P v times rowscale: unnormalized probabilities, whose largest is exactly 1, round more accurately).
 *   A row with every key masked gets p = 0, lse = 0 (as ATen's CPU flash kernel gives it) and rowscale 0.
 * - kiln_attn_probs (backward): p = exp(z - lse) from the forward's lse (a row whose lse is -inf gets 0).
 * - kiln_attn_dscores (backward): given dp = dO.v^T (fp32) and delta[r] = sum_d dO[r, d] * O[r, d],
 *   ds[r, j] = p[r, j] * (dp[r, j] - delta[r]) * scale, in dt, written over p.
 * - kiln_bf16_abt: c[g] = a[g] b[g]^T for bf16 a (g x m x k; or a[g] given as k x m, `a_t`) and b (g x n x k;
 *   or b[g] given as k x n), each row dense (strides per matrix and per row), into fp32 c or, `c_bf16`, c rounded
 *   once to bf16 (as ATen's bf16 products round). `causal` says that only j <= i counts (a query i sees keys
 *   j <= i): for a b^T the tiles wholly above the diagonal are not computed but written as 0; for a b (kn,
 *   the sum over keys of probabilities that are exactly 0 past i) row i's sum stops after key i; for a^T b
 *   (dV = P^T dO, dK = dS^T q: a's rows are queries, its columns keys, exactly 0 past the diagonal) key i's
 *   sum starts at query i. On AVX-512 BF16's pair dot products (vdpbf16ps: products of bf16 pairs, exact,
 *   summed into fp32 accumulators): as accurate as an fp32 product of the widened inputs and about 3.5x faster
 *   than it at attention's sizes (ATen has no bf16 product with an fp32 result on CPU). Built where the
 *   compiler knows the instructions; kiln_bf16_abt_built() says whether it was, and the Python side calls it
 *   only on a CPU that has them. */

/* the columns row r computes: all, or (causal: query r % tq sees keys j <= r % tq) the first r % tq + 1 */
static inline int64_t row_cols(int causal, int64_t r, int64_t tq, int64_t cols) {
    return causal && r % tq + 1 < cols ? r % tq + 1 : cols;
}

/* One row of scaled, masked scores z (n of them) in place into the forward's unnormalized probabilities
 * exp(z - max), with *lse = log(sum) + max and *rowscale = 1 / sum; a row with a NaN or +inf gets NaN
 * probabilities, lse and rowscale, and a row with every key masked 0, 0 and 0 (as ATen's CPU flash kernel). */
static void row_probs(float *buf, int64_t n, float *lse, float *rowscale) {
    int nan = 0;
    float m = block_max(buf, n, -INFINITY, &nan);
    if (nan || m == INFINITY) {
#pragma omp simd
        for (int64_t j = 0; j < n; j++) buf[j] = exp_or_zero(buf[j] - NAN);
        *lse = *rowscale = NAN;
    } else if (m == -INFINITY) {
        memset(buf, 0, (size_t)n * sizeof(float));
        *lse = *rowscale = 0.0f;
    } else {
        double sum = block_exp_sum(buf, n, m);
        *lse = (float)((double)m + log(sum));
        *rowscale = (float)(1.0 / sum);
    }
}

int kiln_attn_softmax(const float *s, void *p, int dt, float *lse, float *rowscale, const float *mask, int64_t mh,
                      int64_t mi, int causal, int64_t tq, int64_t rows, int64_t cols, double scale, int threads) {
    float sc = (float)scale;
#pragma omp parallel num_threads(threads)
    {
        float buf[ROW_MAX];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *sr = s + r * cols;
            int64_t nc = row_cols(causal, r, tq, cols);
            if (mask) {
                const float *mr = mask + (r / tq) * mh + (r % tq) * mi;
#pragma omp simd
                for (int64_t j = 0; j < nc; j++) buf[j] = sr[j] * sc + mr[j];
            } else {
#pragma omp simd
                for (int64_t j = 0; j < nc; j++) buf[j] = sr[j] * sc;
            }
            memset(buf + nc, 0, (size_t)(cols - nc) * sizeof(float));      /* keys past a causal row: p 0 */
            if (rowscale) {
                row_probs(buf, nc, &lse[r], &rowscale[r]);
                store(elem_out(p, dt, r * cols), dt, buf, cols);
                continue;
            }
            int nan = 0;
            float m = block_max(buf, nc, -INFINITY, &nan);
            float l;
            if (nan || m == INFINITY) {
                l = NAN;
            } else if (m == -INFINITY) {             /* every key masked: no probabilities, lse 0 */
                lse[r] = 0.0f;
                memset(buf, 0, (size_t)cols * sizeof(float));
                store(elem_out(p, dt, r * cols), dt, buf, cols);
                continue;
            } else {
                l = (float)((double)m + log(block_sum_exp(buf, nc, m)));
            }
            lse[r] = l;
#pragma omp simd
            for (int64_t j = 0; j < nc; j++) buf[j] = exp_or_zero(buf[j] - l);
            store(elem_out(p, dt, r * cols), dt, buf, cols);
        }
    }
    return 0;
}

/* The backward's probabilities of one row again, from the forward's lse: out[j] = exp(z_j - lse), z = s * scale
 * (+ mask), for the first nc keys; returns how many it wrote (0 for a row whose lse is -inf). */
static int64_t row_probs_again(const float *sr, const float *mr, float sc, float l, int64_t nc, float *out) {
    if (l == -INFINITY) return 0;
    if (mr) {
#pragma omp simd
        for (int64_t j = 0; j < nc; j++) out[j] = exp_or_zero(sr[j] * sc + mr[j] - l);
    } else {
#pragma omp simd
        for (int64_t j = 0; j < nc; j++) out[j] = exp_or_zero(sr[j] * sc - l);
    }
    return nc;
}

/* One row of the scores' gradient: out[j] = p[j] * (dp[j] - delta) * scale (out may be p) */
static inline void row_dscores(const float *p, const float *dp, float delta, float sc, int64_t n, float *out) {
#pragma omp simd
    for (int64_t j = 0; j < n; j++) out[j] = p[j] * (dp[j] - delta) * sc;
}

int kiln_attn_probs(const float *s, void *p, int dt, const float *lse, const float *mask, int64_t mh, int64_t mi,
                    int causal, int64_t tq, int64_t rows, int64_t cols, double scale, int threads) {
    float sc = (float)scale;
#pragma omp parallel num_threads(threads)
    {
        float buf[ROW_MAX];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            int64_t nc = row_probs_again(s + r * cols, mask ? mask + (r / tq) * mh + (r % tq) * mi : NULL, sc, lse[r],
                                         row_cols(causal, r, tq, cols), buf);
            memset(buf + nc, 0, (size_t)(cols - nc) * sizeof(float));
            store(elem_out(p, dt, r * cols), dt, buf, cols);
        }
    }
    return 0;
}

/* causal: p is 0 past the diagonal (kiln_attn_probs wrote it), and so is ds there: those columns are left */
int kiln_attn_dscores(void *p, int dt, const float *dp, const float *delta, int causal, int64_t tq, int64_t rows,
                      int64_t cols, double scale, int threads) {
    float sc = (float)scale;
#pragma omp parallel num_threads(threads)
    {
        float buf[ROW_MAX];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            int64_t nc = row_cols(causal, r, tq, cols);
            row_dscores(in_row(buf, elem(p, dt, r * cols), dt, nc), dp + r * cols, delta[r], sc, nc, buf);
            store(elem_out(p, dt, r * cols), dt, buf, nc);
        }
    }
    return 0;
}

/* 1 when an additive fp32 mask (b, h, t, s; element strides ms, 0 where broadcast; a dense last dimension) is
 * causal as far as softmax can tell: in every (batch, head) slice, each query i's keys j > i are hidden (<= -1e30,
 * -inf included: exp of them less the row's max is exactly 0) and some key j <= i is not. Then skipping the keys
 * after each query gives the same probabilities; the mask still applies to the keys it leaves. Else 0. */
int kiln_attn_mask_is_causal(const float *mask, const int64_t *ms, int64_t b, int64_t h, int64_t t, int64_t s) {
    for (int64_t bi = 0; bi < (ms[0] ? b : 1); bi++)
        for (int64_t hi = 0; hi < (ms[1] ? h : 1); hi++)
            for (int64_t i = 0; i < t; i++) {
                const float *row = mask + bi * ms[0] + hi * ms[1] + i * ms[2];
                int64_t seen = i + 1 < s ? i + 1 : s;
                int hidden = 1, open = 0;
#pragma omp simd reduction(& : hidden)
                for (int64_t j = seen; j < s; j++) hidden &= row[j] <= -1e30f;
#pragma omp simd reduction(| : open)
                for (int64_t j = 0; j < seen; j++) open |= !(row[j] <= -1e30f);
                if (!hidden || !open) return 0;
            }
    return 1;
}

/* KILN_NO_BF16_PRODUCTS builds the fallbacks below, as a compiler without AVX-512 BF16 does (tested) */
#if !defined(KILN_NO_BF16_PRODUCTS) && defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#include <immintrin.h>
#define ABT_ROWS 8     /* rows of a register tile: 8 x 32 fp32 accumulators, 16 of the 32 zmm registers */

/* c[rows x ncols] (row stride ldc, fp32, or rounded to bf16 where c_bf16) = a[8 x pairs kbeg .. kend] .
 * bp[the same pairs x np], the columns j0 .. j0 + 32 of bp; a's pair p of row r is a[r * ars + p * aps].
 * c_bf16 < 0: c is fp32 and the sums start from its values (c +=), which is the same arithmetic as one longer
 * sum when the pairs before were added the same way. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static void abt_tile(const uint32_t *a, int64_t ars,
                                                                                    int64_t aps, int64_t kbeg,
                                                                                    int64_t kend,
                                                                                    const uint32_t *bp, int64_t np,
                                                                                    void *c, int c_bf16, int64_t ldc,
                                                                                    int rows, int64_t ncols) {
    __m512 acc[ABT_ROWS][2];
    __mmask16 m0 = ncols >= 16 ? 0xFFFF : (__mmask16)((1u << ncols) - 1);
    __mmask16 m1 = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : (__mmask16)((1u << (ncols - 16)) - 1);
    for (int r = 0; r < ABT_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    if (c_bf16 < 0)
        for (int r = 0; r < rows; r++) {
            acc[r][0] = _mm512_maskz_loadu_ps(m0, (float *)c + r * ldc);
            acc[r][1] = _mm512_maskz_loadu_ps(m1, (float *)c + r * ldc + 16);
        }
    for (int64_t p = kbeg; p < kend; p++) {
        __m512i b0 = _mm512_loadu_si512(bp + p * np), b1 = _mm512_loadu_si512(bp + p * np + 16);
        for (int r = 0; r < ABT_ROWS; r++) {
            __m512i av = _mm512_set1_epi32((int)a[r * ars + p * aps]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)av, (__m512bh)b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)av, (__m512bh)b1);
        }
    }
    for (int r = 0; r < rows; r++) {
        if (c_bf16 > 0) {           /* round to nearest even, as ATen rounds a bf16 product's fp32 sums */
            uint16_t *row = (uint16_t *)c + r * ldc;
            _mm256_mask_storeu_epi16(row, m0, (__m256i)_mm512_cvtneps_pbh(acc[r][0]));
            _mm256_mask_storeu_epi16(row + 16, m1, (__m256i)_mm512_cvtneps_pbh(acc[r][1]));
        } else {
            float *row = (float *)c + r * ldc;
            _mm512_mask_storeu_ps(row, m0, acc[r][0]);
            _mm512_mask_storeu_ps(row + 16, m1, acc[r][1]);
        }
    }
}

int kiln_bf16_abt_built(void) { return 1; }

/* b's pairs for one matrix, column-major over its n columns of the product: bp[p][j] = (B[2p][j], B[2p+1][j]) of
 * B = b^T (k x n), zero past k and past n (np columns). b is given as n x k (row stride rs) or, `kn`, as k x n. */
static void abt_pack(const uint16_t *b, int64_t rs, int kn, int64_t n, int64_t k, uint32_t *bp, int64_t np) {
    int64_t kp = (k + 1) / 2;
    for (int64_t p = 0; p < kp; p++) {
        uint32_t *out = bp + p * np;
        int two = 2 * p + 1 < k;
        if (kn) {
            const uint16_t *lo = b + 2 * p * rs, *hi = lo + rs;
            for (int64_t j = 0; j < n; j++) out[j] = (uint32_t)lo[j] | (two ? (uint32_t)hi[j] << 16 : 0u);
        } else {
            for (int64_t j = 0; j < n; j++) {
                const uint16_t *row = b + j * rs + 2 * p;
                out[j] = (uint32_t)row[0] | (two ? (uint32_t)row[1] << 16 : 0u);
            }
        }
        for (int64_t j = n; j < np; j++) out[j] = 0;
    }
}

/* a's tile of rows i0 .. i0 + rows as pairs, zero past k and past `rows`, pairs kbeg .. kp of it; A (m x k) is a,
 * or (a_t) a given as k x m. Row-major a: at[r * kp + p] = (A[i0 + r][2p], A[i0 + r][2p + 1]), its rows copied
 * whole; a_t: pair-major, at[p * 8 + r], each pair of a's rows interleaved 8 columns at a time. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void abt_pack_rows(const uint16_t *a, int64_t a_rs,
                                                                              int a_t, int64_t i0, int rows,
                                                                              int64_t k, int64_t kbeg, uint32_t *at) {
    int64_t kp = (k + 1) / 2;
    if (!a_t) {
        uint16_t *h = (uint16_t *)at;
        memset(at, 0, (size_t)(ABT_ROWS * kp) * sizeof(uint32_t));
        for (int r = 0; r < rows; r++) memcpy(h + r * kp * 2, a + (i0 + r) * a_rs, (size_t)k * 2);
        return;
    }
    __mmask8 live = (__mmask8)((1u << rows) - 1);
    for (int64_t p = kbeg; p < kp; p++) {
        const uint16_t *lo = a + 2 * p * a_rs + i0;
        __m128i l = _mm_maskz_loadu_epi16(live, lo);
        __m128i h = 2 * p + 1 < k ? _mm_maskz_loadu_epi16(live, lo + a_rs) : _mm_setzero_si128();
        _mm_storeu_si128((__m128i *)(at + p * ABT_ROWS), _mm_unpacklo_epi16(l, h));
        _mm_storeu_si128((__m128i *)(at + p * ABT_ROWS + 4), _mm_unpackhi_epi16(l, h));
    }
}

/* a: g x m x k, element (h, i, c) at a[h * a_hs + i * a_rs + c], or (a_t) g x k x m at a[h * a_hs + c * a_rs + i];
 * b: g x n x k at b[h * b_hs + j * b_rs + c], or (b_kn) g x k x n at b[h * b_hs + c * b_rs + j]; c: g x m x n
 * dense, fp32 or (c_bf16) bf16. `causal`: a b^T's entries j > i are 0 (not computed); a b (b_kn) sums row i over
 * c <= i; a^T b (a_t, b_kn: a's k x m holds probabilities or their gradients, 0 for key i > query c) sums row i
 * over c >= i. a_t needs b_kn. */
#include "native_amx.c"

int kiln_bf16_abt(const uint16_t *a, int64_t a_hs, int64_t a_rs, int a_t, const uint16_t *b, int64_t b_hs,
                  int64_t b_rs, int b_kn, int causal, void *c, int c_bf16, int64_t g, int64_t m, int64_t n, int64_t k,
                  int amx, int threads) {
    if (k <= 0 || k > (1 << 20) || (a_t && !b_kn)) return 2;
    if (amx && amx_state > 0 && c_bf16 >= 0)   /* AMX (native_amx.c); c_bf16 < 0 (summing into c) stays below */
        return amx_abt(a, a_hs, a_rs, a_t, b, b_hs, b_rs, b_kn, causal, c, c_bf16, g, m, n, k, threads);
    /* k padded to pairs (a zero last element when odd); n to whole tiles of 32 columns */
    int64_t kp = (k + 1) / 2, np = (n + 31) / 32 * 32, tiles = (m + ABT_ROWS - 1) / ABT_ROWS;
    size_t esize = c_bf16 ? 2 : 4;
    int bad = 0;
#pragma omp parallel num_threads(threads) reduction(| : bad)
    {
        /* the matrix in hand's b as pairs; a's tile of rows as pairs, zero-padded to whole pairs and 8 rows */
        uint32_t *bp = malloc((size_t)(np * kp) * sizeof(uint32_t));
        uint32_t *at = malloc((size_t)(ABT_ROWS * kp) * sizeof(uint32_t));
        int64_t packed = -1;
        if (!bp || !at) bad = 1;
#pragma omp for schedule(static, 1)  /* tiles dealt out in turn: causal ones grow along a head */
        for (int64_t t = 0; t < g * tiles; t++) {
            if (!bp || !at) continue;
            int64_t h = t / tiles, i0 = (t % tiles) * ABT_ROWS;
            if (h != packed) {
                abt_pack(b + h * b_hs, b_rs, b_kn, n, k, bp, np);
                packed = h;
            }
            int rows = m - i0 < ABT_ROWS ? (int)(m - i0) : ABT_ROWS;
            int64_t last = i0 + rows - 1;       /* causal: the tile's last query sees keys 0 .. last */
            /* the pairs summed: a b sums up to the tile's last query, a^T b from its first key */
            int64_t kbeg = causal && a_t ? (i0 / 2 < kp ? i0 / 2 : kp) : 0;
            int64_t kend = causal && b_kn && !a_t && last + 1 < k ? (last + 2) / 2 : kp;
            abt_pack_rows(a + h * a_hs, a_rs, a_t, i0, rows, k, kbeg, at);
            char *ch = (char *)c + (size_t)(h * m + i0) * n * esize;
            for (int64_t j0 = 0; j0 < n; j0 += 32) {
                if (causal && !b_kn && j0 > last) {
                    for (int r = 0; r < rows; r++) memset(ch + (r * n + j0) * esize, 0, (size_t)(n - j0) * esize);
                    break;
                }
                abt_tile(at, a_t ? 1 : kp, a_t ? ABT_ROWS : 1, kbeg, kend, bp + j0, np, ch + j0 * esize, c_bf16, n,
                         rows, n - j0);
            }
        }
        free(bp);
        free(at);
    }
    return bad ? 3 : 0;
}
/* Attention's forward for bf16 q, k, v, one (batch, head) at a time per thread and 8 queries at a time: the
 * scores of the 8 queries (fp32, in cache), row_probs over them (unnormalized probabilities rounded to bf16, lse,
 * 1 / sum), their product with v (fp32), times 1 / sum and rounded once into out: what kiln_bf16_abt,
 * kiln_attn_softmax (with rowscale) and kiln_bf16_abt (kn) compute for a head group, the same operations in the
 * same order, without a (queries x keys)-sized buffer between them. q: (b, h, t, d), k: (b, h, s, d), v: (b, h, s,
 * dv), element strides qs, ks, vs (batch, head, row; the last dimension dense); mask: fp32 (b, h, t, s) with
 * strides ms (0 where broadcast) and a dense last dimension, or NULL; `causal`: query i sees keys j <= i only (the
 * mask, if any, added to those: a causal mask a model materialized, kiln_attn_mask_is_causal). out: (b, h, t, dv) bf16 with strides os (a dense last dimension: ATen's
 * flash kernel lays it out as (b, t, h, dv)); lse: (b, h, t) dense fp32. probs: NULL, or (b, h, t, 2 ceil(s / 2))
 * dense bf16 that receives P = exp(z - max) / sum per row, rounded once, 0 past the keys the row sees (what
 * kiln_attn_backward_bf16 computes again from lse, kept instead where it is small: kiln/passes/keep_probs.py). */
int kiln_attn_forward_bf16(const uint16_t *q, const int64_t *qs, const uint16_t *k, const int64_t *ks,
                           const uint16_t *v, const int64_t *vs, const float *mask, const int64_t *ms, int causal,
                           uint16_t *out, const int64_t *os, float *lse, uint16_t *probs, int64_t b, int64_t h,
                           int64_t t, int64_t s, int64_t d, int64_t dv, double scale, int threads) {
    if (d <= 0 || dv <= 0 || s <= 0 || s > ROW_MAX || d > (1 << 16) || dv > (1 << 16)) return 2;
    int64_t kd = (d + 1) / 2, ks2 = (s + 1) / 2;            /* pairs along d (scores) and along keys (P v) */
    int64_t ns = (s + 31) / 32 * 32, nv = (dv + 31) / 32 * 32, tiles = (t + ABT_ROWS - 1) / ABT_ROWS;
    float sc = (float)scale;
    int bad = 0;
#pragma omp parallel num_threads(threads) reduction(| : bad)
    {
        uint32_t *kp = malloc((size_t)(ns * kd) * sizeof(uint32_t));           /* k as pairs, per column */
        uint32_t *vp = malloc((size_t)(nv * ks2) * sizeof(uint32_t));          /* v as pairs over keys */
        uint32_t *qt = malloc((size_t)(ABT_ROWS * kd) * sizeof(uint32_t));     /* 8 queries as pairs */
        uint32_t *pt = calloc((size_t)(ABT_ROWS * ks2), sizeof(uint32_t));     /* their probabilities, bf16 */
        float *st = malloc((size_t)(ABT_ROWS * ns) * sizeof(float));           /* their scores */
        float *ot = malloc((size_t)(ABT_ROWS * nv) * sizeof(float));           /* their P v */
        int64_t packed = -1;
        if (!kp || !vp || !qt || !pt || !st || !ot) bad = 1;
#pragma omp for schedule(static)
        for (int64_t w = 0; w < b * h * tiles; w++) {
            if (bad) continue;
            int64_t bh = w / tiles, bi = bh / h, hi = bh % h, i0 = (w % tiles) * ABT_ROWS;
            const uint16_t *qh = q + bi * qs[0] + hi * qs[1];
            if (bh != packed) {
                abt_pack(k + bi * ks[0] + hi * ks[1], ks[2], 0, s, d, kp, ns);
                abt_pack(v + bi * vs[0] + hi * vs[1], vs[2], 1, dv, s, vp, nv);
                packed = bh;
            }
            int rows = t - i0 < ABT_ROWS ? (int)(t - i0) : ABT_ROWS;
            int64_t last = i0 + rows - 1;
            /* the keys any of the 8 queries sees, and the pairs of them P v sums over */
            int64_t seen = causal && last + 1 < s ? last + 1 : s;
            int64_t kend = causal && last + 1 < s ? (last + 2) / 2 : ks2;
            abt_pack_rows(qh, qs[2], 0, i0, rows, d, 0, qt);
            for (int64_t j0 = 0; j0 < seen; j0 += 32)
                abt_tile(qt, kd, 1, 0, kd, kp + j0, ns, st + j0, 0, ns, rows, s - j0);
            uint16_t *ph = (uint16_t *)pt;
            float rowscale[ABT_ROWS];
            for (int r = 0; r < rows; r++) {
                int64_t i = i0 + r, nc = causal && i + 1 < s ? i + 1 : s;
                float *z = st + r * ns;
                if (mask) {
                    const float *mr = mask + bi * ms[0] + hi * ms[1] + i * ms[2];
#pragma omp simd
                    for (int64_t j = 0; j < nc; j++) z[j] = z[j] * sc + mr[j];
                } else {
#pragma omp simd
                    for (int64_t j = 0; j < nc; j++) z[j] = z[j] * sc;
                }
                row_probs(z, nc, &lse[bh * t + i], &rowscale[r]);
                if (probs) {                /* P for the backward: normalized, rounded once, 0 past the row's keys */
                    uint16_t *pr = probs + (bh * t + i) * 2 * ks2;
                    float rs = rowscale[r];
#pragma omp simd
                    for (int64_t j = 0; j < nc; j++) pr[j] = f_bf16(z[j] * rs);
                    memset(pr + nc, 0, (size_t)(2 * ks2 - nc) * sizeof(uint16_t));
                }
                store(ph + r * 2 * ks2, BF16, z, nc);
                memset(ph + r * 2 * ks2 + nc, 0, (size_t)(2 * kend - nc) * sizeof(uint16_t));
            }
            for (int64_t j0 = 0; j0 < dv; j0 += 32)
                abt_tile(pt, ks2, 1, 0, kend, vp + j0, nv, ot + j0, 0, nv, rows, dv - j0);
            for (int r = 0; r < rows; r++) {
                float *o = ot + r * nv;
#pragma omp simd
                for (int64_t c = 0; c < dv; c++) o[c] *= rowscale[r];
                store(out + bi * os[0] + hi * os[1] + (i0 + r) * os[2], BF16, o, dv);
            }
        }
        free(kp);
        free(vp);
        free(qt);
        free(pt);
        free(st);
        free(ot);
    }
    return bad ? 3 : 0;
}
/* rows x n fp32 accumulators (row stride ld) rounded to bf16 rows of `out` (row stride out_rs) */
static void round_rows(const float *acc, int64_t ld, int64_t rows, int64_t n, uint16_t *out, int64_t out_rs) {
    for (int64_t r = 0; r < rows; r++) store(out + r * out_rs, BF16, acc + r * ld, n);
}

#define QBLOCK 32      /* queries whose P and dS rows are kept for dV and dK: 16 pairs a pass over the sums */

/* acc[keys x n] (row stride ldc, fp32) += x^T y over a block of `rows` queries, the first of them query q0: x (rows x
 * keys, bf16, row stride xs: probabilities or their gradients) and y (rows x n, bf16, row stride ys: dO or q), for
 * the first `keys` keys; `causal`: key j sums queries i >= j only (x is 0 before them). yp and at are scratch
 * (QBLOCK / 2 x ldc and QBLOCK / 2 x 8 pairs). dV and dK a block at a time, the queries' pairs in order. */
static void add_transposed(const uint16_t *x, int64_t xs, const uint16_t *y, int64_t ys, int rows, int64_t q0,
                           int causal, int64_t keys, int64_t n, uint32_t *yp, uint32_t *at, float *acc, int64_t ldc) {
    int64_t pairs = (rows + 1) / 2;
    abt_pack(y, ys, 1, n, rows, yp, ldc);
    for (int64_t j0 = 0; j0 < keys; j0 += ABT_ROWS) {
        int kr = keys - j0 < ABT_ROWS ? (int)(keys - j0) : ABT_ROWS;
        int64_t kbeg = causal && j0 > q0 ? (j0 - q0) / 2 : 0;    /* kiln_bf16_abt's a_t form starts there too */
        abt_pack_rows(x, xs, 1, j0, kr, rows, kbeg, at);
        for (int64_t c0 = 0; c0 < n; c0 += 32)
            abt_tile(at, 1, ABT_ROWS, kbeg, pairs, yp + c0, ldc, acc + j0 * ldc + c0, -1, ldc, kr, n - c0);
    }
}

/* Attention's backward for bf16 q, k, v, dO, one (batch, head) per thread and 8 queries at a time: the scores
 * again, P = exp(z - lse) and dP = dO v^T (fp32, in cache), dS = P (dP - delta) scale, dQ = dS k (rounded once),
 * and dV += P^T dO, dK += dS^T q in fp32 per head, rounded once at its end: kiln_bf16_abt, kiln_attn_probs and
 * kiln_attn_dscores's arithmetic (a causal head's dV and dK sum the queries' pairs in the same order as
 * kiln_bf16_abt's a_t form), with nothing (queries x keys)-sized in memory; delta = rowsum(dO * O) per query, in
 * fp32. Strides and layouts as kiln_attn_forward_bf16's (g: dO and o: the forward's output, as q but dv wide);
 * lse fp32 (b, h, t) dense; dq, dk, dv_ bf16 with the (batch, head, row) strides ds[0..2], ds[3..5], ds[6..8]
 * and dense last dimensions (ATen's flash backward gives them q's, k's and v's layouts). probs: NULL, or the
 * forward's P (kiln_attn_forward_bf16's probs): its rows are read in place of the scores' product and their exps
 * (lse is then not read), and the blocks' dV and dK sums read them where they are. */
int kiln_attn_backward_bf16(const uint16_t *g, const int64_t *gs, const uint16_t *q, const int64_t *qs,
                            const uint16_t *k, const int64_t *ks, const uint16_t *v, const int64_t *vs, const uint16_t *o,
                            const int64_t *os, const float *lse, const uint16_t *probs, const float *mask,
                            const int64_t *ms, int causal, uint16_t *dq, uint16_t *dk, uint16_t *dv_, const int64_t *ds,
                            int64_t b, int64_t h, int64_t t, int64_t s, int64_t d, int64_t dv, double scale,
                            int threads) {
    if (d <= 0 || dv <= 0 || s <= 0 || s > ROW_MAX || d > (1 << 16) || dv > (1 << 16)) return 2;
    int64_t kd = (d + 1) / 2, kv = (dv + 1) / 2, ks2 = (s + 1) / 2;
    int64_t ns = (s + 31) / 32 * 32, nd = (d + 31) / 32 * 32, nv = (dv + 31) / 32 * 32;
    float sc = (float)scale;
    int bad = 0;
#pragma omp parallel num_threads(threads) reduction(| : bad)
    {
        uint32_t *kp = malloc((size_t)(ns * kd) * sizeof(uint32_t));      /* k, pairs along d: scores */
        uint32_t *vp = malloc((size_t)(ns * kv) * sizeof(uint32_t));      /* v, pairs along dv: dP */
        uint32_t *kk = malloc((size_t)(nd * ks2) * sizeof(uint32_t));     /* k, pairs over keys: dQ */
        uint32_t *qt = malloc((size_t)(ABT_ROWS * kd) * sizeof(uint32_t));
        uint32_t *gt = malloc((size_t)(ABT_ROWS * kv) * sizeof(uint32_t));
        uint32_t *yp = malloc((size_t)(QBLOCK / 2 * (nd > nv ? nd : nv)) * sizeof(uint32_t));
        uint32_t *at = malloc((size_t)(QBLOCK / 2 * ABT_ROWS) * sizeof(uint32_t));
        uint32_t *pt = calloc((size_t)(QBLOCK * ks2), sizeof(uint32_t));    /* a block's P, bf16 rows */
        uint32_t *dt = calloc((size_t)(QBLOCK * ks2), sizeof(uint32_t));    /* and its dS */
        float *st = malloc((size_t)(ABT_ROWS * ns) * sizeof(float));       /* scores, then dP */
        float *row = malloc((size_t)ns * sizeof(float));
        float *dva = malloc((size_t)(s * nv) * sizeof(float)), *dka = malloc((size_t)(s * nd) * sizeof(float));
        if (!kp || !vp || !kk || !qt || !gt || !yp || !at || !pt || !dt || !st || !row || !dva || !dka) bad = 1;
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < b * h; bh++) {
            if (bad) continue;
            int64_t bi = bh / h, hi = bh % h;
            const uint16_t *qh = q + bi * qs[0] + hi * qs[1], *kh = k + bi * ks[0] + hi * ks[1];
            const uint16_t *gh = g + bi * gs[0] + hi * gs[1], *oh = o + bi * os[0] + hi * os[1];
            if (!probs) abt_pack(kh, ks[2], 0, s, d, kp, ns);
            abt_pack(v + bi * vs[0] + hi * vs[1], vs[2], 0, s, dv, vp, ns);
            abt_pack(kh, ks[2], 1, d, s, kk, nd);
            memset(dva, 0, (size_t)(s * nv) * sizeof(float));
            memset(dka, 0, (size_t)(s * nd) * sizeof(float));
            for (int64_t i0 = 0; i0 < t; i0 += ABT_ROWS) {
                int rows = t - i0 < ABT_ROWS ? (int)(t - i0) : ABT_ROWS;
                int64_t last = i0 + rows - 1, q0 = i0 / QBLOCK * QBLOCK;
                int64_t seen = causal && last + 1 < s ? last + 1 : s;
                int64_t kend = causal && last + 1 < s ? (last + 2) / 2 : ks2;
                /* this tile's rows of the block's P (the forward's, or computed here) and dS */
                const uint16_t *block = probs ? probs + (bh * t + q0) * 2 * ks2 : (const uint16_t *)pt;
                uint16_t *ph = (uint16_t *)block + (i0 - q0) * 2 * ks2, *dh = (uint16_t *)dt + (i0 - q0) * 2 * ks2;
                abt_pack_rows(gh, gs[2], 0, i0, rows, dv, 0, gt);
                if (!probs) {
                    abt_pack_rows(qh, qs[2], 0, i0, rows, d, 0, qt);
                    for (int64_t j0 = 0; j0 < seen; j0 += 32)
                        abt_tile(qt, kd, 1, 0, kd, kp + j0, ns, st + j0, 0, ns, rows, s - j0);
                    for (int r = 0; r < rows; r++) {    /* P, rounded to bf16, 0 past what the row sees */
                        int64_t i = i0 + r, nc = causal && i + 1 < s ? i + 1 : s;
                        const float *mr = mask ? mask + bi * ms[0] + hi * ms[1] + i * ms[2] : NULL;
                        int64_t n = row_probs_again(st + r * ns, mr, sc, lse[bh * t + i], nc, row);
                        memset(row + n, 0, (size_t)(2 * kend - n) * sizeof(float));
                        store(ph + r * 2 * ks2, BF16, row, 2 * kend);
                    }
                }
                for (int64_t j0 = 0; j0 < seen; j0 += 32)  /* dP = dO v^T over the scores */
                    abt_tile(gt, kv, 1, 0, kv, vp + j0, ns, st + j0, 0, ns, rows, s - j0);
                for (int r = 0; r < rows; r++) {        /* dS, rounded to bf16 */
                    int64_t i = i0 + r, nc = causal && i + 1 < s ? i + 1 : s;
                    const uint16_t *gr = gh + i * gs[2], *orow = oh + i * os[2];
                    float delta = 0.0f;
#pragma omp simd reduction(+ : delta)
                    for (int64_t c = 0; c < dv; c++) delta += bf16_f(gr[c]) * bf16_f(orow[c]);
                    load(row, ph + r * 2 * ks2, BF16, nc);
                    row_dscores(row, st + r * ns, delta, sc, nc, row);
                    memset(row + nc, 0, (size_t)(2 * kend - nc) * sizeof(float));
                    store(dh + r * 2 * ks2, BF16, row, 2 * kend);
                }
                for (int64_t c0 = 0; c0 < d; c0 += 32)     /* dQ = dS k, each of its rows rounded once */
                    abt_tile((uint32_t *)dh, ks2, 1, 0, kend, kk + c0, nd, dq + bi * ds[0] + hi * ds[1] + i0 * ds[2] + c0,
                             1, ds[2], rows, d - c0);
                if (last + 1 == t || last + 1 - q0 == QBLOCK) {   /* the block is whole: its part of dV and dK */
                    int qr = (int)(last + 1 - q0);
                    add_transposed(block, 2 * ks2, gh + q0 * gs[2], gs[2], qr, q0, causal, seen, dv, yp, at, dva, nv);
                    add_transposed((uint16_t *)dt, 2 * ks2, qh + q0 * qs[2], qs[2], qr, q0, causal, seen, d, yp, at,
                                   dka, nd);
                }
            }
            round_rows(dva, nv, s, dv, dv_ + bi * ds[6] + hi * ds[7], ds[8]);
            round_rows(dka, nd, s, d, dk + bi * ds[3] + hi * ds[4], ds[5]);
        }
        free(kp), free(vp), free(kk), free(qt), free(gt), free(yp), free(at), free(pt), free(dt), free(st), free(row);
        free(dva), free(dka);
    }
    return bad ? 3 : 0;
}
#else
int kiln_bf16_abt_built(void) { return 0; }

int kiln_amx_granted(void) { return 0; }

int kiln_bf16_abt(const uint16_t *a, int64_t a_hs, int64_t a_rs, int a_t, const uint16_t *b, int64_t b_hs,
                  int64_t b_rs, int b_kn, int causal, void *c, int c_bf16, int64_t g, int64_t m, int64_t n, int64_t k,
                  int amx, int threads) {
    (void)a, (void)a_hs, (void)a_rs, (void)a_t, (void)b, (void)b_hs, (void)b_rs, (void)b_kn, (void)causal, (void)c,
        (void)c_bf16, (void)g, (void)m, (void)n, (void)k, (void)amx, (void)threads;
    return 4;
}

int kiln_attn_forward_bf16(const uint16_t *q, const int64_t *qs, const uint16_t *k, const int64_t *ks,
                           const uint16_t *v, const int64_t *vs, const float *mask, const int64_t *ms, int causal,
                           uint16_t *out, const int64_t *os, float *lse, uint16_t *probs, int64_t b, int64_t h,
                           int64_t t, int64_t s, int64_t d, int64_t dv, double scale, int threads) {
    (void)q, (void)qs, (void)k, (void)ks, (void)v, (void)vs, (void)mask, (void)ms, (void)causal, (void)out, (void)os,
        (void)lse, (void)probs, (void)b, (void)h, (void)t, (void)s, (void)d, (void)dv, (void)scale, (void)threads;
    return 4;
}

int kiln_attn_backward_bf16(const uint16_t *g, const int64_t *gs, const uint16_t *q, const int64_t *qs,
                            const uint16_t *k, const int64_t *ks, const uint16_t *v, const int64_t *vs, const uint16_t *o,
                            const int64_t *os, const float *lse, const uint16_t *probs, const float *mask,
                            const int64_t *ms, int causal, uint16_t *dq, uint16_t *dk, uint16_t *dv_, const int64_t *ds,
                            int64_t b, int64_t h, int64_t t, int64_t s, int64_t d, int64_t dv, double scale,
                            int threads) {
    (void)g, (void)gs, (void)q, (void)qs, (void)k, (void)ks, (void)v, (void)vs, (void)o, (void)os, (void)lse, (void)probs,
        (void)mask, (void)ms, (void)causal, (void)dq, (void)dk, (void)dv_, (void)ds, (void)b, (void)h, (void)t, (void)s, (void)d, (void)dv,
        (void)scale, (void)threads;
    return 4;
}
#endif
