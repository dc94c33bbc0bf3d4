/* Cross-entropy over rows of logits, and the row reductions attention's passes share (kiln/kernels/logit_loss.py,
 * cross_entropy.py, native_attention.c), #included by native.c (one library, its helpers: load/store, exp_approx,
 * BLOCK). */

/* ---- cross-entropy over rows of logits (kiln/kernels/logit_loss.py) --------------------------------
 * x: rows x cols, row stride xs (elements), dense last dimension, fp32 or bf16; labels int64.
 * Forward: lse[r] = log(sum_j exp(x_rj)) (shifted by the row's max, summed in double) and
 * loss[r] = lse[r] - x[r, labels[r]] (in double, then rounded to fp32); a row whose label is `ignore`
 * gets 0 and 0. Returns 2 (the rest computed) when a label is outside [0, cols) and not `ignore`.
 * Backward: grad[r, j] = (exp(x_rj - lse[r]) - [j == labels[r]]) * scale[r * ss] (ss 0: one scale for all
 * rows), written in g_dt with row stride gs; 0 on ignored rows. Reads x once and writes grad once. */
static inline float exp_or_zero(float d) {
    /* exp(d), 0 below -87.3 (-inf too); a product rather than a select, so the loops vectorize on AVX2
     * (NaN stays NaN: NaN * 0 is NaN) */
    return exp_approx(d) * (float)((d >= -87.3f) | (d != d));
}

/* the block loops stand alone (inlined into the OpenMP region, gcc did not vectorize them) */
static __attribute__((noinline)) float block_max(const float *restrict v, int64_t n, float m, int *nan) {
    int bad = 0;
#pragma omp simd reduction(max : m) reduction(| : bad)
    for (int64_t j = 0; j < n; j++) {
        m = v[j] > m ? v[j] : m;
        bad |= v[j] != v[j];
    }
    *nan |= bad;
    return m;
}

static __attribute__((noinline)) double block_sum_exp(const float *restrict v, int64_t n, float m) {
    /* float lanes over pieces of 256 values (vectorizes; a double accumulator did not), the pieces added in
     * double: each lane sums at most 32 terms */
    double s = 0.0;
    for (int64_t lo = 0; lo < n; lo += 256) {
        int64_t hi = n - lo < 256 ? n : lo + 256;
        float piece = 0.0f;
#pragma omp simd reduction(+ : piece)
        for (int64_t j = lo; j < hi; j++) piece += exp_or_zero(v[j] - m);
        s += piece;
    }
    return s;
}

/* exp_or_zero(d) for d = x - max(row) of a row without NaN (block_max found none): d <= 0 or -inf, so neither
 * exp_approx's upper clamp nor its NaN cases can arise, and these lanes skip them (a fifth of the exp's
 * instructions; the loss's exp pass is bound by them). Every value is exp_or_zero's, bit for bit: the same
 * polynomial on the same clamped argument, and 0 below -87.3. */
static inline float exp_nonpositive(float d) {
    float e = exp_in_range(d < -87.3f ? -87.3f : d);
    return d >= -87.3f ? e : 0.0f;
}

/* v[j] = exp(v[j] - m) in place, and their sum (float lanes over pieces of 256, the pieces added in double);
 * v holds no NaN and m is its finite maximum */
static __attribute__((noinline)) double block_exp_sum(float *restrict v, int64_t n, float m) {
#ifdef KILN_VEC512
    return exp_sum16(v, n, m);          /* the same values (native_vec512.c) */
#endif
    double s = 0.0;
    for (int64_t lo = 0; lo < n; lo += 256) {
        int64_t hi = n - lo < 256 ? n : lo + 256;
        float piece = 0.0f;
#pragma omp simd reduction(+ : piece)
        for (int64_t j = lo; j < hi; j++) {
            v[j] = exp_nonpositive(v[j] - m);
            piece += v[j];
        }
        s += piece;
    }
    return s;
}

static __attribute__((noinline)) void block_softmax_grad(const float *restrict v, float *restrict o, int64_t n,
                                                         float l, float s) {
#pragma omp simd
    for (int64_t j = 0; j < n; j++) o[j] = exp_or_zero(v[j] - l) * s;
}

int kiln_ce_forward(const void *x, int dt, int64_t xs, const int64_t *labels, int64_t ignore, float *loss,
                    float *lse, int64_t rows, int64_t cols, int threads) {
    int bad = 0;
#pragma omp parallel num_threads(threads) reduction(| : bad)
    {
        float buf[BLOCK];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            int64_t y = labels[r];
            if (y == ignore) {
                loss[r] = 0.0f;
                lse[r] = 0.0f;
                continue;
            }
            if (y < 0 || y >= cols) {
                bad = 1;
                loss[r] = lse[r] = NAN;
                continue;
            }
            const void *row = elem(x, dt, r * xs);
            float m = -INFINITY;
            int nan = 0;
            for (int64_t lo = 0; lo < cols; lo += BLOCK) {
                int64_t n = cols - lo < BLOCK ? cols - lo : BLOCK;
                m = block_max(in_row(buf, elem(row, dt, lo), dt, n), n, m, &nan);
            }
            if (nan || m == INFINITY || m == -INFINITY) {   /* as log_softmax: NaN (all -inf, +inf, NaN) */
                loss[r] = lse[r] = NAN;
                continue;
            }
            double s = 0.0;
            for (int64_t lo = 0; lo < cols; lo += BLOCK) {
                int64_t n = cols - lo < BLOCK ? cols - lo : BLOCK;
                s += block_sum_exp(in_row(buf, elem(row, dt, lo), dt, n), n, m);
            }
            double l = (double)m + log(s);
            float xy;
            load(&xy, elem(row, dt, y), dt, 1);
            lse[r] = (float)l;
            loss[r] = (float)(l - (double)xy);
        }
    }
    return bad ? 2 : 0;
}

int kiln_ce_backward(const void *x, int dt, int64_t xs, const int64_t *labels, int64_t ignore, const float *lse,
                     const float *scale, int64_t ss, void *grad, int g_dt, int64_t gs, int64_t rows, int64_t cols,
                     int threads) {
#pragma omp parallel num_threads(threads)
    {
        float xb[BLOCK], ob[BLOCK];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            int64_t y = labels[r];
            float l = lse[r], s = scale[r * ss];
            int skip = y == ignore;
            const void *row = elem(x, dt, r * xs);
            void *grow = elem_out(grad, g_dt, r * gs);
            for (int64_t lo = 0; lo < cols; lo += BLOCK) {
                int64_t n = cols - lo < BLOCK ? cols - lo : BLOCK;
                float *o = out_row(ob, elem_out(grow, g_dt, lo), g_dt);
                if (skip) {
                    memset(o, 0, (size_t)n * sizeof(float));
                } else {
                    const float *v = in_row(xb, elem(row, dt, lo), dt, n);
                    block_softmax_grad(v, o, n, l, s);
                    if (y >= lo && y < lo + n) o[y - lo] = (exp_or_zero(v[y - lo] - l) - 1.0f) * s;
                }
                out_done(elem_out(grow, g_dt, lo), g_dt, o, n);
            }
        }
    }
    return 0;
}

/* row[j] = e[j] * inv in the row's dtype, for j in [lo, hi), each value also added to gb[j] when gb is given:
 * one pass over the fp32 row buffer where scaling, summing and storing took three */
static inline void scale_sum_store(void *row, int dt, const float *restrict e, float inv, float *restrict gb,
                                   int64_t lo, int64_t hi) {
    if (dt == F32) {
        float *o = (float *)row;
        if (gb) {
#pragma omp simd
            for (int64_t j = lo; j < hi; j++) { float p = e[j] * inv; gb[j] += p; o[j] = p; }
        } else {
#pragma omp simd
            for (int64_t j = lo; j < hi; j++) o[j] = e[j] * inv;
        }
        return;
    }
    uint16_t *o = (uint16_t *)row;
    if (gb) {
#pragma omp simd
        for (int64_t j = lo; j < hi; j++) { float p = e[j] * inv; gb[j] += p; o[j] = f_bf16(p); }
    } else {
#pragma omp simd
        for (int64_t j = lo; j < hi; j++) o[j] = f_bf16(e[j] * inv);
    }
}

/* kiln_ce_forward and kiln_ce_backward (scale 1) in one call, the gradient written over x: per row its max, then
 * e = exp(x - max) into a row buffer (fp32) with its sum, lse and the loss, then e / sum - onehot; one exp per
 * logit instead of two and the row read twice instead of three times. e / sum is as accurate as exp(x - lse)
 * (more, where lse is large: x - lse rounds). bias (fp32, cols; or NULL) is added to each row as it is read (a
 * decoder's bias: the logits x + bias, in fp32), and bias_grad (threads x cols fp32 zeros; or NULL) receives each
 * thread's sums of its rows' gradients in fp32, before rounding (the bias's gradient: the caller adds the threads'
 * rows). Returns 2 when a label is outside [0, cols) and not `ignore` (that row NaN), 3 when a row buffer could not
 * be allocated. */
int kiln_ce_grads(void *x, int dt, int64_t xs, const int64_t *labels, int64_t ignore, float *loss, float *lse,
                  int64_t rows, int64_t cols, const float *bias, float *bias_grad, int threads) {
    int bad = 0;
#pragma omp parallel num_threads(threads) reduction(| : bad)
    {
        float *e = malloc((size_t)(cols > 0 ? cols : 1) * sizeof(float));
        float *gb = NULL;             /* this thread's sums of its rows' gradients: the bias's gradient */
        if (bias_grad) {
            int me = 0;
#ifdef _OPENMP
            me = omp_get_thread_num();
#endif
            gb = bias_grad + (size_t)me * (size_t)cols;
        }
        if (!e) bad |= 4;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!e) continue;
            int64_t y = labels[r];
            void *row = elem_out(x, dt, r * xs);
            int skip = y == ignore, out = !skip && (y < 0 || y >= cols);
            float m = -INFINITY;
            int nan = 0;
            if (!skip && !out)
                for (int64_t lo = 0; lo < cols; lo += BLOCK) {
                    int64_t n = cols - lo < BLOCK ? cols - lo : BLOCK;
                    load(e + lo, elem(row, dt, lo), dt, n);
                    if (bias) {
#pragma omp simd
                        for (int64_t j = lo; j < lo + n; j++) e[j] += bias[j];
                    }
                    m = block_max(e + lo, n, m, &nan);
                }
            if (skip || out || nan || m == INFINITY || m == -INFINITY) {   /* 0 (ignored) or NaN, as the pair */
                float fill = skip ? 0.0f : NAN;
                bad |= out ? 2 : 0;
                loss[r] = lse[r] = fill;
                for (int64_t j = 0; j < cols; j++) e[j] = fill;
                store(row, dt, e, cols);
                if (gb && !skip)
                    for (int64_t j = 0; j < cols; j++) gb[j] += fill;
                continue;
            }
            double sum = 0.0;
            for (int64_t lo = 0; lo < cols; lo += BLOCK) {
                int64_t n = cols - lo < BLOCK ? cols - lo : BLOCK;
                sum += block_exp_sum(e + lo, n, m);
            }
            double l = (double)m + log(sum);
            lse[r] = (float)l;
            float xy;
            load(&xy, elem(row, dt, y), dt, 1);
            loss[r] = (float)(l - ((double)xy + (bias ? (double)bias[y] : 0.0)));
            float inv = (float)(1.0 / sum);
            /* the row's gradient p = e * inv (less 1 at the label), summed into the bias's gradient and
             * written in the row's dtype in one pass; the label's element between the two halves, so each
             * value is rounded as the three separate passes rounded it */
            float py = e[y] * inv;
            py -= 1.0f;
            scale_sum_store(row, dt, e, inv, gb, 0, y);
            if (gb) gb[y] += py;
            if (dt == F32) ((float *)row)[y] = py;
            else ((uint16_t *)row)[y] = f_bf16(py);
            scale_sum_store(row, dt, e, inv, gb, y + 1, cols);
        }
        free(e);
    }
    return bad & 4 ? 3 : bad & 2 ? 2 : 0;
}
