// The ceiling of the quantized GEMM's inner loop on this CPU (bench/vnni_ceiling.py builds and runs it).
// Each line times independent chains of AVX-512 VNNI dot products (vpdpbusd, 64 int8 multiply-adds
// each), alone and mixed with the fp32 multiplies and adds that qgemm.cpp's fold spends per block:
// a u4 block (Q4_0/Q4_1/Q4_K) is 8 dot products and 3 multiplies a (row, panel), an s8 block
// (Q8_0) 8 and 2. Where a multiply takes a dot product's port, the mix runs slower than the dot
// products alone: that ratio is the most a fold of that shape lets the GEMM reach.
#include <immintrin.h>
#include <omp.h>

#include <cstdio>

template <int NM, int NA>
static double dots_per_ns(long iters) {
    double rate = 0.0;
#pragma omp parallel reduction(+ : rate)
    {
        __m512i a[8];
        __m512 m[4], s[4];
        for (int i = 0; i < 8; i++) a[i] = _mm512_set1_epi32(i);
        for (int i = 0; i < 4; i++) m[i] = s[i] = _mm512_set1_ps(1.0f + i);
        __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(5);
        const __m512 f = _mm512_set1_ps(1.0000001f);
        const double t0 = omp_get_wtime();
        for (long it = 0; it < iters; it++) {
            for (int i = 0; i < 8; i++) a[i] = _mm512_dpbusd_epi32(a[i], x, y);
            for (int i = 0; i < NM; i++) m[i] = _mm512_mul_ps(m[i], f);
            for (int i = 0; i < NA; i++) s[i] = _mm512_add_ps(s[i], f);
            __asm__ volatile("" : "+v"(x), "+v"(y));
        }
        const double dt = omp_get_wtime() - t0;
        int sink = 0;
        float fs = 0.0f;
        for (int i = 0; i < 8; i++) sink += _mm512_reduce_add_epi32(a[i]);
        for (int i = 0; i < 4; i++) fs += _mm512_reduce_add_ps(m[i]) + _mm512_reduce_add_ps(s[i]);
        if (sink == 42 && fs == 1.0f) std::printf(" ");
        rate += 8.0 * iters / dt / 1e9;
    }
    return rate;  // dot products a ns, all threads together
}

int main() {
    const long n = 50000000;
    const double alone = dots_per_ns<0, 0>(n), u4 = dots_per_ns<3, 2>(n), s8 = dots_per_ns<2, 1>(n);
    std::printf("{\"threads\": %d, \"dots_per_ns\": %.3f, \"u4_fold_dots_per_ns\": %.3f, \"s8_fold_dots_per_ns\": %.3f}\n",
                omp_get_max_threads(), alone, u4, s8);
}
