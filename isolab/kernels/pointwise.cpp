// Fused per-row pointwise ops of the Llama forward (isolab/models/llama.py, native path).
//
// Every output row is computed by one thread, in an order fixed by the row's own length (16-lane
// partial sums, then the lanes in index order), so a row's bits never depend on the batch.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace {

// sum of squares of row[0..D): 16 lane partial sums in index order, then lanes 0..15 in order
template <typename T>
float sum_sq(const T* row, int D) {
    float lane[16] = {0};
    int d = 0;
    for (; d + 16 <= D; d += 16)
        for (int l = 0; l < 16; l++) {
            float v = load(row, d + l);
            lane[l] += v * v;
        }
    for (; d < D; d++) {
        float v = load(row, d);
        lane[d % 16] += v * v;
    }
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += lane[l];
    return s;
}

// out = w * round(x * rsqrt(mean(x^2) + eps)), as Hugging Face's LlamaRMSNorm rounds
template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int D, float eps) {
    const float r = 1.0f / std::sqrt(sum_sq(x, D) / (float)D + eps);
    int d = 0;
    for (; d + 16 <= D; d += 16) store16(out + d, load16(w + d) * round16(T{}, load16(x + d) * r));
    for (; d < D; d++) store(out, d, load(w, d) * round_to(T{}, load(x, d) * r));
}

// Gemma's RMSNorm: out = round(x * rsqrt(mean(x^2) + eps) * w), all in fp32 with w fp32 (the
// file's 1 + w), rounded once, as transformers' Gemma3RMSNorm does
template <typename T>
void rms_norm_gemma(const T* x, const float* w, T* out, int N, int D, float eps) {
#pragma omp parallel for schedule(static) if (N > 1)
    for (int n = 0; n < N; n++) {
        const T* xr = x + (long)n * D;
        T* o = out + (long)n * D;
        const float r = 1.0f / std::sqrt(sum_sq(xr, D) / (float)D + eps);
        int d = 0;
        for (; d + 16 <= D; d += 16) store16(o + d, (load16(xr + d) * r) * load16(w + d));
        for (; d < D; d++) store(o, d, (load(xr, d) * r) * w[d]);
    }
}

template <typename T>
void rms_norm(const T* x, const T* w, T* out, int N, int D, float eps) {
#pragma omp parallel for schedule(static) if (N > 1)
    for (int n = 0; n < N; n++) rms_norm_row(x + (long)n * D, w, out + (long)n * D, D, eps);
}

// x += delta (rounded to T, as a torch add would), then out = rms_norm(x)
template <typename T>
void add_rms_norm(T* x, const T* delta, const T* w, T* out, int N, int D, float eps) {
#pragma omp parallel for schedule(static) if (N > 1)
    for (int n = 0; n < N; n++) {
        T* xr = x + (long)n * D;
        const T* dr = delta + (long)n * D;
        int d = 0;
        for (; d + 16 <= D; d += 16) store16(xr + d, load16(xr + d) + load16(dr + d));
        for (; d < D; d++) store(xr, d, load(xr, d) + load(dr, d));
        rms_norm_row(xr, w, out + (long)n * D, D, eps);
    }
}

// out[n, i] = silu(gu[n, i]) * gu[n, I + i]; silu rounded to T first, as torch's two ops do
template <typename T>
void silu_mul(const T* gu, T* out, int N, int I) {
#pragma omp parallel for schedule(static) if (N > 1)
    for (int n = 0; n < N; n++) {
        const T* g = gu + (long)n * 2 * I;
        const T* u = g + I;
        T* o = out + (long)n * I;
        int i = 0;
        for (; i + 32 <= I; i += 32) {  // two independent chains a pass: the exp's latency overlaps
            const v16f g0 = load16(g + i), g1 = load16(g + i + 16);
            const v16f s0 = g0 / (1.0f + vexp(v16f{} - g0)), s1 = g1 / (1.0f + vexp(v16f{} - g1));
            store16(o + i, round16(T{}, s0) * load16(u + i));
            store16(o + i + 16, round16(T{}, s1) * load16(u + i + 16));
        }
        for (; i + 16 <= I; i += 16) {
            const v16f gv = load16(g + i);
            const v16f s = gv / (1.0f + vexp(v16f{} - gv));
            store16(o + i, round16(T{}, s) * load16(u + i));
        }
        for (; i < I; i++) {
            v16f gv = v16f{} + load(g, i);
            v16f s = gv / (1.0f + vexp(v16f{} - gv));
            store(o, i, round_to(T{}, s[0]) * load(u, i));
        }
    }
}

// RoPE (rotate-half) on the first (H + Hkv) heads of each qkv row, in place:
// x * cos + rotate_half(x) * sin, with cos/sin rows (P, Dh) picked by the row's position
template <typename T>
void rope(T* qkv, const T* cos, const T* sin, const int64_t* pos, int N, int heads, int row_stride, int Dh) {
    const int half = Dh / 2;
#pragma omp parallel for schedule(static) if (N > 1)
    for (int n = 0; n < N; n++) {
        const T* c = cos + pos[n] * Dh;
        const T* s = sin + pos[n] * Dh;
        for (int h = 0; h < heads; h++) {
            T* x = qkv + (long)n * row_stride + (long)h * Dh;
            float tmp[512];
            for (int d = 0; d < Dh; d++) tmp[d] = load(x, d);
            for (int d = 0; d < Dh; d++) {
                const float rot = d < half ? -tmp[d + half] : tmp[d - half];
                const float a = round_to(T{}, tmp[d] * load(c, d));
                const float b = round_to(T{}, rot * load(s, d));
                store(x, d, a + b);
            }
        }
    }
}

// torch.argmax of one row: the index of the first NaN if the row has one, else the first index of
// its maximum (-0.0 and 0.0 equal, as torch compares them). Two passes: the maximum (and whether a
// NaN is there), 16 lanes at a time; then the first index equal to it, 64 values a test.
template <typename T>
long argmax_row(const T* x, int V) {
    v16f mx = v16f{} - INFINITY;
    v16i nan = v16i{};
    int i = 0;
    for (; i + 16 <= V; i += 16) {
        const v16f v = load16(x + i);
        nan |= (v != v);
        mx = v > mx ? v : mx;
    }
    float m = -INFINITY;
    bool any_nan = false;
    for (int l = 0; l < 16; l++) {
        any_nan |= nan[l] != 0;
        m = mx[l] > m ? mx[l] : m;
    }
    for (; i < V; i++) {
        const float v = load(x, i);
        any_nan |= v != v;
        m = v > m ? v : m;
    }
    if (any_nan) {
        for (int j = 0; j < V; j++)
            if (load(x, j) != load(x, j)) return j;
    }
    const v16f mv = v16f{} + m;
    for (i = 0; i + 64 <= V; i += 64) {
        const v16i e = (load16(x + i) == mv) | (load16(x + i + 16) == mv) | (load16(x + i + 32) == mv) |
                       (load16(x + i + 48) == mv);
        uint64_t w[8];
        std::memcpy(w, &e, 64);
        if ((w[0] | w[1] | w[2] | w[3] | w[4] | w[5] | w[6] | w[7]) == 0) continue;
        for (int j = i; j < i + 64; j++)
            if (load(x, j) == m) return j;
    }
    for (; i < V; i++)
        if (load(x, i) == m) return i;
    return 0;  // not reached: some value equals the maximum
}

// out[r] = argmax of row r of x (M rows of V values, row stride `stride` elements); each row on its own
template <typename T>
void argmax_rows(const T* x, long stride, int M, int V, int64_t* out) {
#pragma omp parallel for schedule(static) if (M > 1)
    for (int r = 0; r < M; r++) out[r] = argmax_row(x + (long)r * stride, V);
}

}  // namespace

extern "C" {
void isolab_argmax_rows_bf16(const uint16_t* x, long stride, int M, int V, int64_t* out) { argmax_rows(x, stride, M, V, out); }
void isolab_argmax_rows_fp32(const float* x, long stride, int M, int V, int64_t* out) { argmax_rows(x, stride, M, V, out); }
void isolab_rms_norm_gemma_bf16(const uint16_t* x, const float* w, uint16_t* out, int N, int D, float eps) { rms_norm_gemma(x, w, out, N, D, eps); }
void isolab_rms_norm_gemma_fp32(const float* x, const float* w, float* out, int N, int D, float eps) { rms_norm_gemma(x, w, out, N, D, eps); }
void isolab_rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int N, int D, float eps) { rms_norm(x, w, out, N, D, eps); }
void isolab_rms_norm_fp32(const float* x, const float* w, float* out, int N, int D, float eps) { rms_norm(x, w, out, N, D, eps); }
void isolab_add_rms_norm_bf16(uint16_t* x, const uint16_t* dx, const uint16_t* w, uint16_t* out, int N, int D, float eps) { add_rms_norm(x, dx, w, out, N, D, eps); }
void isolab_add_rms_norm_fp32(float* x, const float* dx, const float* w, float* out, int N, int D, float eps) { add_rms_norm(x, dx, w, out, N, D, eps); }
void isolab_silu_mul_bf16(const uint16_t* gu, uint16_t* out, int N, int I) { silu_mul(gu, out, N, I); }
void isolab_silu_mul_fp32(const float* gu, float* out, int N, int I) { silu_mul(gu, out, N, I); }
void isolab_rope_bf16(uint16_t* qkv, const uint16_t* c, const uint16_t* s, const int64_t* pos, int N, int heads, int stride, int Dh) { rope(qkv, c, s, pos, N, heads, stride, Dh); }
void isolab_rope_fp32(float* qkv, const float* c, const float* s, const int64_t* pos, int N, int heads, int stride, int Dh) { rope(qkv, c, s, pos, N, heads, stride, Dh); }
}
