// Every layer of the Llama forward in one native call: the kernels of this directory, called in the
// order and on the buffers LlamaModel._forward_native uses for its per-op calls, so the bits are the
// same (a test compares them); what goes is ~8 Python -> C round trips a layer (about 2 ms a token
// at batch 1 on the small model, a third of a decode step).
#include <atomic>
#include <chrono>
#include <cstdint>

extern "C" {
void isolab_qgemm(const void* A, int a_bf16, long lda, const uint8_t* W, int fmt, int fp16, void* out, int out_bf16,
                  int M, int N, int K);
void isolab_gemm_bf16(const uint16_t* A, long lda, const uint16_t* W, uint16_t* out, int M, int N, int K);
void isolab_qdense(const uint16_t* A, long lda, const uint8_t* W, int fmt, int fp16, uint16_t* out, int M, int N, int K);
void isolab_gemm_fp32(const float* A, long lda, const float* W, float* out, int M, int N, int K);
void isolab_rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int N, int D, float eps);
void isolab_rms_norm_fp32(const float* x, const float* w, float* out, int N, int D, float eps);
void isolab_add_rms_norm_bf16(uint16_t* x, const uint16_t* dx, const uint16_t* w, uint16_t* out, int N, int D, float eps);
void isolab_add_rms_norm_fp32(float* x, const float* dx, const float* w, float* out, int N, int D, float eps);
void isolab_silu_mul_bf16(const uint16_t* gu, uint16_t* out, int N, int I);
void isolab_silu_mul_fp32(const float* gu, float* out, int N, int I);
void isolab_rope_bf16(uint16_t* qkv, const uint16_t* c, const uint16_t* s, const int64_t* pos, int N, int heads, int stride, int Dh);
void isolab_rope_fp32(float* qkv, const float* c, const float* s, const int64_t* pos, int N, int heads, int stride, int Dh);
void isolab_paged_attention_bf16(const uint16_t* q, const uint16_t* k_new, const uint16_t* v_new, long qs,
                                 const int64_t* slots, uint16_t* k, uint16_t* v, const int32_t* tables, int table_len,
                                 const int32_t* row_table, const int32_t* q_pos, uint16_t* out, int N, int H, int Hkv,
                                 long NB, int bs, int Dh, float scale, int window);
void isolab_paged_attention_fp32(const float* q, const float* k_new, const float* v_new, long qs,
                                 const int64_t* slots, float* k, float* v, const int32_t* tables, int table_len,
                                 const int32_t* row_table, const int32_t* q_pos, float* out, int N, int H, int Hkv,
                                 long NB, int bs, int Dh, float scale, int window);
void isolab_paged_attention_i8_bf16(const uint16_t* q, const uint16_t* k_new, const uint16_t* v_new, long qs,
                                    const int64_t* slots, int8_t* pool, const int32_t* tables, int table_len,
                                    const int32_t* row_table, const int32_t* q_pos, uint16_t* out, int N, int H,
                                    int Hkv, long NB, int bs, int Dh, float scale, int window);
void isolab_paged_attention_i8_fp32(const float* q, const float* k_new, const float* v_new, long qs,
                                    const int64_t* slots, int8_t* pool, const int32_t* tables, int table_len,
                                    const int32_t* row_table, const int32_t* q_pos, float* out, int N, int H,
                                    int Hkv, long NB, int bs, int Dh, float scale, int window);
}

namespace {

// One linear layer's weight (isolab/kernels/__init__.py: FusedLinear mirrors it).
struct Linear {
    const void* w;  // qgemm records, the dense GEMM's packed panels, or qdense records
    int32_t quant;  // 1: qgemm (fmt, fp16), 0: the dense isolab GEMM, 2: qdense (fmt, fp16; bf16 only)
    int32_t fmt;
    int32_t fp16;
    int32_t n;
    int32_t k;
    int32_t pad_;
};

struct Layer {
    const void* attn_norm;  // (D,)
    const void* ffn_norm;   // (D,)
    Linear qkv, o, gate_up, down;
};

inline void rms(const uint16_t* x, const void* w, uint16_t* o, int N, int D, float e) { isolab_rms_norm_bf16(x, (const uint16_t*)w, o, N, D, e); }
inline void rms(const float* x, const void* w, float* o, int N, int D, float e) { isolab_rms_norm_fp32(x, (const float*)w, o, N, D, e); }
inline void add_rms(uint16_t* x, const uint16_t* d, const void* w, uint16_t* o, int N, int D, float e) { isolab_add_rms_norm_bf16(x, d, (const uint16_t*)w, o, N, D, e); }
inline void add_rms(float* x, const float* d, const void* w, float* o, int N, int D, float e) { isolab_add_rms_norm_fp32(x, d, (const float*)w, o, N, D, e); }
inline void silu(const uint16_t* g, uint16_t* o, int N, int I) { isolab_silu_mul_bf16(g, o, N, I); }
inline void silu(const float* g, float* o, int N, int I) { isolab_silu_mul_fp32(g, o, N, I); }
inline void rope(uint16_t* q, const void* c, const void* s, const int64_t* p, int N, int h, int st, int Dh) { isolab_rope_bf16(q, (const uint16_t*)c, (const uint16_t*)s, p, N, h, st, Dh); }
inline void rope(float* q, const void* c, const void* s, const int64_t* p, int N, int h, int st, int Dh) { isolab_rope_fp32(q, (const float*)c, (const float*)s, p, N, h, st, Dh); }
inline void dense(const uint16_t* a, const Linear& l, uint16_t* o, int M) {
    if (l.quant == 2)
        isolab_qdense(a, l.k, (const uint8_t*)l.w, l.fmt, l.fp16, o, M, l.n, l.k);
    else
        isolab_gemm_bf16(a, l.k, (const uint16_t*)l.w, o, M, l.n, l.k);
}
// (fp32 never gets quant == 2: dense weights stay in blocks only in bf16, models/llama.py)
inline void dense(const float* a, const Linear& l, float* o, int M) { isolab_gemm_fp32(a, l.k, (const float*)l.w, o, M, l.n, l.k); }
// i8: the layer's pool is the int8 one (kp; vp unused)
inline void attend(const uint16_t* q, const uint16_t* k, const uint16_t* v, long qs, const int64_t* slots, void* kp,
                   void* vp, const int32_t* t, int tl, const int32_t* rt, const int32_t* qp, uint16_t* o, int N, int H,
                   int Hkv, long NB, int bs, int Dh, float sc, int i8) {
    if (i8)
        isolab_paged_attention_i8_bf16(q, k, v, qs, slots, (int8_t*)kp, t, tl, rt, qp, o, N, H, Hkv, NB, bs, Dh, sc, 0);
    else
        isolab_paged_attention_bf16(q, k, v, qs, slots, (uint16_t*)kp, (uint16_t*)vp, t, tl, rt, qp, o, N, H, Hkv, NB, bs, Dh, sc, 0);
}
inline void attend(const float* q, const float* k, const float* v, long qs, const int64_t* slots, void* kp, void* vp,
                   const int32_t* t, int tl, const int32_t* rt, const int32_t* qp, float* o, int N, int H, int Hkv,
                   long NB, int bs, int Dh, float sc, int i8) {
    if (i8)
        isolab_paged_attention_i8_fp32(q, k, v, qs, slots, (int8_t*)kp, t, tl, rt, qp, o, N, H, Hkv, NB, bs, Dh, sc, 0);
    else
        isolab_paged_attention_fp32(q, k, v, qs, slots, (float*)kp, (float*)vp, t, tl, rt, qp, o, N, H, Hkv, NB, bs, Dh, sc, 0);
}

// Per-op wall time across forward calls, for bench/step_profile.py (off by default: two clock reads
// an op when on). Ops: the four linear layers, rope, attention, the two add_rms_norms, silu_mul.
enum Op { QKV = 0, ROPE, ATTN, O, ADD_RMS, GATE_UP, SILU, DOWN, NOPS };
std::atomic<int> profile_on{0};
double profile_ns[NOPS];  // written by the calling thread only (the forward runs on one caller at a time)

struct Timer {  // times one op of the forward if profiling is on
    const bool on = profile_on.load(std::memory_order_relaxed) != 0;
    std::chrono::steady_clock::time_point t0 = on ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
    void lap(Op op) {
        if (!on) return;
        const auto t1 = std::chrono::steady_clock::now();
        profile_ns[op] += std::chrono::duration<double, std::nano>(t1 - t0).count();
        t0 = t1;
    }
};

template <typename T>
void linear(const T* a, const Linear& l, T* out, int M) {  // (M, k) @ W^T -> (M, n), rows contiguous
    if (l.quant == 1)
        isolab_qgemm(a, sizeof(T) == 2, l.k, (const uint8_t*)l.w, l.fmt, l.fp16, out, sizeof(T) == 2, M, l.n, l.k);
    else
        dense(a, l, out, M);
}

// k_pools, v_pools: each layer's K and V pool (Hkv, NB, bs, Dh), blocks as the attention kernel lays them out;
// kv_i8: k_pools are the layers' int8 pools (paged_attention.cpp, attend_all_i8), v_pools unused.
// x: (N, D) the residual stream, in place; h: (N, D) rms_norm(x) with layer 0's attn_norm on entry,
// the final norm's output on return. Buffers: qkv (N, Wqkv), att (N, H*Dh), tmp (N, D),
// gu (N, 2I), act (N, I).
template <typename T>
void forward(T* x, T* h, const Layer* layers, void* const* k_pools, void* const* v_pools, int L, const void* final_norm, const void* cos, const void* sin,
             const int64_t* positions, const int64_t* slots, const int32_t* tables, int table_len,
             const int32_t* row_table, const int32_t* q_pos, int N, int D, int H, int Hkv, int Dh, long NB, int bs,
             float scale, float eps, T* qkv, T* att, T* tmp, T* gu, T* act, int kv_i8) {
    const int W = (H + 2 * Hkv) * Dh;
    for (int i = 0; i < L; i++) {
        const Layer& ly = layers[i];
        Timer t;
        linear(h, ly.qkv, qkv, N);
        t.lap(QKV);
        rope(qkv, cos, sin, positions, N, H + Hkv, W, Dh);
        t.lap(ROPE);
        attend(qkv, qkv + H * Dh, qkv + (H + Hkv) * Dh, W, slots, k_pools[i], v_pools[i], tables, table_len, row_table,
               q_pos, att, N, H, Hkv, NB, bs, Dh, scale, kv_i8);
        t.lap(ATTN);
        linear(att, ly.o, tmp, N);
        t.lap(O);
        add_rms(x, tmp, ly.ffn_norm, h, N, D, eps);
        t.lap(ADD_RMS);
        linear(h, ly.gate_up, gu, N);
        t.lap(GATE_UP);
        silu(gu, act, N, ly.gate_up.n / 2);
        t.lap(SILU);
        linear(act, ly.down, tmp, N);
        t.lap(DOWN);
        add_rms(x, tmp, i + 1 < L ? layers[i + 1].attn_norm : final_norm, h, N, D, eps);
        t.lap(ADD_RMS);
    }
}

}  // namespace

extern "C" {
long isolab_forward_layer_size() { return sizeof(Layer); }
// on: start timing the forward's ops (and zero the totals); off: stop. read: the totals in ns, NOPS of them.
void isolab_forward_profile(int on) {
    if (on)
        for (double& v : profile_ns) v = 0.0;
    profile_on.store(on, std::memory_order_relaxed);
}
int isolab_forward_profile_read(double* out, int n) {
    for (int i = 0; i < n && i < NOPS; i++) out[i] = profile_ns[i];
    return NOPS;
}
#define ISOLAB_FORWARD(SUFFIX, T)                                                                                    \
    void isolab_forward_##SUFFIX(T* x, T* h, const Layer* layers, void* const* k_pools, void* const* v_pools, int L, const void* final_norm, const void* cos,     \
                                 const void* sin, const int64_t* positions, const int64_t* slots,                    \
                                 const int32_t* tables, int table_len, const int32_t* row_table,                     \
                                 const int32_t* q_pos, int N, int D, int H, int Hkv, int Dh, long NB, int bs,        \
                                 float scale, float eps, T* qkv, T* att, T* tmp, T* gu, T* act, int kv_i8) {        \
        forward<T>(x, h, layers, k_pools, v_pools, L, final_norm, cos, sin, positions, slots, tables, table_len, row_table, q_pos, N,  \
                   D, H, Hkv, Dh, NB, bs, scale, eps, qkv, att, tmp, gu, act, kv_i8);                                \
    }
ISOLAB_FORWARD(bf16, uint16_t)
ISOLAB_FORWARD(fp32, float)
}
