/* TFRecord framing and CRC-32C in C: the compiled backend of shardkit/formats/tfrecord/kernel.py.
 *
 * Three loops the pure-Python reader runs per record, done here per block:
 *
 *   frame  walks the records of a buffer from a start offset: reads each
 *          8-byte length, checks its masked CRC-32C (optionally) and writes
 *          the record's end offset into an int64 array; it stops when the
 *          array is full, when the bytes left do not hold a whole record (a
 *          header or a body cut off: the caller reads on or reports the
 *          truncation), or at a bad length CRC (reported by its index);
 *   cut    checks the data CRC of records lo:hi and copies each one's data
 *          into a new bytes object in the same pass (read_tfrecord);
 *   pack   the same into one values buffer plus an Arrow offsets array,
 *          with no Python object per record (read_tfrecord_batches).
 *
 * Memory safety comes first: every offset is checked against the buffer's
 * length before a read; a record fits only when `end - pos >= 16` and
 * `length <= end - pos - 16`, compared without adding, so a length near
 * 2**64 cannot wrap around; cut and pack take the ends frame wrote but check
 * them again (increasing, each record at least 16 bytes, within the buffer),
 * since Python can hand them any array.
 *
 * CRC-32C: with SSE4.2 (checked at run time) three streams are interleaved
 * through the crc32 instruction and combined with zero-shift tables (Mark
 * Adler's method, as in the crc32c package), else slicing-by-8 tables. Both
 * give the crc32c package's values; the tests compare them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_SSE42 1
#include <nmmintrin.h>
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

__attribute__((target("sse4.2"))) static uint32_t crc_hardware(const uint8_t *p, size_t len) {
    uint64_t c0 = 0xFFFFFFFFu;
    CRC_TRIPLE(LONG_BLOCK, zeros_long)
    CRC_TRIPLE(SHORT_BLOCK, zeros_short)
    for (; len >= 8; p += 8, len -= 8) c0 = _mm_crc32_u64(c0, load64(p));
    uint32_t c = (uint32_t)c0;
    for (; len; p++, len--) c = _mm_crc32_u8(c, *p);
    return c ^ 0xFFFFFFFFu;
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

static inline uint32_t crc32c(const uint8_t *p, size_t len) {
#if HAVE_SSE42
    if (hardware) return crc_hardware(p, len);
#endif
    return crc_software(p, len);
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

/* Copy a record's data to dst, returning whether its CRC matches the stored one (when verify). */
static inline int take(const uint8_t *b, int64_t start, int64_t stop, uint8_t *dst, int verify) {
    const uint8_t *data = b + start + HEADER;
    size_t n = (size_t)(stop - start - OVERHEAD);
    if (verify && mask(crc32c(data, n)) != load32(b + stop - 4)) return 0;
    memmove(dst, data, n); /* pack may compact a block in place: dst <= data then */
    return 1;
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
    for (Py_ssize_t i = lo; i < hi; i++) {
        int64_t start = i ? ends[i - 1] : first;
        PyObject *record = PyBytes_FromStringAndSize(NULL, ends[i] - start - OVERHEAD);
        if (!record) goto fail;
        if (!take(buf.buf, start, ends[i], (uint8_t *)PyBytes_AS_STRING(record), verify)) {
            Py_DECREF(record);
            bad = i;
            if (PyList_SetSlice(records, i - lo, hi - lo, NULL) < 0) goto fail; /* the empty slots */
            break;
        }
        PyList_SET_ITEM(records, i - lo, record);
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
    for (Py_ssize_t i = lo; i < hi; i++) {
        if (!take(buf.buf, start, ends[i], dst + at, verify)) {
            bad = i;
            break;
        }
        at += ends[i] - start - OVERHEAD;
        off[i - lo + 1] = at;
        start = ends[i];
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

static PyMethodDef methods[] = {
    {"frame", frame, METH_VARARGS,
     "frame(buf, pos, end, out, check_lengths) -> (count, bad_length): record ends from pos into out (int64)."},
    {"cut", cut, METH_VARARGS,
     "cut(buf, first, ends, lo, hi, verify) -> (records, bad): data of records lo:hi as bytes; bad: first bad CRC or -1."},
    {"pack", pack, METH_VARARGS,
     "pack(buf, first, ends, lo, hi, verify, values, offsets, base) -> bad: data of records lo:hi into values at "
     "offsets (int64, from base); bad: first bad data CRC or -1."},
    {"crc32c", crc32c_py, METH_O, "CRC-32C of a buffer (hardware when available)."},
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
#endif
    PyObject *module = PyModule_Create(&module_def);
    if (!module) return NULL;
    if (PyModule_AddIntConstant(module, "HARDWARE_CRC", hardware) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
