/* Elementwise functions of one bfloat16 value, by table.
 *
 * A bf16 tensor holds one of 65536 bit patterns, so a function of one bf16 value is a table of 65536 entries,
 * computed once (kiln/kernels/activations.py builds GELU's: the forward's entries are ATen's own results for every
 * bf16 value, so the lookup gives ATen's bits; the backward's derivative entries are computed in float64 and
 * rounded to fp32 once). A lookup costs a load where the function costs an erf or a tanh: GELU over 4M bf16
 * values on the EPYC, 0.6 against ATen's 1.1 ms forward. Tables of 32-bit entries (256 KiB, in L2) let the
 * loops vectorize with gathers.
 *
 * kiln_lut_bf16:       out[i] = table[x[i]] (the entry's low 16 bits: a bf16 value).
 * kiln_lut_scale_bf16: out[i] = bf16(g[i] * table[x[i]]), the product in fp32 rounded once (a backward: the
 *                      incoming gradient times the derivative).
 * x, g, out dense bf16 of n elements; out may be x or g (in place). Compiled as part of native.c (#included). */
int kiln_lut_bf16(const uint16_t *x, uint16_t *out, const uint32_t *table, int64_t n, int threads) {
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) out[i] = (uint16_t)table[x[i]];
    return 0;
}

int kiln_lut_scale_bf16(const uint16_t *g, const uint16_t *x, uint16_t *out, const float *table, int64_t n,
                        int threads) {
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) out[i] = f_bf16(bf16_f(g[i]) * table[x[i]]);
    return 0;
}
