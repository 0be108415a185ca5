// The quantized record formats qgemm.cpp and qdense.cpp read (isolab/kernels/quant.py packs them):
// their kinds, a record's size, and the fp16 scales' exact widening.
#pragma once
#include <cstdint>
#include <cstring>

enum Fmt { U4 = 0, S8 = 1, S8G16 = 2 };  // quant.py: U4, S8, S8G16

// bytes of one record (16 columns x 32 k's): the integers, then the scales (16 a row, fp16 or fp32)
static inline long record_bytes(int fmt, bool fp16) {
    const long sb = fp16 ? 32 : 64;  // one row of 16 scales
    return fmt == U4 ? 256 + 2 * sb : fmt == S8 ? 512 + sb : 512 + 2 * sb;
}

// fp16 bits -> fp32, exactly (every fp16 is an fp32), subnormals and NaN payloads included
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {  // subnormal: normalize
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
