/* Native block decoder for the CPU: GGML block types to float32 or bfloat16, bit for bit as the torch codecs in
 * simple.py and kquants.py decode them.
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

#define JUNO_NATIVE_ABI 1
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
    vf32 v;
    for (int i = 0; i < LANES; i++) v[i] = x;
    return v;
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
