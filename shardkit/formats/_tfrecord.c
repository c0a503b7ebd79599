/* TFRecord framing and CRC-32C in C: the compiled backend of shardkit/formats/tfrecord/kernel.py.
 *
 * Four loops the pure-Python reader runs per record, done here per block:
 *
 *   frame  walks the records of a buffer from a start offset: reads each
 *          8-byte length, checks its masked CRC-32C (optionally) and writes
 *          the record's end offset into an int64 array; it stops when the
 *          array is full, when the bytes left do not hold a whole record (a
 *          header or a body cut off: the caller reads on or reports the
 *          truncation), or at a bad length CRC (reported by its index);
 *   cut    checks the data CRC of records lo:hi and copies each one's data
 *          into a new bytes object (read_tfrecord);
 *   pack   the same into one values buffer plus an Arrow offsets array,
 *          with no Python object per record (read_tfrecord_batches);
 *   views  checks the same CRCs and writes an Arrow binary_view view per
 *          record (16 bytes: length, prefix or inline data, buffer, offset),
 *          the data left in the buffer: no copy (arrow_type="binary_view");
 *   read_views, read_pack
 *          read a local file themselves (pread, GIL released), a batch per
 *          call, in cache-sized reads, and frame, check and view (or move
 *          down over the framing, in the values buffer read into) each read's
 *          records while they are cached; they stop at whatever needs Python
 *          (the file's end, a bad CRC, a record cut off or too long for the
 *          buffer), with the reader's state in an int64 array Python keeps.
 *
 * Memory safety comes first: every offset is checked against the buffer's
 * length before a read; a record fits only when `end - pos >= 16` and
 * `length <= end - pos - 16`, compared without adding, so a length near
 * 2**64 cannot wrap around; cut, pack and views take the ends frame wrote but
 * check them again (increasing, each record at least 16 bytes, within the
 * buffer), since Python can hand them any array.
 *
 * CRC-32C, to the crc32c package's values (the tests compare every path):
 * - data CRCs are computed twelve records at a time (check_group): with AVX2
 *   VPCLMULQDQ but not AVX-512 (AMD Zen 3, Intel Alder Lake), six at once by
 *   crc_hybrid6, three by crc32 streams and three by 256-bit folding, the two
 *   units busy side by side (about 1.4x the folding alone on records of 1 KB);
 *   otherwise four at a time: with
 *   AVX-512 VPCLMULQDQ (checked at run time; SHARDKIT_NO_AVX512=1 turns it
 *   and the AVX2 folding below off), each record folds 64 bytes a step by carry-less multiplication in a
 *   register of its own, the four chains interleaved, about three times the
 *   crc32 instruction's speed on records of 1 KB; with AVX2 VPCLMULQDQ only
 *   (AMD Zen 3, Intel Alder Lake), the same with 32 bytes a step in 256-bit
 *   registers, about 1.1x four crc32 streams there; else four records run as
 *   four interleaved crc32 streams (the instruction's latency is 3 cycles,
 *   its throughput 1: three streams and a fourth record alone took 1.2x as long);
 * - one buffer alone: folding from 256 bytes, else the crc32 instruction
 *   with three streams combined by zero-shift tables (Mark Adler's method, as
 *   in the crc32c package), else slicing-by-8 tables.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_SSE42 1
#include <immintrin.h>
#else
#define HAVE_SSE42 0
#endif

#define POLY 0x82F63B78u /* CRC-32C, bit-reflected */
#define MASK_DELTA 0xA282EAD8u
#define HEADER 12
#define OVERHEAD 16
#define LONG_BLOCK 8192
#define SHORT_BLOCK 256

static uint32_t table8[8][256];           /* slicing-by-8 */
static uint32_t zeros_long[4][256];       /* shift a CRC over LONG_BLOCK zero bytes */
static uint32_t zeros_short[4][256];      /* ... over SHORT_BLOCK zero bytes */
static int hardware = 0;                  /* SSE4.2 present */
static int vector = 0;                    /* VECTOR_AVX512 or VECTOR_AVX2 (VPCLMULQDQ present, enabled by the OS) */
#define VECTOR_AVX512 1                   /* 512-bit folding: crc_vector, crc_vector4 */
#define VECTOR_AVX2 2                     /* 256-bit folding of four records at once: crc_vector4_avx2 */
/* Folding constants (see crc_vector): per distance D bits, the pair (x^(D+31) mod P, x^(D-33) mod P). */
static uint64_t fold_2048[2], fold_512[2], fold_lanes[8];

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* unaligned, little-endian hosts only (checked at import) */
    return v;
}

static inline uint32_t load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint32_t mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + MASK_DELTA; }

/* ------------------------------------------------------------------ tables */

static void init_tables(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table8[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 1; k < 8; k++) table8[k][n] = (table8[k - 1][n] >> 8) ^ table8[0][table8[k - 1][n] & 0xFF];
}

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    for (; vec; vec >>= 1, mat++)
        if (vec & 1) sum ^= *mat;
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* The operator appending `len` zero bytes (a power of two) to a CRC register. */
static void zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32];
    odd[0] = POLY; /* one zero bit */
    for (int n = 1; n < 32; n++) odd[n] = 1u << (n - 1);
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four */
    do {
        gf2_square(even, odd); /* eight, then 2**k bytes */
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof(odd));
}

static void zeros_table(uint32_t zeros[4][256], size_t len) {
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 0; k < 4; k++) zeros[k][n] = gf2_times(op, n << (8 * k));
}

static inline uint32_t shift(uint32_t zeros[4][256], uint32_t crc) {
    return zeros[0][crc & 0xFF] ^ zeros[1][(crc >> 8) & 0xFF] ^ zeros[2][(crc >> 16) & 0xFF] ^ zeros[3][crc >> 24];
}

/* ------------------------------------------------------------------ CRC-32C */

static uint32_t crc_software(const uint8_t *p, size_t len) {
    uint32_t crc = 0xFFFFFFFFu;
    for (; len >= 8; p += 8, len -= 8) {
        uint64_t v = load64(p) ^ crc;
        crc = table8[7][v & 0xFF] ^ table8[6][(v >> 8) & 0xFF] ^ table8[5][(v >> 16) & 0xFF] ^
              table8[4][(v >> 24) & 0xFF] ^ table8[3][(v >> 32) & 0xFF] ^ table8[2][(v >> 40) & 0xFF] ^
              table8[1][(v >> 48) & 0xFF] ^ table8[0][v >> 56];
    }
    for (; len; p++, len--) crc = (crc >> 8) ^ table8[0][(crc ^ *p) & 0xFF];
    return crc ^ 0xFFFFFFFFu;
}

#if HAVE_SSE42
/* Three interleaved streams of `block` bytes each, combined by shifting (the instruction's latency is 3 cycles). */
#define CRC_TRIPLE(block, zeros)                                                 \
    while (len >= 3 * (block)) {                                                 \
        uint64_t c1 = 0, c2 = 0;                                                 \
        const uint8_t *stop = p + (block);                                       \
        do {                                                                     \
            c0 = _mm_crc32_u64(c0, load64(p));                                   \
            c1 = _mm_crc32_u64(c1, load64(p + (block)));                         \
            c2 = _mm_crc32_u64(c2, load64(p + 2 * (block)));                     \
            p += 8;                                                              \
        } while (p < stop);                                                      \
        c0 = shift(zeros, (uint32_t)c0) ^ (uint32_t)c1;                          \
        c0 = shift(zeros, (uint32_t)c0) ^ (uint32_t)c2;                          \
        p += 2 * (block);                                                        \
        len -= 3 * (block);                                                      \
    }

/* Carry the register `crc` (not inverted) on over p[0:len]. */
__attribute__((target("sse4.2"))) static uint32_t crc_hardware_on(uint32_t crc, const uint8_t *p, size_t len) {
    uint64_t c0 = crc;
    CRC_TRIPLE(LONG_BLOCK, zeros_long)
    CRC_TRIPLE(SHORT_BLOCK, zeros_short)
    for (; len >= 8; p += 8, len -= 8) c0 = _mm_crc32_u64(c0, load64(p));
    uint32_t c = (uint32_t)c0;
    for (; len; p++, len--) c = _mm_crc32_u8(c, *p);
    return c;
}

__attribute__((target("sse4.2"))) static uint32_t crc_hardware(const uint8_t *p, size_t len) {
    return crc_hardware_on(0xFFFFFFFFu, p, len) ^ 0xFFFFFFFFu;
}

/* The length every one of the n buffers has, rounded down to a multiple of step (a power of two): what the
 * interleaved CRCs below run over together before each buffer's rest goes on alone. */
static inline size_t common_length(const size_t *len, int n, size_t step) {
    size_t common = len[0];
    for (int j = 1; j < n; j++) common = len[j] < common ? len[j] : common;
    return common & ~(step - 1);
}

/* The CRCs of three separate buffers at once: their common length runs as three interleaved streams (the
 * instruction's latency is 3 cycles, its throughput 1), with nothing to combine, since each stream is a whole
 * record's CRC; the rest of each record then goes on alone. Short records gain most: one record of 1 KB has
 * only one 768-byte triple of CRC_TRIPLE's short blocks, the rest serial. */
__attribute__((target("sse4.2"))) static void crc_hardware3(const uint8_t *const p[3], const size_t len[3],
                                                            uint32_t out[3]) {
    size_t common = common_length(len, 3, 8);
    uint64_t c0 = 0xFFFFFFFFu, c1 = 0xFFFFFFFFu, c2 = 0xFFFFFFFFu;
    const uint8_t *a = p[0], *b = p[1], *c = p[2];
    for (size_t i = 0; i < common; i += 8) {
        c0 = _mm_crc32_u64(c0, load64(a + i));
        c1 = _mm_crc32_u64(c1, load64(b + i));
        c2 = _mm_crc32_u64(c2, load64(c + i));
    }
    out[0] = crc_hardware_on((uint32_t)c0, a + common, len[0] - common) ^ 0xFFFFFFFFu;
    out[1] = crc_hardware_on((uint32_t)c1, b + common, len[1] - common) ^ 0xFFFFFFFFu;
    out[2] = crc_hardware_on((uint32_t)c2, c + common, len[2] - common) ^ 0xFFFFFFFFu;
}

/* crc_hardware3 with four buffers: the instruction's throughput (one a cycle) bounds four streams, where three
 * streams and a fourth record alone left the fourth latency-bound (three cycles per 8 bytes). */
__attribute__((target("sse4.2"))) static void crc_hardware4(const uint8_t *const p[4], const size_t len[4],
                                                            uint32_t out[4]) {
    size_t common = common_length(len, 4, 8);
    uint64_t c0 = 0xFFFFFFFFu, c1 = 0xFFFFFFFFu, c2 = 0xFFFFFFFFu, c3 = 0xFFFFFFFFu;
    const uint8_t *a = p[0], *b = p[1], *c = p[2], *d = p[3];
    for (size_t i = 0; i < common; i += 8) {
        c0 = _mm_crc32_u64(c0, load64(a + i));
        c1 = _mm_crc32_u64(c1, load64(b + i));
        c2 = _mm_crc32_u64(c2, load64(c + i));
        c3 = _mm_crc32_u64(c3, load64(d + i));
    }
    out[0] = crc_hardware_on((uint32_t)c0, a + common, len[0] - common) ^ 0xFFFFFFFFu;
    out[1] = crc_hardware_on((uint32_t)c1, b + common, len[1] - common) ^ 0xFFFFFFFFu;
    out[2] = crc_hardware_on((uint32_t)c2, c + common, len[2] - common) ^ 0xFFFFFFFFu;
    out[3] = crc_hardware_on((uint32_t)c3, d + common, len[3] - common) ^ 0xFFFFFFFFu;
}

/* x^n mod P, bit-reflected (bit i is the coefficient of x^(31-i)). */
static uint32_t xpow(unsigned n) {
    uint32_t r = 0x80000000u;
    for (; n; n--) r = r & 1 ? (r >> 1) ^ POLY : r >> 1;
    return r;
}

static void fold_pair(uint64_t *pair, unsigned bits) {
    pair[0] = xpow(bits + 31); /* multiplies the low (earlier, higher-degree) 64 bits of a 128-bit lane */
    pair[1] = xpow(bits - 33); /* the high 64 bits */
}

static void init_folding(void) {
    fold_pair(fold_2048, 2048);
    fold_pair(fold_512, 512);
    fold_pair(fold_lanes, 384); /* a 64-byte register's four lanes onto its last */
    fold_pair(fold_lanes + 2, 256);
    fold_pair(fold_lanes + 4, 128);
    fold_lanes[6] = fold_lanes[7] = 0;
}

#define VECTOR_TARGET __attribute__((target("avx512f,avx512vl,avx512bw,vpclmulqdq,pclmul,sse4.2")))

/* x * x^D + data, modulo P, on four 128-bit lanes at once (k holds the pair for D). */
VECTOR_TARGET static inline __m512i fold(__m512i x, __m512i k, __m512i data) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11),
                                     data, 0x96);
}

VECTOR_TARGET static inline uint32_t reduce_vector(__m512i x);

/* CRC-32C of len >= 256 bytes by carry-less multiplication (Intel's "Fast CRC Computation Using PCLMULQDQ",
 * bit-reflected): four 64-byte registers fold 256 bytes a round, one folds 64, its four lanes fold into one,
 * whose 128 bits the crc32 instruction reduces (x^32 times their CRC register: crc32_u64 twice), then the tail.
 * About twice the crc32 instruction's 8 bytes a cycle; the tests compare it with the tables at every length. */
VECTOR_TARGET static uint32_t crc_vector(const uint8_t *p, size_t len) {
    __m512i k = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)fold_2048));
    __m512i x0 = _mm512_loadu_si512(p), x1 = _mm512_loadu_si512(p + 64);
    __m512i x2 = _mm512_loadu_si512(p + 128), x3 = _mm512_loadu_si512(p + 192);
    x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)0xFFFFFFFFu))); /* the register's start */
    for (p += 256, len -= 256; len >= 256; p += 256, len -= 256) {
        x0 = fold(x0, k, _mm512_loadu_si512(p));
        x1 = fold(x1, k, _mm512_loadu_si512(p + 64));
        x2 = fold(x2, k, _mm512_loadu_si512(p + 128));
        x3 = fold(x3, k, _mm512_loadu_si512(p + 192));
    }
    k = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)fold_512));
    x3 = fold(fold(fold(x0, k, x1), k, x2), k, x3);
    for (; len >= 64; p += 64, len -= 64) x3 = fold(x3, k, _mm512_loadu_si512(p));
    uint32_t crc = crc_hardware_on(reduce_vector(x3), p, len) ^ 0xFFFFFFFFu;
    _mm256_zeroupper(); /* see crc_vector4 */
    return crc;
}

/* The CRC register (not inverted) of the 64 bytes folded into x, as crc_vector ends. */
VECTOR_TARGET static inline uint32_t reduce_vector(__m512i x) {
    __m512i folded = fold(x, _mm512_loadu_si512(fold_lanes), _mm512_maskz_mov_epi64(0xC0, x));
    __m128i y = _mm_xor_si128(_mm_xor_si128(_mm512_extracti32x4_epi32(folded, 0), _mm512_extracti32x4_epi32(folded, 1)),
                              _mm_xor_si128(_mm512_extracti32x4_epi32(folded, 2), _mm512_extracti32x4_epi32(folded, 3)));
    uint32_t crc = (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(y));
    return (uint32_t)_mm_crc32_u64(crc, (uint64_t)_mm_extract_epi64(y, 1));
}

/* The CRCs of four separate buffers of at least 64 bytes: each folds 64 bytes a step in a register of its own,
 * the four steps interleaved. One buffer of 1 KB has too few steps to hide the carry-less multiplication's
 * latency (crc_vector is slower than the crc32 instruction there); four independent chains keep the multiplier
 * busy, about three times the crc32 instruction's speed on records of 1 KB. */
VECTOR_TARGET static void crc_vector4(const uint8_t *const p[4], const size_t len[4], uint32_t out[4]) {
    size_t common = common_length(len, 4, 64);
    const __m512i k = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)fold_512));
    const __m512i start = _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)0xFFFFFFFFu));
    __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(p[0]), start);
    __m512i x1 = _mm512_xor_si512(_mm512_loadu_si512(p[1]), start);
    __m512i x2 = _mm512_xor_si512(_mm512_loadu_si512(p[2]), start);
    __m512i x3 = _mm512_xor_si512(_mm512_loadu_si512(p[3]), start);
    for (size_t at = 64; at < common; at += 64) {
        x0 = fold(x0, k, _mm512_loadu_si512(p[0] + at));
        x1 = fold(x1, k, _mm512_loadu_si512(p[1] + at));
        x2 = fold(x2, k, _mm512_loadu_si512(p[2] + at));
        x3 = fold(x3, k, _mm512_loadu_si512(p[3] + at));
    }
    out[0] = crc_hardware_on(reduce_vector(x0), p[0] + common, len[0] - common) ^ 0xFFFFFFFFu;
    out[1] = crc_hardware_on(reduce_vector(x1), p[1] + common, len[1] - common) ^ 0xFFFFFFFFu;
    out[2] = crc_hardware_on(reduce_vector(x2), p[2] + common, len[2] - common) ^ 0xFFFFFFFFu;
    out[3] = crc_hardware_on(reduce_vector(x3), p[3] + common, len[3] - common) ^ 0xFFFFFFFFu;
    _mm256_zeroupper(); /* GCC leaves the upper halves dirty: the SSE code after would stall on them */
}
#endif

#if HAVE_SSE42
#define VECTOR2_TARGET __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2")))

/* x * x^D + data, modulo P, on two 128-bit lanes at once (k holds the pair for D). */
VECTOR2_TARGET static inline __m256i fold2(__m256i x, __m256i k, __m256i data) {
    return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00), _mm256_clmulepi64_epi128(x, k, 0x11)),
                            data);
}

/* The CRC register (not inverted) of the 32 bytes folded into x: its first lane folded onto its second (128 bits
 * on), whose 128 bits the crc32 instruction reduces, as reduce_vector does with four lanes. */
VECTOR2_TARGET static inline uint32_t reduce_vector2(__m256i x) {
    __m128i k = _mm_loadu_si128((const __m128i *)(fold_lanes + 4)); /* 128 bits */
    __m128i lo = _mm256_castsi256_si128(x), hi = _mm256_extracti128_si256(x, 1);
    __m128i y = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(lo, k, 0x00), _mm_clmulepi64_si128(lo, k, 0x11)), hi);
    uint32_t crc = (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(y));
    return (uint32_t)_mm_crc32_u64(crc, (uint64_t)_mm_extract_epi64(y, 1));
}

/* crc_vector4 for CPUs with VPCLMULQDQ but not AVX-512 (AMD Zen 3, Intel Alder Lake): four buffers of at least
 * 32 bytes, each folding 32 bytes a step in a 256-bit register of its own, the four chains interleaved. On records
 * of 1 KB (an AMD EPYC, Zen 3) about 20 GB/s, 1.1x crc_hardware4's four crc32 streams, 1.25x three streams and a
 * fourth record alone. */
VECTOR2_TARGET static void crc_vector4_avx2(const uint8_t *const p[4], const size_t len[4], uint32_t out[4]) {
    size_t common = common_length(len, 4, 32);
    const __m256i k = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(fold_lanes + 2))); /* 256 bits */
    const __m256i start = _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)0xFFFFFFFFu));
    __m256i x0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p[0]), start);
    __m256i x1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p[1]), start);
    __m256i x2 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p[2]), start);
    __m256i x3 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p[3]), start);
    for (size_t at = 32; at < common; at += 32) {
        x0 = fold2(x0, k, _mm256_loadu_si256((const __m256i *)(p[0] + at)));
        x1 = fold2(x1, k, _mm256_loadu_si256((const __m256i *)(p[1] + at)));
        x2 = fold2(x2, k, _mm256_loadu_si256((const __m256i *)(p[2] + at)));
        x3 = fold2(x3, k, _mm256_loadu_si256((const __m256i *)(p[3] + at)));
    }
    uint32_t r0 = reduce_vector2(x0), r1 = reduce_vector2(x1), r2 = reduce_vector2(x2), r3 = reduce_vector2(x3);
    _mm256_zeroupper(); /* see crc_vector4 */
    out[0] = crc_hardware_on(r0, p[0] + common, len[0] - common) ^ 0xFFFFFFFFu;
    out[1] = crc_hardware_on(r1, p[1] + common, len[1] - common) ^ 0xFFFFFFFFu;
    out[2] = crc_hardware_on(r2, p[2] + common, len[2] - common) ^ 0xFFFFFFFFu;
    out[3] = crc_hardware_on(r3, p[3] + common, len[3] - common) ^ 0xFFFFFFFFu;
}

/* The CRCs of six buffers of at least 32 bytes: three by crc32 streams, three by 256-bit folding chains, the six
 * interleaved over their common length. The two run on different units (the crc32 instruction on the integer side,
 * carry-less multiplication on the vector side), so each keeps its own busy: on an AMD EPYC (Zen 3), 32 bytes a
 * step take each unit about 4 cycles for three records, and records of 1 KB check at about 32 GB/s, 1.4x
 * crc_vector4_avx2's four folding chains (22 GB/s) and 1.5x four crc32 streams (benchmarks/tfrecord.py prints the
 * data CRCs' share of a read). Records are independent: no combining step. */
VECTOR2_TARGET static void crc_hybrid6(const uint8_t *const p[6], const size_t len[6], uint32_t out[6]) {
    size_t common = common_length(len, 6, 32);
    const __m256i k = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(fold_lanes + 2))); /* 256 bits */
    const __m256i start = _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)0xFFFFFFFFu));
    const uint8_t *a = p[0], *b = p[1], *c = p[2];
    uint64_t c0 = 0xFFFFFFFFu, c1 = 0xFFFFFFFFu, c2 = 0xFFFFFFFFu;
    __m256i x0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p[3]), start);
    __m256i x1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p[4]), start);
    __m256i x2 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p[5]), start);
    for (size_t at = 0;;) {
        for (int i = 0; i < 32; i += 8) {
            c0 = _mm_crc32_u64(c0, load64(a + at + i));
            c1 = _mm_crc32_u64(c1, load64(b + at + i));
            c2 = _mm_crc32_u64(c2, load64(c + at + i));
        }
        at += 32;
        if (at >= common) break;
        x0 = fold2(x0, k, _mm256_loadu_si256((const __m256i *)(p[3] + at)));
        x1 = fold2(x1, k, _mm256_loadu_si256((const __m256i *)(p[4] + at)));
        x2 = fold2(x2, k, _mm256_loadu_si256((const __m256i *)(p[5] + at)));
    }
    uint32_t r0 = reduce_vector2(x0), r1 = reduce_vector2(x1), r2 = reduce_vector2(x2);
    _mm256_zeroupper(); /* see crc_vector4 */
    out[0] = crc_hardware_on((uint32_t)c0, a + common, len[0] - common) ^ 0xFFFFFFFFu;
    out[1] = crc_hardware_on((uint32_t)c1, b + common, len[1] - common) ^ 0xFFFFFFFFu;
    out[2] = crc_hardware_on((uint32_t)c2, c + common, len[2] - common) ^ 0xFFFFFFFFu;
    out[3] = crc_hardware_on(r0, p[3] + common, len[3] - common) ^ 0xFFFFFFFFu;
    out[4] = crc_hardware_on(r1, p[4] + common, len[4] - common) ^ 0xFFFFFFFFu;
    out[5] = crc_hardware_on(r2, p[5] + common, len[5] - common) ^ 0xFFFFFFFFu;
}
#endif

#if HAVE_SSE42
__attribute__((target("sse4.2"))) static uint32_t crc8_hardware(uint64_t v) {
    return (uint32_t)_mm_crc32_u64(0xFFFFFFFFu, v) ^ 0xFFFFFFFFu;
}
#endif

/* The CRC of a length field: 8 bytes, one instruction (or one round of the tables). */
static inline uint32_t crc8(const uint8_t *p) {
#if HAVE_SSE42
    if (hardware) return crc8_hardware(load64(p));
#endif
    uint64_t v = load64(p) ^ 0xFFFFFFFFu;
    return (table8[7][v & 0xFF] ^ table8[6][(v >> 8) & 0xFF] ^ table8[5][(v >> 16) & 0xFF] ^
            table8[4][(v >> 24) & 0xFF] ^ table8[3][(v >> 32) & 0xFF] ^ table8[2][(v >> 40) & 0xFF] ^
            table8[1][(v >> 48) & 0xFF] ^ table8[0][v >> 56]) ^
           0xFFFFFFFFu;
}

#define VECTOR_MIN 256 /* shorter buffers take the crc32 instruction (alone, crc_vector is latency-bound) */

static inline uint32_t crc32c(const uint8_t *p, size_t len) {
#if HAVE_SSE42
    if (vector == VECTOR_AVX512 && len >= VECTOR_MIN) return crc_vector(p, len);
    if (hardware) return crc_hardware(p, len);
#endif
    return crc_software(p, len);
}

#define GROUP 12     /* records whose data CRCs are computed together: two crc_hybrid6 calls, or three of four */
#define GROUP_MIN 64 /* ... by crc_vector4 when each has at least this many bytes */
#define HYBRID_MIN 32 /* ... by crc_hybrid6 (its folding chains start with 32 bytes) */

/* The CRCs of k <= 4 buffers: interleaved (crc_vector4 or crc_vector4_avx2, crc_hardware4 or 3) where the CPU and
 * lengths allow. */
static void crc32c_group4(int k, const uint8_t *const p[4], const size_t len[4], uint32_t out[4]) {
    int done = 0;
#if HAVE_SSE42
    if (vector && k == 4 && len[0] >= GROUP_MIN && len[1] >= GROUP_MIN && len[2] >= GROUP_MIN && len[3] >= GROUP_MIN) {
        if (vector == VECTOR_AVX512) crc_vector4(p, len, out);
        else crc_vector4_avx2(p, len, out);
        return;
    }
    if (hardware && k == 4) {
        crc_hardware4(p, len, out);
        return;
    }
    if (hardware && k == 3) {
        crc_hardware3(p, len, out);
        done = 3;
    }
#endif
    for (int j = done; j < k; j++) out[j] = crc32c(p[j], len[j]);
}

/* The CRCs of k <= GROUP buffers: six at a time by crc_hybrid6 where the CPU (AVX2 folding, not AVX-512) and
 * lengths allow, the rest four at a time by crc32c_group4. */
static void crc32c_group(int k, const uint8_t *const p[GROUP], const size_t len[GROUP], uint32_t out[GROUP]) {
    for (int j = 0; j < k;) {
#if HAVE_SSE42
        if (vector == VECTOR_AVX2 && k - j >= 6) {
            int fits = 1;
            for (int i = j; i < j + 6; i++) fits &= len[i] >= HYBRID_MIN;
            if (fits) {
                crc_hybrid6(p + j, len + j, out + j);
                j += 6;
                continue;
            }
        }
#endif
        int n = k - j < 4 ? k - j : 4;
        crc32c_group4(n, p + j, len + j, out + j);
        j += n;
    }
}

/* ------------------------------------------------------------------ buffers */

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous%s buffer, got %.80s", what, writable ? " writable" : "",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

/* The int64 ends array: a C-contiguous buffer of 8-byte items. */
static int get_ends(PyObject *obj, Py_buffer *view, int writable) {
    if (get_buffer(obj, view, writable, "ends") < 0) return -1;
    if (view->len % 8 != 0 || (view->itemsize != 8 && view->itemsize != 1)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "ends must be an int64 array");
        return -1;
    }
    return 0;
}

/* Record i of a block spans [start_i, ends[i]): start_0 = first, start_i = ends[i - 1]. Check what Python gave. */
static int check_spans(const int64_t *ends, Py_ssize_t n, int64_t first, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t size) {
    if (lo < 0 || hi > n || lo > hi || first < 0) {
        PyErr_Format(PyExc_ValueError, "records %zd:%zd out of range for %zd ends", lo, hi, n);
        return -1;
    }
    int64_t start = lo ? ends[lo - 1] : first;
    for (Py_ssize_t i = lo; i < hi; i++) {
        if (start < first || start > (int64_t)size || ends[i] > (int64_t)size || ends[i] - start < OVERHEAD) {
            PyErr_Format(PyExc_ValueError, "record %zd spans [%lld, %lld): not a record of a %zd-byte buffer", i,
                         (long long)start, (long long)ends[i], size);
            return -1;
        }
        start = ends[i];
    }
    return 0;
}

/* ------------------------------------------------------------------ frame */

static PyObject *frame(PyObject *self, PyObject *args) {
    PyObject *buf_obj, *out_obj;
    Py_ssize_t pos, end;
    int check_lengths;
    if (!PyArg_ParseTuple(args, "OnnOp", &buf_obj, &pos, &end, &out_obj, &check_lengths)) return NULL;
    Py_buffer buf, out;
    if (get_buffer(buf_obj, &buf, 0, "buf") < 0) return NULL;
    if (get_ends(out_obj, &out, 1) < 0) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    if (pos < 0 || end < pos || end > buf.len) {
        PyErr_Format(PyExc_ValueError, "need 0 <= pos <= end <= len(buf), got pos=%zd end=%zd len=%zd", pos, end,
                     buf.len);
        PyBuffer_Release(&buf);
        PyBuffer_Release(&out);
        return NULL;
    }
    const uint8_t *b = buf.buf;
    int64_t *ends = out.buf;
    Py_ssize_t cap = out.len / 8, count = 0;
    int bad = 0;
    size_t p = (size_t)pos, stop = (size_t)end;
    Py_BEGIN_ALLOW_THREADS;
    while (count < cap && stop - p >= HEADER) {
        uint64_t length = load64(b + p);
        if (check_lengths && mask(crc8(b + p)) != load32(b + p + 8)) {
            bad = 1;
            break;
        }
        if (stop - p < OVERHEAD || length > stop - p - OVERHEAD) break; /* cut off: the caller reads on */
        p += (size_t)length + OVERHEAD;
        ends[count++] = (int64_t)p;
    }
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&buf);
    PyBuffer_Release(&out);
    return Py_BuildValue("ni", count, bad);
}

/* ------------------------------------------------------------------ cut and pack */

/* Check the data CRCs of records i..i+k-1 (k <= GROUP; start: where record i starts); the first bad one, or -1. */
static Py_ssize_t check_group(const uint8_t *b, const int64_t *ends, int64_t start, Py_ssize_t i, int k) {
    const uint8_t *data[GROUP];
    size_t len[GROUP];
    uint32_t crc[GROUP];
    for (int j = 0; j < k; j++) {
        int64_t stop = ends[i + j];
        data[j] = b + start + HEADER;
        len[j] = (size_t)(stop - start - OVERHEAD);
        start = stop;
    }
    crc32c_group(k, data, len, crc);
    for (int j = 0; j < k; j++)
        if (mask(crc[j]) != load32(data[j] + len[j])) return i + j;
    return -1;
}

static PyObject *cut(PyObject *self, PyObject *args) {
    PyObject *buf_obj, *ends_obj;
    long long first;
    Py_ssize_t lo, hi;
    int verify;
    if (!PyArg_ParseTuple(args, "OLOnnp", &buf_obj, &first, &ends_obj, &lo, &hi, &verify)) return NULL;
    Py_buffer buf, ends_view;
    if (get_buffer(buf_obj, &buf, 0, "buf") < 0) return NULL;
    if (get_ends(ends_obj, &ends_view, 0) < 0) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    const int64_t *ends = ends_view.buf;
    PyObject *records = NULL;
    Py_ssize_t bad = -1;
    if (check_spans(ends, ends_view.len / 8, first, lo, hi, buf.len) < 0) goto done;
    records = PyList_New(hi - lo);
    if (!records) goto done;
    const uint8_t *b = buf.buf;
    int64_t start = lo ? ends[lo - 1] : first;
    for (Py_ssize_t i = lo; i < hi;) {
        int k = hi - i < GROUP ? (int)(hi - i) : GROUP;
        Py_ssize_t stop = verify ? check_group(b, ends, start, i, k) : -1;
        Py_ssize_t good = stop >= 0 ? stop : i + k;
        for (; i < good; i++) {
            PyObject *record = PyBytes_FromStringAndSize((const char *)b + start + HEADER, ends[i] - start - OVERHEAD);
            if (!record) goto fail;
            PyList_SET_ITEM(records, i - lo, record);
            start = ends[i];
        }
        if (stop >= 0) {
            bad = stop;
            if (PyList_SetSlice(records, stop - lo, hi - lo, NULL) < 0) goto fail; /* the empty slots */
            break;
        }
    }
    goto done;
fail:
    Py_CLEAR(records);
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&ends_view);
    if (!records) return NULL;
    return Py_BuildValue("Nn", records, bad);
}

static PyObject *pack(PyObject *self, PyObject *args) {
    PyObject *buf_obj, *ends_obj, *values_obj, *offsets_obj;
    long long first, base;
    Py_ssize_t lo, hi;
    int verify;
    if (!PyArg_ParseTuple(args, "OLOnnpOOL", &buf_obj, &first, &ends_obj, &lo, &hi, &verify, &values_obj,
                          &offsets_obj, &base))
        return NULL;
    Py_buffer buf, ends_view, values, offsets;
    Py_ssize_t bad = -1, result = -2; /* -2: a Python error is set */
    if (get_buffer(buf_obj, &buf, 0, "buf") < 0) return NULL;
    if (get_ends(ends_obj, &ends_view, 0) < 0) goto release_buf;
    if (get_buffer(values_obj, &values, 1, "values") < 0) goto release_ends;
    if (get_ends(offsets_obj, &offsets, 1) < 0) goto release_values;
    const int64_t *ends = ends_view.buf;
    int64_t *off = offsets.buf;
    uint8_t *dst = values.buf;
    if (check_spans(ends, ends_view.len / 8, first, lo, hi, buf.len) < 0) goto release;
    int64_t start = lo ? ends[lo - 1] : first;
    int64_t need = hi > lo ? ends[hi - 1] - start - (int64_t)(hi - lo) * OVERHEAD : 0;
    if (offsets.len / 8 < hi - lo + 1 || base < 0 || values.len - base < need) {
        PyErr_Format(PyExc_ValueError, "pack: values (%zd bytes from %lld) or offsets (%zd) too small for %zd records",
                     values.len, base, offsets.len / 8, hi - lo);
        goto release;
    }
    Py_BEGIN_ALLOW_THREADS;
    int64_t at = base;
    off[0] = at;
    const uint8_t *b = buf.buf;
    for (Py_ssize_t i = lo; i < hi;) {
        int k = hi - i < GROUP ? (int)(hi - i) : GROUP;
        Py_ssize_t stop = verify ? check_group(b, ends, start, i, k) : -1; /* before any of the group moves */
        Py_ssize_t good = stop >= 0 ? stop : i + k;
        for (; i < good; i++) {
            int64_t n = ends[i] - start - OVERHEAD;
            memmove(dst + at, b + start + HEADER, (size_t)n); /* in place, dst <= data: only bytes before it */
            at += n;
            off[i - lo + 1] = at;
            start = ends[i];
        }
        if (stop >= 0) {
            bad = stop;
            break;
        }
    }
    Py_END_ALLOW_THREADS;
    result = bad;
release:
    PyBuffer_Release(&offsets);
release_values:
    PyBuffer_Release(&values);
release_ends:
    PyBuffer_Release(&ends_view);
release_buf:
    PyBuffer_Release(&buf);
    if (result == -2) return NULL;
    return PyLong_FromSsize_t(result);
}

/* ------------------------------------------------------------------ views */

#define VIEW 16   /* bytes of an Arrow binary_view view */
#define INLINE 12 /* data of at most this many bytes sits in the view itself */

/* The view of `n` data bytes at `data`, which is byte `offset` of the array's data buffer `index`. */
static inline void write_view(uint8_t *view, const uint8_t *data, uint32_t n, int32_t index, int32_t offset) {
    memcpy(view, &n, 4);
    if (n <= INLINE) {
        memset(view + 4, 0, INLINE); /* the format wants the bytes after short data zeroed */
        memcpy(view + 4, data, n);
        return;
    }
    memcpy(view + 4, data, 4); /* the prefix */
    memcpy(view + 8, &index, 4);
    memcpy(view + 12, &offset, 4);
}

static PyObject *views(PyObject *self, PyObject *args) {
    PyObject *buf_obj, *ends_obj, *out_obj;
    long long first;
    Py_ssize_t lo, hi;
    int verify, index;
    if (!PyArg_ParseTuple(args, "OLOnnpOi", &buf_obj, &first, &ends_obj, &lo, &hi, &verify, &out_obj, &index))
        return NULL;
    Py_buffer buf, ends_view, out;
    Py_ssize_t bad = -1, result = -2; /* -2: a Python error is set */
    if (get_buffer(buf_obj, &buf, 0, "buf") < 0) return NULL;
    if (get_ends(ends_obj, &ends_view, 0) < 0) goto release_buf;
    if (get_buffer(out_obj, &out, 1, "out") < 0) goto release_ends;
    const int64_t *ends = ends_view.buf;
    if (check_spans(ends, ends_view.len / 8, first, lo, hi, buf.len) < 0) goto release;
    if (out.len / VIEW < hi - lo || index < 0 || buf.len > INT32_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "views: out (%zd bytes) too small for %zd views, buffer index %d < 0, or a buffer of %zd bytes "
                     "(binary_view offsets are int32)",
                     out.len, hi - lo, index, buf.len);
        goto release;
    }
    const uint8_t *b = buf.buf;
    uint8_t *view = out.buf;
    Py_BEGIN_ALLOW_THREADS;
    int64_t start = lo ? ends[lo - 1] : first;
    for (Py_ssize_t i = lo; i < hi;) {
        int k = hi - i < GROUP ? (int)(hi - i) : GROUP; /* records checked together, then given views */
        Py_ssize_t stop = verify ? check_group(b, ends, start, i, k) : -1;
        Py_ssize_t good = stop >= 0 ? stop : i + k;
        for (; i < good; i++, view += VIEW) {
            write_view(view, b + start + HEADER, (uint32_t)(ends[i] - start - OVERHEAD), index,
                       (int32_t)(start + HEADER));
            start = ends[i];
        }
        if (stop >= 0) {
            bad = stop;
            break;
        }
    }
    Py_END_ALLOW_THREADS;
    result = bad;
release:
    PyBuffer_Release(&out);
release_ends:
    PyBuffer_Release(&ends_view);
release_buf:
    PyBuffer_Release(&buf);
    if (result == -2) return NULL;
    return PyLong_FromSsize_t(result);
}

/* ------------------------------------------------------------------ read: a local file, a batch per call */

/* How read_views and read_pack stop (their second result). */
#define READ_FULL 0      /* max_records records handed out */
#define READ_END 1       /* the file ends at a record boundary */
#define READ_HAND_OVER 2 /* a bad length CRC, a file ending inside a record, or a record longer than the buffer:
                          * the caller's block reader takes over at the record (it has the error messages) */
#define READ_BAD_DATA 3  /* the record at state[START] has a bad data CRC */
#define READ_ROOM 4      /* views: the buffer has no room for the next record; pack: the values buffer */
#define READ_PAUSED 5    /* cut: the records of what was read are handed out (the next call reads on): as lazy as
                          * the block reader, which hands out each block's records before it reads the next */
#define READ_FAILED -2   /* cut: a bytes object could not be made (a Python error is set) */

/* The reader's state (an int64 array Python keeps between calls, checked on every call). */
enum { START, FILLED, POS, SIZE, INDEX, SKIP, LIMIT, CHUNK, STATE_LEN };

typedef struct {
    int fd, verify, compact; /* compact: move a record cut off at the buffer's end to its start (pack's scratch) */
    int gil;                 /* read_cut: the loop holds the GIL (it makes bytes objects), released around each read */
    uint8_t *buf;
    int64_t cap, s[STATE_LEN];
} Reader;

/* 1: a whole record at buf[at:*end]; 0: the buffer does not hold all of it yet; -1: a bad length CRC. */
static int next_record(const Reader *r, int64_t at, int64_t *end) {
    int64_t have = r->s[FILLED] - at;
    if (have < HEADER) return 0;
    const uint8_t *h = r->buf + at;
    if (r->verify && mask(crc8(h)) != load32(h + 8)) return -1;
    uint64_t length = load64(h);
    if (have < OVERHEAD || length > (uint64_t)(have - OVERHEAD)) return 0; /* compared without adding: no wrap */
    *end = at + (int64_t)length + OVERHEAD;
    return 1;
}

#define FILL_READ 0
#define FILL_EOF 1
#define FILL_ROOM 2
#define FILL_ERROR 3 /* errno is set */

/* Read on into the buffer after its bytes: up to SIZE bytes (doubling up to CHUNK, a cache-sized read), not past
 * LIMIT (where an index says the records wanted end) unless already there. With `compact` (read_pack, whose buffer
 * is the values buffer: the data of the records handed out sits below `floor`), the bytes not yet handed out move
 * down to `floor` first when the room left is less than a read. */
static int fill(Reader *r, int64_t floor, int64_t hint) {
    int64_t *s = r->s;
    if (r->compact && s[START] > floor && r->cap - s[FILLED] < s[SIZE]) {
        memmove(r->buf + floor, r->buf + s[START], (size_t)(s[FILLED] - s[START]));
        s[FILLED] -= s[START] - floor;
        s[START] = floor;
    }
    int64_t want = r->cap - s[FILLED];
    if (want == 0) return FILL_ROOM;
    if (s[SIZE] < want) want = s[SIZE];
    if (hint > 0 && hint < want) want = hint;
    if (s[LIMIT] > s[POS] && s[LIMIT] - s[POS] < want) want = s[LIMIT] - s[POS];
    ssize_t n;
    int error = 0;
    if (r->gil) {
        Py_BEGIN_ALLOW_THREADS;
        do n = pread(r->fd, r->buf + s[FILLED], (size_t)want, (off_t)s[POS]);
        while (n < 0 && errno == EINTR);
        error = errno;
        Py_END_ALLOW_THREADS;
    } else {
        do n = pread(r->fd, r->buf + s[FILLED], (size_t)want, (off_t)s[POS]);
        while (n < 0 && errno == EINTR);
        error = errno;
    }
    if (n < 0) {
        errno = error;
        return FILL_ERROR;
    }
    if (n == 0) return FILL_EOF;
    s[FILLED] += n;
    s[POS] += n;
    s[SIZE] = 2 * s[SIZE] < s[CHUNK] ? 2 * s[SIZE] : s[CHUNK];
    return FILL_READ;
}

typedef struct {
    uint8_t *views;   /* read_views: 16 bytes a record */
    int32_t index;    /* ... the array's data buffer the reader's buffer is */
    int64_t *offsets; /* read_pack: the data of record k at buf[offsets[k]:offsets[k + 1]] */
    PyObject *records; /* read_cut: a list whose slot k gets record k's data as bytes (the GIL held) */
    int failed;        /* ... a bytes object could not be made: a Python error is set */
} Out;

/* Check the data CRCs of the k records framed from START and hand out the good ones; the first bad one, or -1. */
static Py_ssize_t emit(Reader *r, Out *o, Py_ssize_t count, const int64_t *ends, int k) {
    int64_t start = r->s[START];
    Py_ssize_t bad = r->verify ? check_group(r->buf, ends, start, 0, k) : -1;
    int good = bad >= 0 ? (int)bad : k;
    for (int j = 0; j < good; j++, count++) {
        uint32_t n = (uint32_t)(ends[j] - start - OVERHEAD);
        if (o->records) { /* copied out of the bytes just read and checked, still in L1 */
            PyObject *record = PyBytes_FromStringAndSize((const char *)r->buf + start + HEADER, (Py_ssize_t)n);
            if (!record) {
                o->failed = 1;
                good = j;
                break;
            }
            PyList_SET_ITEM(o->records, count, record);
        } else if (o->offsets) { /* down over the framing, in place: the bytes were read and checked just now, still cached */
            memmove(r->buf + o->offsets[count], r->buf + start + HEADER, n);
            o->offsets[count + 1] = o->offsets[count] + n;
        } else {
            write_view(o->views + VIEW * count, r->buf + start + HEADER, n, o->index, (int32_t)(start + HEADER));
        }
        start = ends[j];
    }
    r->s[START] = start;
    r->s[INDEX] += good;
    return bad;
}

/* The loop: frame, check and hand out records, reading on when the buffer holds no whole one; GIL released. */
static int read_loop(Reader *r, Out *o, Py_ssize_t max_records, Py_ssize_t *count) {
    int64_t *s = r->s, ends[GROUP];
    int64_t began = s[POS] - (s[FILLED] - s[START]); /* the file offset of the first record */
    for (;;) {
        int got = 1, k = 0;
        while (s[INDEX] < s[SKIP] && (got = next_record(r, s[START], ends)) == 1) { /* before `start`: framed only */
            s[START] = ends[0];
            s[INDEX]++;
        }
        if (got == 1) {
            if (*count == max_records) return READ_FULL;
            for (int64_t at = s[START]; k < GROUP && *count + k < max_records; at = ends[k++])
                if ((got = next_record(r, at, ends + k)) != 1) break;
        }
        if (k) {
            int64_t before = s[INDEX];
            Py_ssize_t bad = emit(r, o, *count, ends, k);
            if (o->failed) { /* the records before the one that failed are handed out */
                *count += (Py_ssize_t)(s[INDEX] - before);
                return READ_FAILED;
            }
            *count += bad >= 0 ? bad : k;
            if (bad >= 0) return READ_BAD_DATA;
            continue;
        }
        if (got < 0) return READ_HAND_OVER;
        if (o->records && *count > 0) return READ_PAUSED;
        int64_t floor = o->offsets ? o->offsets[*count] : 0, hint = 0;
        if (o->offsets && *count > 0) { /* read about what the batch's last records need: what read_pack reads after
                                         * them moves to the next values buffer (or the same, if the array copies) */
            int64_t per = (s[POS] - (s[FILLED] - s[START]) - began) / *count + 1;
            hint = per * (max_records - *count + 1) - (s[FILLED] - s[START]);
            hint = hint < 4096 ? 4096 : hint;
        }
        int f = fill(r, floor, hint);
        if (f == FILL_ERROR) return -1;
        if (f == FILL_EOF) return s[START] == s[FILLED] ? READ_END : READ_HAND_OVER;
        if (f == FILL_ROOM) { /* a record cut off at the buffer's end: more room if it is not the most of it */
            int64_t freed = r->compact ? floor : s[START]; /* by a buffer twice the size (pack), another (views) */
            return s[FILLED] - s[START] > freed ? READ_HAND_OVER : READ_ROOM;
        }
    }
}

/* Parse the arguments both entry points share; check the state against the buffer. */
static int reader_open(Reader *r, PyObject *buf_obj, Py_buffer *buf, PyObject *state_obj, Py_buffer *state,
                       int64_t max_cap) {
    if (get_buffer(buf_obj, buf, 1, "buf") < 0) return -1;
    if (get_ends(state_obj, state, 1) < 0) {
        PyBuffer_Release(buf);
        return -1;
    }
    r->buf = buf->buf;
    r->cap = buf->len;
    int64_t *s = state->buf;
    const int64_t big = (int64_t)1 << 60; /* no sum or double of these can overflow */
    if (state->len != 8 * STATE_LEN || s[START] < 0 || s[START] > s[FILLED] || s[FILLED] > r->cap || s[POS] < 0 ||
        s[POS] > big || s[SIZE] < 1 || s[SIZE] > big || s[CHUNK] < 1 || s[CHUNK] > big || s[INDEX] < 0 ||
        s[INDEX] > big || r->cap > max_cap) {
        PyErr_Format(PyExc_ValueError, "read: a state of %zd bytes that does not fit a buffer of %zd bytes "
                     "(need %d int64: 0 <= start <= filled <= len(buf); pos and index >= 0; size and chunk >= 1; "
                     "all below 2**60)",
                     state->len, buf->len, STATE_LEN);
        PyBuffer_Release(state);
        PyBuffer_Release(buf);
        return -1;
    }
    memcpy(r->s, s, sizeof(r->s));
    return 0;
}

/* Run the loop, write the state back, release the buffers; the status (< 0: a Python error is set). */
static int reader_loop(Reader *r, Out *o, Py_ssize_t max_records, Py_buffer *buf, Py_buffer *state,
                       Py_ssize_t *count) {
    int status;
    *count = 0;
    if (r->gil) { /* read_cut: the loop makes bytes objects, and releases the GIL around each read itself */
        status = read_loop(r, o, max_records, count);
    } else {
        Py_BEGIN_ALLOW_THREADS;
        status = read_loop(r, o, max_records, count);
        Py_END_ALLOW_THREADS;
    }
    if (status == -1) PyErr_SetFromErrno(PyExc_OSError);
    memcpy(state->buf, r->s, sizeof(r->s));
    PyBuffer_Release(state);
    PyBuffer_Release(buf);
    return status;
}

/* reader_loop's (count, status), or NULL. */
static PyObject *reader_run(Reader *r, Out *o, Py_ssize_t max_records, Py_buffer *buf, Py_buffer *state) {
    Py_ssize_t count;
    int status = reader_loop(r, o, max_records, buf, state, &count);
    if (status < 0) return NULL;
    return Py_BuildValue("ni", count, status);
}

static PyObject *read_views(PyObject *self, PyObject *args) {
    PyObject *buf_obj, *state_obj, *out_obj;
    int fd, verify, index;
    Py_ssize_t max_records;
    if (!PyArg_ParseTuple(args, "iOOnpOi", &fd, &buf_obj, &state_obj, &max_records, &verify, &out_obj, &index))
        return NULL;
    Reader r = {.fd = fd, .verify = verify, .compact = 0};
    Py_buffer buf, state, out;
    if (reader_open(&r, buf_obj, &buf, state_obj, &state, INT32_MAX) < 0) return NULL;
    if (get_buffer(out_obj, &out, 1, "out") < 0) goto fail;
    if (max_records < 0 || out.len / VIEW < max_records || index < 0) {
        PyErr_Format(PyExc_ValueError, "read_views: out (%zd bytes) too small for %zd views, or buffer index %d < 0",
                     out.len, max_records, index);
        PyBuffer_Release(&out);
        goto fail;
    }
    Out o = {.views = out.buf, .index = index};
    PyObject *result = reader_run(&r, &o, max_records, &buf, &state);
    PyBuffer_Release(&out);
    return result;
fail:
    PyBuffer_Release(&state);
    PyBuffer_Release(&buf);
    return NULL;
}

static PyObject *read_pack(PyObject *self, PyObject *args) {
    PyObject *buf_obj, *state_obj, *offsets_obj;
    int fd, verify;
    Py_ssize_t max_records;
    if (!PyArg_ParseTuple(args, "iOOnpO", &fd, &buf_obj, &state_obj, &max_records, &verify, &offsets_obj))
        return NULL;
    Reader r = {.fd = fd, .verify = verify, .compact = 1};
    Py_buffer buf, state, offsets;
    if (reader_open(&r, buf_obj, &buf, state_obj, &state, PY_SSIZE_T_MAX) < 0) return NULL;
    if (get_ends(offsets_obj, &offsets, 1) < 0) goto fail;
    int64_t *off = offsets.buf;
    if (max_records < 0 || offsets.len / 8 < max_records + 1 || off[0] < 0 || off[0] > r.s[START]) {
        PyErr_Format(PyExc_ValueError, "read_pack: offsets (%zd) too small for %zd records, or offsets[0] (%lld) "
                     "not in 0..start (%lld)", offsets.len / 8, max_records,
                     offsets.len >= 8 ? (long long)off[0] : -1LL, (long long)r.s[START]);
        PyBuffer_Release(&offsets);
        goto fail;
    }
    Out o = {.offsets = off};
    PyObject *result = reader_run(&r, &o, max_records, &buf, &state);
    PyBuffer_Release(&offsets);
    return result;
fail:
    PyBuffer_Release(&state);
    PyBuffer_Release(&buf);
    return NULL;
}

/* read_pack's loop with each record's data copied into a bytes object as soon as it is checked (read_tfrecord):
 * the buffer is scratch, compacted in place (what is left of a read moves to its start). */
static PyObject *read_cut(PyObject *self, PyObject *args) {
    PyObject *buf_obj, *state_obj;
    int fd, verify;
    Py_ssize_t max_records;
    if (!PyArg_ParseTuple(args, "iOOnp", &fd, &buf_obj, &state_obj, &max_records, &verify)) return NULL;
    if (max_records < 0 || max_records > ((Py_ssize_t)1 << 24)) {
        PyErr_Format(PyExc_ValueError, "read_cut: max_records %zd not in 0..2**24", max_records);
        return NULL;
    }
    Reader r = {.fd = fd, .verify = verify, .compact = 1, .gil = 1};
    Py_buffer buf, state;
    if (reader_open(&r, buf_obj, &buf, state_obj, &state, INT32_MAX) < 0) return NULL;
    Out o = {.records = PyList_New(max_records)};
    if (!o.records) {
        PyBuffer_Release(&state);
        PyBuffer_Release(&buf);
        return NULL;
    }
    Py_ssize_t count;
    int status = reader_loop(&r, &o, max_records, &buf, &state, &count);
    if (status < 0 || PyList_SetSlice(o.records, count, max_records, NULL) < 0) { /* the slots no record filled */
        Py_DECREF(o.records);
        return NULL;
    }
    return Py_BuildValue("Ni", o.records, status);
}

static PyObject *crc32c_py(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (get_buffer(arg, &view, 0, "data") < 0) return NULL;
    uint32_t crc = crc32c(view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *crc32c_software_py(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (get_buffer(arg, &view, 0, "data") < 0) return NULL;
    uint32_t crc = crc_software(view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

/* crc32c_group over a list's buffers, GROUP at a time: how the tests reach the interleaved paths directly. */
static PyObject *crc32c_records_py(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "crc32c_records takes a sequence of buffers");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *result = PyList_New(n);
    for (Py_ssize_t i = 0; result && i < n; i += GROUP) {
        int k = n - i < GROUP ? (int)(n - i) : GROUP, got = 0;
        Py_buffer views[GROUP];
        const uint8_t *data[GROUP];
        size_t len[GROUP];
        uint32_t crc[GROUP];
        for (; got < k; got++) {
            if (get_buffer(PySequence_Fast_GET_ITEM(seq, i + got), &views[got], 0, "data") < 0) break;
            data[got] = views[got].buf;
            len[got] = (size_t)views[got].len;
        }
        if (got == k) crc32c_group(k, data, len, crc);
        for (int j = 0; j < got; j++) PyBuffer_Release(&views[j]);
        if (got < k) {
            Py_CLEAR(result);
            break;
        }
        for (int j = 0; j < k; j++) {
            PyObject *value = PyLong_FromUnsignedLong(crc[j]);
            if (!value) {
                Py_CLEAR(result);
                break;
            }
            PyList_SET_ITEM(result, i + j, value);
        }
    }
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"frame", frame, METH_VARARGS,
     "frame(buf, pos, end, out, check_lengths) -> (count, bad_length): record ends from pos into out (int64)."},
    {"cut", cut, METH_VARARGS,
     "cut(buf, first, ends, lo, hi, verify) -> (records, bad): data of records lo:hi as bytes; bad: first bad CRC or -1."},
    {"pack", pack, METH_VARARGS,
     "pack(buf, first, ends, lo, hi, verify, values, offsets, base) -> bad: data of records lo:hi into values at "
     "offsets (int64, from base); bad: first bad data CRC or -1."},
    {"views", views, METH_VARARGS,
     "views(buf, first, ends, lo, hi, verify, out, index) -> bad: Arrow binary_view views of records lo:hi into "
     "out (16 bytes each), their data in buf as the array's data buffer `index`; bad: first bad data CRC or -1."},
    {"read_views", read_views, METH_VARARGS,
     "read_views(fd, buf, state, max_records, verify, out, index) -> (count, status): read a local file into buf "
     "from state (int64[8]: start, filled, pos, size, index, skip, limit, chunk), check the records, write their "
     "binary_view views into out (data buffer `index`), until max_records or status (0 full, 1 end, 2 hand over, "
     "3 bad data CRC at start, 4 no room in buf, 5 paused: read_cut only)."},
    {"read_pack", read_pack, METH_VARARGS,
     "read_pack(fd, buf, state, max_records, verify, offsets) -> (count, status): as read_views, the records' data "
     "moved down in buf over their framing, from offsets[0] (<= start), ending at offsets[1:]."},
    {"read_cut", read_cut, METH_VARARGS,
     "read_cut(fd, buf, state, max_records, verify) -> (records, status): as read_pack, each record's data copied "
     "into a bytes object (a list of at most max_records, returned before a read once it has any: status 5); "
     "buf is scratch, compacted in place."},
    {"crc32c", crc32c_py, METH_O, "CRC-32C of a buffer (hardware when available)."},
    {"crc32c_records", crc32c_records_py, METH_O,
     "CRC-32C of each buffer of a sequence, computed GROUP (12) at a time (interleaved) as the readers' checks are."},
    {"crc32c_software", crc32c_software_py, METH_O, "CRC-32C of a buffer with the slicing-by-8 tables."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "shardkit.formats._tfrecord", "Compiled TFRecord framing kernel (see tfrecord/kernel.py).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__tfrecord(void) {
    const uint16_t probe = 1;
    if (*(const uint8_t *)&probe != 1) {
        PyErr_SetString(PyExc_ImportError, "the TFRecord kernel reads little-endian integers in place");
        return NULL;
    }
    init_tables();
    zeros_table(zeros_long, LONG_BLOCK);
    zeros_table(zeros_short, SHORT_BLOCK);
#if HAVE_SSE42
    __builtin_cpu_init();
    hardware = __builtin_cpu_supports("sse4.2") != 0;
    int folding = hardware && __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul") &&
                  getenv("SHARDKIT_NO_AVX512") == NULL; /* (the variable turns off both widths of folding) */
    if (folding && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw"))
        vector = VECTOR_AVX512;
    else if (folding && __builtin_cpu_supports("avx2"))
        vector = VECTOR_AVX2;
    init_folding();
#endif
    PyObject *module = PyModule_Create(&module_def);
    if (!module) return NULL;
    if (PyModule_AddIntConstant(module, "HARDWARE_CRC", hardware) < 0 ||
        PyModule_AddIntConstant(module, "VECTOR_CRC", vector) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
