/* Single sweeps over whole tensors: the non-finite guard's scan, a scaled and rounded copy, a widening sum.
 * Compiled as part of native.c (#included).
 *
 * kiln_first_nonfinite: the non-finite guard's scan (kiln/guards.py), one read of every gradient.
 *
 * A float32 or bfloat16 value is NaN or infinite exactly when its exponent bits are all ones, so each
 * chunk takes the maximum of its values' exponent fields (an integer max, vectorized) and compares it
 * once. The tensors are cut into chunks of CHUNK elements, numbered across all tensors in order; threads
 * take chunks dynamically (a large gradient and many small ones balance alike) and the smallest tensor
 * index holding a non-finite value wins, so the answer does not depend on timing.
 *
 * ptrs[i], dts[i], ns[i]: tensor i's first element, dtype code and element count (each a dense block).
 * Returns 0 when every value is finite, else 1 + the index of the first tensor holding a NaN or an inf;
 * -1 when it cannot allocate its chunk table. */
#define FINITE_CHUNK 65536

static int chunk_finite(const void *p, int dt, int64_t lo, int64_t hi) {
    if (dt == F32) {
        const uint32_t *u = (const uint32_t *)p;
        uint32_t top = 0;
#pragma omp simd reduction(max : top)
        for (int64_t i = lo; i < hi; i++) {
            uint32_t e = u[i] & 0x7F800000u;
            top = e > top ? e : top;
        }
        return top != 0x7F800000u;
    }
    const uint16_t *h = (const uint16_t *)p;
    uint16_t top = 0;
#pragma omp simd reduction(max : top)
    for (int64_t i = lo; i < hi; i++) {
        uint16_t e = (uint16_t)(h[i] & 0x7F80u);
        top = e > top ? e : top;
    }
    return top != 0x7F80u;
}

int kiln_first_nonfinite(const int64_t *ptrs, const int *dts, const int64_t *ns, int count, int threads) {
    int64_t *first_chunk = (int64_t *)malloc(sizeof(int64_t) * (size_t)(count + 1));
    if (first_chunk == NULL) return -1;
    first_chunk[0] = 0;
    for (int t = 0; t < count; t++) first_chunk[t + 1] = first_chunk[t] + (ns[t] + FINITE_CHUNK - 1) / FINITE_CHUNK;
    int64_t chunks = first_chunk[count];
    int first = count;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4) reduction(min : first)
    for (int64_t c = 0; c < chunks; c++) {
        int lo = 0, hi = count - 1; /* the tensor holding chunk c: the last t with first_chunk[t] <= c */
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (first_chunk[mid] <= c) lo = mid; else hi = mid - 1;
        }
        if (lo >= first) continue;
        int64_t start = (c - first_chunk[lo]) * FINITE_CHUNK;
        int64_t end = start + FINITE_CHUNK < ns[lo] ? start + FINITE_CHUNK : ns[lo];
        if (!chunk_finite((const void *)(intptr_t)ptrs[lo], dts[lo], start, end)) first = lo;
    }
    free(first_chunk);
    return first == count ? 0 : first + 1;
}

/* kiln_scale: out[i] = x[i] * f in fp32, rounded once to out's dtype: the bits of ATen's mul of x by a 0-dim
 * tensor of x's dtype followed by a cast to out's dtype, in one pass and without the temporary. n elements,
 * dense; x fp32 (out fp32 or bf16) or x and out bf16 (f: the factor as bf16 holds it). Returns 2 for bf16 x
 * with fp32 out (ATen rounds that product to bf16 before it widens: not this loop). */
int kiln_scale(const void *x, int x_dt, void *out, int o_dt, int64_t n, double factor, int threads) {
    float f = (float)factor;
    if (x_dt == F32 && o_dt == F32) {
        const float *a = (const float *)x;
        float *o = (float *)out;
#pragma omp parallel for simd num_threads(threads) schedule(static)
        for (int64_t i = 0; i < n; i++) o[i] = a[i] * f;
    } else if (x_dt == F32) {
        const float *a = (const float *)x;
        uint16_t *o = (uint16_t *)out;
#pragma omp parallel for simd num_threads(threads) schedule(static)
        for (int64_t i = 0; i < n; i++) o[i] = f_bf16(a[i] * f);
    } else if (o_dt == BF16) {
        const uint16_t *a = (const uint16_t *)x;
        uint16_t *o = (uint16_t *)out;
#pragma omp parallel for simd num_threads(threads) schedule(static)
        for (int64_t i = 0; i < n; i++) o[i] = f_bf16(bf16_f(a[i]) * f);
    } else {
        return 2;
    }
    return 0;
}

/* kiln_widen_acc: acc[i] = x[i] (first) or acc[i] + x[i] (else), x bf16 widened exactly, acc fp32: the bits of
 * ATen's `x.to(float32)` and of `acc.add_(x)`, without their temporaries (a promoting add_ converts x into a
 * fresh fp32 buffer first). The fused loss's weight gradient summed over its blocks of rows (cross_entropy.py):
 * 8192 x 512 on the EPYC, the add 0.28 against 1.33 ms alone; the whole bf16 loss kernel (2048 tokens, two
 * blocks) 161.5 against 166.6 ms. n elements, both dense. */
int kiln_widen_acc(float *acc, const uint16_t *x, int64_t n, int first, int threads) {
    if (first) {
#pragma omp parallel for simd num_threads(threads) schedule(static)
        for (int64_t i = 0; i < n; i++) acc[i] = bf16_f(x[i]);
    } else {
#pragma omp parallel for simd num_threads(threads) schedule(static)
        for (int64_t i = 0; i < n; i++) acc[i] += bf16_f(x[i]);
    }
    return 0;
}
