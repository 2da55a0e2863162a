/* A whole Llama decoder forward for a decode-sized batch in one call, in bf16 or float32: the
 * same native kernels, in the same order and with the same arguments, as the Python layer loop
 * of LlamaForCausalLM.forward over layer_ops.FusedOps with the decode linears (bf16:
 * decode_linear, AMX where the process may use it, else AVX512-BF16; float32: f32_linear) and
 * one paged-attention call per layer, so the result is bit for bit the one the Python loop
 * computes. What it saves is the loop itself: ~9 kernel calls per layer, each a Python wrapper,
 * a ctypes crossing and a fresh output tensor, with OpenMP's threads idle in between
 * (docs/performance.md has the step times before and after).
 *
 * The model is described once (llama_model: shapes, and per layer the norm weights, the linear
 * weights as the dtype's decode kernel packs them and the KV cache tensors, all owned by Python
 * and alive for as long as the description is used); a step passes the embedded input rows and
 * the attention metadata of its sequences. Every tensor of one description has the model's
 * dtype, except the rope tables (float32). The _bf16 and _f32 entry points differ only in the
 * kernels they dispatch to (llama_ops). */
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const void *const *input_norm, *const *post_norm; /* [num_layers] -> [hidden] */
    const void *const *qkv, *const *o, *const *gate_up, *const *down; /* packed */
    void *const *k_cache, *const *v_cache;            /* [num_layers] */
    const void *final_norm;
    const float *rope_cos, *rope_sin;                 /* [max_pos, head_dim / 2] */
} llama_model;

int decode_linear(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *wp,
                  int64_t n, int gated, uint16_t *y, int64_t y_stride, int num_threads);
int f32_linear(const float *x, int64_t m, int64_t k, int64_t x_stride, const float *wp, int64_t n,
               int gated, float *y, int64_t y_stride, int num_threads);
void add_rms_norm_bf16(uint16_t *x, const uint16_t *residual, const uint16_t *weight,
                       uint16_t *out, int64_t rows, int64_t dim, int64_t x_stride,
                       int64_t res_stride, int64_t out_stride, float eps, int num_threads);
void add_rms_norm_f32(float *x, const float *residual, const float *weight, float *out,
                      int64_t rows, int64_t dim, int64_t x_stride, int64_t res_stride,
                      int64_t out_stride, float eps, int num_threads);
void rope_bf16(uint16_t *x, const int64_t *positions, const float *cos_table,
               const float *sin_table, int64_t rows, int64_t heads, int64_t head_dim,
               int64_t x_stride, int num_threads);
void rope_f32(float *x, const int64_t *positions, const float *cos_table, const float *sin_table,
              int64_t rows, int64_t heads, int64_t head_dim, int64_t x_stride, int num_threads);
void write_kv_cache(const void *k, const void *v, void *k_cache, void *v_cache,
                    const int64_t *slots, int64_t num_tokens, int64_t row_elems, int64_t k_stride,
                    int64_t v_stride, int elem_size, int num_threads);
int paged_attention(const void *q, const void *k_cache, const void *v_cache,
                    const int64_t *block_tables, const int64_t *seq_lens,
                    const int64_t *query_start, const int64_t *query_len, void *out,
                    float *lse, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                    int block_size, int64_t bt_stride, int64_t q_stride, int64_t out_stride,
                    int64_t kv_start, float scale, int dtype, int num_threads);

/* One dtype's kernels behind untyped pointers: element size, paged_attention's dtype code. */
typedef struct {
    int elem, attn_dtype;
    int (*linear)(const void *x, int64_t m, int64_t k, const void *wp, int64_t n, int gated,
                  void *y, int64_t y_stride, int num_threads);
    void (*add_rms_norm)(void *x, const void *residual, const void *weight, void *out,
                         int64_t rows, int64_t dim, float eps, int num_threads);
    void (*rope)(void *x, const int64_t *positions, const float *cos_table,
                 const float *sin_table, int64_t rows, int64_t heads, int64_t head_dim,
                 int64_t x_stride, int num_threads);
} llama_ops;

/* Inputs with contiguous rows of k elements; residual, weight and out rows of dim. */
static int bf16_linear_op(const void *x, int64_t m, int64_t k, const void *wp, int64_t n,
                          int gated, void *y, int64_t y_stride, int num_threads) {
    return decode_linear((const uint16_t *)x, m, k, k, (const uint16_t *)wp, n, gated,
                         (uint16_t *)y, y_stride, num_threads);
}
static int f32_linear_op(const void *x, int64_t m, int64_t k, const void *wp, int64_t n,
                         int gated, void *y, int64_t y_stride, int num_threads) {
    return f32_linear((const float *)x, m, k, k, (const float *)wp, n, gated, (float *)y,
                      y_stride, num_threads);
}
static void bf16_norm_op(void *x, const void *residual, const void *weight, void *out,
                         int64_t rows, int64_t dim, float eps, int num_threads) {
    add_rms_norm_bf16((uint16_t *)x, (const uint16_t *)residual, (const uint16_t *)weight,
                      (uint16_t *)out, rows, dim, dim, dim, dim, eps, num_threads);
}
static void f32_norm_op(void *x, const void *residual, const void *weight, void *out,
                        int64_t rows, int64_t dim, float eps, int num_threads) {
    add_rms_norm_f32((float *)x, (const float *)residual, (const float *)weight, (float *)out,
                     rows, dim, dim, dim, dim, eps, num_threads);
}
static void bf16_rope_op(void *x, const int64_t *positions, const float *cos_table,
                         const float *sin_table, int64_t rows, int64_t heads, int64_t head_dim,
                         int64_t x_stride, int num_threads) {
    rope_bf16((uint16_t *)x, positions, cos_table, sin_table, rows, heads, head_dim, x_stride,
              num_threads);
}
static void f32_rope_op(void *x, const int64_t *positions, const float *cos_table,
                        const float *sin_table, int64_t rows, int64_t heads, int64_t head_dim,
                        int64_t x_stride, int num_threads) {
    rope_f32((float *)x, positions, cos_table, sin_table, rows, heads, head_dim, x_stride,
             num_threads);
}

static const llama_ops BF16_OPS = {2, 1, bf16_linear_op, bf16_norm_op, bf16_rope_op};
static const llama_ops F32_OPS = {4, 0, f32_linear_op, f32_norm_op, f32_rope_op};

/* The element at index i of a buffer of the ops' dtype. */
static inline char *at(const llama_ops *ops, const void *p, int64_t i) {
    return (char *)p + i * ops->elem;
}

/* Layer l up to its attention. x [T, hidden] (the residual stream, delta [T, hidden] of the
 * previous layer added into it first; delta NULL for layer 0); h [T, hidden] and qkv [T, q + 2 kv]
 * scratch: qkv is left holding the layer's rotated queries and keys and its values. With slots
 * (the cache slots of the step's keys and values), writes them into the layer's cache; NULL
 * leaves that to the caller's attention. Returns 0 or -1. */
static int layer_pre(const llama_ops *ops, const llama_model *m, int l, void *x,
                     const void *delta, int64_t T, const int64_t *positions,
                     const int64_t *slots, void *h, void *qkv, int num_threads) {
    const int64_t H = m->hidden, D = m->head_dim;
    const int64_t q_size = (int64_t)m->num_heads * D, kv_size = (int64_t)m->num_kv_heads * D;
    const int64_t qkv_n = q_size + 2 * kv_size;
    ops->add_rms_norm(x, delta, m->input_norm[l], h, T, H, m->eps, num_threads);
    int rc = ops->linear(h, T, H, m->qkv[l], qkv_n, 0, qkv, qkv_n, num_threads);
    ops->rope(qkv, positions, m->rope_cos, m->rope_sin, T, m->num_heads + m->num_kv_heads, D,
              qkv_n, num_threads);
    /* Every row's K/V before the layer's attention reads the cache: a sequence may read
     * blocks another sequence of the step writes (engine.attention.base). */
    if (slots != NULL)
        write_kv_cache(at(ops, qkv, q_size), at(ops, qkv, q_size + kv_size), m->k_cache[l],
                       m->v_cache[l], slots, T, kv_size, qkv_n, qkv_n, ops->elem, num_threads);
    return rc;
}

/* Layer l after its attention: attn [T, q] the attention's output; the output projection goes
 * into delta [T, hidden] and is added into x, then the MLP, whose output is left in delta for
 * the next layer (or the final norm) to add. h [T, hidden] and act [T, intermediate] scratch.
 * Returns 0 or -1. */
static int layer_post(const llama_ops *ops, const llama_model *m, int l, void *x,
                      const void *attn, void *delta, void *h, void *act, int64_t T,
                      int num_threads) {
    const int64_t H = m->hidden, q_size = (int64_t)m->num_heads * m->head_dim;
    const int64_t inter = m->intermediate;
    /* The attention output projection goes to delta's buffer: it is added into x next. */
    int rc = ops->linear(attn, T, q_size, m->o[l], H, 0, delta, H, num_threads);
    ops->add_rms_norm(x, delta, m->post_norm[l], h, T, H, m->eps, num_threads);
    rc |= ops->linear(h, T, H, m->gate_up[l], 2 * inter, 1, act, inter, num_threads);
    rc |= ops->linear(act, T, inter, m->down[l], H, 0, delta, H, num_threads);
    return rc;
}

/* x [T, hidden]: the embedded tokens, left holding the last residual stream; out [T, hidden]:
 * the final normed hidden states. Attention: num_seqs sequences as paged_attention takes them
 * (the step's whole batch), slots [T] the cache slots of the step's keys and values. Returns 0,
 * -1 when memory or a kernel fails, or paged_attention's code for an unsupported shape. */
static int forward(const llama_ops *ops, const llama_model *m, void *x, int64_t T,
                   const int64_t *positions, const int64_t *slots, const int64_t *block_tables,
                   int64_t bt_stride, const int64_t *seq_lens, const int64_t *query_start,
                   const int64_t *query_len, int num_seqs, void *out, int num_threads) {
    const int64_t H = m->hidden, D = m->head_dim;
    const int64_t q_size = (int64_t)m->num_heads * D, kv_size = (int64_t)m->num_kv_heads * D;
    const int64_t qkv_n = q_size + 2 * kv_size, inter = m->intermediate;
    /* One scratch block: h [T, H], qkv [T, qkv_n], attn [T, q_size], o / delta [T, H],
     * act [T, inter]. */
    const int64_t elems = T * (2 * H + qkv_n + q_size + inter);
    char *scratch = (char *)malloc((size_t)ops->elem * (size_t)(elems > 0 ? elems : 1));
    if (scratch == NULL) return -1;
    void *h = scratch, *qkv = at(ops, h, T * H), *attn = at(ops, qkv, T * qkv_n);
    void *delta = at(ops, attn, T * q_size), *act = at(ops, delta, T * H);
    int rc = 0;
    for (int l = 0; l < m->num_layers && rc == 0; l++) {
        rc |= layer_pre(ops, m, l, x, l == 0 ? NULL : delta, T, positions, slots, h, qkv,
                        num_threads);
        if (rc == 0)
            rc = paged_attention(qkv, m->k_cache[l], m->v_cache[l], block_tables, seq_lens,
                                 query_start, query_len, attn, NULL, num_seqs, m->num_heads,
                                 m->num_kv_heads, (int)D, m->block_size, bt_stride, qkv_n, q_size,
                                 0, m->scale, ops->attn_dtype, num_threads);
        if (rc == 0) rc |= layer_post(ops, m, l, x, attn, delta, h, act, T, num_threads);
    }
    if (rc == 0)
        ops->add_rms_norm(x, m->num_layers > 0 ? delta : NULL, m->final_norm, out, T, H, m->eps,
                          num_threads);
    free(scratch);
    return rc;
}

/* The exported entry points, one set per dtype: the whole forward, and a layer's work before
 * and after its attention for steps whose attention the caller runs (native_forward.py). */
#define LLAMA_ENTRY_POINTS(SUFFIX, OPS)                                                          \
    int llama_forward_##SUFFIX(const llama_model *m, void *x, int64_t T,                       \
                               const int64_t *positions, const int64_t *slots,                  \
                               const int64_t *block_tables, int64_t bt_stride,                  \
                               const int64_t *seq_lens, const int64_t *query_start,             \
                               const int64_t *query_len, int num_seqs, void *out,               \
                               int num_threads) {                                                \
        return forward(&OPS, m, x, T, positions, slots, block_tables, bt_stride, seq_lens,       \
                       query_start, query_len, num_seqs, out, num_threads);                      \
    }                                                                                            \
    int llama_layer_pre_##SUFFIX(const llama_model *m, int l, void *x, const void *delta,       \
                                 int64_t T, const int64_t *positions, const int64_t *slots,     \
                                 void *h, void *qkv, int num_threads) {                          \
        return layer_pre(&OPS, m, l, x, delta, T, positions, slots, h, qkv, num_threads);        \
    }                                                                                            \
    int llama_layer_post_##SUFFIX(const llama_model *m, int l, void *x, const void *attn,       \
                                  void *delta, void *h, void *act, int64_t T,                   \
                                  int num_threads) {                                             \
        return layer_post(&OPS, m, l, x, attn, delta, h, act, T, num_threads);                  \
    }                                                                                            \
    void llama_final_norm_##SUFFIX(const llama_model *m, void *x, const void *delta, int64_t T, \
                                   void *out, int num_threads) {                                 \
        OPS.add_rms_norm(x, delta, m->final_norm, out, T, m->hidden, m->eps, num_threads);       \
    }

LLAMA_ENTRY_POINTS(bf16, BF16_OPS)
LLAMA_ENTRY_POINTS(f32, F32_OPS)
