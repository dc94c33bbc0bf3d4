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
