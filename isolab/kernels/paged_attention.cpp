// Paged attention over isolab's KV pool, one query row at a time: the cache's read path.
//
// Layout of one layer's pool (isolab/engine/kv_storage.py, models/attention.py:write_kv): per (KV head,
// block) a K block and a V block of bs * Dh values each, laid out for the dot products that read them:
//   fp32: K (Dh, bs): 16 keys of one dimension are one vector; V (bs, Dh)
//   bf16: K (Dh/2, bs, 2) and V (bs/2, Dh, 2): the pairs that one AVX512-BF16 dot product takes
//         (two dimensions of one key, or one dimension of two keys) side by side
// A block of bs = 16 f keys (f > 1) is f runs of 16 keys, each laid out as a block of 16 (K: (f, Dh/2,
// 16, 2) in bf16), and attend_all hands the kernels a table of 16-key blocks: every multiple of 16
// takes the fast paths below, with the bits of bs = 16. Other block sizes keep the layout above and
// the generic loop.
// Each (query row, kv head) is computed in a fixed order that depends only on the row's own query,
// its keys 0..pos and its block table: never on the batch, the chunking or padding. That is what
// makes a row's bits independent of what else runs (issue 3, item 7). Keys after `pos` are never
// read (the AVX paths), or enter only as exact zeros that change no sum (AMX, below). Paths:
//   fp32 and generic bf16: fp32 arithmetic, one (row, kv head) per thread task;
//   bf16 with AVX512-BF16 (no AMX): dot products on the paired layouts, a row at a time, or a
//   prompt chunk's rows four at a time in one pass over their keys (the same operations a row);
//   bf16 with AMX tiles: a unit of consecutive rows of one table per task (a prompt chunk), its
//   (row, head) queries the rows of one tile; every bf16 row on that CPU takes it, decode rows too.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <atomic>
#include <vector>

#include <omp.h>

#include "simd.h"

// offset of K element (dimension d, key j) and V element (key j, dimension d) inside a block
static inline long kidx(const float*, int d, int j, int bs) { return (long)d * bs + j; }
static inline long kidx(const uint16_t*, int d, int j, int bs) { return ((long)(d >> 1) * bs + j) * 2 + (d & 1); }
static inline long vidx(const float*, int j, int d, int Dh) { return (long)j * Dh + d; }
static inline long vidx(const uint16_t*, int j, int d, int Dh) { return ((long)(j >> 1) * Dh + d) * 2 + (j & 1); }

// Softmax of one head's scores s[0..L) in place, unnormalized: s[k] = exp(s[k] - max); returns
// the sum. Lanes L..Lpad are filled with a visible score and never summed. The sum is 16 lane
// partials in index order, then the lanes in order: fixed by L alone.
// A sliding window (Gemma's local layers): keys before the row's window start get probability
// exactly 0 and add exact zeros, so a kernel may skip them (attend_row does) without changing a bit;
// set per task by attend_all, read by softmax_row and attend_row.
static thread_local int window_start = 0;

// The (row, KV head) task this thread takes next, when attend_all knows it: the bf16 kernel
// prefetches that task's K runs into L2 during its own P.V pass, which reads only what is already
// in cache, so the next task's keys arrive while this one computes. Set per task by attend_all;
// table == nullptr: no next task. Prefetches only: no effect on any result.
struct NextTask {
    const int32_t* table = nullptr;
    int first_block = 0, nblk = 0, h = 0;
};
static thread_local NextTask next_task;

// The kernels' vectors: 16 lanes where AVX-512 gives 32 registers, 8 lanes elsewhere (AVX2 has 16
// registers of 8: with 16-lane vectors the P.V pass's G x 4 accumulators and the V rows took 40 of
// them and spilled on every key, and a 32-row step's attention ran 5x its arithmetic; GCC also kept
// 16-lane vectors written lane by lane in memory). The lane count changes which lanes go together,
// never a lane's operations, so both give the same bits.
#if defined(__AVX512F__)
typedef v16f vlf;
typedef v16u vlu;
#else
typedef v8f vlf;
typedef v8u vlu;
#endif
constexpr int VW = sizeof(vlf) / 4;      // lanes
constexpr int VK = 16 / VW;              // vectors a 16-key block's scores take
constexpr int VD = VW == 16 ? 4 : 2;     // vectors of dimensions a P.V pass holds for each head
static inline vlf loadv(const float* p) {
    vlf x;
    std::memcpy(&x, p, sizeof x);
    return x;
}
template <typename T>
static inline void storev(T* p, vlf x) {  // bf16: rounded as store() rounds
#if defined(__AVX512F__)
    store16(p, x);
#else
    store8(p, x);
#endif
}

static inline float softmax_row(float* s, int L, int Lpad) {
    const int start = window_start < L ? window_start : 0;
    for (int k = 0; k < start; k++) s[k] = -INFINITY;
    for (int k = L; k < Lpad; k++) s[k] = s[start];
    // 16 lane partials (key k in lane k % 16: mv[l / VW][l % VW]), VK vectors of VW lanes
    vlf mv[VK];
    for (int j = 0; j < VK; j++) mv[j] = loadv(s + j * VW);
    for (int k = 16; k < Lpad; k += 16)
        for (int j = 0; j < VK; j++) mv[j] = max_nan_lanes(loadv(s + k + j * VW), mv[j]);  // NaN wins
    float m = mv[0][0];
    for (int l = 1; l < 16; l++) {
        const float x = mv[l / VW][l % VW];
        m = (x > m || x != x) ? x : m;
    }
    const int full = L / 16 * 16;
    vlf acc[VK] = {};
    for (int k = 0; k < Lpad; k += 16)
        for (int j = 0; j < VK; j++) {
            const int k0 = k + j * VW;
            vlf x = vexp(loadv(s + k0) - m);
            if (k0 < start) {  // exact zeros before the window (vexp bottoms out at e^-87)
                vlf lane;  // 0, 1, ..., VW - 1 (exact in fp32)
                for (int l = 0; l < VW; l++) lane[l] = (float)l;
                x = lane < (float)(start - k0) ? vlf{} : x;
            }
            storev(s + k0, x);
            if (k < full) acc[j] += x;
        }
    for (int k = full; k < L; k++) acc[(k % 16) / VW][k % VW] += s[k];
    float t = 0.0f;
    for (int l = 0; l < 16; l++) t += acc[l / VW][l % VW];
    return t;
}

template <typename T, int BS>
static void attend_row(const T* q, const T* kplane, const T* vplane, const int32_t* table, int L, long NB,
                       int bs_rt, int Dh, int G, int h, float scale, T* out, float* sc, int Lpad) {
    const int bs = BS ? BS : bs_rt;
    const int nblk = (L + bs - 1) / bs;
    const int start = window_start < L ? window_start : 0;  // keys before it weigh exactly 0: skipped
    float qf[8 * 256];
    for (int g = 0; g < G; g++)
        for (int d = 0; d < Dh; d++) qf[g * Dh + d] = load(q, (long)g * Dh + d);
    // scores: s = (q . k) * scale, 16 keys at a time from the transposed K block
    for (int i = start / bs; i < nblk; i++) {
        const long blk = table[i];
        const T* kb = kplane + ((long)h * NB + blk) * Dh * bs;
        for (int g = 0; g < G; g++) {
            float acc[BS ? BS : 256];
            for (int j = 0; j < bs; j++) acc[j] = 0.0f;
            const float* qg = qf + g * Dh;
            for (int d = 0; d < Dh; d++) {
                const float qd = qg[d];
                for (int j = 0; j < bs; j++) acc[j] += qd * load(kb, kidx(kb, d, j, bs));
            }
            float* s = sc + (long)g * Lpad + (long)i * bs;
            for (int j = 0; j < bs; j++) s[j] = acc[j] * scale;
        }
    }
    for (int g = 0; g < G; g++) {
        float* s = sc + (long)g * Lpad;
        const float sum = softmax_row(s, L, Lpad);
        float acc[256];
        for (int d = 0; d < Dh; d++) acc[d] = 0.0f;
        for (int k = start; k < L; k++) {
            const T* vb = vplane + ((long)h * NB + table[k / bs]) * bs * Dh;
            const float p = s[k];
            for (int d = 0; d < Dh; d++) acc[d] += p * load(vb, vidx(vb, k % bs, d, Dh));
        }
        const float inv = 1.0f / sum;
        for (int d = 0; d < Dh; d++) store(out, (long)g * Dh + d, acc[d] * inv);
    }
}

// The same arithmetic as attend_row for bs = 16 and Dh = 64, with the G query heads of one KV head
// sharing each K/V load and every accumulator in a register. Same order of operations per lane.
template <typename T, int G>
static void attend_row_fast(const T* q, const T* kplane, const T* vplane, const int32_t* table, int L, long NB,
                            int h, float scale, T* out, float* sc, int Lpad) {
    constexpr int BS = 16, DH = 64;
    const int nblk = (L + BS - 1) / BS;
    float qf[G][DH];
    for (int g = 0; g < G; g++)
        for (int d = 0; d < DH; d++) qf[g][d] = load(q, (long)g * DH + d);
    for (int i = 0; i < nblk; i++) {
        const T* kb = kplane + ((long)h * NB + table[i]) * DH * BS;
        vlf acc[G][VK];
        for (int g = 0; g < G; g++)
            for (int x = 0; x < VK; x++) acc[g][x] = vlf{};
        for (int d = 0; d < DH; d++) {
            vlf k[VK];
            for (int x = 0; x < VK; x++) k[x] = loadv(kb + d * BS + x * VW);
            for (int g = 0; g < G; g++)
                for (int x = 0; x < VK; x++) acc[g][x] += qf[g][d] * k[x];
        }
        for (int g = 0; g < G; g++)
            for (int x = 0; x < VK; x++) storev(sc + (long)g * Lpad + (long)i * BS + x * VW, acc[g][x] * scale);
    }
    float sum[G];  // the row's own keys padded to whole blocks, not the step's longest row (no bit changes)
    for (int g = 0; g < G; g++) sum[g] = softmax_row(sc + (long)g * Lpad, L, nblk * BS);
    for (int c = 0; c < DH; c += VD * VW) {  // P.V, VD x VW dimensions a pass over the keys
        vlf o[G][VD];
        for (int g = 0; g < G; g++)
            for (int x = 0; x < VD; x++) o[g][x] = vlf{};
        for (int k = 0; k < L; k++) {
            const T* vr = vplane + (((long)h * NB + table[k / BS]) * BS + (k % BS)) * DH + c;
            vlf v[VD];
            for (int x = 0; x < VD; x++) v[x] = loadv(vr + x * VW);
            for (int g = 0; g < G; g++) {
                const float p = sc[(long)g * Lpad + k];
                for (int x = 0; x < VD; x++) o[g][x] += p * v[x];
            }
        }
        for (int g = 0; g < G; g++) {
            const float inv = 1.0f / sum[g];
            for (int x = 0; x < VD; x++)
                for (int l = 0; l < VW; l++) store(out, (long)g * DH + c + x * VW + l, o[g][x][l] * inv);
        }
    }
}

// What attend_row_bf16 prefetches: 0 nothing; 1 within its own task (the K runs of scattered blocks
// a few blocks ahead, each block's V while its keys are scored); 2 (default) also the next task's K
// during its P.V pass. attend_unit_amx and attend_row_pairs (bf16 without bf16 dot products) prefetch
// within their task at 1 and 2. bench/attention_prefetch.py compares the levels; none changes a bit.
static std::atomic<int> prefetch_level{2};  // read once a task (relaxed): a setting, not a synchronization
extern "C" void isolab_attention_prefetch(int level) { prefetch_level.store(level, std::memory_order_relaxed); }

// The within-task prefetch of the bf16 kernels (attend_row_bf16, attend_unit_amx, attend_row_pairs), at
// level 1 or 2. A row's blocks lie anywhere in the pool. Where a block follows the one before it (a prompt's
// blocks, allocated together), the hardware's stream prefetcher runs ahead; where it does not
// (blocks taken one by one as decoding went on), each would start with a miss to DRAM. So the K
// runs of those blocks are prefetched into L1 AHEAD blocks before their scores (about 16 KB in
// flight), and every block's V run into L2 while its keys are scored (the P.V pass then finds it
// there). Blocks [first, nblk) of `table`, KV head h. Prefetches only: no effect on any result.
// (E, RUN: the pool's element type and the bytes of a run; the int8 pool's runs hold their scales)
template <int DH, int BS, typename E = uint16_t, int RUN = DH * BS * 2>
struct TaskPrefetch {
    static constexpr int AHEAD = 16384 / RUN > 1 ? 16384 / RUN : 1;  // RUN: bytes of a (head, block) run
    const E* kplane;
    const E* vplane;
    const int32_t* table;
    long NB;
    int h, first, nblk;
    bool on;

    // always_inline: GCC 12 finds a function whose only work is prefetches "const" and deletes the
    // call before it would inline it (a lambda too: the K prefetch of the kernels' first version
    // never reached the binary; no prefetcht0 in any build until this)
    template <int LOCALITY>  // 3: into L1 (prefetcht0), 2: into L2 (prefetcht1)
    __attribute__((always_inline)) void run(const E* plane, int i) const {
        const char* p = (const char*)(const void*)plane + ((long)h * NB + table[i]) * RUN;
        for (int l = 0; l < RUN; l += 64) __builtin_prefetch(p + l, 0, LOCALITY);
    }
    __attribute__((always_inline)) void k_if_scattered(int i) const {
        if (i == first || table[i] != table[i - 1] + 1) run<3>(kplane, i);
    }
    __attribute__((always_inline)) void begin() const {  // the first AHEAD blocks' K
        if (on)
            for (int i = first; i < nblk && i < first + AHEAD; i++) k_if_scattered(i);
    }
    __attribute__((always_inline)) void at(int i) const {  // block i is about to be scored
        if (!on) return;
        if (i + AHEAD < nblk) k_if_scattered(i + AHEAD);
        run<2>(vplane, i);
    }
};

// bf16, bs = 16, Dh = 64, on CPUs without AVX512-BF16: attend_row's arithmetic (fp32 products and
// sums, dimensions then keys in ascending order, so the same bits as attend_row) over the paired
// layouts, VW lanes at a time. A 32-bit lane of a K pair row holds dimensions 2p and 2p+1 of one
// key; of a V pair row, keys 2j and 2j+1 of one dimension: a shift and a mask give both in fp32.
static inline void bf16_pairs(const uint16_t* p, vlf& lo, vlf& hi) {  // VW pairs -> their low and high halves
    vlu u;
    std::memcpy(&u, p, sizeof u);
    const vlu u0 = u << 16, u1 = u & 0xffff0000u;
    std::memcpy(&lo, &u0, sizeof lo);
    std::memcpy(&hi, &u1, sizeof hi);
}

template <int G>
static void attend_row_pairs(const uint16_t* q, const uint16_t* kplane, const uint16_t* vplane, const int32_t* table,
                             int L, long NB, int h, float scale, uint16_t* out, float* sc, int Lpad) {
    constexpr int BS = 16, DH = 64;
    const int nblk = (L + BS - 1) / BS;
    float qf[G][DH];
    for (int g = 0; g < G; g++)
        for (int d = 0; d < DH; d++) qf[g][d] = load(q, (long)g * DH + d);
    // scattered blocks' K ahead and each block's V while its keys are scored (prefetches only)
    const TaskPrefetch<DH, BS> pre{kplane, vplane, table, NB, h, 0, nblk,
                                   prefetch_level.load(std::memory_order_relaxed) != 0};
    pre.begin();
    // scores, a block's 16 keys at a time: per key, dimensions in ascending order
    for (int i = 0; i < nblk; i++) {
        pre.at(i);
        const uint16_t* kb = kplane + ((long)h * NB + table[i]) * DH * BS;
        vlf acc[G][VK];
        for (int g = 0; g < G; g++)
            for (int x = 0; x < VK; x++) acc[g][x] = vlf{};
        for (int p = 0; p < DH / 2; p++) {
            vlf k0[VK], k1[VK];
            for (int x = 0; x < VK; x++) bf16_pairs(kb + p * BS * 2 + x * 2 * VW, k0[x], k1[x]);
            for (int g = 0; g < G; g++) {
                const float a = qf[g][2 * p], b = qf[g][2 * p + 1];
                for (int x = 0; x < VK; x++) {
                    acc[g][x] += a * k0[x];
                    acc[g][x] += b * k1[x];
                }
            }
        }
        for (int g = 0; g < G; g++)
            for (int x = 0; x < VK; x++) storev(sc + (long)g * Lpad + (long)i * BS + x * VW, acc[g][x] * scale);
    }
    float sum[G];  // the row's own keys padded to whole blocks, not the step's longest row (no bit changes)
    for (int g = 0; g < G; g++) sum[g] = softmax_row(sc + (long)g * Lpad, L, nblk * BS);
    // P.V, VD x VW dimensions a pass over the keys: per dimension, keys in ascending order
    const int even = L & ~1;
    for (int c = 0; c < DH; c += VD * VW) {
        vlf o[G][VD];
        for (int g = 0; g < G; g++)
            for (int x = 0; x < VD; x++) o[g][x] = vlf{};
        for (int k = 0; k < even; k += 2) {
            const uint16_t* vb = vplane + ((long)h * NB + table[k / BS]) * BS * DH + (long)((k % BS) >> 1) * DH * 2;
            vlf v0[VD], v1[VD];
            for (int x = 0; x < VD; x++) bf16_pairs(vb + 2 * (c + x * VW), v0[x], v1[x]);
            for (int g = 0; g < G; g++) {
                const float p0 = sc[(long)g * Lpad + k], p1 = sc[(long)g * Lpad + k + 1];
                for (int x = 0; x < VD; x++) {
                    o[g][x] += p0 * v0[x];
                    o[g][x] += p1 * v1[x];
                }
            }
        }
        if (L & 1) {  // the odd last key: the low half of its pair
            const int k = L - 1;
            const uint16_t* vb = vplane + ((long)h * NB + table[k / BS]) * BS * DH + (long)((k % BS) >> 1) * DH * 2;
            vlf v0[VD], v1[VD];
            for (int x = 0; x < VD; x++) bf16_pairs(vb + 2 * (c + x * VW), v0[x], v1[x]);
            for (int g = 0; g < G; g++)
                for (int x = 0; x < VD; x++) o[g][x] += sc[(long)g * Lpad + k] * v0[x];
        }
        for (int g = 0; g < G; g++) {
            const float inv = 1.0f / sum[g];
            for (int x = 0; x < VD; x++)
                for (int l = 0; l < VW; l++) store(out, (long)g * DH + c + x * VW + l, o[g][x][l] * inv);
        }
    }
}

#ifdef __AVX512BF16__
#include <immintrin.h>

// A head's probabilities s[0..Lown) rounded to bf16 once, 16 lanes at a time (bf16_bits16: the
// scalar rounding), written in place as uint16 at the front of its score row: keys k, k+1 are then
// the one 32-bit pair a dot product takes.
static inline void round_probs_bf16(float* s, int Lown) {
    uint16_t* pb = (uint16_t*)(void*)s;
    for (int k = 0; k < Lown; k += 16) {
        const v16u b = bf16_bits16(load16(s + k));  // read before the write below overlaps it
        _mm256_storeu_si256((__m256i*)(void*)(pb + k), _mm512_cvtepi32_epi16((__m512i)b));
    }
}

// The end of one head's P.V for dimensions [c * 64, c * 64 + 64): acc holds the key pairs' sums;
// an odd last key (its pair partner not visible) is added alone in fp32, then acc / sum is stored
// as the head's output (out: the head's first value).
template <int DH>
static inline void finish_chunk_bf16(float* acc, int L, const uint16_t* vplane, const int32_t* table, long NB, int h,
                                     const float* probs, float sum, uint16_t* out, int c) {
    constexpr int BS = 16;
    if (L & 1) {
        const int k = L - 1;
        const uint16_t* vb = vplane + ((long)h * NB + table[k / BS]) * BS * DH;
        uint32_t pb = (uint32_t)((const uint16_t*)(const void*)probs)[k] << 16;
        float p;
        std::memcpy(&p, &pb, 4);
        for (int d = 0; d < 64; d++) acc[d] += p * load(vb, vidx(vb, k % BS, c * 64 + d, DH));
    }
    const float inv = 1.0f / sum;
    uint16_t* o = out + (long)c * 64;
    for (int d = 0; d < 64; d++) store(o, d, acc[d] * inv);
}

// bf16, bs = 16, Dh = 64: the same steps as attend_row_fast, with AVX512-BF16 dot products over
// the paired layouts. Scores: 32 dimension pairs, each one instruction per query head for 16
// keys. P.V: probabilities rounded to bf16 (as transformers rounds them before its matmul), two
// keys per instruction; an odd last key is added on its own, in fp32.
template <int G, int DH = 64>
static void attend_row_bf16(const uint16_t* q, const uint16_t* kplane, const uint16_t* vplane,
                            const int32_t* table, int L, long NB, int h, float scale, uint16_t* out, float* sc,
                            int Lpad) {
    constexpr int BS = 16;
    const int nblk = (L + BS - 1) / BS;
    const int Lown = nblk * BS;  // this row's own keys, padded to whole blocks: softmax_row's
    // result does not depend on the padding (lanes past L are never summed), so a row does the
    // work of its own length whatever the longest row of the step
    const int start = window_start < L ? window_start : 0;  // keys before it weigh exactly 0: skipped
    uint32_t qp[G][DH / 2];
    for (int g = 0; g < G; g++) std::memcpy(qp[g], q + g * DH, DH * 2);
    // bench/attention_prefetch.py measures the prefetch levels; none changes a bit
    const int pf = prefetch_level.load(std::memory_order_relaxed);
    const int first = start / BS;
    const TaskPrefetch<DH, BS> pre{kplane, vplane, table, NB, h, first, nblk, pf != 0};
    pre.begin();
    for (int i = first; i < nblk; i++) {
        const uint16_t* kb = kplane + ((long)h * NB + table[i]) * DH * BS;
        pre.at(i);
        // two chains per head (even and odd dimension pairs), added at the end: a fixed order,
        // and twice the independent dot products in flight
        __m512 acc[G], acc1[G];
        for (int g = 0; g < G; g++) acc[g] = acc1[g] = _mm512_setzero_ps();
        for (int p = 0; p < DH / 2; p += 2) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + p * BS * 2);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + (p + 1) * BS * 2);
            for (int g = 0; g < G; g++) {
                acc[g] = _mm512_dpbf16_ps(acc[g], k0, (__m512bh)_mm512_set1_epi32((int)qp[g][p]));
                acc1[g] = _mm512_dpbf16_ps(acc1[g], k1, (__m512bh)_mm512_set1_epi32((int)qp[g][p + 1]));
            }
        }
        for (int g = 0; g < G; g++)
            _mm512_storeu_ps(sc + (long)g * Lpad + (long)i * BS,
                             _mm512_mul_ps(_mm512_add_ps(acc[g], acc1[g]), _mm512_set1_ps(scale)));
    }
    float sum[G];
    for (int g = 0; g < G; g++) sum[g] = softmax_row(sc + (long)g * Lpad, L, Lown);
    for (int g = 0; g < G; g++) round_probs_bf16(sc + (long)g * Lpad, Lown);
    const int even = L & ~1;
    // the next task's K lines, a few per key pair of this pass (LINES a run)
    constexpr int LINES = DH * BS * 2 / 64;
    const NextTask nx = pf >= 2 ? next_task : NextTask{};  // (a copy: no TLS reads in the loop)
    constexpr long MAX_LINES = 262144 / 64;  // at most 256 KB of it: a quarter of this machine's L2
    const long nx_all = nx.table ? (long)(nx.nblk - nx.first_block) * LINES : 0;
    const long nx_lines = nx_all < MAX_LINES ? nx_all : MAX_LINES;
    const long pairs = (even - (start & ~1)) / 2 * (DH / 64);
    const long per_pair = pairs > 0 ? (nx_lines + pairs - 1) / pairs : 0;
    long nx_done = 0;
    // P.V, 64 dimensions at a time (4 accumulators a head)
    for (int c = 0; c < DH / 64; c++) {
        __m512 o[G][4];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < 4; j++) o[g][j] = _mm512_setzero_ps();
        for (int k = start & ~1; k < even; k += 2) {
            for (long e = 0; e < per_pair && nx_done < nx_lines; e++, nx_done++) {
                const long blk = nx.table[nx.first_block + nx_done / LINES];
                _mm_prefetch((const char*)(kplane + ((long)nx.h * NB + blk) * DH * BS) + (nx_done % LINES) * 64,
                             _MM_HINT_T1);
            }
            const uint16_t* vb = vplane + ((long)h * NB + table[k / BS]) * BS * DH + (long)((k % BS) >> 1) * DH * 2
                                 + c * 128;
            const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vb), v1 = (__m512bh)_mm512_loadu_si512(vb + 32);
            const __m512bh v2 = (__m512bh)_mm512_loadu_si512(vb + 64), v3 = (__m512bh)_mm512_loadu_si512(vb + 96);
            for (int g = 0; g < G; g++) {
                uint32_t pair;
                std::memcpy(&pair, (const uint16_t*)(const void*)(sc + (long)g * Lpad) + k, 4);
                const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
                o[g][0] = _mm512_dpbf16_ps(o[g][0], v0, pp);
                o[g][1] = _mm512_dpbf16_ps(o[g][1], v1, pp);
                o[g][2] = _mm512_dpbf16_ps(o[g][2], v2, pp);
                o[g][3] = _mm512_dpbf16_ps(o[g][3], v3, pp);
            }
        }
        for (int g = 0; g < G; g++) {
            float acc[64];
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + j * 16, o[g][j]);
            finish_chunk_bf16<DH>(acc, L, vplane, table, NB, h, sc + (long)g * Lpad, sum[g], out + (long)g * DH, c);
        }
    }
}

// R consecutive rows of one table (a prompt chunk: keys 0..L-1, 0..L, ...), one KV head: every
// row's operations are exactly attend_row_bf16's (the same chains in the same order, the same
// softmax and roundings, the odd last key alone), so a row's bits are those it has alone; what
// changes is that each K and V vector is loaded once for the R rows, not once a row. Scores stay
// in registers as there (R * G * 2 chains: G <= 3 for R = 4); P.V takes the 64 dimensions in two
// halves of 32 (R * G * 2 accumulators), each accumulator over the keys in the same order. No
// sliding window and no prefetch (a prompt's blocks are consecutive: the stream prefetcher's).
template <int G, int R, int DH = 64>
static void attend_rows_bf16(const uint16_t* q, long qs, const uint16_t* kplane, const uint16_t* vplane,
                             const int32_t* table, const int* Ls, long NB, int h, float scale, uint16_t* out,
                             long os, float* sc, int Lpad) {
    static_assert(R * G * 2 + 3 <= 32, "the score chains must fit the 32 vector registers");
    static_assert(DH == 64, "P.V in two halves of 32 dimensions, finished as one chunk of 64");
    constexpr int BS = 16;
    int nblk[R], Lown[R], even[R], nmax = 0, emin = Ls[0], emax = 0;
    for (int r = 0; r < R; r++) {
        nblk[r] = (Ls[r] + BS - 1) / BS;
        Lown[r] = nblk[r] * BS;
        even[r] = Ls[r] & ~1;
        nmax = nblk[r] > nmax ? nblk[r] : nmax;
        emin = even[r] < emin ? even[r] : emin;
        emax = even[r] > emax ? even[r] : emax;
    }
    uint32_t qp[R][G][DH / 2];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) std::memcpy(qp[r][g], q + r * qs + g * DH, DH * 2);
    auto srow = [&](int r, int g) { return sc + (long)(r * G + g) * Lpad; };
    for (int i = 0; i < nmax; i++) {  // a row past its own blocks computes scores it never stores
        const uint16_t* kb = kplane + ((long)h * NB + table[i]) * DH * BS;
        __m512 acc[R][G], acc1[R][G];
        for (int r = 0; r < R; r++)
            for (int g = 0; g < G; g++) acc[r][g] = acc1[r][g] = _mm512_setzero_ps();
        for (int p = 0; p < DH / 2; p += 2) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + p * BS * 2);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + (p + 1) * BS * 2);
            for (int r = 0; r < R; r++)
                for (int g = 0; g < G; g++) {
                    acc[r][g] = _mm512_dpbf16_ps(acc[r][g], k0, (__m512bh)_mm512_set1_epi32((int)qp[r][g][p]));
                    acc1[r][g] = _mm512_dpbf16_ps(acc1[r][g], k1, (__m512bh)_mm512_set1_epi32((int)qp[r][g][p + 1]));
                }
        }
        for (int r = 0; r < R; r++)
            if (i < nblk[r])
                for (int g = 0; g < G; g++)
                    _mm512_storeu_ps(srow(r, g) + (long)i * BS,
                                     _mm512_mul_ps(_mm512_add_ps(acc[r][g], acc1[r][g]), _mm512_set1_ps(scale)));
    }
    float sum[R][G];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            sum[r][g] = softmax_row(srow(r, g), Ls[r], Lown[r]);
            round_probs_bf16(srow(r, g), Lown[r]);
        }
    alignas(64) float accb[R][G][DH];
    for (int half = 0; half < 2; half++) {
        __m512 o[R][G][2];
        for (int r = 0; r < R; r++)
            for (int g = 0; g < G; g++) o[r][g][0] = o[r][g][1] = _mm512_setzero_ps();
        auto pair_step = [&](int k, int r, const __m512bh& v0, const __m512bh& v1) {
            for (int g = 0; g < G; g++) {
                uint32_t pair;
                std::memcpy(&pair, (const uint16_t*)(const void*)srow(r, g) + k, 4);
                const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
                o[r][g][0] = _mm512_dpbf16_ps(o[r][g][0], v0, pp);
                o[r][g][1] = _mm512_dpbf16_ps(o[r][g][1], v1, pp);
            }
        };
        for (int k = 0; k < emax; k += 2) {
            const uint16_t* vb = vplane + ((long)h * NB + table[k / BS]) * BS * DH + (long)((k % BS) >> 1) * DH * 2
                                 + half * 64;
            const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vb), v1 = (__m512bh)_mm512_loadu_si512(vb + 32);
            if (k < emin) {
                for (int r = 0; r < R; r++) pair_step(k, r, v0, v1);
            } else {
                for (int r = 0; r < R; r++)
                    if (k < even[r]) pair_step(k, r, v0, v1);
            }
        }
        for (int r = 0; r < R; r++)
            for (int g = 0; g < G; g++) {
                _mm512_storeu_ps(accb[r][g] + half * 32, o[r][g][0]);
                _mm512_storeu_ps(accb[r][g] + half * 32 + 16, o[r][g][1]);
            }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++)
            finish_chunk_bf16<DH>(accb[r][g], Ls[r], vplane, table, NB, h, srow(r, g), sum[r][g],
                                  out + r * os + (long)g * DH, 0);
}
#define ISOLAB_HAVE_BF16_DOT 1
#else
#define ISOLAB_HAVE_BF16_DOT 0
#endif

// bf16 rows with Dh = 256 (Gemma 3) on AVX512-BF16 dot products; false: use attend_row.
template <typename T>
static bool attend_fast_256(int G, const T* q, const T* kplane, const T* vplane, const int32_t* table, int L, long NB,
                            int h, float scale, T* out, float* sc, int Lpad) {
#if ISOLAB_HAVE_BF16_DOT
    if constexpr (sizeof(T) == 2) {
        switch (G) {
            case 1: attend_row_bf16<1, 256>(q, kplane, vplane, table, L, NB, h, scale, out, sc, Lpad); return true;
            case 2: attend_row_bf16<2, 256>(q, kplane, vplane, table, L, NB, h, scale, out, sc, Lpad); return true;
            case 4: attend_row_bf16<4, 256>(q, kplane, vplane, table, L, NB, h, scale, out, sc, Lpad); return true;
        }
    }
#endif
    (void)G, (void)q, (void)kplane, (void)vplane, (void)table, (void)L, (void)NB, (void)h, (void)scale, (void)out,
        (void)sc, (void)Lpad;
    return false;
}

// Rows of a prompt chunk four at a time (attend_rows_bf16): 1 (default) or 0 (every row alone, for
// the bench's A/B). No bit depends on it. Read once a call (relaxed): a setting, not a synchronization.
static std::atomic<int> row_units{1};
constexpr int UNIT = 4;
// rows n .. n + UNIT - 1 of one unit, one KV head; false: this G has no unit kernel
static bool attend_unit(int G, const uint16_t* q, long qs, const uint16_t* kplane, const uint16_t* vplane,
                        const int32_t* table, const int* Ls, long NB, int h, float scale, uint16_t* out, long os,
                        float* sc, int Lpad) {
#if ISOLAB_HAVE_BF16_DOT
    switch (G) {
        case 1: attend_rows_bf16<1, UNIT>(q, qs, kplane, vplane, table, Ls, NB, h, scale, out, os, sc, Lpad); return true;
        case 2: attend_rows_bf16<2, UNIT>(q, qs, kplane, vplane, table, Ls, NB, h, scale, out, os, sc, Lpad); return true;
        case 3: attend_rows_bf16<3, UNIT>(q, qs, kplane, vplane, table, Ls, NB, h, scale, out, os, sc, Lpad); return true;
    }
#endif
    (void)q, (void)qs, (void)kplane, (void)vplane, (void)table, (void)Ls, (void)NB, (void)h, (void)scale, (void)out;
    (void)os, (void)sc, (void)Lpad;
    return false;
}

// The fast paths for bs = 16, Dh = 64 and G query heads per KV head; false: use attend_row.
template <typename T>
static bool attend_fast(int G, const T* q, const T* kplane, const T* vplane, const int32_t* table, int L, long NB,
                        int h, float scale, T* out, float* sc, int Lpad) {
    if constexpr (sizeof(T) == 2) {
#if ISOLAB_HAVE_BF16_DOT
        switch (G) {
            case 1: attend_row_bf16<1>(q, kplane, vplane, table, L, NB, h, scale, out, sc, Lpad); return true;
            case 2: attend_row_bf16<2>(q, kplane, vplane, table, L, NB, h, scale, out, sc, Lpad); return true;
            case 3: attend_row_bf16<3>(q, kplane, vplane, table, L, NB, h, scale, out, sc, Lpad); return true;
            case 4: attend_row_bf16<4>(q, kplane, vplane, table, L, NB, h, scale, out, sc, Lpad); return true;
        }
#else
        switch (G) {
            case 1: attend_row_pairs<1>(q, kplane, vplane, table, L, NB, h, scale, out, sc, Lpad); return true;
            case 2: attend_row_pairs<2>(q, kplane, vplane, table, L, NB, h, scale, out, sc, Lpad); return true;
            case 3: attend_row_pairs<3>(q, kplane, vplane, table, L, NB, h, scale, out, sc, Lpad); return true;
            case 4: attend_row_pairs<4>(q, kplane, vplane, table, L, NB, h, scale, out, sc, Lpad); return true;
        }
#endif
        return false;
    } else {
        switch (G) {
            case 1: attend_row_fast<T, 1>(q, kplane, vplane, table, L, NB, h, scale, out, sc, Lpad); return true;
            case 2: attend_row_fast<T, 2>(q, kplane, vplane, table, L, NB, h, scale, out, sc, Lpad); return true;
            case 3: attend_row_fast<T, 3>(q, kplane, vplane, table, L, NB, h, scale, out, sc, Lpad); return true;
            case 4: attend_row_fast<T, 4>(q, kplane, vplane, table, L, NB, h, scale, out, sc, Lpad); return true;
        }
        return false;
    }
}


#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
// ---- bf16 on AMX tiles: a unit of rows of one block table, all G query heads of one KV head ----
//
// A unit is up to 16 / G consecutive rows that read the same table (a prompt chunk; a decode row
// is a unit of one). Its R*G (row, head) query vectors are the rows of one A tile; a row's results
// read only its own tile row, so they do not depend on which rows share the unit:
//   scores, per 16-key block: C = 0, += Q[dims 0..31] . K, += Q[dims 32..63] . K, then * scale;
//   softmax over the row's own keys (softmax_row), probabilities rounded to bf16, zero past the
//   row's last key;
//   output, per 16-key block in order: O += P[block] . V[block], then * 1 / sum.
// A row whose unit reaches further than its own keys adds exact zeros for those keys (+0 leaves
// every sum unchanged), so its bits equal those it gets alone. Keys past the unit's last one are
// never multiplied: the last partial V block is copied with those slots zeroed (a freed block is
// NaN-poisoned in audit mode, and 0 * NaN is NaN). Another summation order than the AVX512-BF16
// path: on a CPU with AMX every bf16 row takes this path.

// tmm0-3: C (16 x 16 fp32; tmm0 the scores, then tmm0-3 the output's four 16-dim chunks; tmm1 the
// K tile while scoring); tmm4: P (16 rows x 16 keys bf16); tmm5: V (8 key pairs x 16 dims x 2);
// tmm6-7: Q, dims 0..31 and 32..63 (16 rows x 32 bf16)
static void attention_amx_configure() {
    TileConfig c{};  // (simd.h)
    c.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    c.colsb[4] = 32;
    c.rows[5] = 8;
    _tile_loadconfig(&c);
}

// The tile steps both AMX units share (the bf16 pool's and the int8 pool's), for units of Dh = 64.
// Load the unit's R * G query rows (row t = r * G + g) into tmm6-7 (dims 0..31, 32..63); returns the
// keys of its longest row.
static inline int amx_unit_queries(const uint16_t* q, long qs, const int32_t* q_pos, int n0, int R, int G, int h,
                                   uint16_t* qb) {
    constexpr int DH = 64;
    int Lmax = 0;
    for (int r = 0; r < R; r++) Lmax = q_pos[n0 + r] + 1 > Lmax ? q_pos[n0 + r] + 1 : Lmax;
    for (int r = 0; r < R; r++)
        std::memcpy(qb + (long)r * G * DH, q + (long)(n0 + r) * qs + (long)h * G * DH, sizeof(uint16_t) * G * DH);
    _tile_loadd(6, qb, DH * 2);
    _tile_loadd(7, qb + 32, DH * 2);
    return Lmax;
}
// One 16-key block's scores (K block kb, bf16 pairs) into the unit's score rows at column s:
// C = 0, += Q[0..31] . K, += Q[32..63] . K.
static inline void amx_scores(const uint16_t* kb, float* s, long sstride) {
    _tile_zero(0);
    _tile_loadd(1, kb, 64);
    _tile_dpbf16ps(0, 6, 1);
    _tile_loadd(1, kb + 16 * 32, 64);
    _tile_dpbf16ps(0, 7, 1);
    _tile_stored(0, s, sstride);
}
// One 16-key block's P.V: the bf16 probabilities at p (the unit's rows, stride sstride bytes) times
// the V block vb (bf16 key pairs), into the output tiles tmm0-3 (dims 0..15, ..., 48..63).
static inline void amx_pv(const uint16_t* p, long sstride, const uint16_t* vb) {
    constexpr int DH = 64;
    _tile_loadd(4, p, sstride);
    _tile_loadd(5, vb, DH * 2 * 2);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, vb + 32, DH * 2 * 2);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, vb + 64, DH * 2 * 2);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, vb + 96, DH * 2 * 2);
    _tile_dpbf16ps(3, 4, 5);
}
// The output tiles through ob to each (row, head) of the unit, divided by its softmax sum.
static inline void amx_store_output(float* ob, const float* sum, int T, int G, int H, int n0, int h, uint16_t* out) {
    constexpr int DH = 64;
    _tile_stored(0, ob, DH * 4);
    _tile_stored(1, ob + 16, DH * 4);
    _tile_stored(2, ob + 32, DH * 4);
    _tile_stored(3, ob + 48, DH * 4);
    for (int t = 0; t < T; t++) {
        const int r = t / G, g = t % G;
        uint16_t* o = out + ((long)(n0 + r) * H + (long)h * G + g) * DH;
        const float inv = 1.0f / sum[t];
        for (int d = 0; d < DH; d += 16) store16(o + d, load16(ob + (long)t * DH + d) * inv);
    }
}

// rows n0..n0+R-1 (one table; R*G <= 16), KV head h. qs: row stride of q; out: (N, H, 64).
// Scratch: sc (16, Lpad) fp32, qb (16, 64) bf16, ob (16, 64) fp32, vt (8, 64, 2) bf16.
static void attend_unit_amx(const uint16_t* q, long qs, const uint16_t* kplane, const uint16_t* vplane,
                            const int32_t* table, const int32_t* q_pos, int n0, int R, int G, int H, long NB, int h,
                            float scale, uint16_t* out, float* sc, int Lpad, uint16_t* qb, float* ob, uint16_t* vt) {
    constexpr int BS = 16, DH = 64;
    const int T = R * G;  // tile rows in use: t = r * G + g
    const int Lmax = amx_unit_queries(q, qs, q_pos, n0, R, G, h, qb), nblk = (Lmax + BS - 1) / BS;
    const long sstride = (long)Lpad * sizeof(float);
    // The within-task prefetch (TaskPrefetch; bench/attention_prefetch.py: 0.89-0.92x at 128
    // decode rows, whose units are single rows with their blocks anywhere in the pool). The
    // next-task prefetch has no counterpart here: tried (tasks claimed one ahead, the next one's K
    // lines spread over this P.V pass), it cost more than it saved (0.94x against 0.89x; 1.29x
    // where the keys are in cache), the P.V pass on tiles being too short to hide them in.
    const TaskPrefetch<DH, BS> pre{kplane, vplane, table, NB, h, 0, nblk,
                                   prefetch_level.load(std::memory_order_relaxed) != 0};
    pre.begin();
    for (int i = 0; i < nblk; i++) {
        pre.at(i);
        amx_scores(kplane + ((long)h * NB + table[i]) * DH * BS, sc + (long)i * BS, sstride);
    }
    float sum[16];
    for (int t = 0; t < T; t++) {
        float* s = sc + (long)t * Lpad;
        const int L = q_pos[n0 + t / G] + 1, Lown = (L + BS - 1) / BS * BS;
        for (int k = 0; k < Lown; k += 16) store16(s + k, load16(s + k) * scale);
        sum[t] = softmax_row(s, L, Lown);
        uint16_t* pb = (uint16_t*)(void*)s;  // bf16 probabilities over the front of the row
        for (int k = 0; k < Lown; k += 16) {
            const v16u b = bf16_bits16(load16(s + k));
            _mm256_storeu_si256((__m256i*)(void*)(pb + k), _mm512_cvtepi32_epi16((__m512i)b));
        }
        for (int k = L; k < nblk * BS; k++) pb[k] = 0;
    }
    const int tail = Lmax % BS;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int i = 0; i < nblk; i++) {
        const uint16_t* vb = vplane + ((long)h * NB + table[i]) * BS * DH;
        if (tail && i == nblk - 1) {  // keys tail..15 of the last block are not the unit's
            std::memcpy(vt, vb, sizeof(uint16_t) * BS * DH);
            for (int j = tail; j < BS; j++)
                for (int d = 0; d < DH; d++) vt[vidx(vt, j, d, DH)] = 0;
            vb = vt;
        }
        amx_pv((const uint16_t*)(const void*)sc + (long)i * BS, sstride, vb);
    }
    amx_store_output(ob, sum, T, G, H, n0, h, out);
}
#define ISOLAB_HAVE_AMX_ATTENTION 1
#else
#define ISOLAB_HAVE_AMX_ATTENTION 0
#endif

static int fast_paths = 1;  // 0: every row takes attend_row (tests compare the two)


// every thread of the parallel region calls this: the AMX units, one (unit, KV head) per task
template <typename T>
static void attend_units_amx(const T* q, long qs, const T* kplane, const T* vplane, const int32_t* tables,
                             int table_len, const int32_t* row_table, const int32_t* q_pos, T* out,
                             const std::vector<int>& units, int H, int Hkv, long NB, int G, float scale, int Lpad) {
#if ISOLAB_HAVE_AMX_ATTENTION
    if constexpr (sizeof(T) == 2) {
        attention_amx_configure();  // tile configuration is per thread
        float* sc = (float*)std::aligned_alloc(64, sizeof(float) * 16 * (size_t)Lpad);
        alignas(64) uint16_t qb[16 * 64];
        alignas(64) float ob[16 * 64];
        alignas(64) uint16_t vt[16 * 64];
        std::memset(qb, 0, sizeof qb);
        std::memset(sc, 0, sizeof(float) * 16 * (size_t)Lpad);
        const long n_units = (long)units.size() / 2;
#pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < n_units * Hkv; task++) {
            const long u = task / Hkv;
            const int h = (int)(task % Hkv), n0 = units[2 * u], R = units[2 * u + 1];
            attend_unit_amx(q, qs, kplane, vplane, tables + (long)row_table[n0] * table_len, q_pos, n0, R, G, H, NB,
                            h, scale, out, sc, Lpad, qb, ob, vt);
        }
        std::free(sc);
        _tile_release();
        return;
    }
#endif
    (void)q, (void)qs, (void)kplane, (void)vplane, (void)tables, (void)table_len, (void)row_table, (void)q_pos;
    (void)out, (void)units, (void)H, (void)Hkv, (void)NB, (void)G, (void)scale, (void)Lpad;
}

template <typename T>
static void attend_all(const T* q, const T* k_new, const T* v_new, long qs, const int64_t* slots, T* kplane,
                       T* vplane, const int32_t* tables, int table_len, const int32_t* row_table,
                       const int32_t* q_pos, T* out, int N, int H, int Hkv, long NB, int bs, int Dh, float scale,
                       int window) {
    if (bs > 16 && bs % 16 == 0) {  // f runs of 16 keys a block: block b's run j is 16-key block b f + j
        const int f = bs / 16;
        int R = 0;  // tables in use
        for (int n = 0; n < N; n++) R = row_table[n] + 1 > R ? row_table[n] + 1 : R;
        std::vector<int32_t> sub((size_t)R * table_len * f);
        for (long i = 0; i < (long)R * table_len; i++)
            for (int j = 0; j < f; j++) sub[i * f + j] = tables[i] * f + j;
        // a slot b bs + o is slot (b f + o / 16) 16 + o % 16 of the 16-key blocks: the same number
        return attend_all(q, k_new, v_new, qs, slots, kplane, vplane, sub.data(), table_len * f, row_table, q_pos,
                          out, N, H, Hkv, NB * f, 16, Dh, scale, window);
    }
    const int G = H / Hkv;
    int max_len = 0;
    for (int n = 0; n < N; n++) max_len = q_pos[n] + 1 > max_len ? q_pos[n] + 1 : max_len;
    const int Lpad = ((max_len + bs - 1) / bs * bs + 15) / 16 * 16;
    // (a windowed call never takes the tiles: every call of a layer takes one path, so a row's bits stay its own)
    const bool amx = sizeof(T) == 2 && fast_paths && bs == 16 && Dh == 64 && G <= 16 && window == 0 && amx_ready();
    std::vector<int> units;  // AMX: (first row, rows) of each unit, consecutive rows of one table
    if (amx)
        for (int n = 0; n < N;) {
            int R = 1;
            while (n + R < N && R < 16 / G && row_table[n + R] == row_table[n]) R++;
            units.push_back(n);
            units.push_back(R);
            n += R;
        }
    // Units of UNIT consecutive rows of one table at consecutive positions (a prompt chunk's rows),
    // each computed by its first row's (row, KV head) task with attend_rows_bf16; unit[n]: UNIT at
    // a unit's first row, 0 at its other rows (their tasks do nothing), 1 for a row alone.
    std::vector<int8_t> unit;
    const bool by_units = sizeof(T) == 2 && ISOLAB_HAVE_BF16_DOT && !amx && fast_paths && bs == 16 && Dh == 64 &&
                       window == 0 && G <= 3 && row_units.load(std::memory_order_relaxed) != 0;
    if (by_units) {
        unit.assign(N, 1);
        for (int n = 0; n + UNIT <= N;) {
            bool ok = true;
            for (int r = 1; r < UNIT && ok; r++)
                ok = row_table[n + r] == row_table[n] && q_pos[n + r] == q_pos[n] + r;
            if (!ok) {
                n++;
                continue;
            }
            unit[n] = UNIT;
            for (int r = 1; r < UNIT; r++) unit[n + r] = 0;
            n += UNIT;
        }
    }
    std::atomic<long> claimed{0};  // the next (row, KV head) task not yet taken
#pragma omp parallel
    {
        // 1. this step's K/V into their slots (K transposed inside its block); all rows are
        //    written before any row reads, since a prompt chunk's rows read each other's keys
        if (slots != nullptr) {
#pragma omp for schedule(static)
            for (long n = 0; n < N; n++) {
                const long blk = slots[n] / bs, off = slots[n] % bs;
                for (int h = 0; h < Hkv; h++) {
                    const T* kr = k_new + n * qs + (long)h * Dh;
                    const T* vr = v_new + n * qs + (long)h * Dh;
                    T* kb = kplane + ((long)h * NB + blk) * Dh * bs;
                    T* vb = vplane + ((long)h * NB + blk) * bs * Dh;
                    for (int d = 0; d < Dh; d++) {
                        kb[kidx(kb, d, (int)off, bs)] = kr[d];
                        vb[vidx(vb, (int)off, d, Dh)] = vr[d];
                    }
                }
            }
        }
        // 2. attention, one (row, KV head) per task; on AMX one (unit of rows, KV head)
        if (amx) {
            attend_units_amx(q, qs, kplane, vplane, tables, table_len, row_table, q_pos, out, units, H, Hkv, NB, G,
                             scale, Lpad);
        } else {
        float* sc = (float*)std::aligned_alloc(64, sizeof(float) * (size_t)(by_units ? UNIT : 1) * G * Lpad);
        // row n's queries, output and block table for KV head h
        auto q_of = [&](int n, int h) { return q + n * qs + (long)h * G * Dh; };
        auto out_of = [&](int n, int h) { return out + ((long)n * H + (long)h * G) * Dh; };
        auto table_of = [&](int n) { return tables + (long)row_table[n] * table_len; };
        auto alone = [&](int n, int h) {  // row n, KV head h
            const T* qr = q_of(n, h);
            T* orow = out_of(n, h);
            const int32_t* table = table_of(n);
            const int L = q_pos[n] + 1;
            window_start = window > 0 && L > window ? L - window : 0;
            if (fast_paths && bs == 16 && Dh == 64 && attend_fast<T>(G, qr, kplane, vplane, table, L, NB, h, scale, orow, sc, Lpad))
                return;
            if (fast_paths && bs == 16 && Dh == 256 && attend_fast_256<T>(G, qr, kplane, vplane, table, L, NB, h, scale, orow, sc, Lpad))
                return;
            if (bs == 16)
                attend_row<T, 16>(qr, kplane, vplane, table, L, NB, bs, Dh, G, h, scale, orow, sc, Lpad);
            else
                attend_row<T, 0>(qr, kplane, vplane, table, L, NB, bs, Dh, G, h, scale, orow, sc, Lpad);
        };
        // (row, KV head) tasks (at a unit's first row, the unit's) from a shared counter, each thread
        // claiming its next task one ahead while many are left, so the kernel knows the next one and
        // can prefetch its keys
        auto one = [&](long task) {
            const int n = (int)(task / Hkv), h = (int)(task % Hkv);
            if (!by_units || unit[n] == 1) return alone(n, h);
            if (unit[n] == 0) return;  // another task's unit holds this row
            if constexpr (sizeof(T) == 2) {
                int Ls[UNIT];
                for (int r = 0; r < UNIT; r++) Ls[r] = q_pos[n] + 1 + r;
                if (attend_unit(G, (const uint16_t*)q_of(n, h), qs, (const uint16_t*)kplane, (const uint16_t*)vplane,
                                table_of(n), Ls, NB, h, scale, (uint16_t*)out_of(n, h), (long)H * Dh, sc, Lpad))
                    return;
            }
            for (int r = 0; r < UNIT; r++) alone(n + r, h);  // no unit kernel for this G: every row of it alone
        };
        // Claiming ahead holds a task back from the other threads, so it stops once few are left
        // (a thread would otherwise take two of the last tasks while another has none).
        const long total = (long)N * Hkv, few = 2L * omp_get_num_threads();
        long cur = claimed.fetch_add(1, std::memory_order_relaxed);
        while (cur < total) {
            const bool ahead = total - cur > few;
            const long nxt = ahead ? claimed.fetch_add(1, std::memory_order_relaxed) : total;
            next_task = NextTask{};
            if (nxt < total) {
                const int n = (int)(nxt / Hkv);
                const int L = q_pos[n] + 1;
                const int ws = window > 0 && L > window ? L - window : 0;
                next_task = NextTask{tables + (long)row_table[n] * table_len, ws / bs, (L + bs - 1) / bs, (int)(nxt % Hkv)};
            }
            one(cur);
            cur = ahead ? nxt : claimed.fetch_add(1, std::memory_order_relaxed);
        }
        next_task = NextTask{};
        std::free(sc);
        window_start = 0;
        }
    }
}

// ---- an 8-bit K/V pool (opt-in, kv_cache_dtype "int8"): half the bytes a row's keys cost to read ----
//
// Every 16 keys of one KV head are one run of 16 * (Dh + 4) bytes: 16 * Dh int8 values in the
// bf16 pool's order (K (Dh/2, 16, 2), V (8, Dh, 2): kidx and vidx), then the 16 keys' fp32
// scales (models/attention.py:write_kv_i8 writes the same bytes in torch). A key's Dh values x share
// one scale: s = max|x| / 127 (fp32), each value stored as round-half-even(x / s), read back as
// s * q (s = 0: every q is 0). A NaN or infinity among the values makes the scale NaN, so an audit-mode NaN
// still spreads; a poisoned run (every byte 0xFF) has NaN scales, so a read of a freed block shows.
// Scores are q . k (an exact bf16 or fp32 copy of the int8 values) times (the key's scale * scale);
// each probability is multiplied by its key's V scale before P.V. Paths: AMX tiles on a CPU with
// them (as the bf16 pool's, over runs converted to bf16 in a scratch tile), else fp32 arithmetic
// (GCC vectors, no fused multiply-add). A row's order of operations depends on its own keys alone.
constexpr int I8_RUN = 16;

// x (Dh values, a multiple of 16) -> q in kidx (is_k) or vidx order at key `off` of a run, its scale
// at the run's scale[off]. 16 lanes at a time: the max is order-free, x / s is one IEEE division, and
// adding then subtracting 1.5 * 2^23 rounds |x / s| <= 127.5 half-to-even, as torch.round does.
template <typename T>
static inline void quantize_key_i8(const T* x, int Dh, bool is_k, int off, int8_t* run) {
    v16f m = v16f{};
    for (int d = 0; d < Dh; d += 16) {
        v16f a = load16(x + d);
        a = a < 0.0f ? -a : a;
        m = (a > m || a != a) ? a : m;  // NaN wins
    }
    float amax = 0.0f;
    for (int l = 0; l < 16; l++) amax = (m[l] > amax || m[l] != m[l]) ? m[l] : amax;
    float s = amax / 127.0f;
    if (!(s <= 3.4028235e38f)) s = NAN;  // a NaN or an infinity among x: the one quiet NaN torch writes too
    const uint16_t* tag = nullptr;  // selects the uint16 (pair) overloads of kidx / vidx
    for (int d = 0; d < Dh; d += 16) {
        v16f r = v16f{};
        if (s > 0.0f) {  // s NaN or 0: every q is 0 (the scale tells)
            r = load16(x + d) / s;
            r = (r + 12582912.0f) - 12582912.0f;
            r = r > 127.0f ? v16f{} + 127.0f : r;
            r = r < -127.0f ? v16f{} - 127.0f : r;
        }
        const v16i qi = __builtin_convertvector(r, v16i);
        for (int l = 0; l < 16; l++)
            run[is_k ? kidx(tag, d + l, off, I8_RUN) : vidx(tag, off, d + l, Dh)] = (int8_t)qi[l];
    }
    std::memcpy(run + (long)Dh * I8_RUN + off * 4, &s, 4);
}

// VW int16 pairs (a key's two dimensions, or a dimension's two keys) -> their low and high bytes, signed
static inline void load_pairs_i8(const int8_t* p, vlf& lo, vlf& hi) {
#if defined(__AVX512F__)
    typedef int16_t vls __attribute__((vector_size(32)));
    typedef v16i vli;
#else
    typedef int16_t vls __attribute__((vector_size(16)));
    typedef v8i vli;
#endif
    vls w;
    std::memcpy(&w, p, sizeof w);
    const vli x = __builtin_convertvector(w, vli);  // sign-extended: the pair's second byte, signed, is x >> 8
    lo = __builtin_convertvector((x << 24) >> 24, vlf);
    hi = __builtin_convertvector(x >> 8, vlf);
}

// One (row, KV head) in fp32 arithmetic: G query heads, DH dimensions (a multiple of 16 up to 256;
// DH_ = 0: dh_rt at run time); table: the row's 16-key runs. Scores over dimension pairs in order
// (two chains: even, odd dimensions, summed at the end), P.V over the keys in order. A run's 16 keys
// (and a chunk's 16 dimensions) are VK vectors of VW lanes: 8 on AVX2, whose 16 registers GCC
// spilled 16-lane vectors from (the same operations lane by lane; no width changes a bit).
template <typename T, int G, int DH_>
static void attend_row_i8(const T* q, const int8_t* kplane, const int8_t* vplane, const int32_t* table, int L,
                          long NR, int h, float scale, T* out, float* sc, int Lpad, int dh_rt) {
    const int DH = DH_ ? DH_ : dh_rt;
    const long RB = (long)I8_RUN * (DH + 4);
    const int nblk = (L + I8_RUN - 1) / I8_RUN;
    const int start = window_start < L ? window_start : 0;  // keys before it weigh exactly 0: skipped
    float qf[G][DH_ ? DH_ : 256];
    for (int g = 0; g < G; g++)
        for (int d = 0; d < DH; d++) qf[g][d] = load(q, (long)g * DH + d);
    for (int i = start / I8_RUN; i < nblk; i++) {
        const int8_t* kb = kplane + ((long)h * NR + table[i]) * RB;
        vlf ev[G][VK], od[G][VK];
        for (int g = 0; g < G; g++)
            for (int x = 0; x < VK; x++) ev[g][x] = od[g][x] = vlf{};
        for (int p = 0; p < DH / 2; p++) {
            vlf k0[VK], k1[VK];
            for (int x = 0; x < VK; x++) load_pairs_i8(kb + p * 32 + x * 2 * VW, k0[x], k1[x]);
            for (int g = 0; g < G; g++)
                for (int x = 0; x < VK; x++) {
                    ev[g][x] += qf[g][2 * p] * k0[x];
                    od[g][x] += qf[g][2 * p + 1] * k1[x];
                }
        }
        for (int x = 0; x < VK; x++) {
            vlf ks;
            std::memcpy(&ks, kb + DH * I8_RUN + x * 4 * VW, sizeof ks);
            ks = ks * scale;
            for (int g = 0; g < G; g++)
                storev(sc + (long)g * Lpad + (long)i * I8_RUN + x * VW, (ev[g][x] + od[g][x]) * ks);
        }
    }
    float inv[G];
    for (int g = 0; g < G; g++) inv[g] = 1.0f / softmax_row(sc + (long)g * Lpad, L, Lpad);
    // P.V in chunks of CH x 16 dimensions: G * CH * VK accumulators in registers (AVX2's 16
    // registers of 8 lanes hold 16 dimensions a head beside the V pairs; no chunking changes a bit)
#if defined(__AVX512F__)
    constexpr int C = G <= 3 ? 4 : G <= 6 ? 2 : 1;
#else
    constexpr int C = 1;
#endif
    constexpr int CH = DH_ && (DH_ / 16) % C == 0 ? C : 1;
    for (int c0 = 0; c0 < DH / 16; c0 += CH) {
        vlf o[G][CH * VK];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < CH * VK; c++) o[g][c] = vlf{};
        for (int k = start & ~1; k < L; k += 2) {  // a pair of keys k, k + 1 (of which only keys in start..L-1 count)
            const int8_t* vb = vplane + ((long)h * NR + table[k / I8_RUN]) * RB;
            const int j = k % I8_RUN;
            float vs[2];
            std::memcpy(vs, vb + (long)DH * I8_RUN + j * 4, 8);
            vlf v0[CH * VK], v1[CH * VK];
            for (int c = 0; c < CH * VK; c++)
                load_pairs_i8(vb + ((long)(j >> 1) * DH + c0 * 16 + c * VW) * 2, v0[c], v1[c]);
            if (k >= start)
                for (int g = 0; g < G; g++) {
                    const float p = sc[(long)g * Lpad + k] * vs[0];
                    for (int c = 0; c < CH * VK; c++) o[g][c] += p * v0[c];
                }
            if (k + 1 < L)
                for (int g = 0; g < G; g++) {
                    const float p = sc[(long)g * Lpad + k + 1] * vs[1];
                    for (int c = 0; c < CH * VK; c++) o[g][c] += p * v1[c];
                }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < CH * VK; c++) storev(out + (long)g * DH + c0 * 16 + c * VW, o[g][c] * inv[g]);
    }
}

template <typename T, int DH>
static void attend_i8_g(int G, const T* q, const int8_t* kp, const int8_t* vp, const int32_t* table, int L, long NR,
                        int h, float scale, T* out, float* sc, int Lpad, int dh) {
    switch (G) {
        case 1: return attend_row_i8<T, 1, DH>(q, kp, vp, table, L, NR, h, scale, out, sc, Lpad, dh);
        case 2: return attend_row_i8<T, 2, DH>(q, kp, vp, table, L, NR, h, scale, out, sc, Lpad, dh);
        case 3: return attend_row_i8<T, 3, DH>(q, kp, vp, table, L, NR, h, scale, out, sc, Lpad, dh);
        case 4: return attend_row_i8<T, 4, DH>(q, kp, vp, table, L, NR, h, scale, out, sc, Lpad, dh);
        case 5: return attend_row_i8<T, 5, DH>(q, kp, vp, table, L, NR, h, scale, out, sc, Lpad, dh);
        case 6: return attend_row_i8<T, 6, DH>(q, kp, vp, table, L, NR, h, scale, out, sc, Lpad, dh);
        case 7: return attend_row_i8<T, 7, DH>(q, kp, vp, table, L, NR, h, scale, out, sc, Lpad, dh);
        default: return attend_row_i8<T, 8, DH>(q, kp, vp, table, L, NR, h, scale, out, sc, Lpad, dh);
    }
}

#if ISOLAB_HAVE_AMX_ATTENTION
// 1024 int8 of a run -> bf16 at dst in the same order, exactly (|q| <= 127: an fp32 copy's high half)
static inline void run_to_bf16(const int8_t* src, uint16_t* dst) {
    const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                                         25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    for (int i = 0; i < 1024; i += 32) {
        const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(const void*)(src + i))));
        const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(const void*)(src + i + 16))));
        _mm512_storeu_si512(dst + i, _mm512_permutex2var_epi16(_mm512_castps_si512(a), odd, _mm512_castps_si512(b)));
    }
}

// attend_unit_amx over the int8 pool (Dh = 64): the same tiles and steps, each K and V run first
// converted to bf16 (kt, vt: 16 x 64 scratch); scores times (the key's scale * scale), then each
// probability times its key's V scale before it is rounded to bf16. Keys past a row's last get
// probability 0 and their V values are finite integers: exact zeros, no copy needed.
static void attend_unit_amx_i8(const uint16_t* q, long qs, const int8_t* kplane, const int8_t* vplane,
                               const int32_t* table, const int32_t* q_pos, int n0, int R, int G, int H, long NR, int h,
                               float scale, uint16_t* out, float* sc, int Lpad, uint16_t* qb, float* ob,
                               uint16_t* kt, uint16_t* vt) {
    constexpr int BS = 16, DH = 64;
    constexpr long RB = (long)BS * (DH + 4);
    const int T = R * G;
    const int nblk = (amx_unit_queries(q, qs, q_pos, n0, R, G, h, qb) + BS - 1) / BS;
    const long sstride = (long)Lpad * sizeof(float);
    const TaskPrefetch<DH, BS, int8_t, (int)RB> pre{kplane, vplane, table, NR, h, 0, nblk,
                                                    prefetch_level.load(std::memory_order_relaxed) != 0};
    pre.begin();
    for (int i = 0; i < nblk; i++) {
        const int8_t* kb = kplane + ((long)h * NR + table[i]) * RB;
        pre.at(i);
        run_to_bf16(kb, kt);
        amx_scores(kt, sc + (long)i * BS, sstride);
    }
    float sum[16];
    for (int t = 0; t < T; t++) {
        float* s = sc + (long)t * Lpad;
        const int L = q_pos[n0 + t / G] + 1, Lown = (L + BS - 1) / BS * BS;
        for (int k = 0; k < Lown; k += 16) {
            v16f ks;
            std::memcpy(&ks, kplane + ((long)h * NR + table[k / BS]) * RB + DH * BS, 64);
            store16(s + k, load16(s + k) * (ks * scale));
        }
        sum[t] = softmax_row(s, L, Lown);
        uint16_t* pb = (uint16_t*)(void*)s;  // bf16 probabilities (times the V scales) over the front of the row
        for (int k = 0; k < Lown; k += 16) {
            v16f vs;
            std::memcpy(&vs, vplane + ((long)h * NR + table[k / BS]) * RB + DH * BS, 64);
            const v16u b = bf16_bits16(load16(s + k) * vs);
            _mm256_storeu_si256((__m256i*)(void*)(pb + k), _mm512_cvtepi32_epi16((__m512i)b));
        }
        for (int k = L; k < nblk * BS; k++) pb[k] = 0;
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int i = 0; i < nblk; i++) {
        run_to_bf16(vplane + ((long)h * NR + table[i]) * RB, vt);
        amx_pv((const uint16_t*)(const void*)sc + (long)i * BS, sstride, vt);
    }
    amx_store_output(ob, sum, T, G, H, n0, h, out);
}
#endif

// The int8 pool's attend_all: the same contract (write this step's K/V, then every row attends to
// its keys 0..q_pos). bs: a multiple of 16 (block b's run j is 16-key run b * bs / 16 + j, so a
// slot s is run s / 16, key s % 16). Dh: a multiple of 16 up to 256; G <= 8. bf16 rows with Dh = 64 and no
// window take the tiles where the CPU has them (units of rows of one table, as attend_all's).
// The pool: per KV head, per 16-key run, the K run then the V run (one 2 * 16 * (Dh + 4)-byte piece
// a row reads in one stream: two planes took 1.17x the time at 128 decode rows, hand-timed). The
// kernels above take it as two planes of runs with stride 2: K runs at even run indices of `pool`,
// V runs at even indices of `pool + RB`.
template <typename T>
static void attend_all_i8(const T* q, const T* k_new, const T* v_new, long qs, const int64_t* slots, int8_t* pool,
                          const int32_t* tables, int table_len, const int32_t* row_table, const int32_t* q_pos, T* out,
                          int N, int H, int Hkv, long NB, int bs, int Dh, float scale, int window) {
    const int f = bs / I8_RUN, G = H / Hkv;
    const long NR = 2 * NB * f, RB = (long)I8_RUN * (Dh + 4);  // NR: runs a head, counting K and V
    int8_t* kplane = pool;
    int8_t* vplane = pool + RB;
    int R = 0;  // tables in use
    for (int n = 0; n < N; n++) R = row_table[n] + 1 > R ? row_table[n] + 1 : R;
    std::vector<int32_t> runs((size_t)R * table_len * f);  // each table in 16-key runs (even indices)
    for (long i = 0; i < (long)R * table_len; i++)
        for (int j = 0; j < f; j++) runs[i * f + j] = 2 * (tables[i] * f + j);
    const int rl = table_len * f;
    int max_len = 0;
    for (int n = 0; n < N; n++) max_len = q_pos[n] + 1 > max_len ? q_pos[n] + 1 : max_len;
    const int Lpad = (max_len + I8_RUN - 1) / I8_RUN * I8_RUN;
    const bool amx = sizeof(T) == 2 && fast_paths && Dh == 64 && G <= 16 && window == 0 && amx_ready();
    std::vector<int> units;  // AMX: (first row, rows) of each unit, consecutive rows of one table
    if (amx)
        for (int n = 0; n < N;) {
            int r = 1;
            while (n + r < N && r < 16 / G && row_table[n + r] == row_table[n]) r++;
            units.push_back(n);
            units.push_back(r);
            n += r;
        }
#pragma omp parallel
    {
        if (slots != nullptr) {  // all rows written before any row reads (a prompt chunk reads its own keys)
#pragma omp for schedule(static)
            for (long n = 0; n < N; n++) {
                const long run = 2 * (slots[n] / I8_RUN);
                const int off = (int)(slots[n] % I8_RUN);
                for (int h = 0; h < Hkv; h++) {
                    quantize_key_i8(k_new + n * qs + (long)h * Dh, Dh, true, off, kplane + ((long)h * NR + run) * RB);
                    quantize_key_i8(v_new + n * qs + (long)h * Dh, Dh, false, off, vplane + ((long)h * NR + run) * RB);
                }
            }
        }
        float* sc = (float*)std::aligned_alloc(64, sizeof(float) * (size_t)(amx ? 16 : G) * Lpad);
        if (amx) {
#if ISOLAB_HAVE_AMX_ATTENTION
            if constexpr (sizeof(T) == 2) {
                attention_amx_configure();  // tile configuration is per thread
                alignas(64) uint16_t qb[16 * 64];
                alignas(64) float ob[16 * 64];
                alignas(64) uint16_t kt[16 * 64];
                alignas(64) uint16_t vt[16 * 64];
                std::memset(qb, 0, sizeof qb);
                std::memset(sc, 0, sizeof(float) * 16 * (size_t)Lpad);
                const long n_units = (long)units.size() / 2;
#pragma omp for schedule(dynamic, 1)
                for (long task = 0; task < n_units * Hkv; task++) {
                    const long u = task / Hkv;
                    const int h = (int)(task % Hkv), n0 = units[2 * u], r = units[2 * u + 1];
                    attend_unit_amx_i8((const uint16_t*)q, qs, kplane, vplane, runs.data() + (long)row_table[n0] * rl,
                                       q_pos, n0, r, G, H, NR, h, scale, (uint16_t*)out, sc, Lpad, qb, ob, kt, vt);
                }
                _tile_release();
            }
#endif
        } else {
#pragma omp for schedule(dynamic, 1)
            for (long task = 0; task < (long)N * Hkv; task++) {
                const int n = (int)(task / Hkv), h = (int)(task % Hkv);
                const int L = q_pos[n] + 1;
                window_start = window > 0 && L > window ? L - window : 0;
                const T* qr = q + n * qs + (long)h * G * Dh;
                T* orow = out + ((long)n * H + (long)h * G) * Dh;
                const int32_t* table = runs.data() + (long)row_table[n] * rl;
                if (Dh == 64) attend_i8_g<T, 64>(G, qr, kplane, vplane, table, L, NR, h, scale, orow, sc, Lpad, Dh);
                else if (Dh == 128) attend_i8_g<T, 128>(G, qr, kplane, vplane, table, L, NR, h, scale, orow, sc, Lpad, Dh);
                else if (Dh == 256) attend_i8_g<T, 256>(G, qr, kplane, vplane, table, L, NR, h, scale, orow, sc, Lpad, Dh);
                else attend_i8_g<T, 0>(G, qr, kplane, vplane, table, L, NR, h, scale, orow, sc, Lpad, Dh);
            }
            window_start = 0;
        }
        std::free(sc);
    }
}

extern "C" {
void isolab_attention_fast_paths(int on) { fast_paths = on; }
// 1 (default): a prompt chunk's rows four at a time (attend_rows_bf16); 0: every row alone. No bit changes.
void isolab_attention_row_units(int on) { row_units.store(on, std::memory_order_relaxed); }
int isolab_attention_bf16_dot() { return ISOLAB_HAVE_BF16_DOT || (ISOLAB_HAVE_AMX_ATTENTION && amx_ready()); }
// the path bf16 rows take: "amx" (tiles), "avx512bf16" (dot products) or "fma" (fp32 arithmetic)
const char* isolab_attention_isa() {
    return ISOLAB_HAVE_AMX_ATTENTION && amx_ready() ? "amx" : ISOLAB_HAVE_BF16_DOT ? "avx512bf16" : "fma";
}
// q, k_new, v_new: rows of one (N, W) buffer with row stride qs elements (q: H heads, k and v:
// Hkv heads, each Dh contiguous); slots: (N,) flat slot of each row's new K/V, or null to write
// nothing; out: (N, H, Dh) contiguous; tables: (R, table_len) block ids; row_table: (N,) which
// table each row uses; q_pos: (N,) the row sees keys 0..q_pos.
void isolab_paged_attention_bf16(const uint16_t* q, const uint16_t* k_new, const uint16_t* v_new, long qs,
                                 const int64_t* slots, uint16_t* k, uint16_t* v, const int32_t* tables,
                                 int table_len, const int32_t* row_table, const int32_t* q_pos, uint16_t* out, int N,
                                 int H, int Hkv, long NB, int bs, int Dh, float scale, int window) {
    attend_all<uint16_t>(q, k_new, v_new, qs, slots, k, v, tables, table_len, row_table, q_pos, out, N, H, Hkv, NB,
                         bs, Dh, scale, window);
}
// The int8 pool (attend_all_i8): (Hkv, NB * bs / 16, 2, 16 * (Dh + 4)) bytes, K and V runs side by side.
void isolab_paged_attention_i8_bf16(const uint16_t* q, const uint16_t* k_new, const uint16_t* v_new, long qs,
                                    const int64_t* slots, int8_t* pool, const int32_t* tables, int table_len,
                                    const int32_t* row_table, const int32_t* q_pos, uint16_t* out, int N, int H,
                                    int Hkv, long NB, int bs, int Dh, float scale, int window) {
    attend_all_i8<uint16_t>(q, k_new, v_new, qs, slots, pool, tables, table_len, row_table, q_pos, out, N, H, Hkv, NB,
                            bs, Dh, scale, window);
}
void isolab_paged_attention_i8_fp32(const float* q, const float* k_new, const float* v_new, long qs,
                                    const int64_t* slots, int8_t* pool, const int32_t* tables, int table_len,
                                    const int32_t* row_table, const int32_t* q_pos, float* out, int N, int H,
                                    int Hkv, long NB, int bs, int Dh, float scale, int window) {
    attend_all_i8<float>(q, k_new, v_new, qs, slots, pool, tables, table_len, row_table, q_pos, out, N, H, Hkv, NB,
                         bs, Dh, scale, window);
}
void isolab_paged_attention_fp32(const float* q, const float* k_new, const float* v_new, long qs,
                                 const int64_t* slots, float* k, float* v, const int32_t* tables, int table_len,
                                 const int32_t* row_table, const int32_t* q_pos, float* out, int N, int H, int Hkv,
                                 long NB, int bs, int Dh, float scale, int window) {
    attend_all<float>(q, k_new, v_new, qs, slots, k, v, tables, table_len, row_table, q_pos, out, N, H, Hkv, NB,
                      bs, Dh, scale, window);
}
}
