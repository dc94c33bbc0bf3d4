/* kiln_embedding_backward_acc: an embedding's weight gradient added to another gradient of the same weight (a
 * tied input embedding and output projection), in one pass.
 *
 * out[v] = (0 + g[i1] + g[i2] + ...) + acc[v], over the tokens i1 < i2 < ... whose id is v (none equal to
 * padding_idx), in fp32, each sum rounded as ATen's embedding_dense_backward rounds it on the CPU (a zeroed row,
 * then each token's gradient row added in token order) and then added to acc as aten.add does: the same bits
 * as those two ops, without the zeroed vocabulary-sized matrix between them. A row no token names is acc + 0.
 *
 * g: tokens x dim (dense, g_dt), ids: tokens int64, acc: vocab x dim (dense, acc_dt), out: vocab x dim fp32. A
 * bf16 g or acc is widened as it is read (exact: what a cast to fp32 before the two ops would give). Returns 0; 2
 * when an id is outside [0, vocab) (nothing is written then); 3 when it cannot allocate its token lists.
 * Compiled as part of native.c (#included). */
#define EMB_AT(p, dt, k) ((dt) == F32 ? ((const float *)(p))[k] : bf16_f(((const uint16_t *)(p))[k]))

int kiln_embedding_backward_acc(const void *g, int g_dt, const int64_t *ids, int64_t tokens, int64_t dim,
                                int64_t vocab, int64_t padding_idx, const void *acc, int acc_dt, float *out,
                                int threads) {
    for (int64_t i = 0; i < tokens; i++)
        if (ids[i] < 0 || ids[i] >= vocab) return 2;
    int64_t *head = (int64_t *)malloc(sizeof(int64_t) * (size_t)(vocab > 0 ? vocab : 1));
    int64_t *tail = (int64_t *)malloc(sizeof(int64_t) * (size_t)(vocab > 0 ? vocab : 1));
    int64_t *next = (int64_t *)malloc(sizeof(int64_t) * (size_t)(tokens > 0 ? tokens : 1));
    if (!head || !tail || !next) {
        free(head), free(tail), free(next);
        return 3;
    }
    for (int64_t v = 0; v < vocab; v++) head[v] = -1;
    for (int64_t i = 0; i < tokens; i++) {            /* each id's tokens, in token order */
        int64_t v = ids[i];
        next[i] = -1;
        if (v == padding_idx) continue;
        if (head[v] < 0) head[v] = i; else next[tail[v]] = i;
        tail[v] = i;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t v = 0; v < vocab; v++) {
        int64_t a = v * dim;
        float *o = out + a;
        int64_t i = head[v];
        if (i < 0) {
#pragma omp simd
            for (int64_t c = 0; c < dim; c++) o[c] = EMB_AT(acc, acc_dt, a + c) + 0.0f;
            continue;
        }
#pragma omp simd
        for (int64_t c = 0; c < dim; c++) o[c] = 0.0f + EMB_AT(g, g_dt, i * dim + c);   /* the first token */
        for (i = next[i]; i >= 0; i = next[i]) {
#pragma omp simd
            for (int64_t c = 0; c < dim; c++) o[c] += EMB_AT(g, g_dt, i * dim + c);
        }
#pragma omp simd
        for (int64_t c = 0; c < dim; c++) o[c] += EMB_AT(acc, acc_dt, a + c);
    }
    free(head), free(tail), free(next);
    return 0;
}
