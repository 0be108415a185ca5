// isolab's GEMM on quantized weights: out (M, N) = A (M, K) @ W^T, W kept in GGUF-style blocks of
// 32 k's (4 or 8 bits a weight), never dequantized as a whole (issue 13).
//
// What it computes (the definition; isolab/kernels/qref.py computes the same bits with torch):
//   1. Each row of A is quantized per block of 32 k's, as llama.cpp's Q8 activations are:
//        amax = max |a_k|;  id = amax ? 127 / amax : 0;  q_k = rint(a_k * id) (nearest even);
//        da = amax / 127;  sa_g = sum of q_k over each group g of G k's;  xs = da * float(sa_32)
//      A row's blocks depend on that row alone.
//   2. Per output (m, n) and block b, an integer dot product isum_g = sum_k wq[n][k] * q[m][k] over
//      each group (exact in int32: |isum| < 2^20, so exact in fp32 too).
//   3. The blocks are folded in order b = 0, 1, ..., nb-1, from acc = +0.0, with one rounding per
//      operation and no fma (built with -ffp-contract=off):
//        u4 (4-bit q in 0..15, w = d q + mn):  acc = acc + (d[n][b] * da) * isum;  acc = acc + mn[n][b] * xs
//        s8 (signed q, w = d q):               for each group g: acc = acc + (d[n][b][g] * da) * isum_g
//      then out = round(acc) to the output type.
// The integer part is exact on every ISA and the float part is the same sequence of IEEE
// operations, so the bits depend on nothing but the row and W: not on M, the neighbours, the
// thread count, or whether AVX-512 VNNI, AVX2 or plain C (or torch) ran it. That is batch
// invariance by construction, and the same bits on every x86 CPU.
//
// Formats (isolab/kernels/quant.py packs them from GGUF blocks):
//   u4: Q4_0 (mn = -8 d), Q4_1 (d, m), Q4_K (d = d_super * sc_j, mn = -dmin * m_j; fp32 scales)
//   s8: Q8_0 (G = 32), Q5_0 (q - 16, G = 32), Q6_K (q - 32, G = 16, d = d_super * sc_j; fp32 scales)
// Layout: columns in panels of 16; per panel, per block b, one record:
//   u4: 4 chunks of 64 bytes; chunk c, lane j (4 bytes): byte i = q[j][8c+i] | q[j][8c+4+i] << 4
//       then d[16], mn[16] as fp16 or fp32
//   s8: 8 chunks of 64 bytes; chunk c, lane j: byte i = q[j][4c+i] + 128 (unsigned)
//       then d[G == 16 ? 2 : 1][16] as fp16 or fp32
// so a panel's weights stream from memory in order. N is padded to 16 with zero records.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <atomic>

#include "balance.h"
#include "records.h"  // Fmt, record_bytes, half_to_float
#include "simd.h"

#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 32;     // k's per block
constexpr int QP = 16;     // columns per panel
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QMR_MAX 8  // (for the preprocessor: tile's switch)
// rows per tile: a weight vector unpacked once serves 8 rows. The kernel is bound by the vector ports
// (dot products, unpacking, the fold; loads are free), and 8 rows spend 15% fewer of them a product
// than 4 do, though the float sums of 8 rows x 2 panels spill to L1 (bench/qgemm.py)
constexpr int QMR = QMR_MAX;
#else
#define QMR_MAX 4
constexpr int QMR = QMR_MAX;  // rows per tile at most (AVX2's 16 ymm registers)
#endif
// Rows per tile unless set: QMR, but 3 where AVX2 is the widest ISA: 4 rows' sums (8 integer and 8
// float vectors) spill, and 4-row tiles ran no faster than 1-row ones on a Zen 3; 3-row tiles ran
// 1.13-1.30x faster than 4 at 8 to 128 rows, Q4_1 and Q8_0 alike (bench/qgemm.py --tiles-ab)
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int QMR_DEFAULT = 3;
#else
constexpr int QMR_DEFAULT = QMR;
#endif
constexpr int QMC = 96;    // rows per cache block of the quantized A

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
const char* QISA = "avx512vnni";
#elif defined(__AVX2__)
const char* QISA = "avx2";
#else
const char* QISA = "generic";
#endif

// The vectors of a panel's 16 columns in the kernel's sums. Where AVX2 is the widest ISA, GCC kept a
// 16-lane accumulator in memory between operations (two 16-byte stores read back by one 32-byte load,
// which the core cannot forward: run_panel_tile<U4, 1, 1>'s assembly), so a block of one row took ~36
// ns on a Zen 3; there the sums run as QL = 2 slices of 8 lanes, the same operations lane by lane (the
// same bits; half the time). s[(r * NP + p) * QL + h]: row r, panel p, columns 8h..8h+7 (QL == 2) or all 16.
#if defined(__AVX2__) && !defined(__AVX512F__)
typedef v8f qf;
typedef v8i qi;
#define ISOLAB_QL 2
#else
typedef v16f qf;
typedef v16i qi;
#define ISOLAB_QL 1
#endif
constexpr int QL = ISOLAB_QL;

// One quantized block of one row of A.
struct QA {
    int8_t q[QK];
    float d;    // da
    float xs;   // da * float(sum of q)
    int32_t s16[2];  // sums of q over k 0..15 and 16..31
};

static inline v16f load_scales(const uint8_t* p, bool fp16) {
    v16f r;
    if (fp16) {
#if defined(__AVX512F__)
        const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
        std::memcpy(&r, &v, 64);
        return r;
#elif defined(__F16C__)
        const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
        const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)));
        std::memcpy(&r, &lo, 32);
        std::memcpy((char*)&r + 32, &hi, 32);
        return r;
#endif
        uint16_t h[16];
        std::memcpy(h, p, 32);
        for (int j = 0; j < 16; j++) r[j] = half_to_float(h[j]);
    } else {
        std::memcpy(&r, p, 64);
    }
    return r;
}

// Lanes 16h/QL.. of a record's 16 scales (fp16 or fp32), as load_scales gives them.
static inline qf load_scales_part(const uint8_t* p, bool fp16, int h) {
#if ISOLAB_QL == 1
    (void)h;
    return load_scales(p, fp16);
#else
    qf r;
#if defined(__F16C__)
    if (fp16) {
        const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * h)));
        std::memcpy(&r, &v, 32);
        return r;
    }
#endif
    if (fp16) {
        uint16_t x[8];
        std::memcpy(x, p + 16 * h, 16);
        for (int j = 0; j < 8; j++) r[j] = half_to_float(x[j]);
    } else {
        std::memcpy(&r, p + 32 * h, 32);
    }
    return r;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline __m512 load_ps(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load_ps(const uint16_t* p) {  // bf16 -> fp32, exact
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// The scalar loop below, 16 lanes at a time, the same bits: max_ps(|x|, m) keeps m where |x| is NaN
// (as `ax > amax` does) and a maximum is exact in any order; x * id is the same IEEE multiply;
// cvtps_epi32 rounds to nearest even (the default MXCSR mode, as nearbyint) and gives INT_MIN where
// (int) of NaN or an overflow does; cvtepi32_epi8 truncates as the int8_t cast does; integer sums
// are exact in any order. bench: a step quantizes 98k values a row (30 layers), ~0.9 ns each scalar.
template <typename T>
static void quantize_row(const T* a, int K, QA* out) {
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int b = 0; b < K / QK; b++) {
        const __m512 x0 = load_ps(a + (long)b * QK), x1 = load_ps(a + (long)b * QK + 16);
        __m512 m = _mm512_max_ps(_mm512_and_ps(x0, absmask), _mm512_setzero_ps());
        m = _mm512_max_ps(_mm512_and_ps(x1, absmask), m);
        const float amax = _mm512_reduce_max_ps(m);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512 vid = _mm512_set1_ps(id);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vid)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vid));
        QA& o = out[b];
        _mm_storeu_si128((__m128i*)o.q, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(o.q + 16), _mm512_cvtepi32_epi8(q1));
        const int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
        o.d = amax / 127.0f;
        o.xs = o.d * (float)(s0 + s1);
        o.s16[0] = s0;
        o.s16[1] = s1;
    }
}
#elif defined(__AVX2__)
static inline __m256 load8_ps(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_ps(const uint16_t* p) {  // bf16 -> fp32, exact
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
// The scalar loop below, 8 lanes at a time, the same bits, as the AVX-512 one is: max_ps(|x|, m) keeps
// m where |x| is NaN; cvtps_epi32 rounds to nearest even and gives INT_MIN where (int) does; the sums
// are of those int32s (wrapping adds, any order); each q byte is its int32's low byte (the int8_t
// cast), taken by masking and two packs that cannot saturate (0..255), then put back in order.
template <typename T>
static void quantize_row(const T* a, int K, QA* out) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i low = _mm256_set1_epi32(0xff), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < K / QK; b++) {
        __m256 x[4];
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            x[i] = load8_ps(a + (long)b * QK + 8 * i);
            m = _mm256_max_ps(_mm256_and_ps(x[i], absmask), m);
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float amax = _mm_cvtss_f32(h);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], vid));
        const __m256i s0v = _mm256_add_epi32(q[0], q[1]), s1v = _mm256_add_epi32(q[2], q[3]);
        auto hsum = [](__m256i v) {
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
            return _mm_cvtsi128_si32(t);
        };
        const __m256i p01 = _mm256_packus_epi32(_mm256_and_si256(q[0], low), _mm256_and_si256(q[1], low));
        const __m256i p23 = _mm256_packus_epi32(_mm256_and_si256(q[2], low), _mm256_and_si256(q[3], low));
        // dwords: q0[0..3] q1[0..3] q2[0..3] q3[0..3] q0[4..7] q1[4..7] q2[4..7] q3[4..7]
        const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(p01, p23), order);
        QA& o = out[b];
        _mm256_storeu_si256((__m256i*)o.q, bytes);
        const int32_t s0 = hsum(s0v), s1 = hsum(s1v);
        o.d = amax / 127.0f;
        o.xs = o.d * (float)(s0 + s1);
        o.s16[0] = s0;
        o.s16[1] = s1;
    }
}
#else
template <typename T>
static void quantize_row(const T* a, int K, QA* out) {
    for (int b = 0; b < K / QK; b++) {
        float x[QK], amax = 0.0f;
        for (int i = 0; i < QK; i++) {
            x[i] = load(a, (long)b * QK + i);
            const float ax = std::fabs(x[i]);
            amax = ax > amax ? ax : amax;
        }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        QA& o = out[b];
        int32_t s0 = 0, s1 = 0;
        for (int i = 0; i < QK; i++) {
            const int q = (int)std::nearbyint(x[i] * id);
            o.q[i] = (int8_t)q;
            (i < 16 ? s0 : s1) += q;
        }
        o.d = amax / 127.0f;
        o.xs = o.d * (float)(s0 + s1);
        o.s16[0] = s0;
        o.s16[1] = s1;
    }
}
#endif

static inline int32_t load4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// ---- the integer part: one block of one panel for R rows -> isum (16 lanes) per row and group ----

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int R>
static inline void dot_u4_1(const uint8_t* w, const QA* const* a, qi* s) {
    __m512i acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();
    const __m512i mask = _mm512_set1_epi8(0x0f);
    for (int c = 0; c < 4; c++) {
        const __m512i x = _mm512_loadu_si512(w + 64 * c);
        const __m512i lo = _mm512_and_si512(x, mask);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), mask);
        for (int r = 0; r < R; r++) {
            acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(load4(a[r]->q + 8 * c)));
            acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi32(load4(a[r]->q + 8 * c + 4)));
        }
    }
    for (int r = 0; r < R; r++) std::memcpy(&s[r], &acc[r], 64);
}
// s8 weights are stored + 128: dpbusd gives sum (q + 128) a = isum + 128 sa
template <int R, int G>
static inline void dot_s8_1(const uint8_t* w, const QA* const* a, qi* s0, qi* s1) {
    __m512i acc0[R], acc1[R];
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm512_setzero_si512();
    for (int c = 0; c < 8; c++) {
        const __m512i x = _mm512_loadu_si512(w + 64 * c);
        for (int r = 0; r < R; r++) {
            const __m512i av = _mm512_set1_epi32(load4(a[r]->q + 4 * c));
            if (G == 16 && c >= 4)
                acc1[r] = _mm512_dpbusd_epi32(acc1[r], x, av);
            else
                acc0[r] = _mm512_dpbusd_epi32(acc0[r], x, av);
        }
    }
    for (int r = 0; r < R; r++) {
        if (G == 16) {
            acc0[r] = _mm512_sub_epi32(acc0[r], _mm512_set1_epi32(128 * a[r]->s16[0]));
            acc1[r] = _mm512_sub_epi32(acc1[r], _mm512_set1_epi32(128 * a[r]->s16[1]));
            std::memcpy(&s1[r], &acc1[r], 64);
        } else {
            acc0[r] = _mm512_sub_epi32(acc0[r], _mm512_set1_epi32(128 * (a[r]->s16[0] + a[r]->s16[1])));
        }
        std::memcpy(&s0[r], &acc0[r], 64);
    }
}
#elif defined(__AVX2__)
template <int R>
static inline void dot_u4_1(const uint8_t* w, const QA* const* a, qi* s) {
    __m256i acc[R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const __m256i mask = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int c = 0; c < 4; c++)
        for (int h = 0; h < 2; h++) {
            const __m256i x = _mm256_loadu_si256((const __m256i*)(w + 64 * c + 32 * h));
            const __m256i lo = _mm256_and_si256(x, mask);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), mask);
            for (int r = 0; r < R; r++) {  // pairs: 2 * 15 * 128 < 2^15, no saturation
                const __m256i p = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load4(a[r]->q + 8 * c)));
                const __m256i q = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load4(a[r]->q + 8 * c + 4)));
                acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(_mm256_add_epi16(p, q), ones));
            }
        }
    for (int r = 0; r < R; r++) std::memcpy(&s[r * QL], acc[r], 64);
}
template <int R, int G>
static inline void dot_s8_1(const uint8_t* w, const QA* const* a, qi* s0, qi* s1) {
    __m256i acc0[R][2], acc1[R][2];
    for (int r = 0; r < R; r++) acc0[r][0] = acc0[r][1] = acc1[r][0] = acc1[r][1] = _mm256_setzero_si256();
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int c = 0; c < 8; c++)
        for (int h = 0; h < 2; h++) {
            const __m256i x = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + 64 * c + 32 * h)), flip);
            const __m256i ax = _mm256_sign_epi8(x, x);  // |q| as unsigned (128 stays 128)
            for (int r = 0; r < R; r++) {  // pairs: 2 * 128 * 127 < 2^15, no saturation
                const __m256i sa = _mm256_sign_epi8(_mm256_set1_epi32(load4(a[r]->q + 4 * c)), x);
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sa), ones);
                if (G == 16 && c >= 4)
                    acc1[r][h] = _mm256_add_epi32(acc1[r][h], p);
                else
                    acc0[r][h] = _mm256_add_epi32(acc0[r][h], p);
            }
        }
    for (int r = 0; r < R; r++) {
        std::memcpy(&s0[r * QL], acc0[r], 64);
        if (G == 16) std::memcpy(&s1[r * QL], acc1[r], 64);
    }
}
#else
template <int R>
static inline void dot_u4_1(const uint8_t* w, const QA* const* a, qi* s) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 16; j++) {
            int32_t acc = 0;
            for (int c = 0; c < 4; c++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t b = w[64 * c + 4 * j + i];
                    acc += (b & 15) * a[r]->q[8 * c + i] + (b >> 4) * a[r]->q[8 * c + 4 + i];
                }
            s[r][j] = acc;
        }
}
template <int R, int G>
static inline void dot_s8_1(const uint8_t* w, const QA* const* a, qi* s0, qi* s1) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 16; j++) {
            int32_t acc0 = 0, acc1 = 0;
            for (int c = 0; c < 8; c++)
                for (int i = 0; i < 4; i++) {
                    const int q = (int)w[64 * c + 4 * j + i] - 128;
                    (G == 16 && c >= 4 ? acc1 : acc0) += q * a[r]->q[4 * c + i];
                }
            s0[r][j] = acc0;
            if (G == 16) s1[r][j] = acc1;
        }
}
#endif

// ---- NP panels at once: each row's activation broadcast serves NP weight vectors ----
// s[r * NP + p]: row r, panel p (panel p's records start at w + p * ps).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int QNP = 2;
// A zeroed accumulator by the zero idiom, which the core resolves at rename with no execution port
// (the compiler would otherwise copy one zero register into each, a vector operation apiece).
static inline __m512i zero_idiom() {
    __m512i z;
    asm volatile("vpxord %0, %0, %0" : "=v"(z));
    return z;
}
template <int R, int NP>
static inline void dot_u4(const uint8_t* w, long ps, const QA* const* a, qi* s) {
    __m512i acc[R * NP];
    for (int i = 0; i < R * NP; i++) acc[i] = zero_idiom();
    const __m512i mask = _mm512_set1_epi8(0x0f);
    for (int c = 0; c < 4; c++) {
        __m512i lo[NP], hi[NP];
        for (int p = 0; p < NP; p++) {
            const __m512i x = _mm512_loadu_si512(w + p * ps + 64 * c);
            lo[p] = _mm512_and_si512(x, mask);
            hi[p] = _mm512_and_si512(_mm512_srli_epi16(x, 4), mask);
        }
        for (int r = 0; r < R; r++) {
            const __m512i b0 = _mm512_set1_epi32(load4(a[r]->q + 8 * c));
            const __m512i b1 = _mm512_set1_epi32(load4(a[r]->q + 8 * c + 4));
            for (int p = 0; p < NP; p++) {
                acc[r * NP + p] = _mm512_dpbusd_epi32(acc[r * NP + p], lo[p], b0);
                acc[r * NP + p] = _mm512_dpbusd_epi32(acc[r * NP + p], hi[p], b1);
            }
        }
    }
    for (int i = 0; i < R * NP; i++) std::memcpy(&s[i], &acc[i], 64);
}
template <int R, int G, int NP>
static inline void dot_s8(const uint8_t* w, long ps, const QA* const* a, qi* s0, qi* s1) {
    __m512i acc0[R * NP], acc1[R * NP];
    for (int i = 0; i < R * NP; i++) {
        acc0[i] = zero_idiom();
        acc1[i] = G == 16 ? zero_idiom() : _mm512_setzero_si512();  // (unused where G == 32)
    }
    for (int c = 0; c < 8; c++) {
        __m512i x[NP];
        for (int p = 0; p < NP; p++) x[p] = _mm512_loadu_si512(w + p * ps + 64 * c);
        for (int r = 0; r < R; r++) {
            const __m512i av = _mm512_set1_epi32(load4(a[r]->q + 4 * c));
            for (int p = 0; p < NP; p++) {
                if (G == 16 && c >= 4)
                    acc1[r * NP + p] = _mm512_dpbusd_epi32(acc1[r * NP + p], x[p], av);
                else
                    acc0[r * NP + p] = _mm512_dpbusd_epi32(acc0[r * NP + p], x[p], av);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int p = 0; p < NP; p++) {
            __m512i t0 = acc0[r * NP + p], t1 = acc1[r * NP + p];
            if (G == 16) {
                t0 = _mm512_sub_epi32(t0, _mm512_set1_epi32(128 * a[r]->s16[0]));
                t1 = _mm512_sub_epi32(t1, _mm512_set1_epi32(128 * a[r]->s16[1]));
                std::memcpy(&s1[r * NP + p], &t1, 64);
            } else {
                t0 = _mm512_sub_epi32(t0, _mm512_set1_epi32(128 * (a[r]->s16[0] + a[r]->s16[1])));
            }
            std::memcpy(&s0[r * NP + p], &t0, 64);
        }
}
#else
constexpr int QNP = 1;
template <int R, int NP>
static inline void dot_u4(const uint8_t* w, long ps, const QA* const* a, qi* s) {
    for (int p = 0; p < NP; p++) {
        qi t[R * QL];
        dot_u4_1<R>(w + p * ps, a, t);
        for (int r = 0; r < R; r++)
            for (int h = 0; h < QL; h++) s[(r * NP + p) * QL + h] = t[r * QL + h];
    }
}
template <int R, int G, int NP>
static inline void dot_s8(const uint8_t* w, long ps, const QA* const* a, qi* s0, qi* s1) {
    for (int p = 0; p < NP; p++) {
        qi t0[R * QL], t1[R * QL];
        dot_s8_1<R, G>(w + p * ps, a, t0, t1);
        for (int r = 0; r < R; r++)
            for (int h = 0; h < QL; h++) {
                s0[(r * NP + p) * QL + h] = t0[r * QL + h];
                if (G == 16) s1[(r * NP + p) * QL + h] = t1[r * QL + h];
            }
    }
}
#endif

// ---- the float part: the same IEEE operations on every build ----

template <int FMT, int R, int NP>
static void run_panel_tile(const uint8_t* W, long ps, int nb, bool fp16, const QA* const* rows, v16f* out) {
    const long rb = record_bytes(FMT, fp16), sb = fp16 ? 32 : 64;
    qf acc[R * NP * QL];  // local, so the accumulators stay in registers across the blocks
    for (int i = 0; i < R * NP * QL; i++) acc[i] = qf{};
    for (int b = 0; b < nb; b++) {
        const uint8_t* rec = W + (long)b * rb;
        const QA* a[R];
        for (int r = 0; r < R; r++) a[r] = rows[r] + b;
        qi s0[R * NP * QL], s1[R * NP * QL];
        if (FMT == U4)
            dot_u4<R, NP>(rec, ps, a, s0);
        else
            dot_s8<R, FMT == S8 ? 32 : 16, NP>(rec, ps, a, s0, s1);
        // the float part of panel p's columns 16h/QL.. (a loop over h where QL == 1, even of one
        // pass, changed how GCC allots the AVX-512 kernel's registers: 23 more stack operations in
        // run_panel_tile<U4, 8, 2>, read in its assembly)
        auto fold = [&](int p, int h) {
            const uint8_t* sc = rec + p * ps + (FMT == U4 ? 256 : 512);
            if (FMT == U4) {
                const qf d = load_scales_part(sc, fp16, h), mn = load_scales_part(sc + sb, fp16, h);
                for (int r = 0; r < R; r++) {
                    const int i = (r * NP + p) * QL + h;
                    qf& x = acc[i];
                    x = x + (d * a[r]->d) * __builtin_convertvector(s0[i], qf);
                    x = x + mn * a[r]->xs;
                }
            } else if (FMT == S8) {
                const qf d = load_scales_part(sc, fp16, h);
                for (int r = 0; r < R; r++) {
                    const int i = (r * NP + p) * QL + h;
                    acc[i] = acc[i] + (d * a[r]->d) * __builtin_convertvector(s0[i], qf);
                }
            } else {
                const qf d0 = load_scales_part(sc, fp16, h), d1 = load_scales_part(sc + sb, fp16, h);
                for (int r = 0; r < R; r++) {
                    const int i = (r * NP + p) * QL + h;
                    qf& x = acc[i];
                    x = x + (d0 * a[r]->d) * __builtin_convertvector(s0[i], qf);
                    x = x + (d1 * a[r]->d) * __builtin_convertvector(s1[i], qf);
                }
            }
        };
        for (int p = 0; p < NP; p++) {
            if constexpr (QL == 1) {
                fold(p, 0);
            } else {
                for (int h = 0; h < QL; h++) fold(p, h);
            }
        }
    }
    if constexpr (QL == 1) {
        for (int i = 0; i < R * NP; i++) out[i] = acc[i];
    } else {
        for (int i = 0; i < R * NP; i++) std::memcpy(&out[i], &acc[i * QL], 64);
    }
}

// rows x (NP panels) of output; cols: the columns of the last panel that exist (1..16)
template <int FMT, int NP, typename TO>
static void tile(int rows, const uint8_t* W, long ps, int nb, bool fp16, const QA* const* a, TO* out, long ldo, int cols) {
    v16f acc[QMR * NP];
    switch (rows < QMR ? rows : QMR) {
        case 1: run_panel_tile<FMT, 1, NP>(W, ps, nb, fp16, a, acc); break;
        case 2: run_panel_tile<FMT, 2, NP>(W, ps, nb, fp16, a, acc); break;
        case 3: run_panel_tile<FMT, 3, NP>(W, ps, nb, fp16, a, acc); break;
        case 4: run_panel_tile<FMT, 4, NP>(W, ps, nb, fp16, a, acc); break;
#if QMR_MAX > 4
        case 5: run_panel_tile<FMT, 5, NP>(W, ps, nb, fp16, a, acc); break;
        case 6: run_panel_tile<FMT, 6, NP>(W, ps, nb, fp16, a, acc); break;
        case 7: run_panel_tile<FMT, 7, NP>(W, ps, nb, fp16, a, acc); break;
        case 8: run_panel_tile<FMT, 8, NP>(W, ps, nb, fp16, a, acc); break;
#endif
    }
    const int R = rows < QMR ? rows : QMR;
    for (int r = 0; r < R; r++)
        for (int p = 0; p < NP; p++) {
            TO* o = out + r * ldo + p * QP;
            const v16f& x = acc[r * NP + p];
            if (p < NP - 1 || cols == 16) {
                store16(o, x);
            } else {
                for (int j = 0; j < cols; j++) store(o, j, x[j]);
            }
        }
}
static_assert(QMR == 4 || QMR == 8, "tile's switch covers 1..QMR rows");

template <int FMT, typename TO>
static void tiles(int np, int rows, const uint8_t* W, long ps, int nb, bool fp16, const QA* const* a, TO* out, long ldo,
                  int cols) {
    if (np == 2)
        tile<FMT, 2>(rows, W, ps, nb, fp16, a, out, ldo, cols);
    else
        tile<FMT, 1>(rows, W, ps, nb, fp16, a, out, ldo, cols);
}

// 1 (default): the task order and prefetch above; 0: chunk by chunk, no prefetch (the bench's A/B).
// Read once a call (relaxed): a setting, not a synchronization.
inline std::atomic<int>& qgemm_order() {
    static std::atomic<int> order{1};
    return order;
}

// Rows per tile, at most QMR; 0 (or less): QMR_DEFAULT. For the bench's A/B (4 rows were the tiles
// before 8-row ones). No setting changes a bit. Read once a call (relaxed).
inline std::atomic<int>& qgemm_tile_rows() {
    static std::atomic<int> rows{0};
    return rows;
}

static inline void prefetch_l2(const char* p) { __builtin_prefetch(p, 0, 2); }  // prefetcht1 on x86

template <typename TA, typename TO>
static void qgemm(const TA* A, long lda, const uint8_t* W, int fmt, bool fp16, TO* out, int M, int N, int K) {
    const int nb = K / QK, panels = (N + QP - 1) / QP;
    const long rb = record_bytes(fmt, fp16), panel_bytes = rb * nb;
    QA* qa = (QA*)std::aligned_alloc(64, sizeof(QA) * ((size_t)M * nb + 1));
    const bool par = (long)M * N * K > 50000;
    // QNP panels share each activation broadcast where rows are many; one stream is faster for a few
    // rows (memory-bound). Either way an output's arithmetic is the same.
    const int qnp = M >= 4 ? QNP : 1, groups = (panels + qnp - 1) / qnp, chunks = (M + QMC - 1) / QMC;
    isolab::Run runs[isolab::kMaxRuns];
    // The order of a thread's tasks (no bit depends on it). Where its share of W outweighs the
    // quantized A (the vocabulary head: 15 MB a thread), group by group, every chunk of rows before
    // the next group, so W streams from memory once; else chunk by chunk, its panels staying in
    // cache while A moves on. And while a task of 4 row tiles or more runs, the next task's panels
    // are prefetched into L2: a step's weights (92 MB on the default model) come from memory, and
    // the hardware's prefetcher does not run far enough ahead of them (bench/qgemm.py --order-ab,
    // bench/step_profile.py --paired-order-ab).
    const int order = qgemm_order().load(std::memory_order_relaxed);
    const bool by_group = order != 0 && (long)panels * panel_bytes / 2 > (long)M * nb * (long)sizeof(QA);
    const bool prefetch_next = order != 0;
    const int set_rows = qgemm_tile_rows().load(std::memory_order_relaxed);
    int tr = set_rows <= 0 ? QMR_DEFAULT : set_rows < QMR ? set_rows : QMR;  // rows per tile
    // s8 records (Q8_0, Q6_K: the vocabulary head) at many rows: 8 rows x 2 panels of their int32
    // sums spill, and 4-row tiles ran 4% faster at 128 rows (bench/qgemm.py --tiles-ab)
    if (fmt != U4 && M >= 96 && tr > 4) tr = 4;
#pragma omp parallel if (par)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) quantize_row(A + (long)m * lda, K, qa + (long)m * nb);
        // a task: one chunk of QMC rows x one group of panels. Thread t owns its static share of the
        // groups in every chunk, in the order above; balance.h shares out what a thread the OS took
        // away has left.
        const int nt = omp_get_num_threads();
        isolab::balanced(
            runs, [&](int t) { return chunks * isolab::share_count(groups, nt, t); },
            [&](int t, long i) {
                const long per = isolab::share_count(groups, nt, t), first = isolab::share_first(groups, nt, t);
                auto group_of = [&](long j) { return (int)(first + (by_group ? j / chunks : j % per)); };
                const int m0 = (int)(by_group ? i % chunks : i / per) * QMC, g = group_of(i);
                const int m1 = m0 + QMC < M ? m0 + QMC : M;
                const int p = g * qnp, np = panels - p < qnp ? panels - p : qnp;
                const uint8_t* wp = W + (long)p * panel_bytes;
                const int last = p + np - 1, cols = N - last * QP < QP ? N - last * QP : QP;
                // the owner's next task's panels, if other than these: into L2, a slice a row tile
                const char* next_w = nullptr;
                long next_lines = 0, pf_done = 0;
                // (a task of 16 rows or more: 4 tiles of 4 rows when this was written, 2 of 8 now)
                if (prefetch_next && i + 1 < chunks * per && m1 - m0 >= 16 && group_of(i + 1) != g) {
                    const int p2 = group_of(i + 1) * qnp, np2 = panels - p2 < qnp ? panels - p2 : qnp;
                    next_w = (const char*)(W + (long)p2 * panel_bytes);
                    next_lines = np2 * panel_bytes / 64;
                }
                const long per_tile = (next_lines + (m1 - m0 + tr - 1) / tr - 1) / ((m1 - m0 + tr - 1) / tr);
                for (int m = m0; m < m1; m += tr) {
                    for (long e = 0; e < per_tile && pf_done < next_lines; e++, pf_done++)
                        prefetch_l2(next_w + pf_done * 64);
                    const int rows = m1 - m < tr ? m1 - m : tr;
                    const QA* a[QMR];
                    for (int r = 0; r < rows; r++) a[r] = qa + (long)(m + r) * nb;
                    TO* o = out + (long)m * N + (long)p * QP;
                    if (fmt == U4)
                        tiles<U4>(np, rows, wp, panel_bytes, nb, fp16, a, o, N, cols);
                    else if (fmt == S8)
                        tiles<S8>(np, rows, wp, panel_bytes, nb, fp16, a, o, N, cols);
                    else
                        tiles<S8G16>(np, rows, wp, panel_bytes, nb, fp16, a, o, N, cols);
                }
            });
    }
    std::free(qa);
}

}  // namespace

extern "C" {
const char* isolab_qgemm_isa() { return QISA; }
// 1: threads take each other's remaining tasks (default); 0: a static share each; 2: as 1, thread 0
// late (balance.h)
void isolab_balance(int mode) { isolab::balance_mode().store(mode, std::memory_order_relaxed); }
// 1: big weights' task order and the next task's prefetch (default); 0: chunk by chunk, no prefetch
void isolab_qgemm_order(int order) { qgemm_order().store(order, std::memory_order_relaxed); }
// rows per tile, at most 8 on AVX-512 VNNI and 4 elsewhere; 0: the build's default (8 on AVX-512 VNNI,
// 3 on AVX2, 4 in plain C); no bit changes
void isolab_qgemm_tile_rows(int rows) { qgemm_tile_rows().store(rows, std::memory_order_relaxed); }
int isolab_qgemm_default_tile_rows() { return QMR_DEFAULT; }
// A (M, K) bf16 or fp32 rows with stride lda; W packed (above); out (M, N) contiguous, bf16 or fp32.
// K % 32 == 0.
void isolab_qgemm(const void* A, int a_bf16, long lda, const uint8_t* W, int fmt, int fp16, void* out, int out_bf16,
                  int M, int N, int K) {
    if (a_bf16) {
        if (out_bf16) qgemm((const uint16_t*)A, lda, W, fmt, fp16 != 0, (uint16_t*)out, M, N, K);
        else qgemm((const uint16_t*)A, lda, W, fmt, fp16 != 0, (float*)out, M, N, K);
    } else {
        if (out_bf16) qgemm((const float*)A, lda, W, fmt, fp16 != 0, (uint16_t*)out, M, N, K);
        else qgemm((const float*)A, lda, W, fmt, fp16 != 0, (float*)out, M, N, K);
    }
}
// The quantized blocks of A's rows as qgemm computes them (for tests against the torch reference):
// qa: (M, K) int8; d, xs: (M, K/32) fp32.
void isolab_quantize_rows(const void* A, int a_bf16, long lda, int M, int K, int8_t* q, float* d, float* xs) {
    const int nb = K / QK;
    QA* tmp = (QA*)std::aligned_alloc(64, sizeof(QA) * (size_t)nb);
    for (int m = 0; m < M; m++) {
        if (a_bf16) quantize_row((const uint16_t*)A + (long)m * lda, K, tmp);
        else quantize_row((const float*)A + (long)m * lda, K, tmp);
        for (int b = 0; b < nb; b++) {
            std::memcpy(q + (long)m * K + b * QK, tmp[b].q, QK);
            d[(long)m * nb + b] = tmp[b].d;
            xs[(long)m * nb + b] = tmp[b].xs;
        }
    }
    std::free(tmp);
}
}
