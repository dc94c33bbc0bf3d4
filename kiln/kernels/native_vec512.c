/* The exp-bound loops in AVX-512 intrinsics, bit for bit the values of native.c's plain C (#included by native.c
 * after exp_in_range, sigmoid and the swiglu helpers; compiled only where the build's flags give AVX-512).
 *
 * gcc vectorizes exp_in_range from plain C, but the 2^n of its last step costs a conversion, an integer add, a
 * shift and a multiply per vector, and exp_approx's clamps (written so that NaN survives them) three more
 * instructions. Here 2^n is one vscalefps and the clamps are two min/max whose operand order keeps NaN. The
 * loops (the loss's exp pass, SwiGLU forward and backward) take 3-12 % less time on the EPYC: the loads, the bf16
 * rounding and SwiGLU's division stay (benchmarks/exp_loops.py; docs/kernels.md).
 *
 * Every value is the plain C's: the same reduction and polynomial with the same roundings (native.c compiles as
 * ISO C, so `x * log2e + 1.5 * 2^23` is a product and a sum, never contracted into one fma: two roundings here
 * too; fmaf is an fma in both), and vscalefps rounds p * 2^n once, as the scalar product by the normal float 2^n
 * does (n is in [-126, 127] for x in [-87.3, 88.3]). tests/kernels/test_native.py checks the bits against the
 * AVX2 build, extremes and NaN included. bf16 is read and written as bf16_f and f_bf16 do (round to nearest
 * even, any NaN to 0x7FC0). */
#include <immintrin.h>

#define LANES 16

/* exp_in_range on 16 lanes */
static inline __m512 exp16_in_range(__m512 x) {
    __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                           _mm512_set1_ps(12582912.0f)), _mm512_set1_ps(12582912.0f));
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* exp_approx on 16 lanes: clamped to [-87.3, 88.3], NaN kept (max/min return their second operand when either
 * is NaN, so x goes second) */
static inline __m512 exp16_approx(__m512 x) {
    __m512 c = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);
    return exp16_in_range(_mm512_min_ps(_mm512_set1_ps(88.3f), c));
}

/* sigmoid on 16 lanes: 1 / (1 + exp_approx(-a)), one IEEE division as the plain C */
static inline __m512 sigmoid16(__m512 a) {
    __m512 e = exp16_approx(_mm512_xor_ps(a, _mm512_set1_ps(-0.0f)));       /* -a, exactly */
    return _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

/* the first m (<= 16) lanes' mask */
static inline __mmask16 lanes(int64_t m) { return m >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << m) - 1u); }

static inline __m512 bf16x16_load(const uint16_t *p, __mmask16 k) {
    __m256i h = k == 0xFFFF ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(k, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* f_bf16 on 16 lanes, stored to the first lanes of k */
static inline void bf16x16_store(uint16_t *p, __m512 v, __mmask16 k) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
    if (k == 0xFFFF)
        _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(rounded));
    else
        _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(rounded));
}

/* block_exp_sum (native_loss.c): v[j] = exp_nonpositive(v[j] - m) in place, their sum in float lanes over pieces
 * of 256 values, the pieces added in double (each lane sums at most 16 terms a piece: the plain loop's lanes,
 * in an order of its own, so the sum may differ from it in the last bits; the values do not) */
static double exp_sum16(float *restrict v, int64_t n, float m) {
    const __m512 mm = _mm512_set1_ps(m), lo = _mm512_set1_ps(-87.3f);
    double s = 0.0;
    for (int64_t at = 0; at < n; at += 256) {
        int64_t hi = n - at < 256 ? n : at + 256;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = at; j < hi; j += LANES) {
            __mmask16 k = lanes(hi - j);
            __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, v + j), mm);
            /* exp_nonpositive: the exp of max(d, -87.3), 0 where d < -87.3 (d is never NaN here) */
            __m512 e = _mm512_maskz_mov_ps(_mm512_mask_cmp_ps_mask(k, d, lo, _CMP_GE_OQ),
                                           exp16_in_range(_mm512_max_ps(d, lo)));
            _mm512_mask_storeu_ps(v + j, k, e);
            acc = _mm512_add_ps(acc, e);
        }
        s += (double)_mm512_reduce_add_ps(acc);
    }
    return s;
}

/* kiln_swiglu's all-bf16 row piece: o = f_bf16(swiglu_f(a, b)) */
static void swiglu16_bf16(const uint16_t *a, const uint16_t *b, uint16_t *o, int64_t m) {
    for (int64_t j = 0; j < m; j += LANES) {
        __mmask16 k = lanes(m - j);
        __m512 x = bf16x16_load(a + j, k), y = bf16x16_load(b + j, k);
        bf16x16_store(o + j, _mm512_mul_ps(_mm512_mul_ps(x, sigmoid16(x)), y), k);
    }
}

/* kiln_swiglu_backward's all-bf16 row piece: og = swiglu_dgate(g, x, b, sig), ou = g (x sig), each rounded once */
static void swiglu_backward16_bf16(const uint16_t *gr, const uint16_t *a, const uint16_t *b, uint16_t *og,
                                   uint16_t *ou, int64_t m) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t j = 0; j < m; j += LANES) {
        __mmask16 k = lanes(m - j);
        __m512 x = bf16x16_load(a + j, k), g = bf16x16_load(gr + j, k), y = bf16x16_load(b + j, k);
        __m512 sig = sigmoid16(x);
        /* g * b * (sig * (1 + x * (1 - sig))), left to right as swiglu_dgate */
        __m512 d = _mm512_mul_ps(sig, _mm512_add_ps(one, _mm512_mul_ps(x, _mm512_sub_ps(one, sig))));
        bf16x16_store(og + j, _mm512_mul_ps(_mm512_mul_ps(g, y), d), k);
        bf16x16_store(ou + j, _mm512_mul_ps(g, _mm512_mul_ps(x, sig)), k);
    }
}
