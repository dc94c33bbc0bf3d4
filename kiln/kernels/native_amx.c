/* kiln_bf16_abt on AMX tiles (#included by native_attention.c inside its AVX-512 BF16 block, before
 * kiln_bf16_abt, which hands its work here when its caller asks for the tiles and the OS has granted them).
 *
 * The same products and the same contract as the pair dot products (exact bf16 products summed in fp32, written
 * as fp32 or rounded once to bf16), in another order of summation: AMX's tile dot product (tdpbf16ps) sums a
 * 16 x 16 fp32 tile over 32 bf16 of k at a time. A task is 32 rows of a (two A tiles) against 32 columns of b at a
 * time (two B tiles), four fp32 accumulator tiles: all eight tile registers. a's rows are packed zero-padded to
 * whole tiles (32 rows, k to a multiple of 32), b as the pairs abt_pack writes (k to a multiple of 32), so every
 * tile load is whole and the padding adds zeros; the four tiles go through a 32 x 32 fp32 buffer into c.
 *
 * Linux gives a process AMX's tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA);
 * kiln_amx_granted() asks (once), and says whether the tiles may be used. The causal skips of kiln_bf16_abt apply in whole
 * steps of 32 k: the extra terms are products with the exact zeros the causal contract guarantees there. */
#if defined(__linux__)
#include <sys/syscall.h>
long syscall(long number, ...);     /* unistd.h declares it only outside strict C11 */
#define AMX_ASK() (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0)
#else
#define AMX_ASK() 0
#endif

#define AMX_ROWS 32
#define AMX_K 32                /* bf16 of k per tile step: 16 pairs */

static int amx_state = 0;       /* 1: granted; -1: refused by the OS; 0: not asked yet */

/* whether this process may use AMX's tiles: asks the OS the first time */
int kiln_amx_granted(void) {
    if (amx_state == 0)
        amx_state = AMX_ASK() ? 1 : -1;
    return amx_state > 0;
}

/* every one of the 8 tiles 16 rows of 64 bytes: A (16 x 32 bf16), B (16 pairs x 16 columns), C (16 x 16 fp32).
 * Static data: GCC's _tile_loadconfig tells the compiler it reads 8 bytes, so a configuration built on the stack
 * could lose its other stores to the optimizer. */
static const struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config __attribute__((aligned(64))) = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64},
                                              {16, 16, 16, 16, 16, 16, 16, 16}};

__attribute__((target("amx-tile"))) static void amx_configure(void) { _tile_loadconfig(&amx_config); }

/* a's rows i0 .. i0 + rows (A = a, m x k, or a_t: a given as k x m) into ap: AMX_ROWS x kpad bf16, zero-padded */
static void amx_pack_rows(const uint16_t *a, int64_t a_rs, int a_t, int64_t i0, int rows, int64_t k, int64_t kpad,
                          uint16_t *ap) {
    memset(ap, 0, (size_t)(AMX_ROWS * kpad) * 2);
    if (!a_t) {
        for (int r = 0; r < rows; r++) memcpy(ap + r * kpad, a + (i0 + r) * a_rs, (size_t)k * 2);
        return;
    }
    for (int64_t c = 0; c < k; c++) {
        const uint16_t *src = a + c * a_rs + i0;
        for (int r = 0; r < rows; r++) ap[r * kpad + c] = src[r];
    }
}

/* buf's rows x ncols (row stride AMX_ROWS fp32) into c (row stride ldc), fp32 or rounded once to bf16 */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static void amx_store(const float *buf, void *c,
                                                                                     int c_bf16, int64_t ldc,
                                                                                     int rows, int64_t ncols) {
    __mmask16 m0 = ncols >= 16 ? 0xFFFF : (__mmask16)((1u << ncols) - 1);
    __mmask16 m1 = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : (__mmask16)((1u << (ncols - 16)) - 1);
    for (int r = 0; r < rows; r++) {
        __m512 lo = _mm512_load_ps(buf + r * AMX_ROWS), hi = _mm512_load_ps(buf + r * AMX_ROWS + 16);
        if (c_bf16) {
            uint16_t *row = (uint16_t *)c + r * ldc;
            _mm256_mask_storeu_epi16(row, m0, (__m256i)_mm512_cvtneps_pbh(lo));
            _mm256_mask_storeu_epi16(row + 16, m1, (__m256i)_mm512_cvtneps_pbh(hi));
        } else {
            float *row = (float *)c + r * ldc;
            _mm512_mask_storeu_ps(row, m0, lo);
            _mm512_mask_storeu_ps(row + 16, m1, hi);
        }
    }
}

/* buf (32 x 32 fp32) = ap's 32 rows . bp's columns j0 .. j0 + 32, k steps s0 .. s1 (AMX_K each) */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_block(const uint16_t *ap, int64_t kpad,
                                                                   const uint32_t *bp, int64_t np, int64_t s0,
                                                                   int64_t s1, float *buf) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = s0; s < s1; s++) {
        _tile_loadd(4, ap + s * AMX_K, kpad * 2);
        _tile_loadd(5, ap + 16 * kpad + s * AMX_K, kpad * 2);
        _tile_loadd(6, bp + s * (AMX_K / 2) * np, np * 4);
        _tile_loadd(7, bp + s * (AMX_K / 2) * np + 16, np * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, buf, AMX_ROWS * 4);
    _tile_stored(1, buf + 16, AMX_ROWS * 4);
    _tile_stored(2, buf + 16 * AMX_ROWS, AMX_ROWS * 4);
    _tile_stored(3, buf + 16 * AMX_ROWS + 16, AMX_ROWS * 4);
}

__attribute__((target("amx-tile"))) static void amx_release(void) { _tile_release(); }

/* kiln_bf16_abt's arguments and result (c_bf16 0 or 1) */
static int amx_abt(const uint16_t *a, int64_t a_hs, int64_t a_rs, int a_t, const uint16_t *b, int64_t b_hs,
                   int64_t b_rs, int b_kn, int causal, void *c, int c_bf16, int64_t g, int64_t m, int64_t n,
                   int64_t k, int threads) {
    int64_t steps = (k + AMX_K - 1) / AMX_K, kpad = steps * AMX_K, kp = kpad / 2;
    int64_t np = (n + 31) / 32 * 32, tiles = (m + AMX_ROWS - 1) / AMX_ROWS;
    size_t esize = c_bf16 ? 2 : 4;
    /* whole heads per thread where there are enough (each thread packs a head's b once), else tiles in turn */
    int64_t chunk = g >= 2 * threads ? tiles : 1;
    int bad = 0;
#pragma omp parallel num_threads(threads) reduction(| : bad)
    {
        uint32_t *bp = aligned_alloc(64, (size_t)(np * kp) * 4);
        uint16_t *ap = aligned_alloc(64, (size_t)(AMX_ROWS * kpad) * 2);
        float *buf = aligned_alloc(64, AMX_ROWS * AMX_ROWS * 4);
        int64_t packed = -1;
        if (!bp || !ap || !buf) bad = 1;
        else amx_configure();
#pragma omp for schedule(static, chunk)
        for (int64_t t = 0; t < g * tiles; t++) {
            if (!bp || !ap || !buf) continue;
            int64_t h = t / tiles, i0 = (t % tiles) * AMX_ROWS;
            if (h != packed) {
                abt_pack(b + h * b_hs, b_rs, b_kn, n, k, bp, np);
                memset(bp + ((k + 1) / 2) * np, 0, (size_t)((kp - (k + 1) / 2) * np) * 4);
                packed = h;
            }
            int rows = m - i0 < AMX_ROWS ? (int)(m - i0) : AMX_ROWS;
            int64_t last = i0 + rows - 1;
            /* as kiln_bf16_abt: a^T b sums from the tile's first key, a b up to its last query (whole steps) */
            int64_t s0 = causal && a_t ? (i0 < k ? i0 / AMX_K : steps) : 0;
            int64_t s1 = causal && b_kn && !a_t && last + 1 < k ? (last + AMX_K) / AMX_K : steps;
            amx_pack_rows(a + h * a_hs, a_rs, a_t, i0, rows, k, kpad, ap);
            char *ch = (char *)c + (size_t)(h * m + i0) * n * esize;
            for (int64_t j0 = 0; j0 < n; j0 += 32) {
                if (causal && !b_kn && j0 > last) {
                    for (int r = 0; r < rows; r++) memset(ch + (r * n + j0) * esize, 0, (size_t)(n - j0) * esize);
                    break;
                }
                amx_block(ap, kpad, bp + j0, np, s0, s1, buf);
                amx_store(buf, ch + j0 * esize, c_bf16, n, rows, n - j0);
            }
        }
        if (bp && ap && buf) amx_release();
        free(bp);
        free(ap);
        free(buf);
    }
    return bad ? 3 : 0;
}
