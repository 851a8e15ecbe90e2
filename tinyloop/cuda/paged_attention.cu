// Decode attention over the paged KV pool (tinyloop/model/kvcache.py, context.py): n_tokens query
// tokens per row (decode: one; a speculative chain's verify: a few), token t of row r over the
// keys at positions 0 .. seq_lens[r] + t - 1 of the slot the row attends in.
//
// The pool keeps K and V as [pool_rows, kv_heads, D] (pool row = block * block_size + offset).
// `tables` is [rows, table_stride] int64: the row's block table *for its slot* (the caller picks
// tables[b, slot_b], so loop slots and cache_window sharing are the caller's index math, as in
// PagedContext._flat_index). Key l of row r lives at pool row tables[r, l / bs] * bs + l % bs.
// A key is attended when l < seq_lens[r] + t and, with a gap mask (SeqKV.gaps), written[r, l] >
// depth[r]: an early-exited token left the loop slots from depth `written` on unwritten. With a
// tree (a tree's verify: `tree` [rows, n_tokens, n_tokens] uint8, node t may see node j), the
// row's new tokens sit at keys seq_lens[r] - 1 + j, and token t sees key seq_lens[r] - 1 + j only
// where tree[r, t, j] (nodes are numbered parents first, so j <= t).
// GQA: q head h reads kv head h / (q_heads / kv_heads). Scores are scaled by `scale`.
//
// Grid (rows * n_tokens, q_heads, splits), TL_ATTN_THREADS threads; each block walks its split's
// keys in tiles of TL_ATTN_THREADS with an online softmax. splits == 1 writes `out`
// [rows * n_tokens, q_heads, D] (T); splits > 1 writes float partials (acc [rows * n_tokens,
// q_heads, splits, D], m and l [.., 2]) that paged_decode_combine reduces (flash-decoding). Dynamic shared memory: (D + THREADS) floats +
// THREADS ints (tinyloop/cuda/launch.py sizes it).
//
// The pool's K and V are read through a loader: PlainKV (K and V in T, [pool_rows, kv_heads, D])
// or Int4KV (an int4 pool, kvstore.Int4Buffer: codes [pool_rows, kv_heads, D/2] uint8, the even
// index in the low nibble, and meta [pool_rows, kv_heads, D/group, 2] fp16 (scale, minimum)),
// dequantized in the read as the torch reference dequantizes: code * scale, then + minimum, in
// float, rounded to T (paged_decode_int4_*).
#define TL_ATTN_THREADS 128
#define TL_ATTN_MAX_PER_THREAD 4  // D <= 512

template <typename T>
struct PlainKV {
    const T* __restrict__ data;
    int kv_heads, head_dim;
    __device__ __forceinline__ float load(int pool_row, int kvh, int d) const {
        return tl_load(data + ((long long)pool_row * kv_heads + kvh) * head_dim + d);
    }
};

template <typename T>
struct Int4KV {
    const unsigned char* __restrict__ codes;
    const __half* __restrict__ meta;
    int kv_heads, head_dim, group;
    __device__ __forceinline__ float load(int pool_row, int kvh, int d) const {
        const long long head = (long long)pool_row * kv_heads + kvh;
        const unsigned char c = codes[head * (head_dim / 2) + d / 2];
        const float q = (float)((d & 1) ? (c >> 4) : (c & 15));
        const __half* m = meta + (head * (head_dim / group) + d / group) * 2;
        // two roundings, as torch's two ops: no fused multiply-add
        return tl_round<T>(__fadd_rn(__fmul_rn(q, __half2float(m[0])), __half2float(m[1])));
    }
};

template <typename T, typename KV>
__device__ void paged_decode(const T* __restrict__ q, const KV k_store, const KV v_store,
                             const long long* __restrict__ tables, const int* __restrict__ seq_lens,
                             const int* __restrict__ written, const int* __restrict__ depth,
                             const unsigned char* __restrict__ tree, T* __restrict__ out,
                             float* __restrict__ part_acc, float* __restrict__ part_ml, int q_heads, int kv_heads,
                             int head_dim, int block_size, int table_stride, int written_stride,
                             long long q_row_stride, long long q_head_stride, int n_tokens, long long q_token_stride,
                             int keys_per_split, float scale) {
    extern __shared__ float smem[];
    float* q_s = smem;                                // [D]
    float* p_s = smem + head_dim;                     // [THREADS]
    int* row_s = (int*)(p_s + TL_ATTN_THREADS);       // [THREADS]
    __shared__ float scratch[32];
    const int rt = blockIdx.x, h = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int r = rt / n_tokens, t = rt - r * n_tokens;
    const int kvh = h / (q_heads / kv_heads);
    const T* qr = q + r * q_row_stride + t * q_token_stride + h * q_head_stride;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) q_s[d] = tl_load(qr + d);
    const int len = seq_lens[r] + t;
    const int first_new = seq_lens[r] - 1;  // the row's first new token's key (a tree's root)
    const unsigned char* tree_row = tree ? tree + ((long long)r * n_tokens + t) * n_tokens : nullptr;
    const int k0 = split * keys_per_split;
    const int k1 = min(len, k0 + keys_per_split);
    const long long* table = tables + (long long)r * table_stride;
    float m = TL_NEG_INF, l_sum = 0.0f;
    float acc[TL_ATTN_MAX_PER_THREAD];
    for (int j = 0; j < TL_ATTN_MAX_PER_THREAD; ++j) acc[j] = 0.0f;
    __syncthreads();
    for (int t0 = k0; t0 < k1; t0 += TL_ATTN_THREADS) {
        const int key = t0 + threadIdx.x;
        float score = TL_NEG_INF;
        int pool_row = 0;
        if (key < k1 && (written == nullptr || written[(long long)r * written_stride + key] > depth[r])
            && (tree_row == nullptr || key < first_new || tree_row[key - first_new])) {
            pool_row = (int)(table[key / block_size] * block_size + key % block_size);
            float dot = 0.0f;
            for (int d = 0; d < head_dim; ++d) dot += q_s[d] * k_store.load(pool_row, kvh, d);
            score = dot * scale;
        }
        const float m_new = fmaxf(m, tl_block_max(score, scratch));
        if (m_new == TL_NEG_INF) continue;  // every key so far masked (uniform across the block)
        const float p = score == TL_NEG_INF ? 0.0f : __expf(score - m_new);
        p_s[threadIdx.x] = p;
        row_s[threadIdx.x] = pool_row;
        const float alpha = m == TL_NEG_INF ? 0.0f : __expf(m - m_new);
        l_sum = l_sum * alpha + tl_block_sum(p, scratch);  // its barrier publishes p_s and row_s
        const int n = min(TL_ATTN_THREADS, k1 - t0);
        for (int j = 0, d = threadIdx.x; d < head_dim; ++j, d += blockDim.x) {
            float a = acc[j] * alpha;
            for (int i = 0; i < n; ++i)
                if (p_s[i] != 0.0f) a += p_s[i] * v_store.load(row_s[i], kvh, d);
            acc[j] = a;
        }
        m = m_new;
        __syncthreads();  // p_s and row_s are rewritten by the next tile
    }
    const long long rh = (long long)rt * q_heads + h;
    if (splits == 1) {
        const float inv = l_sum > 0.0f ? 1.0f / l_sum : 0.0f;
        for (int j = 0, d = threadIdx.x; d < head_dim; ++j, d += blockDim.x)
            out[rh * head_dim + d] = tl_cast<T>(acc[j] * inv);
        return;
    }
    const long long part = rh * splits + split;
    for (int j = 0, d = threadIdx.x; d < head_dim; ++j, d += blockDim.x) part_acc[part * head_dim + d] = acc[j];
    if (threadIdx.x == 0) { part_ml[2 * part] = m; part_ml[2 * part + 1] = l_sum; }
}

// The splits of paged_decode reduced: grid (rows, q_heads), any block size.
template <typename T>
__device__ void paged_combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                              T* __restrict__ out, int q_heads, int head_dim, int splits) {
    const long long rh = (long long)blockIdx.x * q_heads + blockIdx.y;
    const float* ml = part_ml + rh * splits * 2;
    float m = TL_NEG_INF;
    for (int s = 0; s < splits; ++s) m = fmaxf(m, ml[2 * s]);
    float total = 0.0f;
    for (int s = 0; s < splits; ++s) if (ml[2 * s] != TL_NEG_INF) total += ml[2 * s + 1] * __expf(ml[2 * s] - m);
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < splits; ++s)
            if (ml[2 * s] != TL_NEG_INF) a += part_acc[(rh * splits + s) * head_dim + d] * __expf(ml[2 * s] - m);
        out[rh * head_dim + d] = tl_cast<T>(a * inv);
    }
}

#define TL_PAGED(T, SUFFIX)                                                                            \
    extern "C" __global__ void __launch_bounds__(TL_ATTN_THREADS) paged_decode_##SUFFIX(               \
        const T* q, const T* k_store, const T* v_store, const long long* tables, const int* seq_lens,  \
        const int* written, const int* depth, const unsigned char* tree, T* out, float* part_acc,      \
        float* part_ml, int q_heads, int kv_heads, int head_dim, int block_size, int table_stride,     \
        int written_stride,                                                                           \
        long long q_row_stride, long long q_head_stride, int n_tokens, long long q_token_stride,       \
        int keys_per_split, float scale) {                                                            \
        paged_decode<T>(q, PlainKV<T>{k_store, kv_heads, head_dim}, PlainKV<T>{v_store, kv_heads, head_dim},  \
                        tables, seq_lens, written, depth, tree, out, part_acc, part_ml, q_heads,       \
                        kv_heads, head_dim, block_size, table_stride, written_stride, q_row_stride,   \
                        q_head_stride, n_tokens, q_token_stride, keys_per_split, scale);              \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(TL_ATTN_THREADS) paged_decode_int4_##SUFFIX(          \
        const T* q, const unsigned char* k_codes, const __half* k_meta, const unsigned char* v_codes,  \
        const __half* v_meta, int group, const long long* tables, const int* seq_lens,                 \
        const int* written, const int* depth, const unsigned char* tree, T* out, float* part_acc,      \
        float* part_ml, int q_heads, int kv_heads, int head_dim, int block_size, int table_stride,     \
        int written_stride,                                                                           \
        long long q_row_stride, long long q_head_stride, int n_tokens, long long q_token_stride,       \
        int keys_per_split, float scale) {                                                            \
        paged_decode<T>(q, Int4KV<T>{k_codes, k_meta, kv_heads, head_dim, group},                     \
                        Int4KV<T>{v_codes, v_meta, kv_heads, head_dim, group}, tables, seq_lens,       \
                        written, depth, tree, out, part_acc, part_ml, q_heads, kv_heads, head_dim,     \
                        block_size, table_stride, written_stride, q_row_stride, q_head_stride,         \
                        n_tokens, q_token_stride, keys_per_split, scale);                             \
    }                                                                                                 \
    extern "C" __global__ void paged_decode_combine_##SUFFIX(const float* part_acc, const float* part_ml,\
                                                             T* out, int q_heads, int head_dim,        \
                                                             int splits) {                             \
        paged_combine<T>(part_acc, part_ml, out, q_heads, head_dim, splits);                           \
    }
TL_INSTANTIATE(TL_PAGED)
