/* Native block decoder for the CPU: GGML block types to float32 or bfloat16, bit for bit as the torch codecs in
 * simple.py, kquants.py, codebooks.py and ternary.py decode them.
 *
 * Built by native.py with the system C compiler (-O3 -march=native -ffp-contract=off, never -ffast-math) and
 * called through ctypes. Every float operation is the torch codec's, in its order: a sub-block scale is formed
 * first (d * sc for Q2_K, Q3_K, Q6_K; sc * d for Q4_K, Q5_K: the same IEEE product), then the code times that
 * scale, then the bias (the minimum, negated) is added. Products of an integer code and a float16-derived scale
 * are exact in float32, so only the bias addition rounds; nothing may be contracted into an FMA.
 *
 * Non-finite scales: a product with one NaN operand gives that NaN quieted whatever the order of the operands, and
 * a scale converted through the fp16 table (built from torch's own conversion, set by juno_set_f16_table) is
 * already quiet. When both operands of the bias addition are NaN, torch's add returns the bias's NaN: so does the
 * decoder (see emit16). bfloat16 output rounds the float32 value to nearest even, and every NaN becomes 0xFFFF,
 * which is what torch's float32 -> bfloat16 conversion writes.
 *
 * Work is done in vectors of 16 lanes (GCC/Clang vector extensions: one AVX-512 register, two AVX2 ones, four
 * NEON ones): every GGML packing is runs of 16 consecutive elements whose codes come from 16 consecutive bytes
 * by one shift and mask (plus, for 5- and 6-bit types, a second such field for the high bits).
 */

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "GGUF blocks are little-endian: the native decoder reads them in place"
#endif

#define JUNO_NATIVE_ABI 3
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* ---- vectors of LANES int32/float32 lanes: one register of the widest unit the target has ------------------------ */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LANES 16
#elif defined(__AVX2__)
#define LANES 8
#else
#define LANES 4
#endif

typedef uint8_t vu8 __attribute__((vector_size(LANES)));
typedef int8_t vi8 __attribute__((vector_size(LANES)));
typedef uint16_t vu16 __attribute__((vector_size(2 * LANES)));
typedef int16_t vi16 __attribute__((vector_size(2 * LANES)));
typedef int32_t vi32 __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu32 __attribute__((vector_size(4 * LANES)));
typedef float vf32 __attribute__((vector_size(4 * LANES)));
/* LANES bytes read from any address */
typedef vu8 vu8_any __attribute__((aligned(1), may_alias));
typedef vi8 vi8_any __attribute__((aligned(1), may_alias));

/* LANES consecutive bytes zero- or sign-extended to a lane each, and lanes narrowed to their low 16 bits: x86 has
 * one instruction for each, which GCC 12 does not find from __builtin_convertvector (it goes through general
 * registers); elsewhere the vector extensions do it in steps */
#if LANES == 16
#include <immintrin.h>
ALWAYS_INLINE vi32 widen_u8(const uint8_t *p) { return (vi32)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
ALWAYS_INLINE vi32 widen_i8(const uint8_t *p) { return (vi32)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
ALWAYS_INLINE vu16 narrow_u16(vu32 x) { return (vu16)_mm512_cvtepi32_epi16((__m512i)x); }
#elif LANES == 8
#include <immintrin.h>
ALWAYS_INLINE vi32 widen_u8(const uint8_t *p) { return (vi32)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
ALWAYS_INLINE vi32 widen_i8(const uint8_t *p) { return (vi32)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
ALWAYS_INLINE vu16 narrow_u16(vu32 x) {
    /* every lane is below 2^16, so packing with unsigned saturation keeps it */
    const __m256i w = (__m256i)x;
    return (vu16)_mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}
#else
ALWAYS_INLINE vi32 widen_u8(const uint8_t *p) {
    return __builtin_convertvector(__builtin_convertvector(*(const vu8_any *)p, vu16), vi32);
}
ALWAYS_INLINE vi32 widen_i8(const uint8_t *p) {
    return __builtin_convertvector(__builtin_convertvector(*(const vi8_any *)p, vi16), vi32);
}
ALWAYS_INLINE vu16 narrow_u16(vu32 x) { return __builtin_convertvector(x, vu16); }
#endif

ALWAYS_INLINE vf32 splat_f32(float x) {
#if LANES == 16
    return (vf32)_mm512_set1_ps(x); /* one broadcast: GCC builds the generic loop lane by lane */
#elif LANES == 8
    return (vf32)_mm256_set1_ps(x);
#else
    vf32 v;
    for (int i = 0; i < LANES; i++) v[i] = x;
    return v;
#endif
}

ALWAYS_INLINE vu32 lane_index(void) {
    vu32 v;
    for (int i = 0; i < LANES; i++) v[i] = (uint32_t)i;
    return v;
}

static float F16_TO_F32[65536];

int juno_native_abi(void) { return JUNO_NATIVE_ABI; }

void juno_set_f16_table(const float *table) { memcpy(F16_TO_F32, table, sizeof F16_TO_F32); }

ALWAYS_INLINE float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return F16_TO_F32[h];
}

/* ---- runs of consecutive elements ------------------------------------------------------------------------------- */

/* Where the codes of a run of consecutive elements lie. Element i of the run has the code
 *     (lo[i] >> lo_shift) & lo_mask  |  ((hi[i] >> hi_shift) & hi_mask) << hi_at  |  ((word >> (word_at + i)) & 1) << 4
 * minus offset, where a zero hi_mask or word_bits drops that part and a zero lo_mask reads lo[i] as an int8 code.
 * Every GGML packing is runs of 16 or 32 such elements: a few whole-vector shifts and masks of contiguous bytes
 * (the word: the 32 high bits of Q5_0 and Q5_1, bit j for element j). */
typedef struct {
    const uint8_t *lo;
    int lo_shift, lo_mask;
    const uint8_t *hi;
    int hi_shift, hi_mask, hi_at;
    int word_bits;
    uint32_t word;
    int word_at, offset;
} run_codes;

ALWAYS_INLINE vi32 codes_at(run_codes c, int i) {
    vi32 code = c.lo_mask ? (widen_u8(c.lo + i) >> c.lo_shift) & c.lo_mask : widen_i8(c.lo + i);
    if (c.hi_mask) code |= ((widen_u8(c.hi + i) >> c.hi_shift) & c.hi_mask) << c.hi_at;
    if (c.word_bits) code |= (vi32)((((vu32){0} + c.word) >> (lane_index() + (uint32_t)(c.word_at + i))) & 1u) << 4;
    return code - c.offset;
}

/* out[at .. at + n) = code * scale (+ bias when affine), float32 or rounded to bfloat16. code * scale is one exact
 * product; adding the bias is the one rounding. torch adds the bias as its second operand and returns the bias's
 * NaN when both are NaN: a NaN bias makes every value of the run that NaN. */
ALWAYS_INLINE void emit_run(run_codes c, float scale, float bias, int affine, void *out, int64_t at, int n, int bf16) {
    const int bias_nan = affine && bias != bias;
    for (int i = 0; i < n; i += LANES) {
        vf32 v = __builtin_convertvector(codes_at(c, i), vf32) * scale;
        if (affine) v = bias_nan ? splat_f32(bias) : v + bias;
        if (!bf16) {
            memcpy((float *)out + at + i, &v, sizeof v);
            continue;
        }
        /* to nearest even on the bits; a NaN lane becomes 0xFFFF */
        const vu32 u = (vu32)v;
        vu32 r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
        r |= (vu32)(v != v) & 0xFFFFu;
        const vu16 h = narrow_u16(r);
        memcpy((uint16_t *)out + at + i, &h, sizeof h);
    }
}

ALWAYS_INLINE run_codes field_run(const uint8_t *lo, int lo_shift, int lo_mask, int offset) {
    run_codes c = {lo, lo_shift, lo_mask, 0, 0, 0, 0, 0, 0, 0, offset};
    return c;
}

ALWAYS_INLINE run_codes with_high(run_codes c, const uint8_t *hi, int hi_shift, int hi_mask, int hi_at) {
    c.hi = hi;
    c.hi_shift = hi_shift;
    c.hi_mask = hi_mask;
    c.hi_at = hi_at;
    return c;
}

/* ---- 32-element block types: 16 nibble bytes, elements 0-15 in the low nibbles, 16-31 in the high ------------ */

/* value = d * (code - offset) (+ m); qh: the 5-bit types' 32 high bits, or none */
ALWAYS_INLINE void emit_nibble_block(const uint8_t *qs, const uint8_t *qh, int offset, float d, float m, int affine,
                                     void *out, int64_t at, int bf16) {
    for (int h = 0; h < 2; h++) {
        run_codes c = field_run(qs, 4 * h, 0x0F, offset);
        if (qh) {
            c.word_bits = 1;
            memcpy(&c.word, qh, 4);
            c.word_at = 16 * h;
        }
        emit_run(c, d, m, affine, out, at + 16 * h, 16, bf16);
    }
}

ALWAYS_INLINE void dec_q4_0(const uint8_t *b, void *out, int64_t at, int bf16) {
    emit_nibble_block(b + 2, 0, 8, f16_at(b), 0.0f, 0, out, at, bf16);
}

ALWAYS_INLINE void dec_q4_1(const uint8_t *b, void *out, int64_t at, int bf16) {
    emit_nibble_block(b + 4, 0, 0, f16_at(b), f16_at(b + 2), 1, out, at, bf16);
}

ALWAYS_INLINE void dec_q5_0(const uint8_t *b, void *out, int64_t at, int bf16) {
    emit_nibble_block(b + 6, b + 2, 16, f16_at(b), 0.0f, 0, out, at, bf16);
}

ALWAYS_INLINE void dec_q5_1(const uint8_t *b, void *out, int64_t at, int bf16) {
    emit_nibble_block(b + 8, b + 4, 0, f16_at(b), f16_at(b + 2), 1, out, at, bf16);
}

ALWAYS_INLINE void dec_q8_0(const uint8_t *b, void *out, int64_t at, int bf16) {
    emit_run(field_run(b + 2, 0, 0, 0), f16_at(b), 0.0f, 0, out, at, 32, bf16);
}

/* ---- k-quant super-blocks (256 elements) ----------------------------------------------------------------------- */

/* Q2_K and Q3_K pack 2-bit codes in 64 bytes, two groups of 32: a group gives bits 0-1 of its bytes (elements 0-31
 * of the group's 128), then bits 2-3, 4-5, 6-7. Sub-block s (16 elements) is half s % 2 of field (s % 8) / 2 of
 * group s / 8. */
ALWAYS_INLINE run_codes crumb_run(const uint8_t *qs, int s, int offset) {
    return field_run(qs + 32 * (s / 8) + 16 * (s % 2), 2 * ((s % 8) / 2), 3, offset);
}

ALWAYS_INLINE void dec_q2_k(const uint8_t *b, void *out, int64_t at, int bf16) {
    const float d = f16_at(b + 80), neg_dmin = -f16_at(b + 82);
    for (int s = 0; s < 16; s++) {
        /* scale and minimum of the sub-block: low and high nibble of byte s */
        const float scale = d * (float)(b[s] & 0x0F), bias = neg_dmin * (float)(b[s] >> 4);
        emit_run(crumb_run(b + 16, s, 0), scale, bias, 1, out, at + 16 * s, 16, bf16);
    }
}

ALWAYS_INLINE void dec_q3_k(const uint8_t *b, void *out, int64_t at, int bf16) {
    const uint8_t *sc = b + 96;
    const float d = f16_at(b + 108);
    for (int s = 0; s < 16; s++) {
        /* 6-bit scales stored with an offset of 32: low nibbles of bytes 0-7 (scales 0-7, then 8-15 from the high
         * nibbles), the high 2 bits of scale 4k + l in bits 2k of byte 8 + l */
        const int low = s < 8 ? sc[s] & 0x0F : sc[s - 8] >> 4;
        const int high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        const float scale = d * (float)((low | high << 4) - 32);
        /* element 32k + l takes bit k of hmask byte l as its bit 2; codes are offset by 4 */
        emit_run(with_high(crumb_run(b + 32, s, 4), b + 16 * (s % 2), s / 2, 1, 2), scale, 0.0f, 0, out,
                 at + 16 * s, 16, bf16);
    }
}

/* the eight 6-bit scales and minimums of Q4_K and Q5_K, packed in 12 bytes (llama.cpp's get_scale_min_k4) */
ALWAYS_INLINE void k_scale_min(const uint8_t *p, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = p[j] & 63;
        *m = p[j + 4] & 63;
    } else {
        *sc = (p[j + 4] & 0x0F) | ((p[j - 4] >> 6) << 4);
        *m = (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
    }
}

/* Q4_K and Q5_K: 4-bit codes in 128 bytes, four groups of 32 giving their low nibbles (sub-block 2g of 32
 * elements), then their high nibbles (2g + 1); Q5_K's fifth bit of element 32s + l is bit s of qh byte l.
 * value = code · (sc · d) + m · (−dmin) */
ALWAYS_INLINE void emit_k4_block(const uint8_t *b, const uint8_t *qs, const uint8_t *qh, void *out, int64_t at,
                                 int bf16) {
    const float d = f16_at(b), neg_dmin = -f16_at(b + 2);
    for (int s = 0; s < 8; s++) {
        int sc, m;
        k_scale_min(b + 4, s, &sc, &m);
        const float scale = (float)sc * d, bias = (float)m * neg_dmin;
        run_codes c = field_run(qs + 32 * (s / 2), 4 * (s % 2), 0x0F, 0);
        if (qh) c = with_high(c, qh, s, 1, 4);
        emit_run(c, scale, bias, 1, out, at + 32 * s, 32, bf16);
    }
}

ALWAYS_INLINE void dec_q4_k(const uint8_t *b, void *out, int64_t at, int bf16) {
    emit_k4_block(b, b + 16, 0, out, at, bf16);
}

ALWAYS_INLINE void dec_q5_k(const uint8_t *b, void *out, int64_t at, int bf16) {
    emit_k4_block(b, b + 48, b + 16, out, at, bf16);
}

ALWAYS_INLINE void dec_q6_k(const uint8_t *b, void *out, int64_t at, int bf16) {
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16_at(b + 208);
    for (int s = 0; s < 16; s++) {
        /* element r of group g (128 each): low 4 bits from ql byte 64g + r % 64 (the low nibble below r = 64, the
         * high one from there), high 2 bits from qh byte 32g + r % 32, bits 2·(r / 32); codes offset by 32 */
        const int g = s / 8, r = 16 * (s % 8);
        const run_codes c = with_high(field_run(b + 64 * g + r % 64, r < 64 ? 0 : 4, 0x0F, 32),
                                      b + 128 + 32 * g + r % 32, 2 * (r / 32), 3, 4);
        emit_run(c, d * (float)sc[s], 0.0f, 0, out, at + 16 * s, 16, bf16);
    }
}

/* ---- codebook, ternary and MXFP4 types: one value at a time ----------------------------------------------------- */

/* The grids (int8 points, 8 or 4 values each) and MXFP4's doubled e2m1 levels, set by juno_set_table from the codec's
 * own tables (which come from the gguf package). Each value is the torch codec's product, in its order: a sub-block
 * scale (d · (s + 0.5) · factor, d · (1 + 2s) or d · (2s + 1)) times the grid point, then times ±1 (IQ2, IQ3) or
 * times (point ± 1/8) (IQ1), or code · d (TQ1_0, TQ2_0, MXFP4). Every product is exact; for bfloat16 the float32
 * value is rounded to nearest even once, a NaN written as 0xFFFF (emit_run's rule). */
static int8_t GRID_IQ2_XXS[256 * 8], GRID_IQ2_XS[512 * 8], GRID_IQ2_S[1024 * 8], GRID_IQ3_XXS[256 * 4],
    GRID_IQ3_S[512 * 4], GRID_IQ1_S[2048 * 8], GRID_IQ1_M[2048 * 8], LEVELS_MXFP4[16];

/* copy a table in: the GGML type's grid or levels, n bytes; 0, or -1 for another type or size */
int juno_set_table(int ggml_type, const int8_t *table, int64_t n) {
    int8_t *dst;
    int64_t size;
    switch (ggml_type) {
        case 16: dst = GRID_IQ2_XXS, size = sizeof GRID_IQ2_XXS; break;
        case 17: dst = GRID_IQ2_XS, size = sizeof GRID_IQ2_XS; break;
        case 18: dst = GRID_IQ3_XXS, size = sizeof GRID_IQ3_XXS; break;
        case 19: dst = GRID_IQ1_S, size = sizeof GRID_IQ1_S; break;
        case 21: dst = GRID_IQ3_S, size = sizeof GRID_IQ3_S; break;
        case 22: dst = GRID_IQ2_S, size = sizeof GRID_IQ2_S; break;
        case 29: dst = GRID_IQ1_M, size = sizeof GRID_IQ1_M; break;
        case 39: dst = LEVELS_MXFP4, size = sizeof LEVELS_MXFP4; break;
        default: return -1;
    }
    if (n != size) return -1;
    memcpy(dst, table, (size_t)size);
    return 0;
}

/* v[0 .. n) to out[at ..) as float32, or rounded to bfloat16 */
ALWAYS_INLINE void store_values(const float *v, int n, void *out, int64_t at, int bf16) {
    if (!bf16) {
        memcpy((float *)out + at, v, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *o = (uint16_t *)out + at;
    for (int i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, v + i, 4);
        o[i] = v[i] != v[i] ? 0xFFFF : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
}

ALWAYS_INLINE uint32_t u16_at(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8; }

ALWAYS_INLINE uint32_t u32_at(const uint8_t *p) {
    uint32_t x;
    memcpy(&x, p, 4);
    return x;
}

/* llama.cpp's ksigns: a 7-bit sign index, and as bit 7 its parity */
ALWAYS_INLINE int ksign(uint32_t index) { return (int)(index | (uint32_t)__builtin_parity(index) << 7); }

/* 8 values: scale · point · (±1 by the bits of sign). The ±1 is made from its bits: a product with a constant −1
 * may be compiled as a negation, which flips the sign of a NaN where torch's product keeps it. */
ALWAYS_INLINE void signed_point(float *v, float scale, const int8_t *point, int sign) {
    for (int j = 0; j < 8; j++) {
        const uint32_t one = 0x3F800000u | (uint32_t)((sign >> j) & 1) << 31;
        float pm;
        memcpy(&pm, &one, 4);
        v[j] = scale * (float)point[j] * pm;
    }
}

ALWAYS_INLINE void dec_iq2_xxs(const uint8_t *b, void *out, int64_t at, int bf16) {
    const float d = f16_at(b);
    float v[256];
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = b + 2 + 8 * ib;
        const uint32_t aux = u32_at(q + 4);
        const float scale = d * ((float)(aux >> 28) + 0.5f) * 0.25f;
        for (int l = 0; l < 4; l++)
            signed_point(v + 32 * ib + 8 * l, scale, GRID_IQ2_XXS + 8 * q[l], ksign((aux >> (7 * l)) & 127));
    }
    store_values(v, 256, out, at, bf16);
}

ALWAYS_INLINE void dec_iq2_xs(const uint8_t *b, void *out, int64_t at, int bf16) {
    const float d = f16_at(b);
    float v[256];
    for (int g = 0; g < 32; g++) {
        const uint32_t q = u16_at(b + 2 + 2 * g);
        const int sb = g / 2;
        const float scale = d * ((float)((b[66 + sb / 2] >> (4 * (sb % 2))) & 15) + 0.5f) * 0.25f;
        signed_point(v + 8 * g, scale, GRID_IQ2_XS + 8 * (q & 511), ksign(q >> 9));
    }
    store_values(v, 256, out, at, bf16);
}

ALWAYS_INLINE void dec_iq2_s(const uint8_t *b, void *out, int64_t at, int bf16) {
    const float d = f16_at(b);
    float v[256];
    for (int g = 0; g < 32; g++) {
        const int index = b[2 + g] | ((b[66 + g / 4] >> (2 * (g % 4))) & 3) << 8;
        const int sb = g / 2;
        const float scale = d * ((float)((b[74 + sb / 2] >> (4 * (sb % 2))) & 15) + 0.5f) * 0.25f;
        signed_point(v + 8 * g, scale, GRID_IQ2_S + 8 * index, b[34 + g]);
    }
    store_values(v, 256, out, at, bf16);
}

ALWAYS_INLINE void dec_iq3_xxs(const uint8_t *b, void *out, int64_t at, int bf16) {
    const float d = f16_at(b);
    float v[256];
    for (int ib = 0; ib < 8; ib++) {
        const uint32_t aux = u32_at(b + 66 + 4 * ib);
        const float scale = d * ((float)(aux >> 28) + 0.5f) * 0.5f;
        for (int l = 0; l < 4; l++) {
            int8_t point[8];
            memcpy(point, GRID_IQ3_XXS + 4 * b[2 + 8 * ib + 2 * l], 4);
            memcpy(point + 4, GRID_IQ3_XXS + 4 * b[2 + 8 * ib + 2 * l + 1], 4);
            signed_point(v + 32 * ib + 8 * l, scale, point, ksign((aux >> (7 * l)) & 127));
        }
    }
    store_values(v, 256, out, at, bf16);
}

ALWAYS_INLINE void dec_iq3_s(const uint8_t *b, void *out, int64_t at, int bf16) {
    const float d = f16_at(b);
    float v[256];
    for (int ib = 0; ib < 8; ib++) {
        const float scale = d * (float)(1 + 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 15));
        for (int l = 0; l < 4; l++) {
            const int g = 4 * ib + l, k = 2 * g;
            int8_t point[8];
            memcpy(point, GRID_IQ3_S + 4 * (b[2 + k] | ((b[66 + k / 8] >> (k % 8)) & 1) << 8), 4);
            memcpy(point + 4, GRID_IQ3_S + 4 * (b[3 + k] | ((b[66 + (k + 1) / 8] >> ((k + 1) % 8)) & 1) << 8), 4);
            signed_point(v + 8 * g, scale, point, b[74 + g]);
        }
    }
    store_values(v, 256, out, at, bf16);
}

/* 8 values: scale · (point ± 1/8) */
ALWAYS_INLINE void shifted_point(float *v, float scale, const int8_t *point, int negative) {
    const float delta = negative ? -0.125f : 0.125f;
    for (int j = 0; j < 8; j++) v[j] = scale * ((float)point[j] + delta);
}

ALWAYS_INLINE void dec_iq1_s(const uint8_t *b, void *out, int64_t at, int bf16) {
    const float d = f16_at(b);
    float v[256];
    for (int ib = 0; ib < 8; ib++) {
        const uint32_t qh = u16_at(b + 34 + 2 * ib);
        const float scale = d * (float)(2 * ((qh >> 12) & 7) + 1);
        for (int l = 0; l < 4; l++) {
            const int index = b[2 + 4 * ib + l] | (int)((qh >> (3 * l)) & 7) << 8;
            shifted_point(v + 32 * ib + 8 * l, scale, GRID_IQ1_S + 8 * index, (qh & 0x8000) != 0);
        }
    }
    store_values(v, 256, out, at, bf16);
}

ALWAYS_INLINE void dec_iq1_m(const uint8_t *b, void *out, int64_t at, int bf16) {
    /* the float16 scale: the top nibbles of the four uint16s at byte 48 */
    const uint32_t bits = (u16_at(b + 48) >> 12) | (u16_at(b + 50) >> 12) << 4 | (u16_at(b + 52) >> 12) << 8 |
                          (u16_at(b + 54) >> 12) << 12;
    const float d = F16_TO_F32[bits];
    float v[256];
    for (int sb = 0; sb < 16; sb++) {
        const float scale = d * (float)(2 * ((u16_at(b + 48 + 2 * (sb / 4)) >> (3 * (sb % 4))) & 7) + 1);
        for (int h = 0; h < 2; h++) {
            const int g = 2 * sb + h, nib = (b[32 + sb] >> (4 * h)) & 15;
            shifted_point(v + 8 * g, scale, GRID_IQ1_M + 8 * (b[g] | (nib & 7) << 8), (nib & 8) != 0);
        }
    }
    store_values(v, 256, out, at, bf16);
}

/* digit k (0-4) of a TQ1_0 byte, as −1, 0, +1 */
ALWAYS_INLINE int trit(int byte, int k) {
    static const int POW3[5] = {1, 3, 9, 27, 81};
    return (((byte * POW3[k]) & 0xFF) * 3 >> 8) - 1;
}

ALWAYS_INLINE void dec_tq1_0(const uint8_t *b, void *out, int64_t at, int bf16) {
    const float d = f16_at(b + 52);
    float v[256];
    for (int k = 0; k < 5; k++) {
        for (int l = 0; l < 32; l++) v[32 * k + l] = (float)trit(b[l], k) * d;
        for (int l = 0; l < 16; l++) v[160 + 16 * k + l] = (float)trit(b[32 + l], k) * d;
    }
    for (int k = 0; k < 4; k++)
        for (int l = 0; l < 4; l++) v[240 + 4 * k + l] = (float)trit(b[48 + l], k) * d;
    store_values(v, 256, out, at, bf16);
}

ALWAYS_INLINE void dec_tq2_0(const uint8_t *b, void *out, int64_t at, int bf16) {
    /* element 128g + 32f + l: bits 2f of byte 32g + l, offset by 1 */
    const float d = f16_at(b + 64);
    for (int g = 0; g < 2; g++)
        for (int f = 0; f < 4; f++)
            emit_run(field_run(b + 32 * g, 2 * f, 3, 1), d, 0.0f, 0, out, at + 128 * g + 32 * f, 32, bf16);
}

ALWAYS_INLINE void dec_mxfp4(const uint8_t *b, void *out, int64_t at, int bf16) {
    /* the e8m0 byte e as float32 bits: 2^(e − 128), the subnormals 2^-128 and 2^-127 below e = 2 */
    const uint32_t e = b[0], bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
    float d, v[32];
    memcpy(&d, &bits, 4);
    for (int l = 0; l < 16; l++) {
        v[l] = (float)LEVELS_MXFP4[b[1 + l] & 15] * d;
        v[16 + l] = (float)LEVELS_MXFP4[b[1 + l] >> 4] * d;
    }
    store_values(v, 32, out, at, bf16);
}

/* ---- the block loop and threads -------------------------------------------------------------------------------- */

typedef void (*range_fn)(const uint8_t *src, int64_t first, int64_t last, void *dst, int bf16);

/* a decoder over blocks [first, last); the output dtype is a constant inside each loop */
#define BLOCK_LOOP(name, block_size, type_size)                                                          \
    static void name##_range(const uint8_t *src, int64_t first, int64_t last, void *dst, int bf16) {     \
        if (bf16)                                                                                        \
            for (int64_t i = first; i < last; i++) dec_##name(src + i * (type_size), dst, i * (block_size), 1); \
        else                                                                                             \
            for (int64_t i = first; i < last; i++) dec_##name(src + i * (type_size), dst, i * (block_size), 0); \
    }

BLOCK_LOOP(q4_0, 32, 18)
BLOCK_LOOP(q4_1, 32, 20)
BLOCK_LOOP(q5_0, 32, 22)
BLOCK_LOOP(q5_1, 32, 24)
BLOCK_LOOP(q8_0, 32, 34)
BLOCK_LOOP(q2_k, 256, 84)
BLOCK_LOOP(q3_k, 256, 110)
BLOCK_LOOP(q4_k, 256, 144)
BLOCK_LOOP(q5_k, 256, 176)
BLOCK_LOOP(q6_k, 256, 210)
BLOCK_LOOP(iq2_xxs, 256, 66)
BLOCK_LOOP(iq2_xs, 256, 74)
BLOCK_LOOP(iq3_xxs, 256, 98)
BLOCK_LOOP(iq1_s, 256, 50)
BLOCK_LOOP(iq3_s, 256, 110)
BLOCK_LOOP(iq2_s, 256, 82)
BLOCK_LOOP(iq1_m, 256, 56)
BLOCK_LOOP(tq1_0, 256, 54)
BLOCK_LOOP(tq2_0, 256, 66)
BLOCK_LOOP(mxfp4, 32, 17)

/* by GGML type id */
static range_fn decoder_of(int ggml_type) {
    switch (ggml_type) {
        case 2: return q4_0_range;
        case 3: return q4_1_range;
        case 6: return q5_0_range;
        case 7: return q5_1_range;
        case 8: return q8_0_range;
        case 10: return q2_k_range;
        case 11: return q3_k_range;
        case 12: return q4_k_range;
        case 13: return q5_k_range;
        case 14: return q6_k_range;
        case 16: return iq2_xxs_range;
        case 17: return iq2_xs_range;
        case 18: return iq3_xxs_range;
        case 19: return iq1_s_range;
        case 21: return iq3_s_range;
        case 22: return iq2_s_range;
        case 29: return iq1_m_range;
        case 34: return tq1_0_range;
        case 35: return tq2_0_range;
        case 39: return mxfp4_range;
        default: return 0;
    }
}

struct part {
    range_fn fn;
    const uint8_t *src;
    int64_t first, last;
    void *dst;
    int bf16;
};

static void *run_part(void *arg) {
    struct part *p = (struct part *)arg;
    p->fn(p->src, p->first, p->last, p->dst, p->bf16);
    return 0;
}

#define MAX_THREADS 64

/* Decode blocks [first, last) of `src` (type_size bytes each) into dst (float32, or bfloat16 when bf16 != 0), block
 * i at element i * block_size of dst. n_threads > 1 splits the blocks into that many ranges, one per pthread (the
 * calling thread takes the first). Returns 0, or -1 for a type without a decoder. */
int juno_decode_blocks(int ggml_type, const uint8_t *src, int64_t first, int64_t last, void *dst, int bf16,
                       int n_threads) {
    range_fn fn = decoder_of(ggml_type);
    if (!fn) return -1;
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    if (n_threads <= 1 || last - first < n_threads) {
        fn(src, first, last, dst, bf16);
        return 0;
    }
    struct part parts[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    const int64_t n = last - first;
    for (int t = 0; t < n_threads; t++)
        parts[t] = (struct part){fn, src, first + n * t / n_threads, first + n * (t + 1) / n_threads, dst, bf16};
    for (int t = 1; t < n_threads; t++) started[t] = pthread_create(&threads[t], 0, run_part, &parts[t]) == 0;
    run_part(&parts[0]);
    for (int t = 1; t < n_threads; t++) {
        if (started[t])
            pthread_join(threads[t], 0);
        else
            run_part(&parts[t]); /* no thread to be had: this one does the part */
    }
    return 0;
}

/* ---- fused dequantize-dot: matrix-vector products straight from the blocks ---------------------------------------
 *
 * y[r] = Σ_i W[r, i] · x[i] for the rows of a GGUF tensor, never writing W out: each block's codes are widened to
 * float lanes, multiplied by x and accumulated in vectors; the block or sub-block scale multiplies its accumulated
 * run once, and an affine type's bias (its minimum) multiplies the precomputed sum of x over the run. This is the
 * decoded W's dot product regrouped (code·scale·x summed as scale·Σ code·x): float32 sums in another order, not the
 * same bits as decode-then-GEMM, within float32 rounding of them. The types without a fused kernel here decode one
 * block into a buffer on the stack and take its dot product; F32, F16 and BF16 rows convert as they are read.
 *
 * The rows of a call (one or several tasks: q, k and v of a block share their input) are split in chunks that the
 * calling thread and the pool's workers claim one at a time, so a thread the system descheduled holds back one
 * chunk, not a fixed share. Workers spin briefly for the next call, then sleep. */

#include <stdlib.h>
#include <sched.h>

ALWAYS_INLINE vf32 load_f32(const float *p) {
    vf32 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* a·b + c, one rounding where the target has FMA (the compile flags forbid contracting a*b+c on their own) */
ALWAYS_INLINE vf32 fma_f32(vf32 a, vf32 b, vf32 c) {
#if LANES == 16
    return (vf32)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif LANES == 8 && defined(__FMA__)
    return (vf32)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

ALWAYS_INLINE float hsum_f32(vf32 v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

/* acc + Σ code_i · x_i over a run of n elements, lane by lane */
ALWAYS_INLINE vf32 dot_run(run_codes c, const float *x, int n, vf32 acc) {
    for (int i = 0; i < n; i += LANES) acc = fma_f32(__builtin_convertvector(codes_at(c, i), vf32), load_f32(x + i), acc);
    return acc;
}

/* one row: x and xs16 (sums of x over each run of 16 elements) start at the row's first element */
typedef float (*row_dot_fn)(const uint8_t *row, const float *x, const float *xs16, int64_t n_blocks);

/* Q4_0, Q4_1, Q5_0, Q5_1: value = d · (code − offset) (+ m) */
ALWAYS_INLINE float dot_nibble_rows(const uint8_t *row, const float *x, const float *xs16, int64_t n_blocks,
                                    int type_size, int qs_at, int qh_at, int offset, int affine) {
    vf32 acc = splat_f32(0.0f);
    float bias_sum = 0.0f;
    for (int64_t ib = 0; ib < n_blocks; ib++) {
        const uint8_t *b = row + ib * type_size;
        const float *xb = x + 32 * ib;
        vf32 part = splat_f32(0.0f);
        for (int h = 0; h < 2; h++) {
            run_codes c = field_run(b + qs_at, 4 * h, 0x0F, offset);
            if (qh_at) {
                c.word_bits = 1;
                memcpy(&c.word, b + qh_at, 4);
                c.word_at = 16 * h;
            }
            part = dot_run(c, xb + 16 * h, 16, part);
        }
        acc = fma_f32(splat_f32(f16_at(b)), part, acc);
        if (affine) bias_sum += f16_at(b + 2) * (xs16[2 * ib] + xs16[2 * ib + 1]);
    }
    return hsum_f32(acc) + bias_sum;
}

static float dot_q4_0(const uint8_t *r, const float *x, const float *s, int64_t n) {
    return dot_nibble_rows(r, x, s, n, 18, 2, 0, 8, 0);
}
static float dot_q4_1(const uint8_t *r, const float *x, const float *s, int64_t n) {
    return dot_nibble_rows(r, x, s, n, 20, 4, 0, 0, 1);
}
static float dot_q5_0(const uint8_t *r, const float *x, const float *s, int64_t n) {
    return dot_nibble_rows(r, x, s, n, 22, 6, 2, 16, 0);
}
static float dot_q5_1(const uint8_t *r, const float *x, const float *s, int64_t n) {
    return dot_nibble_rows(r, x, s, n, 24, 8, 4, 0, 1);
}

static float dot_q8_0(const uint8_t *row, const float *x, const float *xs16, int64_t n_blocks) {
    (void)xs16;
    vf32 acc = splat_f32(0.0f);
    for (int64_t ib = 0; ib < n_blocks; ib++) {
        const uint8_t *b = row + 34 * ib;
        acc = fma_f32(splat_f32(f16_at(b)), dot_run(field_run(b + 2, 0, 0, 0), x + 32 * ib, 32, splat_f32(0.0f)), acc);
    }
    return hsum_f32(acc);
}

static float dot_q2_k(const uint8_t *row, const float *x, const float *xs16, int64_t n_blocks) {
    vf32 acc = splat_f32(0.0f);
    float bias_sum = 0.0f;
    for (int64_t ib = 0; ib < n_blocks; ib++) {
        const uint8_t *b = row + 84 * ib;
        const float d = f16_at(b + 80), neg_dmin = -f16_at(b + 82);
        for (int s = 0; s < 16; s++) {
            const vf32 part = dot_run(crumb_run(b + 16, s, 0), x + 256 * ib + 16 * s, 16, splat_f32(0.0f));
            acc = fma_f32(splat_f32(d * (float)(b[s] & 0x0F)), part, acc);
            bias_sum += neg_dmin * (float)(b[s] >> 4) * xs16[16 * ib + s];
        }
    }
    return hsum_f32(acc) + bias_sum;
}

static float dot_q3_k(const uint8_t *row, const float *x, const float *xs16, int64_t n_blocks) {
    (void)xs16;
    vf32 acc = splat_f32(0.0f);
    for (int64_t ib = 0; ib < n_blocks; ib++) {
        const uint8_t *b = row + 110 * ib, *sc = b + 96;
        const float d = f16_at(b + 108);
        for (int s = 0; s < 16; s++) {
            const int low = s < 8 ? sc[s] & 0x0F : sc[s - 8] >> 4;
            const int high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
            const run_codes c = with_high(crumb_run(b + 32, s, 4), b + 16 * (s % 2), s / 2, 1, 2);
            acc = fma_f32(splat_f32(d * (float)((low | high << 4) - 32)),
                          dot_run(c, x + 256 * ib + 16 * s, 16, splat_f32(0.0f)), acc);
        }
    }
    return hsum_f32(acc);
}

ALWAYS_INLINE float dot_k4_rows(const uint8_t *row, const float *x, const float *xs16, int64_t n_blocks,
                                int type_size, int qs_at, int qh_at) {
    vf32 acc = splat_f32(0.0f);
    float bias_sum = 0.0f;
    for (int64_t ib = 0; ib < n_blocks; ib++) {
        const uint8_t *b = row + ib * type_size;
        const float d = f16_at(b), neg_dmin = -f16_at(b + 2);
        for (int s = 0; s < 8; s++) {
            int sc, m;
            k_scale_min(b + 4, s, &sc, &m);
            run_codes c = field_run(b + qs_at + 32 * (s / 2), 4 * (s % 2), 0x0F, 0);
            if (qh_at) c = with_high(c, b + qh_at, s, 1, 4);
            acc = fma_f32(splat_f32((float)sc * d), dot_run(c, x + 256 * ib + 32 * s, 32, splat_f32(0.0f)), acc);
            bias_sum += (float)m * neg_dmin * (xs16[16 * ib + 2 * s] + xs16[16 * ib + 2 * s + 1]);
        }
    }
    return hsum_f32(acc) + bias_sum;
}

static float dot_q4_k(const uint8_t *r, const float *x, const float *s, int64_t n) {
    return dot_k4_rows(r, x, s, n, 144, 16, 0);
}
static float dot_q5_k(const uint8_t *r, const float *x, const float *s, int64_t n) {
    return dot_k4_rows(r, x, s, n, 176, 48, 16);
}

static float dot_q6_k(const uint8_t *row, const float *x, const float *xs16, int64_t n_blocks) {
    (void)xs16;
    vf32 acc = splat_f32(0.0f);
    for (int64_t ib = 0; ib < n_blocks; ib++) {
        const uint8_t *b = row + 210 * ib;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = f16_at(b + 208);
        for (int s = 0; s < 16; s++) {
            const int g = s / 8, r = 16 * (s % 8);
            const run_codes c = with_high(field_run(b + 64 * g + r % 64, r < 64 ? 0 : 4, 0x0F, 32),
                                          b + 128 + 32 * g + r % 32, 2 * (r / 32), 3, 4);
            acc = fma_f32(splat_f32(d * (float)sc[s]), dot_run(c, x + 256 * ib + 16 * s, 16, splat_f32(0.0f)), acc);
        }
    }
    return hsum_f32(acc);
}

/* the other block types: one block decoded to float32 on the stack, then its dot product */
#define DECODED_DOT(name, block_size, type_size)                                                                 \
    static float dot_##name(const uint8_t *row, const float *x, const float *xs16, int64_t n_blocks) {          \
        (void)xs16;                                                                                              \
        float buf[block_size] __attribute__((aligned(64)));                                                      \
        vf32 acc = splat_f32(0.0f);                                                                              \
        for (int64_t ib = 0; ib < n_blocks; ib++) {                                                              \
            dec_##name(row + ib * (type_size), buf, 0, 0);                                                       \
            for (int i = 0; i < (block_size); i += LANES)                                                        \
                acc = fma_f32(load_f32(buf + i), load_f32(x + (block_size) * ib + i), acc);                      \
        }                                                                                                        \
        return hsum_f32(acc);                                                                                    \
    }

DECODED_DOT(iq2_xxs, 256, 66)
DECODED_DOT(iq2_xs, 256, 74)
DECODED_DOT(iq3_xxs, 256, 98)
DECODED_DOT(iq1_s, 256, 50)
DECODED_DOT(iq3_s, 256, 110)
DECODED_DOT(iq2_s, 256, 82)
DECODED_DOT(iq1_m, 256, 56)
DECODED_DOT(tq1_0, 256, 54)
DECODED_DOT(tq2_0, 256, 66)
DECODED_DOT(mxfp4, 32, 17)

/* float rows (block size 1: any length, the tail lane by lane) */
static float dot_f32(const uint8_t *row, const float *x, const float *xs16, int64_t n) {
    (void)xs16;
    const float *w = (const float *)row; /* GGUF aligns tensor data; a row of floats is 4-byte aligned */
    vf32 acc = splat_f32(0.0f);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) acc = fma_f32(load_f32(w + i), load_f32(x + i), acc);
    float s = hsum_f32(acc);
    for (; i < n; i++) s += w[i] * x[i];
    return s;
}

ALWAYS_INLINE float bf16_value(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float dot_bf16(const uint8_t *row, const float *x, const float *xs16, int64_t n) {
    (void)xs16;
    vf32 acc = splat_f32(0.0f);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vu16 h;
        memcpy(&h, row + 2 * i, sizeof h);
        const vu32 u = __builtin_convertvector(h, vu32) << 16;
        acc = fma_f32((vf32)u, load_f32(x + i), acc);
    }
    float s = hsum_f32(acc);
    for (; i < n; i++) {
        uint16_t h;
        memcpy(&h, row + 2 * i, 2);
        s += bf16_value(h) * x[i];
    }
    return s;
}

static float dot_f16(const uint8_t *row, const float *x, const float *xs16, int64_t n) {
    (void)xs16;
    vf32 acc = splat_f32(0.0f);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
#if LANES == 16
        const vf32 w = (vf32)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * i)));
#elif LANES == 8 && defined(__F16C__)
        const vf32 w = (vf32)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i)));
#else
        vf32 w;
        for (int l = 0; l < LANES; l++) w[l] = f16_at(row + 2 * (i + l));
#endif
        acc = fma_f32(w, load_f32(x + i), acc);
    }
    float s = hsum_f32(acc);
    for (; i < n; i++) s += f16_at(row + 2 * i) * x[i];
    return s;
}

/* by GGML type id, with the block size (elements) */
static row_dot_fn row_dot_of(int ggml_type, int *block_size) {
    *block_size = 256;
    switch (ggml_type) {
        case 0: *block_size = 1; return dot_f32;
        case 1: *block_size = 1; return dot_f16;
        case 30: *block_size = 1; return dot_bf16;
        case 2: *block_size = 32; return dot_q4_0;
        case 3: *block_size = 32; return dot_q4_1;
        case 6: *block_size = 32; return dot_q5_0;
        case 7: *block_size = 32; return dot_q5_1;
        case 8: *block_size = 32; return dot_q8_0;
        case 10: return dot_q2_k;
        case 11: return dot_q3_k;
        case 12: return dot_q4_k;
        case 13: return dot_q5_k;
        case 14: return dot_q6_k;
        case 16: return dot_iq2_xxs;
        case 17: return dot_iq2_xs;
        case 18: return dot_iq3_xxs;
        case 19: return dot_iq1_s;
        case 21: return dot_iq3_s;
        case 22: return dot_iq2_s;
        case 29: return dot_iq1_m;
        case 34: return dot_tq1_0;
        case 35: return dot_tq2_0;
        case 39: *block_size = 32; return dot_mxfp4;
        default: return 0;
    }
}

/* one product y[0 .. n_rows) = W · x: W's rows are row_bytes apart from w */
typedef struct {
    int64_t ggml_type;
    const uint8_t *w;
    int64_t row_bytes, n_rows, n_in;
    const float *x;
    float *y;
} juno_mv_task;

int juno_matvec_supports(int ggml_type) {
    int bs;
    return row_dot_of(ggml_type, &bs) != 0;
}

/* ---- the pool -------------------------------------------------------------------------------------------------- */

#define MV_MAX_TASKS 64
#define MV_CHUNK_ELEMENTS 16384 /* weights per claimed chunk: about 10 µs of work */

typedef struct {
    const juno_mv_task *tasks;
    int n_tasks;
    int64_t first_chunk[MV_MAX_TASKS + 1]; /* chunk index where each task starts */
    int64_t rows_per_chunk[MV_MAX_TASKS];
    row_dot_fn fn[MV_MAX_TASKS];
    int block_size[MV_MAX_TASKS];
    uint64_t serial; /* products started so far, this one included */
} mv_job;

/* state: generation (bits 40-63), chunks in the job (20-39), next chunk to claim (0-19). Claiming compares the
 * whole word, so a worker that saw an old generation can never claim a chunk of a newer job. */
static volatile uint64_t mv_state;
static volatile int64_t mv_done;
static mv_job mv_current;
static volatile int mv_active = 0; /* workers taking part: the thread count asked for, minus the caller */
static int mv_workers = 0;          /* workers started */
static volatile int mv_sleepers = 0;
static pthread_mutex_t mv_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t mv_wake = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t mv_call = PTHREAD_MUTEX_INITIALIZER; /* one product at a time */

#define MV_GEN(s) ((s) >> 40)
#define MV_TOTAL(s) (((s) >> 20) & 0xFFFFF)
#define MV_NEXT(s) ((s) & 0xFFFFF)
#define MV_MAX_CHUNKS 0xFFFFF

ALWAYS_INLINE void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

typedef struct {
    float *xs16;
    int64_t cap;
    const float *for_x; /* the input whose sums xs16 holds, in the product numbered for_serial */
    uint64_t for_serial;
} mv_scratch;

static int run_chunk(mv_job *job, int64_t chunk, mv_scratch *scratch) {
    int t = 0;
    while (chunk >= job->first_chunk[t + 1]) t++;
    const juno_mv_task *task = &job->tasks[t];
    const int64_t r0 = (chunk - job->first_chunk[t]) * job->rows_per_chunk[t];
    int64_t r1 = r0 + job->rows_per_chunk[t];
    if (r1 > task->n_rows) r1 = task->n_rows;
    const int bs = job->block_size[t];
    const float *xs16 = 0;
    if (bs > 1) {
        const int64_t n16 = task->n_in / 16;
        if (scratch->for_x != task->x || scratch->for_serial != job->serial) {
            if (scratch->cap < n16) {
                float *p = (float *)realloc(scratch->xs16, sizeof(float) * (size_t)n16);
                if (!p) return -1;
                scratch->xs16 = p, scratch->cap = n16;
            }
            for (int64_t k = 0; k < n16; k++) {
                float s = 0.0f;
                for (int i = 0; i < 16; i++) s += task->x[16 * k + i];
                scratch->xs16[k] = s;
            }
            scratch->for_x = task->x, scratch->for_serial = job->serial;
        }
        xs16 = scratch->xs16;
    }
    const int64_t n_blocks = task->n_in / bs;
    const row_dot_fn fn = job->fn[t];
    for (int64_t r = r0; r < r1; r++) task->y[r] = fn(task->w + r * task->row_bytes, task->x, xs16, n_blocks);
    return 0;
}

/* claim and run chunks of generation gen until none is left */
static void work_on(uint64_t gen, mv_scratch *scratch) {
    for (;;) {
        uint64_t s = __atomic_load_n(&mv_state, __ATOMIC_ACQUIRE);
        if (MV_GEN(s) != gen || MV_NEXT(s) >= MV_TOTAL(s)) return;
        if (!__atomic_compare_exchange_n(&mv_state, &s, s + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
        run_chunk(&mv_current, (int64_t)MV_NEXT(s), scratch);
        __atomic_add_fetch(&mv_done, 1, __ATOMIC_RELEASE);
    }
}

static int mv_spin = 20000; /* pause iterations a worker waits for the next product before it sleeps */

static void *mv_worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    mv_scratch scratch = {0, 0, 0, 0};
    uint64_t seen = MV_GEN(__atomic_load_n(&mv_state, __ATOMIC_ACQUIRE));
    for (;;) {
        uint64_t gen = seen;
        for (int i = 0; i < mv_spin; i++) {
            gen = MV_GEN(__atomic_load_n(&mv_state, __ATOMIC_ACQUIRE));
            if (gen != seen) break;
            cpu_relax();
        }
        if (gen == seen) {
            pthread_mutex_lock(&mv_mutex);
            __atomic_add_fetch(&mv_sleepers, 1, __ATOMIC_SEQ_CST);
            while ((gen = MV_GEN(__atomic_load_n(&mv_state, __ATOMIC_SEQ_CST))) == seen)
                pthread_cond_wait(&mv_wake, &mv_mutex);
            __atomic_sub_fetch(&mv_sleepers, 1, __ATOMIC_SEQ_CST);
            pthread_mutex_unlock(&mv_mutex);
        }
        seen = gen;
        if (id < __atomic_load_n(&mv_active, __ATOMIC_ACQUIRE)) work_on(gen, &scratch);
    }
    return 0;
}

static mv_scratch mv_caller_scratch = {0, 0, 0, 0};

/* y = W · x for each task, over n_threads threads (the caller and n_threads − 1 pool workers). Returns 0, -1 for
 * a type without a kernel, -2 for too many tasks or chunks, -3 for a row length that is not whole blocks. */
int juno_matvec(const juno_mv_task *tasks, int n_tasks, int n_threads) {
    if (n_tasks <= 0) return 0;
    if (n_tasks > MV_MAX_TASKS) return -2;
    if (n_threads < 1) n_threads = 1;
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    pthread_mutex_lock(&mv_call);
    mv_job *job = &mv_current;
    job->tasks = tasks;
    job->n_tasks = n_tasks;
    job->serial++;
    job->first_chunk[0] = 0;
    for (int t = 0; t < n_tasks; t++) {
        int bs;
        job->fn[t] = row_dot_of((int)tasks[t].ggml_type, &bs);
        if (!job->fn[t]) {
            pthread_mutex_unlock(&mv_call);
            return -1;
        }
        if (tasks[t].n_in % bs || (bs > 1 && tasks[t].n_in % 16)) {
            pthread_mutex_unlock(&mv_call);
            return -3;
        }
        job->block_size[t] = bs;
        int64_t rows = MV_CHUNK_ELEMENTS / (tasks[t].n_in > 0 ? tasks[t].n_in : 1);
        if (rows < 1) rows = 1;
        job->rows_per_chunk[t] = rows;
        job->first_chunk[t + 1] = job->first_chunk[t] + (tasks[t].n_rows + rows - 1) / rows;
    }
    const int64_t total = job->first_chunk[n_tasks];
    if (total > MV_MAX_CHUNKS) {
        pthread_mutex_unlock(&mv_call);
        return -2;
    }
    /* a product too small to share, or one thread: the caller alone */
    int helpers = n_threads - 1;
    if (total < 2) helpers = 0;
    while (mv_workers < helpers) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int ok = pthread_create(&th, &attr, mv_worker, (void *)(intptr_t)mv_workers) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        mv_workers++;
    }
    if (helpers > mv_workers) helpers = mv_workers;
    __atomic_store_n(&mv_active, helpers, __ATOMIC_RELEASE);
    __atomic_store_n(&mv_done, 0, __ATOMIC_RELEASE);
    const uint64_t gen = (MV_GEN(__atomic_load_n(&mv_state, __ATOMIC_ACQUIRE)) + 1) & 0xFFFFFF;
    __atomic_store_n(&mv_state, gen << 40 | (uint64_t)total << 20, __ATOMIC_SEQ_CST);
    if (helpers && __atomic_load_n(&mv_sleepers, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&mv_mutex);
        pthread_cond_broadcast(&mv_wake);
        pthread_mutex_unlock(&mv_mutex);
    }
    work_on(gen, &mv_caller_scratch);
    for (int64_t i = 0; __atomic_load_n(&mv_done, __ATOMIC_ACQUIRE) < total; i++) {
        if (i < 4096)
            cpu_relax();
        else
            sched_yield(); /* a worker holding a chunk was descheduled: let it run */
    }
    pthread_mutex_unlock(&mv_call);
    return 0;
}

/* ---- the small steps of a one-token decode ----------------------------------------------------------------------
 *
 * What a decode step does between its matrix-vector products, on vectors of one token, in float32 with float64
 * sums where a long sum is taken: the model's RMSNorm, RoPE, attention over the cached keys and gated activation,
 * the same formulas as the torch modules (within float32 rounding of them). One call each instead of the dozen small
 * torch operations each would be. */

#include <math.h>

/* x += h (h may be null), then out[g] = x[g] / rms(x[g]) · w for each of n_groups groups of n (w: n values) */
void juno_residual_rmsnorm(float *x, const float *h, const float *w, int64_t n, int64_t n_groups, float eps,
                           float *out) {
    for (int64_t g = 0; g < n_groups; g++) {
        float *xg = x + g * n;
        if (h)
            for (int64_t i = 0; i < n; i++) xg[i] += h[g * n + i];
        double ss = 0.0;
        for (int64_t i = 0; i < n; i++) ss += (double)xg[i] * xg[i];
        const float r = 1.0f / sqrtf((float)(ss / (double)n) + eps);
        for (int64_t i = 0; i < n; i++) out[g * n + i] = xg[i] * r * w[i];
    }
}

/* rotate the first n_rot features of each of n_heads heads (head_dim apart) in place by the angles of one position:
 * adjacent pairs (neox == 0) or the halves of the rotated part (neox != 0); cos and sin hold n_rot / 2 values */
void juno_rope(float *x, int64_t n_heads, int64_t head_dim, int64_t n_rot, const float *cos_, const float *sin_,
               int neox) {
    const int64_t half = n_rot / 2;
    for (int64_t h = 0; h < n_heads; h++) {
        float *p = x + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
            const float xa = p[a], xb = p[b], c = cos_[i], s = sin_[i];
            p[a] = xa * c - xb * s;
            p[b] = xa * s + xb * c;
        }
    }
}

/* out[h] = softmax(scale · q[h]·K[j]) · V over positions j in [lo, hi) for each query head h, its key/value head
 * h / (n_head / n_kv); K and V rows of head g at position j: k + g·k_head + j·d (and v + g·v_head + j·dv);
 * scores: scratch of hi − lo floats */
void juno_attend(const float *q, const float *k, const float *v, int64_t n_head, int64_t n_kv, int64_t d, int64_t dv,
                 int64_t k_head, int64_t v_head, int64_t lo, int64_t hi, float scale, float *scores, float *out) {
    const int64_t group = n_head / n_kv;
    for (int64_t h = 0; h < n_head; h++) {
        const float *qh = q + h * d, *kh = k + (h / group) * k_head, *vh = v + (h / group) * v_head;
        float m = -INFINITY;
        for (int64_t j = lo; j < hi; j++) {
            const float *kj = kh + j * d;
            vf32 acc = splat_f32(0.0f);
            int64_t i = 0;
            for (; i + LANES <= d; i += LANES) acc = fma_f32(load_f32(qh + i), load_f32(kj + i), acc);
            float s = hsum_f32(acc);
            for (; i < d; i++) s += qh[i] * kj[i];
            s *= scale;
            scores[j - lo] = s;
            if (s > m) m = s;
        }
        double total = 0.0;
        for (int64_t j = lo; j < hi; j++) {
            const float e = expf(scores[j - lo] - m);
            scores[j - lo] = e;
            total += e;
        }
        float *oh = out + h * dv;
        for (int64_t i = 0; i < dv; i++) oh[i] = 0.0f;
        const float inv = (float)(1.0 / total);
        for (int64_t j = lo; j < hi; j++) {
            const float p = scores[j - lo] * inv;
            const float *vj = vh + j * dv;
            for (int64_t i = 0; i < dv; i++) oh[i] += p * vj[i];
        }
    }
}

/* out = act(gate) · up over n values: act 0 is SiLU, 1 GELU with the tanh approximation */
void juno_gated(const float *gate, const float *up, int64_t n, int act, float *out) {
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        const float a = act == 0 ? g / (1.0f + expf(-g))
                                 : 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
        out[i] = a * up[i];
    }
}
