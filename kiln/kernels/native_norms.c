/* RMSNorm's forward and backward, and LayerNorm's backward (below). Compiled as part of native.c. */

/* ---- a float32 row's sum of squares in the order ATen's CPU `x.pow(2).sum(-1)` adds them ---------------
 * ATen's cascade sum of a contiguous row (SumKernel): vectors of `lanes` floats, four abreast; every 16 rounds of
 * four the running level is carried into the next of four levels (a carry stops at the first level whose index
 * bits are not all zero), the levels then folded into the first, leftover vectors added to the first of the four,
 * the four folded in order; a scalar running sum of the elements past the last whole vector, then the lanes in
 * order. Every square is rounded to float32 before it is added (no contraction: -std=c11). Bit for bit ATen's on
 * the tested lane widths (8: AVX2 and the AVX-512 build of this torch, 16), rows >= 16 long: norms.py checks that on
 * this machine before it uses it (`_aten_lanes`), so the statistics stay eager's own. */
#define SQ_LEVELS 4
#define SQ_ILP 4
#define SQ_STEP 16
static inline float sumsq_ordered(const float *restrict x, int64_t d, const int lanes) {
    float acc[SQ_LEVELS][SQ_ILP][16];
    memset(acc, 0, sizeof acc);
    int64_t nv = d / lanes, n4 = nv / SQ_ILP, i = 0;
    while (i + SQ_STEP <= n4) {
        for (int j = 0; j < SQ_STEP; j++, i++)
            for (int k = 0; k < SQ_ILP; k++) {
                const float *v = x + (i * SQ_ILP + k) * lanes;
                for (int l = 0; l < lanes; l++) acc[0][k][l] += v[l] * v[l];
            }
        for (int lv = 1; lv < SQ_LEVELS; lv++) {
            for (int k = 0; k < SQ_ILP; k++)
                for (int l = 0; l < lanes; l++) {
                    acc[lv][k][l] += acc[lv - 1][k][l];
                    acc[lv - 1][k][l] = 0.0f;
                }
            if (i & ((int64_t)(SQ_STEP - 1) << (lv * 4))) break;
        }
    }
    for (; i < n4; i++)
        for (int k = 0; k < SQ_ILP; k++) {
            const float *v = x + (i * SQ_ILP + k) * lanes;
            for (int l = 0; l < lanes; l++) acc[0][k][l] += v[l] * v[l];
        }
    for (int lv = 1; lv < SQ_LEVELS; lv++)
        for (int k = 0; k < SQ_ILP; k++)
            for (int l = 0; l < lanes; l++) acc[0][k][l] += acc[lv][k][l];
    for (int64_t r = n4 * SQ_ILP; r < nv; r++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += x[r * lanes + l] * x[r * lanes + l];
    for (int k = 1; k < SQ_ILP; k++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t j = nv * lanes; j < d; j++) total += x[j] * x[j];
    for (int l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

/* the two lane widths as their own functions: the lane loops get constant trip counts (and vectorize) */
static float sumsq_lanes8(const float *x, int64_t d) { return sumsq_ordered(x, d, 8); }
static float sumsq_lanes16(const float *x, int64_t d) { return sumsq_ordered(x, d, 16); }

/* ---- RMSNorm ---------------------------------------------------------------------------------------
 * s = x (+ residual, rounded to sum_dt when the sum is written); rstd by `stats`: 0 computed, 1/sqrt(mean(s^2) +
 * eps) with the squares summed in double (half-type sums); 1 read from `rstd` (computed by the caller); 8 or 16
 * eager's own float32 statistics, `x.pow(2).mean(-1).add(eps).rsqrt()` as ATen computes them, the sum in ATen's
 * order for that lane width (sumsq_ordered), over the mean as ATen divides, plus eps in float32. out = s * rstd *
 * weight, in out_dt. Contiguous rows x d. */
int kiln_rms_forward(const void *x, int x_dt, const void *res, int res_dt, const void *w, int w_dt, void *out,
                     int out_dt, void *sum, int sum_dt, float *rstd, int stats, int64_t rows, int64_t d,
                     double eps, int threads) {
    if (d > ROW_MAX || (stats > 1 && stats != 8 && stats != 16)) return -1;
    float wbuf[ROW_MAX];
    const float *wf = in_row(wbuf, w, w_dt, d);
#pragma omp parallel num_threads(threads)
    {
        float sb[ROW_MAX], tb[ROW_MAX], ob[ROW_MAX];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *s = in_row(sb, elem(x, x_dt, r * d), x_dt, d);
            if (res) {
                const float *t = in_row(tb, elem(res, res_dt, r * d), res_dt, d);
                float *sum_row = out_row(sb, elem_out(sum, sum_dt, r * d), sum_dt);
#pragma omp simd
                for (int64_t j = 0; j < d; j++) sum_row[j] = s[j] + t[j];
                round_to(sum_row, sum_dt, d);
                out_done(elem_out(sum, sum_dt, r * d), sum_dt, sum_row, d);
                s = sum_row;
            }
            float k = rstd[r];
            if (stats == 0) {
                double acc = 0.0;
#pragma omp simd reduction(+ : acc)
                for (int64_t j = 0; j < d; j++) acc += (double)s[j] * (double)s[j];
                k = 1.0f / sqrtf((float)(acc / (double)d) + (float)eps);
                rstd[r] = k;
            } else if (stats != 1) {
                float total = stats == 16 ? sumsq_lanes16(s, d) : sumsq_lanes8(s, d);
                k = 1.0f / sqrtf(total / (float)d + (float)eps);
                rstd[r] = k;
            }
            float *o = out_row(ob, elem_out(out, out_dt, r * d), out_dt);
#pragma omp simd
            for (int64_t j = 0; j < d; j++) o[j] = s[j] * k * wf[j];
            out_done(elem_out(out, out_dt, r * d), out_dt, o, d);
        }
    }
    return 0;
}

/* (a + b) + c (rows of dtype dt; c optional) into dst, each add as aten.add adds two tensors of one dtype: in fp32,
 * rounded once to dt */
static const float *load_sum(float *restrict dst, const void *a, const void *b, const void *c, int dt, int64_t n) {
    if (dt == F32) {
        const float *x = (const float *)a, *y = (const float *)b, *z = (const float *)c;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) dst[j] = x[j] + y[j];
        if (z) {
#pragma omp simd
            for (int64_t j = 0; j < n; j++) dst[j] += z[j];
        }
        return dst;
    }
    const uint16_t *x = (const uint16_t *)a, *y = (const uint16_t *)b, *z = (const uint16_t *)c;
#pragma omp simd
    for (int64_t j = 0; j < n; j++) dst[j] = bf16_f(f_bf16(bf16_f(x[j]) + bf16_f(y[j])));
    if (z) {
#pragma omp simd
        for (int64_t j = 0; j < n; j++) dst[j] = bf16_f(f_bf16(dst[j] + bf16_f(z[j])));
    }
    return dst;
}

/* grad_s = rstd * (g*w - s * rstd^2 * dot / d) (+ grad_sum), dot = sum_j g w s (in double); grad_w = sum_rows
 * g s rstd (fp32 over blocks of SUM_ROWS rows, the blocks added in double, per thread, then the threads in order,
 * as kiln_ln_backward sums). g2 (optional, g's dtype): the output gradient is g + g2, added as aten.add adds two
 * tensors of one dtype (in fp32, rounded once to that dtype) before anything reads it: the graph's bits, without
 * the add's pass; g3 (optional, with g2): (g + g2) + g3, each add so (three projections' input gradients: Llama's
 * q, k and v). gi_low (optional): grad_s rounded to low_dt as well. partial: threads x d doubles of scratch. */
int kiln_rms_backward(const void *g, int g_dt, const void *g2, const void *g3, const void *gsum, int gsum_dt,
                      const void *s_in, int s_dt, const void *w, int w_dt, const float *rstd, void *gi, int gi_dt,
                      void *gw, int gw_dt, void *gi_low, int low_dt, double *partial, int64_t rows, int64_t d,
                      int threads) {
    if (d > ROW_MAX) return -1;
    float wbuf[ROW_MAX];
    const float *wf = in_row(wbuf, w, w_dt, d);
    memset(partial, 0, sizeof(double) * (size_t)threads * (size_t)d);
#pragma omp parallel num_threads(threads)
    {
        float gb[ROW_MAX], sb[ROW_MAX], hb[ROW_MAX], ob[ROW_MAX], bw[ROW_MAX];
        int64_t lo, hi;
        share(rows, &lo, &hi);
        double *acc_w = partial + (size_t)thread_index() * (size_t)d;
        for (int64_t r0 = lo; r0 < hi; r0 += SUM_ROWS) {
            int64_t r1 = hi - r0 < SUM_ROWS ? hi : r0 + SUM_ROWS;
            memset(bw, 0, (size_t)d * sizeof(float));
            for (int64_t r = r0; r < r1; r++) {
                const float *gr = g2 ? load_sum(gb, elem(g, g_dt, r * d), elem(g2, g_dt, r * d),
                                                g3 ? elem(g3, g_dt, r * d) : NULL, g_dt, d)
                                     : in_row(gb, elem(g, g_dt, r * d), g_dt, d);
                const float *sr = in_row(sb, elem(s_in, s_dt, r * d), s_dt, d);
                float k = rstd[r];
                double dot = 0.0;
#pragma omp simd reduction(+ : dot)
                for (int64_t j = 0; j < d; j++) {
                    float p = gr[j] * sr[j];
                    dot += (double)p * (double)wf[j];
                    bw[j] += p * k;
                }
                float coef = (float)(dot * (double)k * (double)k / (double)d);
                float *t = out_row(ob, elem_out(gi, gi_dt, r * d), gi_dt);
                if (gsum) {
                    const float *h = in_row(hb, elem(gsum, gsum_dt, r * d), gsum_dt, d);
#pragma omp simd
                    for (int64_t j = 0; j < d; j++) t[j] = (gr[j] * wf[j] - sr[j] * coef) * k + h[j];
                } else {
#pragma omp simd
                    for (int64_t j = 0; j < d; j++) t[j] = (gr[j] * wf[j] - sr[j] * coef) * k;
                }
                out_done(elem_out(gi, gi_dt, r * d), gi_dt, t, d);
                if (gi_low) {             /* the same gradient in a narrower dtype too: rounded from gi's value */
                    if (gi_dt != F32) load(ob, elem(gi, gi_dt, r * d), gi_dt, d);
                    store(elem_out(gi_low, low_dt, r * d), low_dt, gi_dt == F32 ? t : ob, d);
                }
            }
#pragma omp simd
            for (int64_t j = 0; j < d; j++) acc_w[j] += (double)bw[j];
        }
    }
    float total[ROW_MAX];
    for (int64_t j = 0; j < d; j++) {
        double a = 0.0;
        for (int m = 0; m < threads; m++) a += partial[(size_t)m * (size_t)d + (size_t)j];
        total[j] = (float)a;
    }
    store(gw, gw_dt, total, d);
    return 0;
}

/* kiln_ln_backward: LayerNorm's backward over the last dimension in one pass per row, with the gradient sums
 * a transformer's backward puts on either side of it.
 *
 * g = grad (+ grad2): the output gradient, or the sum of two (the residual stream's gradient and the branch's,
 * which the graph added as aten.add does for a float32 result: both widened exactly, one fp32 add). Per row r,
 * with x the input, w the weight (1 where absent), N = d:
 *   ds = sum_j g w x, db = sum_j g w (in fp32, as ATen sums them);
 *   a = rstd, b = (db mean - ds) a^3 / N, c = -b mean - db a / N;
 *   gi = a g w + b x + c (+ gsum: the gradient reaching the input through its other uses, added in fp32)
 * as ATen's CPU kernel writes it; gw_j = sum_r g (x - mean) rstd and gb_j = sum_r g (fp32 over blocks of
 * SUM_ROWS rows, the blocks added in double, per thread, then the threads in order). gi_low (optional): gi
 * rounded to low_dt as well, from gi's own value; low_sums (optional, with gi_low): the column sums of gi_low's
 * values as rounded, summed as gw and gb are (the gradient of the bias of the linear layer gi_low is the output
 * gradient of, which the graph would sum in a pass of its own). One sweep over each row's inputs for the sums
 * and one for the output, the row in L1 between them.
 *
 * grad, grad2 (optional), x, gsum (optional): rows x d, dense, fp32 or bf16; mean, rstd: fp32 per row;
 * w: d values or NULL; gi: rows x d (gi_dt); gw, gb, low_sums: d fp32 values each, or NULL (not wanted);
 * partial: threads x 3d doubles of scratch. Returns 0, -1 for d above ROW_MAX, 3 when it cannot allocate its row
 * buffers. Compiled as part of native.c. */
int kiln_ln_backward(const void *grad, int g_dt, const void *grad2, int g2_dt, const void *x, int x_dt,
                     const float *mean, const float *rstd, const void *w, int w_dt, const void *gsum, int gsum_dt,
                     void *gi, int gi_dt, void *gi_low, int low_dt, float *gw, float *gb, float *low_sums,
                     double *partial, int64_t rows, int64_t d, int threads) {
    if (d > ROW_MAX || d <= 0) return -1;
    float wbuf[ROW_MAX];
    if (w)
        load(wbuf, w, w_dt, d);
    else
        for (int64_t j = 0; j < d; j++) wbuf[j] = 1.0f;
    const float *wf = wbuf;
    if (!gi_low) low_sums = NULL;
    int sums = gw != NULL || gb != NULL, lsums = low_sums != NULL;
    if (sums || lsums) memset(partial, 0, sizeof(double) * 3 * (size_t)threads * (size_t)d);
    int bad = 0;
#pragma omp parallel num_threads(threads) reduction(| : bad)
    {
        /* rows of d floats: g_b, x_b (bf16 rows widened), t_b (grad2, then gsum), o_b (a bf16 output row), gf (the
         * summed gradient), bw, bb, bl (this thread's column sums over its current block of rows, fp32, added into
         * its double totals at the block's end) */
        float *buf = malloc(8 * (size_t)d * sizeof(float));
        if (!buf) bad = 1;
        float *g_b = buf, *x_b = buf + d, *t_b = buf + 2 * d, *o_b = buf + 3 * d, *gf = buf + 4 * d,
              *bw = buf + 5 * d, *bb = buf + 6 * d, *bl = buf + 7 * d;
        int64_t lo, hi;
        share(rows, &lo, &hi);
        /* partial is NULL without sums: no pointer is formed from it then */
        double *acc_w = sums || lsums ? partial + 3 * (size_t)thread_index() * (size_t)d : NULL;
        double *acc_b = acc_w ? acc_w + d : NULL, *acc_l = acc_w ? acc_w + 2 * d : NULL;
        for (int64_t r0 = lo; r0 < hi && buf; r0 += SUM_ROWS) {
            int64_t r1 = hi - r0 < SUM_ROWS ? hi : r0 + SUM_ROWS;
            if (sums) {
                memset(bw, 0, (size_t)d * sizeof(float));
                memset(bb, 0, (size_t)d * sizeof(float));
            }
            if (lsums) memset(bl, 0, (size_t)d * sizeof(float));
            for (int64_t r = r0; r < r1; r++) {
                const float *gr = in_row(g_b, elem(grad, g_dt, r * d), g_dt, d);
                const float *xr = in_row(x_b, elem(x, x_dt, r * d), x_dt, d);
                if (grad2) {
                    const float *g2 = in_row(t_b, elem(grad2, g2_dt, r * d), g2_dt, d);
#pragma omp simd
                    for (int64_t j = 0; j < d; j++) gf[j] = gr[j] + g2[j];
                    gr = gf;
                }
                float m = mean[r], a = rstd[r], ds = 0.0f, db = 0.0f;
                if (sums) {
#pragma omp simd reduction(+ : ds, db)
                    for (int64_t j = 0; j < d; j++) {
                        float gw_j = gr[j] * wf[j];
                        ds += gw_j * xr[j];
                        db += gw_j;
                        bw[j] += gr[j] * ((xr[j] - m) * a);
                        bb[j] += gr[j];
                    }
                } else {
#pragma omp simd reduction(+ : ds, db)
                    for (int64_t j = 0; j < d; j++) {
                        float gw_j = gr[j] * wf[j];
                        ds += gw_j * xr[j];
                        db += gw_j;
                    }
                }
                float bc = (db * m - ds) * a * a * a / (float)d;
                float cc = -bc * m - db * a / (float)d;
                float *t = out_row(o_b, elem_out(gi, gi_dt, r * d), gi_dt);
                if (gsum) {
                    const float *h = in_row(t_b, elem(gsum, gsum_dt, r * d), gsum_dt, d);
#pragma omp simd
                    for (int64_t j = 0; j < d; j++) t[j] = (a * gr[j] * wf[j] + bc * xr[j] + cc) + h[j];
                } else {
#pragma omp simd
                    for (int64_t j = 0; j < d; j++) t[j] = a * gr[j] * wf[j] + bc * xr[j] + cc;
                }
                out_done(elem_out(gi, gi_dt, r * d), gi_dt, t, d);
                if (gi_low) {             /* rounded from gi's value (a cast of gi, folded in) */
                    if (gi_dt != F32) load(o_b, elem(gi, gi_dt, r * d), gi_dt, d);
                    store(elem_out(gi_low, low_dt, r * d), low_dt, gi_dt == F32 ? t : o_b, d);
                    if (lsums) {          /* the values as rounded, read back from the row just written */
                        load(o_b, elem(gi_low, low_dt, r * d), low_dt, d);
#pragma omp simd
                        for (int64_t j = 0; j < d; j++) bl[j] += o_b[j];
                    }
                }
            }
            if (sums) {
#pragma omp simd
                for (int64_t j = 0; j < d; j++) {
                    acc_w[j] += (double)bw[j];
                    acc_b[j] += (double)bb[j];
                }
            }
            if (lsums) {
#pragma omp simd
                for (int64_t j = 0; j < d; j++) acc_l[j] += (double)bl[j];
            }
        }
        free(buf);
    }
    if (bad) return 3;
    if (sums || lsums) {
        for (int64_t j = 0; j < d; j++) {
            double sw = 0.0, sb = 0.0, sl = 0.0;
            for (int k = 0; k < threads; k++) {
                sw += partial[3 * (size_t)k * (size_t)d + (size_t)j];
                sb += partial[(3 * (size_t)k + 1) * (size_t)d + (size_t)j];
                sl += partial[(3 * (size_t)k + 2) * (size_t)d + (size_t)j];
            }
            if (gw) gw[j] = (float)sw;
            if (gb) gb[j] = (float)sb;
            if (low_sums) low_sums[j] = (float)sl;
        }
    }
    return 0;
}
