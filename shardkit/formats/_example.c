/* tf.Example / tf.SequenceExample decoder in C: the compiled backend of shardkit/formats/example.py.
 *
 * It decodes exactly what the pure-Python decoder decodes, to the same values,
 * and rejects exactly what it rejects (see that module's docstring for the
 * rules: protobuf's). Memory safety comes first:
 *
 *   - every read is bounded by the end of the message being read (a field, a
 *     varint or a group that would run past it is an error, as it is in the
 *     Python decoder, where such a read either fails or ends past the end);
 *   - lengths are compared as `length > end - pos` (end >= pos always), never
 *     by adding, so no length can wrap around;
 *   - varints stop at 10 bytes (tags and lengths at 5), bits past the 64th of
 *     a 10-byte varint are dropped, as protobuf does;
 *   - unknown groups are skipped with a fixed-size stack of open group numbers
 *     bounded by protobuf's depth limit (100 levels, counting every enclosing
 *     message); nothing recurses on the input's nesting: the known messages
 *     nest at most six deep, by their schema.
 *
 * A record is walked once to validate everything and count values, then the
 * values of each feature that survives (last map key, last oneof member) are
 * copied into arrays sized from the counts.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

#define MAX_TAG 0xFFFFFFFFull /* field numbers go up to 2**29 - 1 */
#define MAX_DEPTH 100         /* protobuf's default recursion limit */
#define F1_LEN 0x0A
#define F2_LEN 0x12
#define F3_LEN 0x1A
#define F1_VARINT 0x08
#define F1_FIXED32 0x0D
#define K_BYTES F1_LEN /* Feature's oneof members, by tag */
#define K_FLOAT F2_LEN
#define K_INT64 F3_LEN

static PyObject *ShardkitError; /* shardkit.errors.ShardkitError, looked up at import */

typedef struct {
    const uint8_t *buf;
    char msg[160]; /* what is malformed and where; empty while nothing is (or a Python error is set) */
} Ctx;

typedef struct {
    size_t a, b;
} Span;

/* A growable array of spans, on the stack while it holds four. */
typedef struct {
    Span local[4];
    Span *items;
    Py_ssize_t n, cap;
} Spans;

static void spans_init(Spans *s) {
    s->items = s->local;
    s->n = 0;
    s->cap = 4;
}

static void spans_free(Spans *s) {
    if (s->items != s->local) PyMem_Free(s->items);
    spans_init(s);
}

static int spans_push(Spans *s, size_t a, size_t b) {
    if (s->n == s->cap) {
        Py_ssize_t cap = s->cap * 2;
        Span *items = PyMem_Malloc((size_t)cap * sizeof(Span));
        if (!items) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(items, s->items, (size_t)s->n * sizeof(Span));
        if (s->items != s->local) PyMem_Free(s->items);
        s->items = items;
        s->cap = cap;
    }
    s->items[s->n].a = a;
    s->items[s->n].b = b;
    s->n++;
    return 0;
}

static int fail(Ctx *c, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    PyOS_vsnprintf(c->msg, sizeof c->msg, fmt, args);
    va_end(args);
    return -1;
}

/* ------------------------------------------------------------------ wire format */

/* A varint of at most `max_bytes` bytes at *pos, not reading at or past `end`. */
static inline int read_varint(Ctx *c, size_t *pos, size_t end, int max_bytes, uint64_t *out) {
    size_t p = *pos;
    uint64_t value = 0;
    *out = 0;
    for (int i = 0; i < max_bytes; i++) {
        if (p >= end) return fail(c, "varint runs past the end of its message at byte %zu", p);
        uint8_t byte = c->buf[p++];
        value |= (uint64_t)(byte & 0x7F) << (7 * i); /* i = 9: only the 64th bit survives */
        if (byte < 0x80) {
            *pos = p;
            *out = value;
            return 0;
        }
    }
    if (max_bytes == 5) return fail(c, "tag or length longer than 5 bytes at byte %zu", *pos);
    return fail(c, "varint longer than 10 bytes at byte %zu", *pos);
}

#define VARINT64(c, pos, end, out) read_varint((c), (pos), (end), 10, (out))
#define VARINT32(c, pos, end, out) read_varint((c), (pos), (end), 5, (out))

static int skip_group(Ctx *c, size_t *pos, size_t end, uint64_t number, int depth);

/* Skip the value of a field whose tag (any but an end-group tag) was just read. */
static int skip_value(Ctx *c, size_t *pos, size_t end, uint64_t tag, int depth) {
    uint64_t n = 0;
    switch (tag & 7) {
        case 0:
            return VARINT64(c, pos, end, &n);
        case 1:
        case 5:
            n = (tag & 7) == 1 ? 8 : 4;
            if (n > end - *pos) return fail(c, "fixed-size field runs past the end of its message at byte %zu", *pos);
            *pos += n;
            return 0;
        case 2:
            if (VARINT32(c, pos, end, &n)) return -1;
            if (n > end - *pos) return fail(c, "field runs past the end of its message at byte %zu", *pos);
            *pos += n;
            return 0;
        case 3:
            return skip_group(c, pos, end, tag >> 3, depth);
        default:
            return fail(c, "invalid wire type %d at byte %zu", (int)(tag & 7), *pos);
    }
}

/* Skip an unknown group and the groups in it, iteratively: the stack of open
 * group numbers can hold MAX_DEPTH + 1 entries, and depth + open <= MAX_DEPTH
 * is checked before each push. Field number 0 is taken inside groups, as upb does. */
static int skip_group(Ctx *c, size_t *pos, size_t end, uint64_t number, int depth) {
    uint64_t open[MAX_DEPTH + 2];
    int n = 0;
    open[n++] = number;
    while (n) {
        if (depth + n > MAX_DEPTH) return fail(c, "groups nested deeper than %d levels at byte %zu", MAX_DEPTH, *pos);
        if (*pos >= end) return fail(c, "group %llu not closed before byte %zu", (unsigned long long)open[n - 1], end);
        uint64_t tag;
        if (VARINT32(c, pos, end, &tag)) return -1;
        if (tag > MAX_TAG) return fail(c, "field number %llu out of range at byte %zu", (unsigned long long)(tag >> 3), *pos);
        if ((tag & 7) == 4) {
            if ((tag >> 3) != open[--n]) return fail(c, "mismatched end-group tag at byte %zu", *pos);
        } else if ((tag & 7) == 3) {
            open[n++] = tag >> 3;
        } else if (skip_value(c, pos, end, tag, depth)) {
            return -1;
        }
    }
    return 0;
}

/* The next field of the message ending at `end`, `depth` levels deep: its tag,
 * and the span of its payload (length-delimited) or of its encoded value. */
static inline int next_field(Ctx *c, size_t *pos, size_t end, int depth, uint64_t *tag, size_t *a, size_t *b) {
    uint64_t t;
    *tag = 0; /* set on every path: the compiler cannot see that callers read nothing after an error */
    *a = *b = *pos;
    if (VARINT32(c, pos, end, &t)) return -1;
    if ((t & 7) == 2 && t > 8 && t <= MAX_TAG) {
        uint64_t n;
        if (VARINT32(c, pos, end, &n)) return -1;
        if (n > end - *pos) return fail(c, "field runs past the end of its message at byte %zu", *pos);
        *a = *pos;
        *pos += n;
    } else {
        if (t < 8 || t > MAX_TAG)
            return fail(c, "field number %llu out of range at byte %zu", (unsigned long long)(t >> 3), *pos);
        *a = *pos;
        if (skip_value(c, pos, end, t, depth)) return -1;
    }
    *b = *pos;
    *tag = t;
    return 0;
}

/* ------------------------------------------------------------------ value lists */

/* Validate the Int64List/FloatList/BytesList at [a, b), `depth` deep, and add its number of values to *count. */
static int list_count(Ctx *c, int kind, size_t a, size_t b, int depth, Py_ssize_t *count) {
    size_t p = a, fa, fb;
    uint64_t tag, v;
    while (p < b) {
        if (next_field(c, &p, b, depth, &tag, &fa, &fb)) return -1;
        if (kind == K_INT64) {
            if (tag == F1_LEN) {
                for (size_t q = fa; q < fb; (*count)++)
                    if (VARINT64(c, &q, fb, &v)) return -1;
            } else if (tag == F1_VARINT) {
                (*count)++;
            }
        } else if (kind == K_FLOAT) {
            if (tag == F1_LEN || tag == F1_FIXED32) {
                if ((fb - fa) % 4) return fail(c, "packed floats of %zu bytes at byte %zu", fb - fa, fa);
                *count += (Py_ssize_t)((fb - fa) / 4);
            }
        } else if (tag == F1_LEN) {
            (*count)++;
        }
    }
    return 0;
}

static inline float load_float(const uint8_t *p) {
    uint32_t bits = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Where values go: numbers into `numbers` (int64_t or float), bytes into `list`
 * (set at index *i), or bytes appended to `data` with their ends in `ends`. */
typedef struct {
    void *numbers;
    PyObject *list;
    char **data;
    size_t *data_len, *data_cap;
    int64_t *ends;
    Py_ssize_t i;
} Sink;

static int append_data(Sink *s, const uint8_t *src, size_t n) {
    if (n > *s->data_cap - *s->data_len) {
        size_t cap = *s->data_cap * 2 + n + 1024;
        char *data = PyMem_Realloc(*s->data, cap);
        if (!data) {
            PyErr_NoMemory();
            return -1;
        }
        *s->data = data;
        *s->data_cap = cap;
    }
    if (n) memcpy(*s->data + *s->data_len, src, n);
    *s->data_len += n;
    return 0;
}

/* Copy the values of a list already validated by list_count into the sink. */
static int list_fill(Ctx *c, int kind, size_t a, size_t b, int depth, Sink *s) {
    size_t p = a, fa, fb;
    uint64_t tag, v;
    while (p < b) {
        if (next_field(c, &p, b, depth, &tag, &fa, &fb)) return -1;
        if (kind == K_INT64 && (tag == F1_LEN || tag == F1_VARINT)) {
            for (size_t q = fa; q < fb;) {
                if (VARINT64(c, &q, fb, &v)) return -1;
                ((int64_t *)s->numbers)[s->i++] = (int64_t)v;
            }
        } else if (kind == K_FLOAT && (tag == F1_LEN || tag == F1_FIXED32)) {
            float *out = (float *)s->numbers + s->i;
            for (size_t q = fa; q < fb; q += 4) *out++ = load_float(c->buf + q);
            s->i += (Py_ssize_t)((fb - fa) / 4);
        } else if (kind == K_BYTES && tag == F1_LEN) {
            if (s->list) {
                PyObject *item = PyBytes_FromStringAndSize((const char *)c->buf + fa, (Py_ssize_t)(fb - fa));
                if (!item) return -1;
                PyList_SET_ITEM(s->list, s->i++, item);
            } else {
                if (append_data(s, c->buf + fa, fb - fa)) return -1;
                s->ends[s->i++] = (int64_t)*s->data_len;
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ Feature */

typedef struct {
    int kind;         /* the last oneof member set, 0 if none */
    int runs;         /* how many times the member changed: the last run is the value */
    Py_ssize_t count; /* values in the last run */
} FeatureInfo;

static inline int is_member(uint64_t tag) { return tag == K_BYTES || tag == K_FLOAT || tag == K_INT64; }

/* Validate the Feature message(s) at `spans`, `depth` deep (every member, even replaced ones, as protobuf does). */
static int feature_scan(Ctx *c, const Span *spans, Py_ssize_t ns, int depth, FeatureInfo *info) {
    info->kind = info->runs = 0;
    info->count = 0;
    for (Py_ssize_t k = 0; k < ns; k++) {
        size_t p = spans[k].a, end = spans[k].b, fa, fb;
        uint64_t tag;
        while (p < end) {
            if (next_field(c, &p, end, depth, &tag, &fa, &fb)) return -1;
            if (!is_member(tag)) continue;
            if ((int)tag != info->kind) { /* a new member replaces the last */
                info->kind = (int)tag;
                info->runs++;
                info->count = 0;
            }
            if (list_count(c, info->kind, fa, fb, depth + 1, &info->count)) return -1;
        }
    }
    return 0;
}

/* Copy the values of the last run of members (found by feature_scan) into the sink. */
static int feature_fill(Ctx *c, const Span *spans, Py_ssize_t ns, int depth, const FeatureInfo *info, Sink *s) {
    int kind = 0, runs = 0;
    for (Py_ssize_t k = 0; k < ns; k++) {
        size_t p = spans[k].a, end = spans[k].b, fa, fb;
        uint64_t tag;
        while (p < end) {
            if (next_field(c, &p, end, depth, &tag, &fa, &fb)) return -1;
            if (!is_member(tag)) continue;
            if ((int)tag != kind) {
                kind = (int)tag;
                runs++;
            }
            if (runs == info->runs && list_fill(c, kind, fa, fb, depth + 1, s)) return -1;
        }
    }
    return 0;
}

/* A decoded Feature: int64 or float32 array, list of bytes, or [] when no member is set. */
static PyObject *feature_value(Ctx *c, const Span *spans, Py_ssize_t ns, int depth) {
    FeatureInfo info;
    if (feature_scan(c, spans, ns, depth, &info)) return NULL;
    PyObject *out;
    Sink sink = {0};
    if (info.kind == K_INT64 || info.kind == K_FLOAT) {
        npy_intp dims[1] = {info.count};
        out = PyArray_SimpleNew(1, dims, info.kind == K_INT64 ? NPY_INT64 : NPY_FLOAT32);
        if (!out) return NULL;
        sink.numbers = PyArray_DATA((PyArrayObject *)out);
    } else {
        out = PyList_New(info.kind ? info.count : 0);
        if (!out) return NULL;
        sink.list = out;
    }
    if (info.kind && feature_fill(c, spans, ns, depth, &info, &sink)) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* ------------------------------------------------------------------ maps */

/* A map entry at [a, b), `depth` deep: its last key (each one checked to be UTF-8)
 * as a str if `key` is not NULL, the span of its key in key_a and key_b, and the spans of its value(s). */
static int map_entry(Ctx *c, size_t a, size_t b, int depth, PyObject **key, size_t *key_a, size_t *key_b,
                     Spans *values) {
    size_t p = a, fa, fb;
    uint64_t tag;
    *key_a = *key_b = a;
    while (p < b) {
        if (next_field(c, &p, b, depth, &tag, &fa, &fb)) return -1;
        if (tag == F1_LEN) {
            PyObject *text = PyUnicode_DecodeUTF8((const char *)c->buf + fa, (Py_ssize_t)(fb - fa), "strict");
            if (!text) {
                if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) return -1;
                PyErr_Clear();
                return fail(c, "a key is not UTF-8 (bytes %zu..%zu)", fa, fb);
            }
            if (key) {
                Py_XSETREF(*key, text);
            } else {
                Py_DECREF(text);
            }
            *key_a = fa;
            *key_b = fb;
        } else if (tag == F2_LEN && spans_push(values, fa, fb)) {
            return -1;
        }
    }
    if (key && !*key) *key = PyUnicode_FromStringAndSize("", 0);
    return key && !*key ? -1 : 0;
}

/* Decode the Features message at [a, b), `depth` deep, into `out`: entries one level deeper, Features two. */
static int features_into(Ctx *c, PyObject *out, size_t a, size_t b, int depth) {
    size_t p = a, fa, fb, ka, kb;
    uint64_t tag;
    while (p < b) {
        if (next_field(c, &p, b, depth, &tag, &fa, &fb)) return -1;
        if (tag != F1_LEN) continue;
        PyObject *key = NULL, *value = NULL;
        Spans values;
        spans_init(&values);
        int rc = -1;
        if (!map_entry(c, fa, fb, depth + 1, &key, &ka, &kb, &values)) {
            value = feature_value(c, values.items, values.n, depth + 2);
            if (value) rc = PyDict_SetItem(out, key, value);
        }
        Py_XDECREF(key);
        Py_XDECREF(value);
        spans_free(&values);
        if (rc) return -1;
    }
    return 0;
}

/* Decode the FeatureLists message at [a, b), `depth` deep, into `out`: {key: [Feature value, ...]}. */
static int feature_lists_into(Ctx *c, PyObject *out, size_t a, size_t b, int depth) {
    size_t p = a, fa, fb, ka, kb;
    uint64_t tag;
    while (p < b) {
        if (next_field(c, &p, b, depth, &tag, &fa, &fb)) return -1;
        if (tag != F1_LEN) continue;
        PyObject *key = NULL, *list = NULL;
        Spans values;
        spans_init(&values);
        int rc = -1;
        if (!map_entry(c, fa, fb, depth + 1, &key, &ka, &kb, &values) && (list = PyList_New(0))) {
            rc = 0;
            for (Py_ssize_t k = 0; k < values.n && !rc; k++) { /* each FeatureList, depth + 2 */
                size_t q = values.items[k].a, end = values.items[k].b, la, lb;
                while (q < end && !rc) {
                    if (next_field(c, &q, end, depth + 2, &tag, &la, &lb)) {
                        rc = -1;
                    } else if (tag == F1_LEN) {
                        Span one = {la, lb};
                        PyObject *value = feature_value(c, &one, 1, depth + 3);
                        rc = value ? PyList_Append(list, value) : -1;
                        Py_XDECREF(value);
                    }
                }
            }
            if (!rc) rc = PyDict_SetItem(out, key, list);
        }
        Py_XDECREF(key);
        Py_XDECREF(list);
        spans_free(&values);
        if (rc) return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ entry points */

/* The record's bytes: borrowed from a bytes object, else copied (as bytes(record) does in Python). */
static PyObject *as_bytes(PyObject *record) {
    if (PyBytes_Check(record)) {
        Py_INCREF(record);
        return record;
    }
    return PyBytes_FromObject(record);
}

static PyObject *malformed(Ctx *c, const char *what, Py_ssize_t size) {
    if (!c->msg[0] && PyErr_Occurred()) return NULL; /* MemoryError and the like pass through */
    PyErr_Format(ShardkitError, "malformed %s (%zd bytes): %s", what, size, c->msg);
    return NULL;
}

static PyObject *decode_example(PyObject *module, PyObject *record) {
    PyObject *bytes = as_bytes(record);
    if (!bytes) return NULL;
    Ctx c = {(const uint8_t *)PyBytes_AS_STRING(bytes), ""};
    size_t p = 0, end = (size_t)PyBytes_GET_SIZE(bytes), fa, fb;
    uint64_t tag;
    PyObject *out = PyDict_New();
    int rc = out ? 0 : -1;
    while (!rc && p < end) {
        rc = next_field(&c, &p, end, 0, &tag, &fa, &fb);
        if (!rc && tag == F1_LEN) rc = features_into(&c, out, fa, fb, 1);
    }
    if (rc) {
        Py_XDECREF(out);
        out = malformed(&c, "tf.Example", (Py_ssize_t)end);
    }
    Py_DECREF(bytes);
    return out;
}

static PyObject *decode_sequence_example(PyObject *module, PyObject *record) {
    PyObject *bytes = as_bytes(record);
    if (!bytes) return NULL;
    Ctx c = {(const uint8_t *)PyBytes_AS_STRING(bytes), ""};
    size_t p = 0, end = (size_t)PyBytes_GET_SIZE(bytes), fa, fb;
    uint64_t tag;
    PyObject *context = PyDict_New(), *lists = PyDict_New(), *out = NULL;
    int rc = context && lists ? 0 : -1;
    while (!rc && p < end) {
        rc = next_field(&c, &p, end, 0, &tag, &fa, &fb);
        if (!rc && tag == F1_LEN) rc = features_into(&c, context, fa, fb, 1);
        if (!rc && tag == F2_LEN) rc = feature_lists_into(&c, lists, fa, fb, 1);
    }
    if (rc)
        malformed(&c, "tf.SequenceExample", (Py_ssize_t)end);
    else
        out = PyTuple_Pack(2, context, lists);
    Py_XDECREF(context);
    Py_XDECREF(lists);
    Py_DECREF(bytes);
    return out;
}

/* ------------------------------------------------------------------ columns */

typedef struct {
    const char *name; /* UTF-8 */
    Py_ssize_t name_len, count, itemsize;
    int kind;
    Py_buffer view; /* numbers, or for bytes the int64 ends (count * records + 1 of them) */
    char *data;     /* bytes: the values back to back */
    size_t data_len, data_cap;
    int found;       /* in the record being decoded */
    size_t a, b;     /* its last entry */
    FeatureInfo info;
} Column;

static const char *kind_name(int kind) { return kind == K_INT64 ? "int64" : kind == K_FLOAT ? "float32" : "bytes"; }

/* Walk one record: validate all of it, and note for each column the last entry with its key. */
static int columns_scan(Ctx *c, size_t end, Column *cols, Py_ssize_t ncols) {
    size_t p = 0, fa, fb, q, ea, eb, ka, kb;
    uint64_t tag;
    for (Py_ssize_t j = 0; j < ncols; j++) cols[j].found = 0;
    while (p < end) {
        if (next_field(c, &p, end, 0, &tag, &fa, &fb)) return -1;
        if (tag != F1_LEN) continue;
        for (q = fa; q < fb;) { /* Features, depth 1 */
            if (next_field(c, &q, fb, 1, &tag, &ea, &eb)) return -1;
            if (tag != F1_LEN) continue;
            Spans values;
            spans_init(&values);
            FeatureInfo info;
            int rc = map_entry(c, ea, eb, 2, NULL, &ka, &kb, &values);
            if (!rc) rc = feature_scan(c, values.items, values.n, 3, &info);
            spans_free(&values);
            if (rc) return -1;
            for (Py_ssize_t j = 0; j < ncols; j++) {
                Column *col = &cols[j];
                if ((Py_ssize_t)(kb - ka) == col->name_len && !memcmp(c->buf + ka, col->name, (size_t)col->name_len)) {
                    col->found = 1;
                    col->a = ea;
                    col->b = eb;
                    col->info = info;
                }
            }
        }
    }
    return 0;
}

/* Copy record i's value of each column into place, or raise naming the feature and the record. */
static int columns_fill(Ctx *c, Py_ssize_t i, Column *cols, Py_ssize_t ncols, PyObject *names, PyObject *shapes) {
    size_t ka, kb;
    for (Py_ssize_t j = 0; j < ncols; j++) {
        Column *col = &cols[j];
        PyObject *name = PyTuple_GET_ITEM(names, j), *shape = PyTuple_GET_ITEM(shapes, j);
        if (!col->found) {
            PyErr_Format(ShardkitError, "record %zd has no feature %R (wanted: %s of shape %R)", i, name,
                         kind_name(col->kind), shape);
            return -1;
        }
        if (col->info.count && col->info.kind != col->kind) {
            PyErr_Format(ShardkitError, "feature %R of record %zd holds %s values, expected %s of shape %R", name, i,
                         kind_name(col->info.kind), kind_name(col->kind), shape);
            return -1;
        }
        if (col->info.count != col->count) {
            PyErr_Format(ShardkitError, "feature %R of record %zd has %zd values, expected %zd for %s of shape %R",
                         name, i, col->info.count, col->count, kind_name(col->kind), shape);
            return -1;
        }
        if (!col->count) continue;
        Sink sink = {0};
        if (col->kind == K_BYTES) {
            sink.data = &col->data;
            sink.data_len = &col->data_len;
            sink.data_cap = &col->data_cap;
            sink.ends = (int64_t *)col->view.buf + 1;
            sink.i = i * col->count;
        } else {
            sink.numbers = (char *)col->view.buf + i * col->count * col->itemsize;
        }
        Spans values;
        spans_init(&values);
        int rc = map_entry(c, col->a, col->b, 2, NULL, &ka, &kb, &values);
        if (!rc) rc = feature_fill(c, values.items, values.n, 3, &col->info, &sink);
        spans_free(&values);
        if (rc) return -1;
    }
    return 0;
}

static int columns_setup(Column *cols, Py_ssize_t ncols, Py_ssize_t n, PyObject *names, PyObject *kinds,
                         PyObject *counts, PyObject *outs) {
    for (Py_ssize_t j = 0; j < ncols; j++) {
        Column *col = &cols[j];
        col->name = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(names, j), &col->name_len);
        col->kind = (int)PyLong_AsLong(PyTuple_GET_ITEM(kinds, j));
        col->count = PyLong_AsSsize_t(PyTuple_GET_ITEM(counts, j));
        if (!col->name || PyErr_Occurred()) return -1;
        if ((col->kind != K_INT64 && col->kind != K_FLOAT && col->kind != K_BYTES) || col->count < 0) {
            PyErr_SetString(PyExc_ValueError, "decode_columns: bad kind or count");
            return -1;
        }
        col->itemsize = col->kind == K_FLOAT ? 4 : 8;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(outs, j), &col->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)) return -1;
        if (col->count && n > (PY_SSIZE_T_MAX - 1) / col->itemsize / col->count) {
            PyErr_SetString(PyExc_ValueError, "decode_columns: output too large");
            return -1;
        }
        Py_ssize_t items = col->kind == K_BYTES ? n * col->count + 1 : n * col->count;
        if (col->view.len != items * col->itemsize) {
            PyErr_SetString(PyExc_ValueError, "decode_columns: an output buffer has the wrong size");
            return -1;
        }
        if (col->kind == K_BYTES) ((int64_t *)col->view.buf)[0] = 0;
    }
    return 0;
}

/* decode_columns(records, names, kinds, counts, shapes, outs) -> tuple of the bytes columns' data (None for numbers).
 * outs[j]: a writable C-contiguous buffer of len(records) * counts[j] int64 or float32 values, or for bytes one
 * of len(records) * counts[j] + 1 int64 offsets (the first, 0, is written here too). */
static PyObject *decode_columns(PyObject *module, PyObject *args) {
    PyObject *records, *names, *kinds, *counts, *shapes, *outs;
    if (!PyArg_ParseTuple(args, "OO!O!O!O!O!:decode_columns", &records, &PyTuple_Type, &names, &PyTuple_Type,
                          &kinds, &PyTuple_Type, &counts, &PyTuple_Type, &shapes, &PyTuple_Type, &outs))
        return NULL;
    Py_ssize_t ncols = PyTuple_GET_SIZE(names);
    if (PyTuple_GET_SIZE(kinds) != ncols || PyTuple_GET_SIZE(counts) != ncols || PyTuple_GET_SIZE(shapes) != ncols ||
        PyTuple_GET_SIZE(outs) != ncols) {
        PyErr_SetString(PyExc_ValueError, "decode_columns: names, kinds, counts, shapes and outs differ in length");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(records, "decode_columns: records must be a sequence of bytes");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Column *cols = PyMem_Calloc((size_t)(ncols ? ncols : 1), sizeof(Column));
    PyObject *out = NULL;
    if (!cols) {
        PyErr_NoMemory();
        goto done;
    }
    if (columns_setup(cols, ncols, n, names, kinds, counts, outs)) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *bytes = as_bytes(PySequence_Fast_GET_ITEM(seq, i));
        if (!bytes) goto done;
        Ctx c = {(const uint8_t *)PyBytes_AS_STRING(bytes), ""};
        size_t end = (size_t)PyBytes_GET_SIZE(bytes);
        int rc = columns_scan(&c, end, cols, ncols);
        if (rc && (c.msg[0] || !PyErr_Occurred()))
            PyErr_Format(ShardkitError, "record %zd: malformed tf.Example (%zu bytes): %s", i, end, c.msg);
        if (!rc) rc = columns_fill(&c, i, cols, ncols, names, shapes);
        Py_DECREF(bytes);
        if (rc) goto done;
    }
    out = PyTuple_New(ncols);
    for (Py_ssize_t j = 0; out && j < ncols; j++) {
        PyObject *data = cols[j].kind == K_BYTES ? PyBytes_FromStringAndSize(cols[j].data, (Py_ssize_t)cols[j].data_len)
                                                 : Py_NewRef(Py_None);
        if (!data) Py_CLEAR(out);
        else PyTuple_SET_ITEM(out, j, data);
    }
done:
    for (Py_ssize_t j = 0; cols && j < ncols; j++) {
        if (cols[j].view.obj) PyBuffer_Release(&cols[j].view);
        PyMem_Free(cols[j].data);
    }
    PyMem_Free(cols);
    Py_DECREF(seq);
    return out;
}

/* ------------------------------------------------------------------ module */

static PyMethodDef methods[] = {
    {"decode_example", decode_example, METH_O, "Decode a serialized tf.train.Example (see shardkit.formats.example)."},
    {"decode_sequence_example", decode_sequence_example, METH_O,
     "Decode a serialized tf.train.SequenceExample into (context, feature_lists)."},
    {"decode_columns", decode_columns, METH_VARARGS,
     "Decode fixed-shape features of many tf.Examples into preallocated columns."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "shardkit.formats._example", "Compiled tf.Example decoder (see example.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__example(void) {
    import_array();
    PyObject *errors = PyImport_ImportModule("shardkit.errors");
    if (!errors) return NULL;
    ShardkitError = PyObject_GetAttrString(errors, "ShardkitError");
    Py_DECREF(errors);
    if (!ShardkitError) return NULL;
    return PyModule_Create(&module_def);
}
