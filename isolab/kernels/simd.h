// Shared by isolab's kernels: 16-lane float vectors (GCC vector extensions, AVX-512 where the CPU
// has it), bf16 <-> fp32 conversion with torch's rounding, and a 16-lane exp. Every helper is a
// pure function of each lane: no result depends on which lane or which call computed it.
#pragma once

#include <cstdint>
#include <cstring>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));  // 8 lanes: one AVX2 register
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

// bf16 bits of f, rounded to nearest even; NaN stays a (quiet) NaN. The rounding torch uses.
static inline uint32_t bf16_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
static inline float load(const float* p, long i) { return p[i]; }
static inline float load(const uint16_t* p, long i) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static inline void store(float* p, long i, float f) { p[i] = f; }
static inline void store(uint16_t* p, long i, float f) { p[i] = (uint16_t)bf16_bits(f); }
// f rounded to what storing it as T keeps
static inline float round_to(float, float f) { return f; }
static inline float round_to(uint16_t, float f) {
    uint32_t u = bf16_bits(f) << 16;
    std::memcpy(&f, &u, 4);
    return f;
}

static inline v16f load16(const float* p) {
    v16f x;
    std::memcpy(&x, p, 64);
    return x;
}
static inline v16f load16(const uint16_t* p) {
    v16h h;
    std::memcpy(&h, p, 32);
    v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f x;
    std::memcpy(&x, &u, 64);
    return x;
}
// Where AVX2 is the widest ISA, GCC turns a 16-lane select (`a < b ? c : d`) into 16 scalar compares
// and stores, which made the softmax, SiLU and bf16 stores cost several times their arithmetic. There
// the helpers below run a 16-lane vector as two halves of 8 lanes: the same operations lane by lane,
// so the same bits (tests/models/test_batch_invariance.py compares the builds of every level).
#if defined(__AVX2__) && !defined(__AVX512F__)
#define ISOLAB_SPLIT_SELECTS 1
#else
#define ISOLAB_SPLIT_SELECTS 0
#endif
// f(x half, y half) for each 8-lane half of two 16-lane vectors (H: the half's type), joined
// (shuffles, not memcpy: GCC moved memcpy'd halves through the stack and general registers)
template <typename H, typename V, typename F>
static inline V by_halves(V x, V y, F f) {
    const H x0 = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
    const H x1 = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    const H y0 = __builtin_shufflevector(y, y, 0, 1, 2, 3, 4, 5, 6, 7);
    const H y1 = __builtin_shufflevector(y, y, 8, 9, 10, 11, 12, 13, 14, 15);
    const H r0 = f(x0, y0), r1 = f(x1, y1);
    return __builtin_shufflevector(r0, r1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
template <typename H, typename V, typename F>
static inline V by_halves(V x, F f) {
    return by_halves<H>(x, x, [&](H a, H) { return f(a); });
}
template <typename U>
static inline U bf16_bits_lanes(U u) {  // bf16_bits of each lane's fp32 bits
    const U nan = (u & 0x7fffffffu) > 0x7f800000u;
    const U r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return nan ? ((u >> 16) | 0x40u) : r;
}
static inline v16u bf16_bits16(v16f x) {  // bf16_bits, lane by lane
    v16u u;
    std::memcpy(&u, &x, 64);
    if constexpr (ISOLAB_SPLIT_SELECTS) return by_halves<v8u>(u, bf16_bits_lanes<v8u>);
    return bf16_bits_lanes(u);
}
static inline v16f round16(float, v16f x) { return x; }
static inline v16f round16(uint16_t, v16f x) {
    v16u u = bf16_bits16(x) << 16;
    std::memcpy(&x, &u, 64);
    return x;
}
static inline void store16(float* p, v16f x) { std::memcpy(p, &x, 64); }
static inline void store16(uint16_t* p, v16f x) {
    v16h h = __builtin_convertvector(bf16_bits16(x), v16h);
    std::memcpy(p, &h, 32);
}
// 8 lanes (one AVX2 register), as store16 stores 16
static inline void store8(float* p, v8f x) { std::memcpy(p, &x, 32); }
static inline void store8(uint16_t* p, v8f x) {
    typedef uint16_t v8h __attribute__((vector_size(16)));
    v8u u;
    std::memcpy(&u, &x, 32);
    const v8h h = __builtin_convertvector(bf16_bits_lanes(u), v8h);
    std::memcpy(p, &h, 16);
}

// exp(x), 16 lanes, x clamped to [-87, 88]: 2^(x log2 e), split into an integer power and a
// degree-6 minimax polynomial on [-0.5, 0.5] (relative error about 1e-7).
template <typename V, typename I>  // V: a float vector, I: its int32 twin
static inline V vexp_lanes(V x) {
    x = x < -87.0f ? V{} - 87.0f : x;
    x = x > 88.0f ? V{} + 88.0f : x;
    V t = x * 1.44269504088896341f;
    V n = (t + 12582912.0f) - 12582912.0f;  // round to nearest integer
    V f = t - n;
    V p = f * 1.535336188319500e-4f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    I e = (__builtin_convertvector(n, I) + 127) << 23;
    V s;
    std::memcpy(&s, &e, sizeof s);
    return p * s;
}
static inline v16f vexp(v16f x) {
    if constexpr (ISOLAB_SPLIT_SELECTS) return by_halves<v8f>(x, vexp_lanes<v8f, v8i>);
    return vexp_lanes<v16f, v16i>(x);
}
static inline v8f vexp(v8f x) { return vexp_lanes<v8f, v8i>(x); }
// lane by lane: x where x > m or x is NaN, else m (a maximum in which NaN wins)
template <typename V>
static inline V max_nan_lanes(V x, V m) { return (x > m || x != x) ? x : m; }

// Whether this process may use AMX tiles: Linux hands the tile state to a process only on request
// (arch_prctl, Linux 5.16+). False in a build without AMX. One answer per kernel file, cached.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
// The tile configuration LDTILECFG reads (palette 1): per tile, its rows and bytes a row.
struct alignas(64) TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
static inline bool amx_ready() {
    static const bool ok = [] {
        constexpr long ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return false;
        unsigned long mask = 0;
        if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &mask) != 0) return false;
        return (mask & (1ul << XFEATURE_XTILEDATA)) != 0;
    }();
    return ok;
}
// The GEMMs' configuration (gemm.cpp, qdense.cpp): all 8 tiles 16 rows of 64 bytes. Per thread.
static inline void amx_configure_gemm() {
    TileConfig c{};
    c.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}
#else
static inline bool amx_ready() { return false; }
#endif
