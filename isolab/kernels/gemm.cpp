// isolab's GEMM: out (M, N) = A (M, K) @ W^T for a weight W (N, K) packed once into column panels.
//
// Batch invariance by construction (issue 12). Every output element is one chain of fused
// multiply-adds over k = 0, 1, ..., K-1 in that order, started from +0.0 and rounded to the output
// type once at the end:
//     acc = 0;  for k in 0..K-1: acc = fma(a[m][k], w[n][k], acc);  out[m][n] = round(acc)
// The chain runs in one lane of one register of one thread. Which lane, register, tile, thread
// or ISA runs it changes nothing, so a row's bits do not depend on M, on its neighbours, on the
// thread count or on the CPU: the AVX-512, AVX2+FMA and generic (std::fma) builds give the same
// bits (a test compares them). bf16 x bf16 products are exact in fp32, so for bf16 the chain is
// also what a non-fused multiply-add would give; for fp32 it is a true fma everywhere.
//
// Layouts (isolab/kernels/__init__.py: pack_weight):
//   fp32 W: panels of 16 columns, (N/16, K, 16): one row of a panel is 16 columns at one k
//   bf16 W: panels of 16 columns, (N/16, K/2, 16, 2): columns' (k, k+1) pairs side by side, so one
//           32-bit lane holds two k's of one column; shift and mask give the two fp32 values
//   N is padded to a multiple of 16 with zero columns (computed, never stored); K must be even
//   for bf16.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector
typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
static inline vf vfma(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
constexpr int MR = 8;   // rows per tile
constexpr int NV = 2;   // vectors per tile row: 32 columns, two panels
const char* ISA = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int VW = 8;
typedef float vf __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
static inline vf vfma(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
constexpr int MR = 6;
constexpr int NV = 2;   // 16 columns, one panel
const char* ISA = "avx2";
#else
constexpr int VW = 4;
typedef float vf __attribute__((vector_size(16)));
typedef uint32_t vu __attribute__((vector_size(16)));
static inline vf vfma(vf a, vf b, vf c) {
    vf r;
    for (int l = 0; l < VW; l++) r[l] = std::fma(a[l], b[l], c[l]);
    return r;
}
constexpr int MR = 4;
constexpr int NV = 4;
const char* ISA = "generic";
#endif

constexpr int PANEL = 16;          // columns per packed panel
constexpr int TILE_N = NV * VW;    // columns per tile
constexpr int MC = 64;             // rows per cache block of A (A block: MC x K fp32 stays in L2)
static_assert(TILE_N % PANEL == 0 || PANEL % TILE_N == 0, "tiles and panels must nest");

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN (torch's rule)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline vf load_vf(const float* p) {
    vf x;
    std::memcpy(&x, p, sizeof(vf));
    return x;
}
static inline vu load_vu(const uint16_t* p) {
    vu x;
    std::memcpy(&x, p, sizeof(vu));
    return x;
}
static inline vf as_vf(vu u) {
    vf x;
    std::memcpy(&x, &u, sizeof(vf));
    return x;
}

// Weight columns j*VW .. j*VW+VW-1 of a tile starting at column n0 (a multiple of TILE_N):
// the panel and the offset inside it.
static inline long panel_of(int n0, int j) { return (n0 + j * VW) / PANEL; }
static inline int offset_of(int n0, int j) { return (n0 + j * VW) % PANEL; }

// One tile: rows m0..m0+R-1 (R <= MR) of the fp32 A block, columns n0..n0+TILE_N-1, all of K.
template <int R>
static inline void tile(const float* a, long lda, const float* w, int K, int n0, float* acc_out) {
    vf acc[R][NV];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++) acc[r][j] = vf{};
    const float* wp[NV];
    for (int j = 0; j < NV; j++) wp[j] = w + panel_of(n0, j) * (long)K * PANEL + offset_of(n0, j);
    for (int k = 0; k < K; k++) {
        vf wv[NV];
        for (int j = 0; j < NV; j++) wv[j] = load_vf(wp[j] + (long)k * PANEL);
        for (int r = 0; r < R; r++) {
            const vf av = vf{} + a[r * lda + k];
            for (int j = 0; j < NV; j++) acc[r][j] = vfma(av, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++) std::memcpy(acc_out + r * TILE_N + j * VW, &acc[r][j], sizeof(vf));
}

template <int R>
static inline void tile(const float* a, long lda, const uint16_t* w, int K, int n0, float* acc_out) {
    vf acc[R][NV];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++) acc[r][j] = vf{};
    const uint16_t* wp[NV];
    for (int j = 0; j < NV; j++) wp[j] = w + panel_of(n0, j) * (long)K * PANEL + offset_of(n0, j) * 2;
    const vu hi_mask = vu{} + 0xffff0000u;
    for (int k = 0; k < K; k += 2) {
        vf w0[NV], w1[NV];  // columns' weights at k and k + 1
        for (int j = 0; j < NV; j++) {
            const vu u = load_vu(wp[j] + (long)k * PANEL);
            w0[j] = as_vf(u << 16);
            w1[j] = as_vf(u & hi_mask);
        }
        for (int r = 0; r < R; r++) {
            const vf a0 = vf{} + a[r * lda + k];
            for (int j = 0; j < NV; j++) acc[r][j] = vfma(a0, w0[j], acc[r][j]);
        }
        for (int r = 0; r < R; r++) {
            const vf a1 = vf{} + a[r * lda + k + 1];
            for (int j = 0; j < NV; j++) acc[r][j] = vfma(a1, w1[j], acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++) std::memcpy(acc_out + r * TILE_N + j * VW, &acc[r][j], sizeof(vf));
}

// tile<rows> for 1 <= rows <= MR
template <int R, typename W>
static inline void run_tile(int rows, const float* a, long lda, const W* w, int K, int n0, float* acc) {
    if constexpr (R >= 1) {
        if (rows == R)
            tile<R>(a, lda, w, K, n0, acc);
        else
            run_tile<R - 1>(rows, a, lda, w, K, n0, acc);
    }
}

template <typename O>
static inline void store_out(O* out, long ldo, const float* acc, int rows, int n0, int cols) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            const float v = acc[r * TILE_N + c];
            if constexpr (sizeof(O) == 2)
                out[r * ldo + n0 + c] = f32_to_bf16(v);
            else
                out[r * ldo + n0 + c] = v;
        }
}

// A (M, K) with row stride lda, as T (bf16 bits or fp32); W packed as above; out (M, N) contiguous.
template <typename T>
static void gemm(const T* A, long lda, const T* W, T* out, int M, int N, int K) {
    const int tiles_n = (N + TILE_N - 1) / TILE_N;
    const int blocks_m = (M + MC - 1) / MC;
    // fp32 copy of A (bf16 -> fp32 is exact); fp32 A is read in place
    float* af = nullptr;
    long ldf = lda;
    if constexpr (sizeof(T) == 2) {
        af = (float*)std::aligned_alloc(64, sizeof(float) * ((size_t)M * K + 16));
        ldf = K;
    }
#pragma omp parallel if ((long)M * N * K > 100000)
    {
        if constexpr (sizeof(T) == 2) {
#pragma omp for schedule(static)
            for (int m = 0; m < M; m++)
                for (int k = 0; k < K; k++) af[(long)m * K + k] = bf16_to_f32(A[(long)m * lda + k]);
        }
        const float* a = sizeof(T) == 2 ? af : (const float*)(const void*)A;
        float acc[MR * TILE_N];
        // work items: (block of MC rows, tile of TILE_N columns); each output element belongs to
        // exactly one item, computed whole by the thread that takes it
#pragma omp for schedule(static) collapse(2)
        for (int b = 0; b < blocks_m; b++)
            for (int t = 0; t < tiles_n; t++) {
                const int n0 = t * TILE_N;
                const int cols = N - n0 < TILE_N ? N - n0 : TILE_N;
                const int m_end = (b + 1) * MC < M ? (b + 1) * MC : M;
                for (int m0 = b * MC; m0 < m_end; m0 += MR) {
                    const int rows = m_end - m0 < MR ? m_end - m0 : MR;
                    run_tile<MR>(rows, a + (long)m0 * ldf, ldf, W, K, n0, acc);
                    store_out(out + (long)m0 * N, N, acc, rows, n0, cols);
                }
            }
    }
    std::free(af);
}

}  // namespace

extern "C" {
const char* isolab_gemm_isa() { return ISA; }
int isolab_gemm_panel() { return PANEL; }
int isolab_gemm_tile_n() { return TILE_N; }
// A: (M, K) rows with stride lda (elements); W: packed (see above), its N padded to a multiple of
// isolab_gemm_tile_n(); out: (M, N) contiguous.
void isolab_gemm_bf16(const uint16_t* A, long lda, const uint16_t* W, uint16_t* out, int M, int N, int K) {
    gemm<uint16_t>(A, lda, W, out, M, N, K);
}
void isolab_gemm_fp32(const float* A, long lda, const float* W, float* out, int M, int N, int K) {
    gemm<float>(A, lda, W, out, M, N, K);
}
}
