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
// AVX512-BF16 (a build for a CPU with it and no AMX: Zen 4/5, Cooper Lake): bf16 GEMMs take
// another fixed chain, one VDPBF16PS per k pair, pairs in order, in one lane of one register:
//     acc = 0;  for k in 0, 2, 4, ...: acc = dpbf16(acc, (a[m][k], a[m][k+1]), (w[n][k], w[n][k+1]))
// The instruction adds the pair's two exact products to acc with the rounding the hardware fixes
// (round to nearest even, denormals flushed): its own bits, the same at every M, thread count and
// neighbour, as the AMX chain below; twice the products per instruction of the fma chain, and A
// stays bf16 (no widened copy). fp32 keeps the fma chain. The ISA level is part of the start-up
// check's key, so a verdict is never reused across chains.
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
#include "simd.h"  // amx_ready, TileConfig

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector
typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
static inline vf vfma(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
static inline vf bcast(const float* p) { return (vf)_mm512_set1_ps(*p); }
constexpr int MR = 8;   // rows per tile
constexpr int NV = 2;   // vectors per tile row: 32 columns, two panels
const char* ISA = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int VW = 8;
typedef float vf __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
static inline vf vfma(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
static inline vf bcast(const float* p) { return (vf)_mm256_broadcast_ss(p); }
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
static inline vf bcast(const float* p) {
    vf r;
    for (int l = 0; l < VW; l++) r[l] = *p;
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

// unaligned, aliasing views for loads and stores (memcpy here makes GCC spill the accumulators)
typedef float vf_u __attribute__((vector_size(sizeof(vf)), aligned(4), may_alias));
typedef uint32_t vu_u __attribute__((vector_size(sizeof(vu)), aligned(2), may_alias));
static inline vf load_vf(const float* p) { return *(const vf_u*)p; }
static inline vu load_vu(const uint16_t* p) { return *(const vu_u*)p; }
static inline void store_vf(float* p, vf x) { *(vf_u*)p = x; }
static inline vf as_vf(vu u) { return (vf)u; }

// Weight columns j*VW .. j*VW+VW-1 of a tile starting at column n0 (a multiple of TILE_N):
// the panel and the offset inside it.
static inline long panel_of(int n0, int j) { return (n0 + j * VW) / PANEL; }
static inline int offset_of(int n0, int j) { return (n0 + j * VW) % PANEL; }

// One tile: rows m0..m0+R-1 (R <= MR) of the fp32 A block, columns n0..n0+TILE_N-1, all of K.
template <int R>
__attribute__((noinline)) static void tile(const float* a, long lda, const float* w, int K, int n0, float* acc_out) {
    vf acc[R][NV];
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 16
        for (int j = 0; j < NV; j++) acc[r][j] = vf{};
    const float* wp[NV];
    #pragma GCC unroll 16
    for (int j = 0; j < NV; j++) wp[j] = w + panel_of(n0, j) * (long)K * PANEL + offset_of(n0, j);
#pragma GCC unroll 2
    for (int k = 0; k < K; k++) {
        vf wv[NV];
        #pragma GCC unroll 16
        for (int j = 0; j < NV; j++) wv[j] = load_vf(wp[j] + (long)k * PANEL);
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const vf av = bcast(a + r * lda + k);
            #pragma GCC unroll 16
            for (int j = 0; j < NV; j++) acc[r][j] = vfma(av, wv[j], acc[r][j]);
        }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 16
        for (int j = 0; j < NV; j++) store_vf(acc_out + r * TILE_N + j * VW, acc[r][j]);
}

template <int R>
__attribute__((noinline)) static void tile(const float* a, long lda, const uint16_t* w, int K, int n0, float* acc_out) {
    vf acc[R][NV];
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 16
        for (int j = 0; j < NV; j++) acc[r][j] = vf{};
    const uint16_t* wp[NV];
    #pragma GCC unroll 16
    for (int j = 0; j < NV; j++) wp[j] = w + panel_of(n0, j) * (long)K * PANEL + offset_of(n0, j) * 2;
    const vu hi_mask = vu{} + 0xffff0000u;
    for (int k = 0; k < K; k += 2) {
        // column vector j at k, then at k + 1: few registers live besides the accumulators
        #pragma GCC unroll 16
        for (int j = 0; j < NV; j++) {
            const vu u = load_vu(wp[j] + (long)k * PANEL);
            const vf w0 = as_vf(u << 16);
            #pragma GCC unroll 16
            for (int r = 0; r < R; r++) acc[r][j] = vfma(bcast(a + r * lda + k), w0, acc[r][j]);
            const vf w1 = as_vf(u & hi_mask);
            #pragma GCC unroll 16
            for (int r = 0; r < R; r++) acc[r][j] = vfma(bcast(a + r * lda + k + 1), w1, acc[r][j]);
        }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 16
        for (int j = 0; j < NV; j++) store_vf(acc_out + r * TILE_N + j * VW, acc[r][j]);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define ISOLAB_GEMM_DP 1
// One tile on AVX512-BF16 dot products (tile<R> on bf16 A): rows m0..m0+R-1 of bf16 A (read in place), columns
// n0..n0+TILE_N-1 (NV whole panels), all of K; each accumulator lane is one output's chain.
template <int R>
__attribute__((noinline)) static void tile(const uint16_t* a, long lda, const uint16_t* w, int K, int n0,
                                           float* acc_out) {
    __m512 acc[R][NV];
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 16
        for (int j = 0; j < NV; j++) acc[r][j] = _mm512_setzero_ps();
    const uint16_t* wp[NV];
    #pragma GCC unroll 16
    for (int j = 0; j < NV; j++) wp[j] = w + panel_of(n0, j) * (long)K * PANEL + offset_of(n0, j) * 2;
    for (int k = 0; k < K; k += 2) {
        __m512bh wv[NV];
        #pragma GCC unroll 16
        for (int j = 0; j < NV; j++) wv[j] = (__m512bh)_mm512_loadu_si512((const void*)(wp[j] + (long)k * PANEL));
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            uint32_t pair;
            std::memcpy(&pair, a + r * lda + k, 4);  // (a[k], a[k+1]) as one 32-bit lane
            const __m512bh av = (__m512bh)_mm512_set1_epi32((int)pair);
            #pragma GCC unroll 16
            for (int j = 0; j < NV; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av, wv[j]);
        }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 16
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(acc_out + r * TILE_N + j * VW, acc[r][j]);
}

#else
#define ISOLAB_GEMM_DP 0
#endif

// tile<rows> for 1 <= rows <= MR; A is fp32 (the fma chain) or, on AVX512-BF16, bf16 (the dot-product chain)
template <int R, typename A, typename W>
static inline void run_tile(int rows, const A* a, long lda, const W* w, int K, int n0, float* acc) {
    if constexpr (R >= 1) {
        if (rows == R)
            tile<R>(a, lda, w, K, n0, acc);
        else
            run_tile<R - 1>(rows, a, lda, w, K, n0, acc);
    }
}

// bf16 panels of one tile (columns n0..n0+TILE_N-1) -> the same panels in fp32 (exact), so the
// fp32 tile can run on them: for a block of many rows this costs one pass over the tile's weights
// and keeps every accumulator in a register.
static void widen_tile(const uint16_t* w, int K, int n0, float* out) {
    const vu hi = vu{} + 0xffff0000u;
    for (int p = 0; p < TILE_N / PANEL; p++) {
        const uint16_t* src = w + (long)(n0 / PANEL + p) * K * PANEL;
        float* dst = out + (long)p * K * PANEL;
        for (int k = 0; k < K; k += 2)
            for (int c = 0; c < PANEL; c += VW) {
                const vu u = load_vu(src + (long)k * PANEL + c * 2);  // columns c..c+VW-1, k and k+1
                store_vf(dst + (long)k * PANEL + c, as_vf(u << 16));
                store_vf(dst + (long)(k + 1) * PANEL + c, as_vf(u & hi));
            }
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---- AMX (bf16 only): the tile unit's dot products, one fixed order per output element ----------
//
// Batch invariance by construction, as above, with another (equally fixed) chain: an output
// element is C[m][n] = 0, then one TDPBF16PS per 32-wide chunk of k, chunks in order
// kc = 0, 32, 64, ...; each instruction adds that chunk's 32 products of row m and column n in the
// order the hardware fixes (bf16 inputs, fp32 accumulate, denormals flushed). Row m's result reads
// only row m of A: the other 15 rows of an A tile (other requests, or zero padding) never enter it,
// so a row gets the same bits for every M. Every M takes this path on a CPU where it runs (the
// chunk order is the same at M = 1 and M = 512), so the AVX-512 chain above is never mixed in.
// Its bits differ from the fma chain's (another summation order), which is why the ISA level is
// part of the invariance check's key. Needs K % 32 == 0; other shapes keep the fma chain at every M.

// tmm0-3: C (16 rows x 16 fp32); tmm4-5: A (16 rows x 32 bf16); tmm6-7: B (16 k-pairs x 16 columns x 2)

// Rows 0..16*RB-1 of a (row stride lda elements) times panels p0, p0 + 1 of W (32 columns), all of
// K, into c (16*RB rows x 32 fp32). A bf16 panel (K/2, 16, 2) is K/32 B tiles one after another.
template <int RB>
static void amx_block(const uint16_t* a, long lda, const uint16_t* w, int K, long p0, float* c) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (RB == 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const uint16_t* b0 = w + p0 * (long)K * PANEL;
    const uint16_t* b1 = b0 + (long)K * PANEL;
    const long stride = lda * (long)sizeof(uint16_t);
    for (int kc = 0; kc < K; kc += 32) {
        _tile_loadd(4, a + kc, stride);
        _tile_loadd(6, b0 + (long)kc * PANEL, 64);
        _tile_loadd(7, b1 + (long)kc * PANEL, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if constexpr (RB == 2) {
            _tile_loadd(5, a + 16 * lda + kc, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    if constexpr (RB == 2) {
        _tile_stored(2, c + 16 * 32, 128);
        _tile_stored(3, c + 16 * 32 + 16, 128);
    }
}

static void gemm_amx(const uint16_t* A, long lda, const uint16_t* W, uint16_t* out, int M, int N, int K) {
    constexpr int MB = 32, NB = 32;  // rows and columns per work item
    static_assert(NB == TILE_N, "store_out reads c with a row stride of TILE_N");
    const int items_n = (N + NB - 1) / NB;
    const int blocks_m = (M + MB - 1) / MB;
    // the last, partial block of rows: a copy padded with zero rows, so every tile load reads 16
    // whole rows of memory we own (the padding rows' results are computed and dropped)
    const int m_tail = M / MB * MB;
    uint16_t* tail = nullptr;
    if (m_tail < M) {
        tail = (uint16_t*)std::aligned_alloc(64, sizeof(uint16_t) * (size_t)MB * K);
        std::memset(tail, 0, sizeof(uint16_t) * (size_t)MB * K);
        for (int m = m_tail; m < M; m++) std::memcpy(tail + (long)(m - m_tail) * K, A + (long)m * lda, sizeof(uint16_t) * K);
    }
#pragma omp parallel
    {
        amx_configure_gemm();  // tile configuration is per thread
        alignas(64) float c[MB * NB];
        // work items: (32 columns, 32 rows), columns outer so a thread reuses one slice of W
        // across the row blocks it takes; each output element belongs to exactly one item
#pragma omp for schedule(static) collapse(2)
        for (int t = 0; t < items_n; t++)
            for (int b = 0; b < blocks_m; b++) {
                const int m0 = b * MB;
                const int rows = M - m0 < MB ? M - m0 : MB;
                const uint16_t* a = m0 < m_tail ? A + (long)m0 * lda : tail;
                const long la = m0 < m_tail ? lda : K;
                if (rows > 16)
                    amx_block<2>(a, la, W, K, 2L * t, c);
                else
                    amx_block<1>(a, la, W, K, 2L * t, c);
                const int n0 = t * NB;
                store_out(out + (long)m0 * N, N, c, rows, n0, N - n0 < NB ? N - n0 : NB);
            }
        _tile_release();
    }
    std::free(tail);
}
static bool use_amx(int K) { return K % 32 == 0 && amx_ready(); }
#else
static bool use_amx(int) { return false; }
static void gemm_amx(const uint16_t*, long, const uint16_t*, uint16_t*, int, int, int) {}
#endif

// The work items of a GEMM: (block of MC rows, tile of TILE_N columns); each output element belongs
// to exactly one item, computed whole by the thread that takes it. Called inside a parallel region:
// the items are split over its threads. item(m_begin, m_end, n0, cols).
template <typename Item>
static inline void for_each_item(int M, int N, Item&& item) {
    const int tiles_n = (N + TILE_N - 1) / TILE_N;
    const int blocks_m = (M + MC - 1) / MC;
#pragma omp for schedule(static) collapse(2)
    for (int b = 0; b < blocks_m; b++)
        for (int t = 0; t < tiles_n; t++) {
            const int n0 = t * TILE_N;
            item(b * MC, (b + 1) * MC < M ? (b + 1) * MC : M, n0, N - n0 < TILE_N ? N - n0 : TILE_N);
        }
}

#if ISOLAB_GEMM_DP
// bf16 on AVX512-BF16: gemm()'s work items, A read in place, no widened weights.
static void gemm_dp(const uint16_t* A, long lda, const uint16_t* W, uint16_t* out, int M, int N, int K) {
#pragma omp parallel if ((long)M * N * K > 100000)
    {
        float acc[MR * TILE_N];
        for_each_item(M, N, [&](int m_begin, int m_end, int n0, int cols) {
            for (int m0 = m_begin; m0 < m_end; m0 += MR) {
                const int rows = m_end - m0 < MR ? m_end - m0 : MR;
                run_tile<MR>(rows, A + (long)m0 * lda, lda, W, K, n0, acc);
                store_out(out + (long)m0 * N, N, acc, rows, n0, cols);
            }
        });
    }
}
#else
static void gemm_dp(const uint16_t*, long, const uint16_t*, uint16_t*, int, int, int) {}
#endif

// A (M, K) with row stride lda, as T (bf16 bits or fp32); W packed as above; out (M, N) contiguous.
template <typename T>
static void gemm(const T* A, long lda, const T* W, T* out, int M, int N, int K) {
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
        // bf16 blocks of many rows: the tile's weights widened once per block (see widen_tile)
        float* wide = sizeof(T) == 2 ? (float*)std::aligned_alloc(64, sizeof(float) * ((size_t)K * TILE_N + 64)) : nullptr;
        for_each_item(M, N, [&](int m_begin, int m_end, int n0, int cols) {
            const bool widen = sizeof(T) == 2 && m_end - m_begin >= 2 * MR;  // fewer rows: memory-bound, read bf16 directly
            if (widen) widen_tile((const uint16_t*)(const void*)W, K, n0, wide);
            for (int m0 = m_begin; m0 < m_end; m0 += MR) {
                const int rows = m_end - m0 < MR ? m_end - m0 : MR;
                if (widen)
                    run_tile<MR>(rows, a + (long)m0 * ldf, ldf, (const float*)wide, K, 0, acc);
                else
                    run_tile<MR>(rows, a + (long)m0 * ldf, ldf, W, K, n0, acc);
                store_out(out + (long)m0 * N, N, acc, rows, n0, cols);
            }
        });
        std::free(wide);
    }
    std::free(af);
}

}  // namespace

extern "C" {
// the bf16 path: "amx" where the tile unit runs (K % 32 == 0; other K take the next path),
// "avx512bf16" (dot-product chain, CPUs without AMX), else the ISA's fma chain; fp32 always takes the fma chain
const char* isolab_gemm_isa() { return amx_ready() ? "amx" : ISOLAB_GEMM_DP ? "avx512bf16" : ISA; }
// (an AMX CPU runs "amx" for K % 32 == 0 and the fma chain for other K; the dot-product chain only
// where there is no AMX, so no build on an AMX CPU mixes three chains)
int isolab_gemm_panel() { return PANEL; }
int isolab_gemm_tile_n() { return TILE_N; }
// A: (M, K) rows with stride lda (elements); W: packed (see above), its N padded to a multiple of
// isolab_gemm_tile_n(); out: (M, N) contiguous.
void isolab_gemm_bf16(const uint16_t* A, long lda, const uint16_t* W, uint16_t* out, int M, int N, int K) {
    if (use_amx(K))
        gemm_amx(A, lda, W, out, M, N, K);
    else if (ISOLAB_GEMM_DP && !amx_ready())  // on AMX CPUs other K keep the fma chain, as before
        gemm_dp(A, lda, W, out, M, N, K);
    else
        gemm<uint16_t>(A, lda, W, out, M, N, K);
}
void isolab_gemm_fp32(const float* A, long lda, const float* W, float* out, int M, int N, int K) {
    gemm<float>(A, lda, W, out, M, N, K);
}
}
