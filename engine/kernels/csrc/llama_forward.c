/* A whole Llama decoder forward for a decode-sized bf16 batch in one call: the same native
 * kernels, in the same order and with the same arguments, as LlamaForCausalLM._forward_fused
 * with the decode linears (decode_linear: AMX where the process may use it, else AVX512-BF16)
 * and one paged-attention call per layer, so the result is bit for bit the one the Python loop
 * computes. What it saves is the loop itself: ~9 kernel calls per layer, each
 * a Python wrapper, a ctypes crossing and a fresh output tensor, with OpenMP's threads idle in
 * between. At batch 64 (30 layers) the time outside the kernels went from 7.6 to 2.3 ms of a
 * decode step (45.5 -> 39.9 ms).
 *
 * The model is described once (llama_model: shapes, and per layer the norm weights, the linear
 * weights as decode_pack_weight packs them and the KV cache tensors, all owned by Python and
 * alive for as long as the description is used); a step passes the embedded input rows and the
 * attention metadata of its sequences. */
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const uint16_t *const *input_norm, *const *post_norm; /* [num_layers] -> [hidden] */
    const uint16_t *const *qkv, *const *o, *const *gate_up, *const *down; /* packed */
    void *const *k_cache, *const *v_cache;                /* [num_layers] */
    const uint16_t *final_norm;
    const float *rope_cos, *rope_sin;                     /* [max_pos, head_dim / 2] */
} llama_model;

int decode_linear(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *wp,
               int64_t n, int gated, uint16_t *y, int64_t y_stride, int num_threads);
void add_rms_norm_bf16(uint16_t *x, const uint16_t *residual, const uint16_t *weight,
                       uint16_t *out, int64_t rows, int64_t dim, int64_t x_stride,
                       int64_t res_stride, int64_t out_stride, float eps, int num_threads);
void rope_bf16(uint16_t *x, const int64_t *positions, const float *cos_table,
               const float *sin_table, int64_t rows, int64_t heads, int64_t head_dim,
               int64_t x_stride, int num_threads);
void write_kv_cache(const void *k, const void *v, void *k_cache, void *v_cache,
                    const int64_t *slots, int64_t num_tokens, int64_t row_elems, int64_t k_stride,
                    int64_t v_stride, int elem_size, int num_threads);
int paged_attention(const void *q, const void *k_cache, const void *v_cache,
                    const int64_t *block_tables, const int64_t *seq_lens,
                    const int64_t *query_start, const int64_t *query_len, void *out,
                    float *lse, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                    int block_size, int64_t bt_stride, int64_t q_stride, int64_t out_stride,
                    int64_t kv_start, float scale, int dtype, int num_threads);

/* Layer l up to its attention. x [T, hidden] (the residual stream, delta [T, hidden] of the
 * previous layer added into it first; delta NULL for layer 0); h [T, hidden] and qkv [T, q + 2 kv]
 * scratch: qkv is left holding the layer's rotated queries and keys and its values. With slots
 * (the cache slots of the step's keys and values), writes them into the layer's cache; NULL
 * leaves that to the caller's attention. Returns 0 or -1. */
int llama_layer_pre_bf16(const llama_model *m, int l, uint16_t *x, const uint16_t *delta, int64_t T,
                         const int64_t *positions, const int64_t *slots, uint16_t *h,
                         uint16_t *qkv, int num_threads) {
    const int64_t H = m->hidden, D = m->head_dim;
    const int64_t q_size = (int64_t)m->num_heads * D, kv_size = (int64_t)m->num_kv_heads * D;
    const int64_t qkv_n = q_size + 2 * kv_size;
    add_rms_norm_bf16(x, delta, m->input_norm[l], h, T, H, H, H, H, m->eps, num_threads);
    int rc = decode_linear(h, T, H, H, m->qkv[l], qkv_n, 0, qkv, qkv_n, num_threads);
    rope_bf16(qkv, positions, m->rope_cos, m->rope_sin, T, m->num_heads + m->num_kv_heads, D,
              qkv_n, num_threads);
    /* Every row's K/V before the layer's attention reads the cache: a sequence may read
     * blocks another sequence of the step writes (engine.attention.base). */
    if (slots != NULL)
        write_kv_cache(qkv + q_size, qkv + q_size + kv_size, m->k_cache[l], m->v_cache[l], slots,
                       T, kv_size, qkv_n, qkv_n, 2, num_threads);
    return rc;
}

/* Layer l after its attention: attn [T, q] the attention's output; the output projection goes
 * into delta [T, hidden] and is added into x, then the MLP, whose output is left in delta for
 * the next layer (or llama_final_norm_bf16) to add. h [T, hidden] and act [T, intermediate]
 * scratch. Returns 0 or -1. */
int llama_layer_post_bf16(const llama_model *m, int l, uint16_t *x, const uint16_t *attn,
                          uint16_t *delta, uint16_t *h, uint16_t *act, int64_t T,
                          int num_threads) {
    const int64_t H = m->hidden, q_size = (int64_t)m->num_heads * m->head_dim;
    const int64_t inter = m->intermediate;
    /* The attention output projection goes to delta's buffer: it is added into x next. */
    int rc = decode_linear(attn, T, q_size, q_size, m->o[l], H, 0, delta, H, num_threads);
    add_rms_norm_bf16(x, delta, m->post_norm[l], h, T, H, H, H, H, m->eps, num_threads);
    rc |= decode_linear(h, T, H, H, m->gate_up[l], 2 * inter, 1, act, inter, num_threads);
    rc |= decode_linear(act, T, inter, inter, m->down[l], H, 0, delta, H, num_threads);
    return rc;
}

/* out [T, hidden] = the final norm of x + delta (the last layer's output; NULL: none). */
void llama_final_norm_bf16(const llama_model *m, uint16_t *x, const uint16_t *delta, int64_t T,
                           uint16_t *out, int num_threads) {
    const int64_t H = m->hidden;
    add_rms_norm_bf16(x, delta, m->final_norm, out, T, H, H, H, H, m->eps, num_threads);
}

/* x [T, hidden]: the embedded tokens, left holding the last residual stream; out [T, hidden]:
 * the final normed hidden states. Attention: num_seqs sequences as paged_attention takes them
 * (the step's whole batch), slots [T] the cache slots of the step's keys and values. Returns 0,
 * -1 when memory or a kernel fails, or paged_attention's code for an unsupported shape. */
int llama_forward_bf16(const llama_model *m, uint16_t *x, int64_t T, const int64_t *positions,
                       const int64_t *slots, const int64_t *block_tables, int64_t bt_stride,
                       const int64_t *seq_lens, const int64_t *query_start,
                       const int64_t *query_len, int num_seqs, uint16_t *out, int num_threads) {
    const int64_t H = m->hidden, D = m->head_dim;
    const int64_t q_size = (int64_t)m->num_heads * D, kv_size = (int64_t)m->num_kv_heads * D;
    const int64_t qkv_n = q_size + 2 * kv_size, inter = m->intermediate;
    /* One scratch block: h [T, H], qkv [T, qkv_n], attn [T, q_size], o / delta [T, H],
     * act [T, inter]. */
    const int64_t elems = T * (2 * H + qkv_n + q_size + inter);
    uint16_t *scratch = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(elems > 0 ? elems : 1));
    if (scratch == NULL) return -1;
    uint16_t *h = scratch, *qkv = h + T * H, *attn = qkv + T * qkv_n;
    uint16_t *delta = attn + T * q_size, *act = delta + T * H;
    int rc = 0;
    for (int l = 0; l < m->num_layers && rc == 0; l++) {
        rc |= llama_layer_pre_bf16(m, l, x, l == 0 ? NULL : delta, T, positions, slots, h, qkv,
                                   num_threads);
        if (rc == 0)
            rc = paged_attention(qkv, m->k_cache[l], m->v_cache[l], block_tables, seq_lens,
                                 query_start, query_len, attn, NULL, num_seqs, m->num_heads,
                                 m->num_kv_heads, (int)D, m->block_size, bt_stride, qkv_n, q_size,
                                 0, m->scale, 1, num_threads);
        if (rc == 0) rc |= llama_layer_post_bf16(m, l, x, attn, delta, h, act, T, num_threads);
    }
    if (rc == 0) llama_final_norm_bf16(m, x, m->num_layers > 0 ? delta : NULL, T, out, num_threads);
    free(scratch);
    return rc;
}
