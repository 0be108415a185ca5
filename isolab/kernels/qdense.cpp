// isolab's GEMM on quantized records with the dense bf16 GEMM's numerics (--weights dense on AMX):
// out (M, N) = A (M, K) @ W^T in bf16, W kept in GGUF-style blocks (0.6 byte a weight for Q4_1),
// each block turned into bf16 weights on the fly, right before the tile unit multiplies it.
//
// What it computes (the definition): exactly what gemm.cpp computes on the weights that
// `--weights dense` packs, so the same bits as `--weights dense` on every CPU:
//   1. w[n][k] = bf16(fp32 value): u4 fl(fl(d q) + mn), s8 fl(d q), one rounding an operation (d q is
//      exact for fp16 scales and the K-quants' fp32 products of fp16 numbers), then rounded to nearest
//      even, NaN kept NaN (torch's rule); that is the GGUF's own dequantization (gguf.quants: d * q + m)
//      cast to bf16, which is what the dense path packs;
//   2. out[m][n] = gemm.cpp's chain over those weights. On a CPU with AMX (K % 32 == 0 always holds
//      for records): C = 0, then one TDPBF16PS per 32-wide chunk of k, in order. Here the tile unit
//      gets the weights as its A operand (16 columns x 32 k's, a record's block as it is laid out)
//      and the activations as its B operand, so it computes C^T: each output element is the same
//      sum of the same products in the same chunk order (tested bit for bit against gemm.cpp's
//      amx_block, which takes the operands the other way round). Elsewhere a chunk of columns is
//      dequantized into gemm.cpp's bf16 panels and gemm.cpp runs on them (the same function, so
//      the same bits; slower than panels read from memory, so a dense model without AMX keeps its
//      panels: this path is for the tests, at every ISA level, and any other caller).
// A row's bits depend on that row and W alone: not on M, the neighbours or the thread count.
//
// Layout (isolab/kernels/quant.py: pack_rows): columns in panels of 16; per panel, per block of 32
// k's, one record of the same size as qgemm.cpp's:
//   u4: 16 columns x 16 bytes, byte i = q[i] | q[i + 16] << 4 (the GGUF's Q4 layout), then d[16], mn[16]
//   s8: 16 columns x 32 bytes, q as int8, then d[G == 16 ? 2 : 1][16]
//   scales fp16 or fp32 as in qgemm.cpp. N is padded to 16 with zero records.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "records.h"  // Fmt, record_bytes, half_to_float
#include "simd.h"  // amx_ready, TileConfig

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

extern "C" void isolab_gemm_bf16(const uint16_t* A, long lda, const uint16_t* W, uint16_t* out, int M, int N, int K);
extern "C" int isolab_gemm_tile_n();

namespace {

constexpr int QK = 32;  // k's per block
constexpr int QP = 16;  // columns per panel

static inline float scale_of(const uint8_t* p, int i, int fp16) {
    if (fp16) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        return half_to_float(h);
    }
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
}
static inline uint16_t f32_to_bf16(float f) { return (uint16_t)bf16_bits(f); }  // simd.h: torch's rounding

// Weight (column j, k = 32 b + i) of a record, as bf16: the definition, one value at a time.
static inline uint16_t weight(const uint8_t* rec, int fmt, int fp16, int j, int i) {
    if (fmt == U4) {
        const uint8_t byte = rec[16 * j + (i & 15)];
        const float q = (float)(i < 16 ? byte & 15 : byte >> 4);
        const float d = scale_of(rec + 256, j, fp16), mn = scale_of(rec + 256 + (fp16 ? 32 : 64), j, fp16);
        const float dq = d * q;
        return f32_to_bf16(dq + mn);
    }
    const float q = (float)(int8_t)rec[32 * j + i];
    const float d = scale_of(rec + 512, fmt == S8G16 ? (i / 16) * 16 + j : j, fp16);
    return f32_to_bf16(d * q);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 fp32 -> 16 bf16 in the low 256 bits: rounded to nearest even, NaN kept NaN (f32_to_bf16's rule)
static inline __m512i round_bf16(__m512 f) {
#if defined(__AVX512BF16__)
    // (it reads a subnormal as zero: record_rows sends a record that could make one to the scalar path)
    return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(f));
#else
    const __m512i u = _mm512_castps_si512(f);
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    const __m512i h = _mm512_mask_or_epi32(_mm512_srli_epi32(r, 16), nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_castsi256_si512(_mm512_cvtepi32_epi16(h));
#endif
}

// One record -> its A tile: 16 rows (columns j) x 32 bf16 (k in order), 64 bytes a row.
static inline void record_rows(const uint8_t* rec, int fmt, int fp16, uint16_t* dst) {
    alignas(64) float d[32], mn[16];
    const int sb = fp16 ? 32 : 64;
    const int nd = fmt == S8G16 ? 32 : 16;
    const uint8_t* ds = rec + (fmt == U4 ? 256 : 512);
    for (int g = 0; g < nd; g += 16)
        _mm512_store_ps(d + g, fp16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(ds + 2 * g)))
                                    : _mm512_loadu_ps((const float*)(ds + 4 * g)));
    if (fmt == U4) {
        const uint8_t* ms = rec + 256 + sb;
        _mm512_store_ps(mn, fp16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)ms)) : _mm512_loadu_ps((const float*)ms));
    }
#if defined(__AVX512BF16__)
    // A nonzero weight fl(d q + mn) is at least the smaller ulp of d q and mn (q an integer), so with
    // every nonzero scale at 2^-100 or more no weight is subnormal (fp16 scales, and the K-quants'
    // products of fp16 numbers, are never below 2^-24). A record with a smaller scale takes the
    // scalar definition, since the bf16 conversion above reads a subnormal as zero.
    if (!fp16) {
        const __m512 tiny = _mm512_set1_ps(0x1p-100f), zero = _mm512_setzero_ps();
        __mmask16 bad = 0;
        for (int g = 0; g < (fmt == U4 ? 32 : nd); g += 16) {
            const __m512 a = _mm512_abs_ps(_mm512_load_ps(g < 16 || fmt != U4 ? d + g : mn));
            bad |= _mm512_cmp_ps_mask(a, tiny, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a, zero, _CMP_NEQ_OQ);
        }
        if (bad) {
            for (int j = 0; j < QP; j++)
                for (int i = 0; i < QK; i++) dst[32 * j + i] = weight(rec, fmt, fp16, j, i);
            return;
        }
    }
#endif
    if (fmt == U4) {
        // per column: a table of its 16 values (lanes q = 0..15), twice over 32 words, picked by the
        // nibbles (vpermw reads an index's low 5 bits: a low nibble's byte indexes the first copy or
        // the second, both the same; a high nibble is the byte shifted right by 4)
        const __m512 qv = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i twice = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
        const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
#pragma GCC unroll 4
        for (int j = 0; j < QP; j++) {
            const __m512 f = _mm512_add_ps(_mm512_mul_ps(qv, _mm512_set1_ps(d[j])), _mm512_set1_ps(mn[j]));
            const __m512i tab = _mm512_permutexvar_epi32(twice, round_bf16(f));
            const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(rec + 16 * j)));
            const __m512i idx = _mm512_srlv_epi16(_mm512_cvtepu8_epi16(b), shift);
            _mm512_store_si512(dst + 32 * j, _mm512_permutexvar_epi16(idx, tab));
        }
        return;
    }
#pragma GCC unroll 4
    for (int j = 0; j < QP; j++) {
        const __m128i* q = (const __m128i*)(rec + 32 * j);
        const float d1 = fmt == S8G16 ? d[16 + j] : d[j];
        const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), _mm512_set1_ps(d[j]));
        const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), _mm512_set1_ps(d1));
        _mm512_store_si512(dst + 32 * j, _mm512_inserti64x4(round_bf16(lo), _mm512_castsi512_si256(round_bf16(hi)), 1));
    }
}
#else
static inline void record_rows(const uint8_t* rec, int fmt, int fp16, uint16_t* dst) {
    for (int j = 0; j < QP; j++)
        for (int i = 0; i < QK; i++) dst[32 * j + i] = weight(rec, fmt, fp16, j, i);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
// r[i] = row i of a 16 x 16 matrix of 32-bit elements -> r[i] = column i
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {  // t[i]: per 128-bit lane L, rows i, i+1 elements 4L, 4L+1 interleaved; t[i+1]: 4L+2, 4L+3
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // r[i + e], lane L: rows i..i+3, element 4L + e
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    __m512i out[16];
    for (int e = 0; e < 4; e++) {  // column 4L + e: lane L of r[e], r[4 + e], r[8 + e], r[12 + e]
        const __m512i x0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88), x1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xdd);
        const __m512i y0 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88), y1 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xdd);
        out[e] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        out[8 + e] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
        out[4 + e] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        out[12 + e] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = out[i];
}

// tmm0-3: C^T (16 columns x 16 rows fp32); tmm4-5: W (16 columns x 32 k's); tmm6-7: A (16 k pairs x 16 rows x 2)
static void gemm_amx(const uint16_t* A, long lda, const uint8_t* R, int fmt, int fp16, uint16_t* out, int M, int N,
                     int K) {
    constexpr int MB = 32, NB = 32;  // rows and columns per work item
    const int nb = K / QK, rb = record_bytes(fmt, fp16), panels = (N + QP - 1) / QP;
    const int items_n = (N + NB - 1) / NB, blocks_m = (M + MB - 1) / MB;
    const int blocks16 = (M + 15) / 16 + 1;  // + a block of zeros for a last item of 16 rows or fewer
    // A as B tiles: (blocks of 16 rows, K/32, 16 k pairs, 16 rows, 2), zero rows past M
    uint16_t* ap = (uint16_t*)std::aligned_alloc(64, sizeof(uint16_t) * 16 * (size_t)K * blocks16);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int mb = 0; mb < blocks16; mb++) {
            // 16 rows x 16 k pairs at a time: a 16 x 16 transpose of 32-bit pairs; rows past M are zeros
            const int have_rows = M - mb * 16 < 0 ? 0 : (M - mb * 16 < 16 ? M - mb * 16 : 16);
            for (int kb = 0; kb < K / QK; kb++) {
                __m512i r[16];
                for (int i = 0; i < 16; i++)
                    r[i] = i < have_rows ? _mm512_loadu_si512(A + (long)(mb * 16 + i) * lda + kb * QK) : _mm512_setzero_si512();
                transpose16(r);
                uint16_t* dst = ap + ((long)mb * (K / QK) + kb) * 512;
                for (int i = 0; i < 16; i++) _mm512_store_si512(dst + 32 * i, r[i]);
            }
        }
        amx_configure_gemm();  // tile configuration is per thread
        alignas(64) float c[4 * 256];
        // the weights of the item's 32 columns, as A tiles: (K/32, 2 panels, 16 columns, 32 k's)
        uint16_t* wt = (uint16_t*)std::aligned_alloc(64, sizeof(uint16_t) * 32 * (size_t)K);
        int have = -1;  // the column tile wt holds (a thread's items run columns outer)
        const __m512i rows16 = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                  _mm512_set1_epi32(16));
#pragma omp for schedule(static) collapse(2)
        for (int t = 0; t < items_n; t++)
            for (int b = 0; b < blocks_m; b++) {
                const int m0 = b * MB, rows = M - m0 < MB ? M - m0 : MB;
                const uint16_t* a0 = ap + (long)(m0 / 16) * 16 * K;
                const uint16_t* a1 = a0 + 16L * K;
                const bool two = rows > 16;
                _tile_zero(0);
                _tile_zero(1);
                if (two) {
                    _tile_zero(2);
                    _tile_zero(3);
                }
                const uint8_t* r0 = R + (long)(2 * t) * nb * rb;
                const uint8_t* r1 = r0 + (long)nb * rb;
                const bool second = 2 * t + 1 < panels;  // (the last item of an odd panel count has one)
                // The item's weights, block by block of k, dequantized right before their tile
                // instructions, so the vector units work on the next block while the tile unit
                // multiplies this one: into one of two small buffers when the item is the only row
                // block, else into wt whole (all of K), which the column tile's next row blocks read.
                const bool fresh = blocks_m == 1 || t != have;
                for (int kb = 0; kb < nb; kb++) {
                    uint16_t* buf = wt + (blocks_m == 1 ? (kb & 1) : kb) * 1024L;
                    if (fresh) {
                        record_rows(r0 + (long)kb * rb, fmt, fp16, buf);
                        if (second) record_rows(r1 + (long)kb * rb, fmt, fp16, buf + 512);
                    }
                    _tile_loadd(4, buf, 64);
                    _tile_loadd(6, a0 + (long)kb * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (second) {
                        _tile_loadd(5, buf + 512, 64);
                        _tile_dpbf16ps(1, 5, 6);
                    }
                    if (two) {
                        _tile_loadd(7, a1 + (long)kb * 512, 64);
                        _tile_dpbf16ps(2, 4, 7);
                        if (second) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                if (blocks_m > 1) have = t;
                // c: tile 0 = columns 0-15 x rows 0-15, 1 = columns 16-31 x rows 0-15, 2 and 3 rows 16-31
                _tile_stored(0, c, 64);
                _tile_stored(1, c + 256, 64);
                if (two) {
                    _tile_stored(2, c + 512, 64);
                    _tile_stored(3, c + 768, 64);
                }
                const int n0 = t * NB, cols = N - n0 < NB ? N - n0 : NB;
                for (int r = 0; r < rows; r++) {
                    const float* cr = c + (r >= 16 ? 512 : 0) + (r & 15);
                    for (int h = 0; h < 2 && 16 * h < cols; h++) {  // 16 columns: a gather down the tile
                        const __m512 v = _mm512_i32gather_ps(rows16, cr + 256 * h, 4);
                        const int nc = cols - 16 * h < 16 ? cols - 16 * h : 16;
                        _mm256_mask_storeu_epi16(out + (long)(m0 + r) * N + n0 + 16 * h, (__mmask16)((1u << nc) - 1),
                                                 _mm512_castsi512_si256(round_bf16(v)));
                    }
                }
            }
        std::free(wt);
        _tile_release();
    }
    std::free(ap);
}
static bool use_amx() { return amx_ready(); }
#else
static bool use_amx() { return false; }
static void gemm_amx(const uint16_t*, long, const uint8_t*, int, int, uint16_t*, int, int, int) {}
#endif

// Anywhere else: a chunk of columns dequantized into gemm.cpp's bf16 panels ((N/16, K/2, 16, 2)),
// gemm.cpp on them, the chunk's outputs copied into place.
static void gemm_panels(const uint16_t* A, long lda, const uint8_t* R, int fmt, int fp16, uint16_t* out, int M, int N,
                        int K) {
    const int nb = K / QK, rb = record_bytes(fmt, fp16);
    const int chunk = 256;  // columns a pass (a multiple of every tile width)
    uint16_t* w = (uint16_t*)std::aligned_alloc(64, sizeof(uint16_t) * (size_t)chunk * K);
    uint16_t* o = (uint16_t*)std::aligned_alloc(64, sizeof(uint16_t) * ((size_t)chunk * M + 32));
    for (int n0 = 0; n0 < N; n0 += chunk) {
        const int cols = N - n0 < chunk ? N - n0 : chunk;
        const int panels = (cols + QP - 1) / QP;
        const int padded = (cols + isolab_gemm_tile_n() - 1) / isolab_gemm_tile_n() * isolab_gemm_tile_n();
        std::memset(w, 0, sizeof(uint16_t) * (size_t)padded * K);
#pragma omp parallel for schedule(static)
        for (int p = 0; p < panels; p++) {
            const uint8_t* rp = R + (long)(n0 / QP + p) * nb * rb;
            uint16_t* wp = w + (long)p * K * QP;
            for (int kb = 0; kb < nb; kb++)
                for (int j = 0; j < QP; j++)
                    for (int i = 0; i < QK; i++) {
                        const int k = kb * QK + i;
                        wp[((long)(k / 2) * QP + j) * 2 + (k & 1)] = weight(rp + (long)kb * rb, fmt, fp16, j, i);
                    }
        }
        isolab_gemm_bf16(A, lda, w, o, M, cols, K);
        for (int m = 0; m < M; m++) std::memcpy(out + (long)m * N + n0, o + (long)m * cols, sizeof(uint16_t) * cols);
    }
    std::free(w);
    std::free(o);
}

}  // namespace

extern "C" {
// "amx" where the tile unit runs (the dequantized tiles go straight to it), else "panels" (gemm.cpp on
// dequantized panels)
const char* isolab_qdense_isa() { return use_amx() ? "amx" : "panels"; }
// A: (M, K) bf16 rows with stride lda (elements); W: records (see above) of N columns, K % 32 == 0 (a
// record's k's: kernels.qdense_bound passes K = 32 x the records a panel); out: (M, N) bf16
void isolab_qdense(const uint16_t* A, long lda, const uint8_t* W, int fmt, int fp16, uint16_t* out, int M, int N, int K) {
    if (M <= 0 || N <= 0) return;
    if (K % QK) std::abort();  // (no caller can: K comes from the records' count)
    if (use_amx())
        gemm_amx(A, lda, W, fmt, fp16, out, M, N, K);
    else
        gemm_panels(A, lda, W, fmt, fp16, out, M, N, K);
}
// one weight, for the tests: record -> (16 columns x 32 k's) bf16, the vector path where it builds
void isolab_qdense_record(const uint8_t* rec, int fmt, int fp16, uint16_t* dst, int scalar) {
    if (scalar) {
        for (int j = 0; j < QP; j++)
            for (int i = 0; i < QK; i++) dst[32 * j + i] = weight(rec, fmt, fp16, j, i);
    } else {
        record_rows(rec, fmt, fp16, dst);
    }
}
}
