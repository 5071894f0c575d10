/*
 * _zinf.c - the CPython extension under the zinf package: an Engine object over a
 * zinf_engine handle (zinf_open, zinf_open_config_flags or zinf_connect), tensor handles,
 * and Pinned objects for fetched copies that export their memory through DLPack and the
 * buffer protocol without copying. Every call that may block runs with the GIL dropped; the
 * bookkeeping of the objects (pins, exports, a close waiting for them) changes only with the
 * GIL held.
 *
 * It is not a tensor library: no arithmetic, no copies beyond read/write, and nothing of
 * torch (a consumer takes the memory with from_dlpack).
 *
 * Lifetimes. A Pinned holds a reference to its Engine, and each DLPack export holds one to
 * its Pinned, so the memory a view points at stays pinned until the consumer's deleter has
 * run, whatever the caller released meanwhile. A buffer (memoryview) holds its Pinned too,
 * but release() is refused while one is alive rather than waiting for it. Engine.close()
 * stops new calls at once, but the engine is closed for real only when no call is in flight
 * and no pin is held.
 */
#include "_zinf.h"

PyObject *ZinfError;
PyObject *TensorType;

/* ---- errors ---------------------------------------------------------------------------- */

/* Raises zinf.Error for errno err with msg (a reference taken); filename, when given, is
 * named in it. */
static PyObject *raise_msg(int err, PyObject *msg, PyObject *filename)
{
    if (!msg) return NULL;
    PyObject *exc = filename ? PyObject_CallFunction(ZinfError, "iOO", err, msg, filename)
                             : PyObject_CallFunction(ZinfError, "iO", err, msg);
    Py_DECREF(msg);
    if (exc) {
        PyErr_SetObject(ZinfError, exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/* Raises zinf.Error for a negative errno r; filename, when given, is named in it. */
PyObject *raise_zinf(int r, const char *what, PyObject *filename)
{
    int err = r < 0 ? -r : r;
    return raise_msg(err, PyUnicode_FromFormat("%s: %s", what, zinf_strerror(-err)), filename);
}

/* As raise_zinf, with a message (PyUnicode_FromFormat's fmt) that says why where the errno's
 * text would mislead. */
PyObject *raise_zinf_why(int r, PyObject *filename, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    return raise_msg(r < 0 ? -r : r, msg, filename);
}

/* A RuntimeWarning where nothing can raise (a deleter, a dealloc); printed as unraisable
 * where warnings are errors. GIL held. */
void warn_unraisable(PyObject *obj, const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    if (PyErr_WarnEx(PyExc_RuntimeWarning, buf, 1)) PyErr_WriteUnraisable(obj);
    PyErr_Restore(et, ev, tb);
}

/* ---- arguments ------------------------------------------------------------------------- */

/* A tier given as zinf.DEVICE/HOST/NVME (ints) or "device"/"host"/"nvme". */
int parse_tier(PyObject *o, int *out)
{
    if (PyUnicode_Check(o)) {
        const char *s = PyUnicode_AsUTF8(o);
        if (!s) return -1;
        if (!strcmp(s, "device")) *out = ZINF_TIER_DEVICE;
        else if (!strcmp(s, "host")) *out = ZINF_TIER_HOST;
        else if (!strcmp(s, "nvme")) *out = ZINF_TIER_NVME;
        else {
            PyErr_Format(PyExc_ValueError, "unknown tier %R (device, host or nvme)", o);
            return -1;
        }
        return 0;
    }
    if (PyLong_Check(o)) {
        long v = PyLong_AsLong(o);
        if (v == -1 && PyErr_Occurred()) return -1;
        if (v < ZINF_TIER_DEVICE || v > ZINF_TIER_NVME) {
            PyErr_Format(PyExc_ValueError, "unknown tier %ld (zinf.DEVICE, HOST or NVME)", v);
            return -1;
        }
        *out = (int)v;
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "a tier is a str or zinf.DEVICE/HOST/NVME, not %s",
                 Py_TYPE(o)->tp_name);
    return -1;
}

/* A tensor handle: a zinf.Tensor or any int. */
int parse_handle(PyObject *o, zinf_tensor *out)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "a tensor handle is an int, not %s", Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%R is no tensor handle", o);
        return -1;
    }
    *out = v;
    return 0;
}

/* Byte counts and offsets: non-negative ints. */
int py_parse_size(PyObject *o, const char *what, size_t *out)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s is an int, not %s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    size_t v = PyLong_AsSize_t(o);
    if (v == (size_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a non-negative int, not %R", what, o);
        return -1;
    }
    *out = v;
    return 0;
}

/* The dtypes DLPack can carry, by numpy's names. */
static const struct dtype_info dtypes[] = {
    {"float16", kDLFloat, 16},  {"float32", kDLFloat, 32},     {"float64", kDLFloat, 64},
    {"bfloat16", kDLBfloat, 16}, {"int8", kDLInt, 8},          {"int16", kDLInt, 16},
    {"int32", kDLInt, 32},      {"int64", kDLInt, 64},         {"uint8", kDLUInt, 8},
    {"uint16", kDLUInt, 16},    {"uint32", kDLUInt, 32},       {"uint64", kDLUInt, 64},
    {"bool", kDLBool, 8},       {"complex64", kDLComplex, 64}, {"complex128", kDLComplex, 128},
};

const struct dtype_info *find_dtype(const char *name)
{
    for (size_t i = 0; i < sizeof(dtypes) / sizeof(dtypes[0]); i++)
        if (!strcmp(dtypes[i].name, name)) return &dtypes[i];
    return NULL;
}

/* A dtype as a str ("float32"), a numpy dtype (its .name) or a numpy scalar type (its
 * __name__); *out is its canonical name, a new reference. */
const struct dtype_info *parse_dtype(PyObject *o, PyObject **out)
{
    PyObject *name;
    if (PyUnicode_Check(o)) {
        name = Py_NewRef(o);
    } else if (PyObject_HasAttrString(o, "itemsize") && PyObject_HasAttrString(o, "name")) {
        name = PyObject_GetAttrString(o, "name");
    } else if (PyType_Check(o)) {
        name = PyObject_GetAttrString(o, "__name__");
    } else {
        PyErr_Format(PyExc_TypeError, "a dtype is a str such as \"float32\", not %s",
                     Py_TYPE(o)->tp_name);
        return NULL;
    }
    if (!name) return NULL;
    const char *s = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    const struct dtype_info *d = s ? find_dtype(s) : NULL;
    if (!d) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "unsupported dtype %R", o);
        Py_DECREF(name);
        return NULL;
    }
    Py_DECREF(name);
    *out = PyUnicode_FromString(d->name);
    return *out ? d : NULL;
}


/* ---- module ---------------------------------------------------------------------------- */

static PyObject *mod_connect(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"socket", "job", NULL};
    PyObject *sock_o, *sock_b = NULL;
    const char *job;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Os", kwlist, &sock_o, &job) ||
        !PyUnicode_FSConverter(sock_o, &sock_b))
        return NULL;
    EngineObject *self = eng_alloc(&EngineType);
    if (!self) {
        Py_DECREF(sock_b);
        return NULL;
    }
    const char *sock = PyBytes_AS_STRING(sock_b);
    zinf_engine *e = NULL;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_connect(sock, job, &e);
    Py_END_ALLOW_THREADS
    Py_DECREF(sock_b);
    if (r) {
        Py_DECREF(self);
        return raise_zinf(r, "zinf_connect", sock_o);
    }
    self->e = e;
    self->opened = ENG_OPENED_CONNECT;
    eng_learn(self);
    return (PyObject *)self;
}

/* The swap directory a module-level call reads: a path, encoded. */
static PyObject *dir_arg(PyObject *args, PyObject **dir)
{
    PyObject *b = NULL;
    if (!PyArg_ParseTuple(args, "O", dir) || !PyUnicode_FSConverter(*dir, &b)) return NULL;
    return b;
}

static PyObject *mod_saved_steps(PyObject *m, PyObject *args)
{
    PyObject *dir, *b = dir_arg(args, &dir);
    if (!b) return NULL;
    int64_t steps[2] = {-1, -1};
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_saved_steps(PyBytes_AS_STRING(b), steps);
    Py_END_ALLOW_THREADS
    Py_DECREF(b);
    if (r) return raise_zinf(r, "zinf_saved_steps", dir);
    PyObject *out = PyTuple_New(2);
    for (int i = 0; out && i < 2; i++) {
        PyObject *v = steps[i] < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(steps[i]);
        if (!v) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *mod_saved_at(PyObject *m, PyObject *args)
{
    PyObject *dir, *b = dir_arg(args, &dir);
    if (!b) return NULL;
    int64_t ns = 0;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_saved_at(PyBytes_AS_STRING(b), &ns);
    Py_END_ALLOW_THREADS
    Py_DECREF(b);
    if (r) return raise_zinf(r, "zinf_saved_at", dir);
    return PyLong_FromLongLong(ns);
}

static PyObject *mod_saved_tensors(PyObject *m, PyObject *args)
{
    PyObject *dir, *b = dir_arg(args, &dir);
    if (!b) return NULL;
    size_t n = 0;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_saved_tensors(PyBytes_AS_STRING(b), &n);
    Py_END_ALLOW_THREADS
    Py_DECREF(b);
    if (r) return raise_zinf(r, "zinf_saved_tensors", dir);
    if (n == SIZE_MAX) Py_RETURN_NONE; /* a manifest that cannot be read */
    return PyLong_FromSize_t(n);
}

/* zinf.set_log: the library's messages to a Python callable. The library calls it from
 * whichever thread logs, holding its log lock: the callback takes the GIL, so zinf_set_log
 * itself is called with the GIL dropped (a thread in the callback may wait for the GIL with
 * that lock held), as every other call of the library is. */
static PyObject *log_fn; /* the callable, or NULL */

static void log_to_python(int level, const char *msg, void *user)
{
    if (!Py_IsInitialized() || _Py_IsFinalizing()) return;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *fn = log_fn;
    if (fn) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        Py_INCREF(fn);
        PyObject *r = PyObject_CallFunction(fn, "is", level, msg);
        if (!r) PyErr_WriteUnraisable(fn);
        Py_XDECREF(r);
        Py_DECREF(fn);
        PyErr_Restore(et, ev, tb);
    }
    PyGILState_Release(g);
}

static PyObject *mod_set_log(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"fn", "level", NULL};
    PyObject *fn = Py_None, *level_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|OO", kwlist, &fn, &level_o)) return NULL;
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_Format(PyExc_TypeError, "set_log takes a callable fn(level, msg) or None, not %s",
                     Py_TYPE(fn)->tp_name);
        return NULL;
    }
    int level = -1;
    if (level_o != Py_None) {
        if (PyUnicode_Check(level_o)) {
            static const char *const names[] = {"error", "warn", "notice", "debug"};
            const char *sl = PyUnicode_AsUTF8(level_o);
            if (!sl) return NULL;
            for (int i = 0; i < 4; i++)
                if (!strcmp(sl, names[i])) level = i;
        } else if (PyLong_Check(level_o) && !PyBool_Check(level_o)) {
            long v = PyLong_AsLong(level_o);
            if (v == -1 && PyErr_Occurred()) return NULL;
            if (v >= 0 && v <= 3) level = (int)v;
        } else {
            PyErr_Format(PyExc_TypeError, "a log level is an int 0-3 or error/warn/notice/debug, "
                         "not %s", Py_TYPE(level_o)->tp_name);
            return NULL;
        }
        if (level < 0) {
            PyErr_Format(PyExc_ValueError, "unknown log level %R (0-3, or error, warn, notice, "
                         "debug)", level_o);
            return NULL;
        }
    }
    PyObject *old = log_fn;
    bool to_python = fn != Py_None;
    if (to_python) log_fn = Py_NewRef(fn);
    Py_BEGIN_ALLOW_THREADS
    zinf_set_log(to_python ? log_to_python : NULL, NULL, level);
    Py_END_ALLOW_THREADS
    if (!to_python) log_fn = NULL;
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

/* At exit, before the interpreter goes: the messages go back to stderr. */
static PyObject *mod_log_reset(PyObject *m, PyObject *unused)
{
    if (!log_fn) Py_RETURN_NONE;
    PyObject *old = log_fn;
    Py_BEGIN_ALLOW_THREADS
    zinf_set_log(NULL, NULL, -1);
    Py_END_ALLOW_THREADS
    log_fn = NULL;
    Py_DECREF(old);
    Py_RETURN_NONE;
}

static PyObject *mod_strerror(PyObject *m, PyObject *arg)
{
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    if (v < -4095 || v > 4095) v = 0;
    return PyUnicode_FromString(zinf_strerror(v < 0 ? (int)v : -(int)v));
}


/* The name of a buffer's type for a message: its dtype where the object has one, else
 * numpy's name for a struct format, else the format itself. A new reference. */
static PyObject *buffer_type_name(PyObject *o, const Py_buffer *v)
{
    PyObject *dt = PyObject_GetAttrString(o, "dtype");
    if (dt) {
        PyObject *s = PyObject_Str(dt);
        Py_DECREF(dt);
        if (s) return s;
    }
    PyErr_Clear();
    const char *f = v->format ? v->format : "B";
    while (*f && strchr("@=<>!", *f)) f++;
    const char *kind = NULL;
    if (f[0] && !f[1]) {
        if (strchr("efdg", f[0])) kind = "float";
        else if (strchr("bhilqn", f[0])) kind = "int";
        else if (strchr("BHILQN", f[0])) kind = "uint";
        else if (f[0] == '?') kind = "bool";
    } else if (f[0] == 'Z' && f[1] && !f[2]) {
        kind = "complex";
    }
    if (kind) return PyUnicode_FromFormat("%s%zd", kind, v->itemsize * 8);
    return PyUnicode_FromFormat("format '%s'", v->format ? v->format : "B");
}

/* Is this buffer float32 (1), untyped bytes (0), or another type (-1)? */
static int buffer_kind(PyObject *o, const Py_buffer *v)
{
    const char *f = v->format ? v->format : "B";
    /* float32, native or in this machine's byte order spelled out. */
    bool native_le = (const union { uint16_t u; uint8_t b[2]; }){.u = 1}.b[0] == 1;
    if (v->itemsize == 4 && (!strcmp(f, "f") || !strcmp(f, "@f") || !strcmp(f, "=f") ||
                             (native_le && !strcmp(f, "<f")) || (!native_le && !strcmp(f, ">f"))))
        return 1;
    if (strcmp(f, "B") && strcmp(f, "@B") && strcmp(f, "=B") && strcmp(f, "<B") &&
        strcmp(f, ">B"))
        return -1;
    /* Unsigned bytes: untyped, unless the object says they are uint8 (a numpy array). */
    PyObject *dt = PyObject_GetAttrString(o, "dtype");
    if (!dt) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(dt);
    return -1;
}

static int f32_get(PyObject *o, const char *call, const char *what, int write,
                   struct f32_arg *a)
{
    memset(a, 0, sizeof(*a));
    if (PyObject_TypeCheck(o, &PinnedType)) {
        PinnedObject *p = (PinnedObject *)o;
        if (eng_foreign(p->eng)) {
            raise_foreign();
            return -1;
        }
        if (p->state != PIN_HELD) {
            PyErr_Format(PyExc_ValueError, "%s: %s: its copy was released", call, what);
            return -1;
        }
        if (p->meta && strcmp(PyUnicode_AsUTF8(PyTuple_GET_ITEM(p->meta, 1)), "float32")) {
            PyErr_Format(PyExc_TypeError, "%s: %s is a pinned %U tensor: the step "
                         "takes float32 only", call, what, PyTuple_GET_ITEM(p->meta, 1));
            return -1;
        }
        if (p->nbytes % sizeof(float)) {
            PyErr_Format(PyExc_ValueError, "%s: %s holds %zu bytes, not a whole "
                         "number of float32", call, what, p->nbytes);
            return -1;
        }
        if (p->tier == ZINF_TIER_DEVICE && p->eng->device_is_cuda) {
            PyErr_Format(PyExc_ValueError, "%s: %s is in GPU memory: the step runs on "
                         "the host (fetch it to \"host\")", call, what);
            return -1;
        }
        a->f = p->ptr;
        a->n = p->nbytes / sizeof(float);
        a->pinned = (PinnedObject *)Py_NewRef(o);
        p->exports++;
        return 0;
    }
    int flags = PyBUF_FORMAT | (write ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS);
    if (PyObject_GetBuffer(o, &a->view, flags) < 0) {
        if (PyErr_ExceptionMatches(PyExc_TypeError) && !PyObject_CheckBuffer(o)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s: %s is a %s, which exports no buffer: "
                         "give a float32 array (numpy) or a zinf.Pinned", call, what,
                         Py_TYPE(o)->tp_name);
        }
        return -1;
    }
    a->have_view = 1;
    int kind = buffer_kind(o, &a->view);
    if (kind < 0) {
        PyObject *name = buffer_type_name(o, &a->view);
        if (name) {
            PyErr_Format(PyExc_TypeError, "%s: %s is %U, not float32: the step takes "
                         "float32 only", call, what, name);
            Py_DECREF(name);
        }
        PyBuffer_Release(&a->view);
        a->have_view = 0;
        return -1;
    }
    if (a->view.len % (Py_ssize_t)sizeof(float)) {
        PyErr_Format(PyExc_ValueError, "%s: %s holds %zd bytes, not a whole number of "
                     "float32", call, what, a->view.len);
        PyBuffer_Release(&a->view);
        a->have_view = 0;
        return -1;
    }
    a->f = a->view.buf;
    a->n = (size_t)a->view.len / sizeof(float);
    return 0;
}

static void f32_put(struct f32_arg *a)
{
    if (a->have_view) PyBuffer_Release(&a->view);
    PinnedObject *p = a->pinned;
    if (!p) return;
    p->exports--;
    if (!p->exports && p->state == PIN_PENDING) pin_drop(p, p->flags, DROP_DEFERRED);
    Py_DECREF(p);
}

static PyObject *mod_adamw_step(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwl[] = {"param", "grad", "m", "v", "step", "lr", "beta1", "beta2", "eps",
                          "weight_decay", "grad_scale", NULL};
    PyObject *o[4];
    int step;
    struct zinf_adamw h;
    float gs = 1.0f;
    zinf_adamw_defaults(&h);
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOi|ffffff", kwl, &o[0], &o[1], &o[2], &o[3],
                                     &step, &h.lr, &h.beta1, &h.beta2, &h.eps, &h.weight_decay,
                                     &gs))
        return NULL;
    static const char *const what[4] = {"param", "grad", "m", "v"};
    struct f32_arg a[4];
    int got = 0, r = 0;
    for (; got < 4; got++)
        if (f32_get(o[got], "adamw_step", what[got], got != 1, &a[got]) < 0) break;
    if (got == 4) {
        size_t n = a[0].n;
        for (int i = 1; i < 4; i++)
            if (a[i].n != n) {
                PyErr_Format(PyExc_ValueError, "adamw_step: %s holds %zu floats, param %zu",
                             what[i], a[i].n, n);
                got = -got; /* an error, every argument held */
                break;
            }
        if (got == 4) {
            Py_BEGIN_ALLOW_THREADS
            r = zinf_adamw_step(&h, step, a[0].f, a[1].f, a[2].f, a[3].f, n, gs);
            Py_END_ALLOW_THREADS
        }
    }
    int held = got < 0 ? -got : got;
    for (int i = 0; i < held; i++)
        f32_put(&a[i]);
    if (got != 4) return NULL;
    if (r) return raise_zinf(r, "zinf_adamw_step", NULL);
    Py_RETURN_NONE;
}

/* An IEEE half's value as a float (exact: every half is a float). */
static float half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | man << 13; /* inf, nan */
    } else if (exp) {
        bits = sign | (exp + 112) << 23 | man << 13;
    } else if (!man) {
        bits = sign;
    } else { /* subnormal: man x 2^-24, normalised */
        uint32_t e = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            e--;
        }
        bits = sign | e << 23 | (man & 0x3ff) << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

/* d[i] = s or d[i] * sc + s, for the i-th source value s (LOAD(i)), returning the sum of
 * the squares of the new d[i] in double: element i is added to lane i % 8, and the lanes are
 * summed in a fixed order at the end, so that the bits are the same whether the compiler
 * vectorises the lanes or not. */
#define GRAD_ADD(name, type, LOAD)                                                              \
    static double name(float *restrict d, const type *restrict src, size_t n, float sc,       \
                       int fresh)                                                              \
    {                                                                                          \
        double acc[8] = {0};                                                                   \
        size_t i = 0;                                                                          \
        for (; i + 8 <= n; i += 8) {                                                           \
            float v[8];                                                                        \
            if (fresh)                                                                         \
                for (int j = 0; j < 8; j++) v[j] = LOAD(i + j);                                \
            else                                                                               \
                for (int j = 0; j < 8; j++) v[j] = d[i + j] * sc + LOAD(i + j);                \
            for (int j = 0; j < 8; j++) {                                                      \
                d[i + j] = v[j];                                                               \
                acc[j] += (double)v[j] * v[j];                                                 \
            }                                                                                  \
        }                                                                                      \
        for (int j = 0; i < n; i++, j++) {                                                     \
            float v = fresh ? LOAD(i) : d[i] * sc + LOAD(i);                                   \
            d[i] = v;                                                                          \
            acc[j] += (double)v * v;                                                           \
        }                                                                                      \
        return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])); \
    }

static inline float bf16_to_float(uint16_t b)
{
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

#define LOAD_F32(i) src[i]
#define LOAD_BF16(i) bf16_to_float(src[i])
#define LOAD_F16(i) half_to_float(src[i])
GRAD_ADD(add_f32, float, LOAD_F32)
GRAD_ADD(add_bf16, uint16_t, LOAD_BF16)
GRAD_ADD(add_f16, uint16_t, LOAD_F16)

/* The sum of squares of d in GRAD_ADD's lanes and order. */
static double sumsq_f32(const float *d, size_t n)
{
    double acc[8] = {0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++)
            acc[j] += (double)d[i + j] * d[i + j];
    for (int j = 0; i < n; i++, j++)
        acc[j] += (double)d[i] * d[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* The gradient's accumulation for zinf.torch, in one call rather than a torch operation
 * each: dst (float32: a Pinned fetched dirty, or a writable buffer) becomes src (fresh) or
 * dst * scale + src, element by element in float32 with one rounding each (as torch's
 * mul_ and add_ round: the extension is built without contraction into fused multiply-
 * adds), src being count float32 (src_dtype 0), bfloat16 (1) or float16 (2) values at
 * address src in host memory. Returns the sum of the squares of the result, accumulated
 * in double in eight lanes (element i in lane i % 8) summed in a fixed order: the same
 * bits for the same values, whatever the threads. The caller vouches for src (private:
 * zinf.torch passes a contiguous CPU tensor's data_ptr()). */
PyObject *grad_add_into(PyObject *dst_o, unsigned long long src_addr, Py_ssize_t count,
                        int src_dtype, double scale, int fresh)
{
    if (count < 0 || src_dtype < 0 || src_dtype > 2 || (count && !src_addr)) {
        PyErr_Format(PyExc_ValueError, "_grad_add: %zd values of dtype code %d at address %llu",
                     count, src_dtype, src_addr);
        return NULL;
    }
    struct f32_arg a;
    if (f32_get(dst_o, "_grad_add", "grad", 1, &a) < 0) return NULL;
    if (a.n != (size_t)count) {
        PyErr_Format(PyExc_ValueError, "_grad_add: the gradient holds %zu float32, the "
                     "source %zd values", a.n, count);
        f32_put(&a);
        return NULL;
    }
    double sum;
    const void *src = (const void *)(uintptr_t)src_addr;
    bool overlap = count && (const char *)src < (const char *)(a.f + a.n) &&
                   (const char *)a.f < (const char *)src + (size_t)count * (src_dtype ? 2 : 4);
    if (overlap && !(src == a.f && src_dtype == 0 && fresh)) {
        PyErr_SetString(PyExc_ValueError, "_grad_add: the source overlaps the gradient");
        f32_put(&a);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (overlap) /* the gradient onto itself: its sum of squares, nothing written */
        sum = sumsq_f32(a.f, a.n);
    else switch (src_dtype) {
    case 0: sum = add_f32(a.f, src, a.n, (float)scale, fresh); break;
    case 1: sum = add_bf16(a.f, src, a.n, (float)scale, fresh); break;
    default: sum = add_f16(a.f, src, a.n, (float)scale, fresh); break;
    }
    Py_END_ALLOW_THREADS
    f32_put(&a);
    return PyFloat_FromDouble(sum);
}

static PyObject *mod_grad_add(PyObject *m, PyObject *args)
{
    PyObject *dst_o;
    unsigned long long src_addr;
    Py_ssize_t count;
    int src_dtype, fresh;
    double scale;
    if (!PyArg_ParseTuple(args, "OKnidp", &dst_o, &src_addr, &count, &src_dtype, &scale,
                          &fresh))
        return NULL;
    return grad_add_into(dst_o, src_addr, count, src_dtype, scale, fresh);
}

static PyObject *tensor_repr(PyObject *unused, PyObject *self)
{
    PyObject *name = PyObject_GetAttrString(self, "name");
    if (!name) {
        PyErr_Clear();
        name = Py_NewRef(Py_None);
    }
    PyObject *r = PyUnicode_FromFormat("<zinf.Tensor %llu %R>",
                                       PyLong_AsUnsignedLongLong(self), name);
    Py_DECREF(name);
    return r;
}

static PyMethodDef module_methods[] = {
    {"connect", KW mod_connect, METH_VARARGS | METH_KEYWORDS,
     "connect(socket, job) -> Engine attached to a zinf daemon's job."},
    {"strerror", (PyCFunction)mod_strerror, METH_O, "strerror(errno) -> zinf's message"},
    {"set_log", KW mod_set_log, METH_VARARGS | METH_KEYWORDS,
     "set_log(fn=None, level=None): where libzinf's messages go (zinf_set_log). fn(level, "
     "msg) is called for each (level 0 error .. 3 debug, msg one line), from whichever "
     "thread logs, and must not call zinf; None: back to stderr. level: the most verbose "
     "level passed on (0-3 or \"error\", \"warn\", \"notice\", \"debug\"); None: as it "
     "is (ZINF_LOG in the environment, default notice). At exit the messages go back to "
     "stderr."},
    {"_log_reset", (PyCFunction)mod_log_reset, METH_NOARGS, NULL},
    {"saved_steps", (PyCFunction)mod_saved_steps, METH_VARARGS,
     "saved_steps(dir) -> (current, previous): the steps the saved state in swap directory "
     "dir was flushed with (None: no tag, or no previous version). Reads the manifests "
     "only (zinf_saved_steps); zinf.Error(ENOENT) where there is no saved state."},
    {"saved_at", (PyCFunction)mod_saved_at, METH_VARARGS,
     "saved_at(dir) -> int: when the saved state in dir was last committed, nanoseconds "
     "since the epoch (zinf_saved_at)."},
    {"saved_tensors", (PyCFunction)mod_saved_tensors, METH_VARARGS,
     "saved_tensors(dir) -> int or None: the tensors the saved state in dir names (None: "
     "its manifest cannot be read, a saved state all the same); zinf.Error(ENOENT) where "
     "there is none (zinf_saved_tensors)."},
    {"_grad_add", (PyCFunction)mod_grad_add, METH_VARARGS,
     "_grad_add(dst, src_address, count, src_dtype, scale, fresh) -> sum of squares: "
     "zinf.torch's gradient accumulation (private: src_address is trusted)."},
    {"adamw_step", KW mod_adamw_step, METH_VARARGS | METH_KEYWORDS,
     "adamw_step(param, grad, m, v, step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,\n"
     "           weight_decay=0.01, grad_scale=1.0)\n"
     "One AdamW step (torch.optim.AdamW's update, zinf_adamw_step) in place on param, m and v:\n"
     "float32 arrays of the same length in host memory, each a Pinned copy (fetched dirty to\n"
     "keep what is written) or a buffer. step counts from 1. zinf.Error(EINVAL) for\n"
     "hyper-parameters out of range; nothing is changed then. Another dtype (a Pinned\n"
     "registered with one, an array or buffer of another type) is a TypeError; untyped\n"
     "bytes (a Pinned registered by size, bytes, bytearray) are taken as float32."},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef tensor_repr_def = {"__repr__", (PyCFunction)tensor_repr, METH_O, NULL};

static struct PyModuleDef zinf_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zinf._zinf",
    .m_doc = "The C extension under the zinf package; see zinf's docstring.",
    .m_size = -1,
    .m_methods = module_methods,
};

/* zinf.Tensor: type("Tensor", (int,), {...}), so that instances carry attributes. */
static PyObject *make_tensor_type(void)
{
    PyObject *fn = PyCFunction_New(&tensor_repr_def, NULL);
    PyObject *meth = fn ? PyInstanceMethod_New(fn) : NULL;
    Py_XDECREF(fn);
    if (!meth) return NULL;
    PyObject *type = PyObject_CallFunction(
        (PyObject *)&PyType_Type, "s(O){s:s,s:s,s:O}", "Tensor", (PyObject *)&PyLong_Type,
        "__module__", "zinf", "__doc__",
        "A tensor handle: an int, with .name, .nbytes and, when registered with one, "
        ".shape and .dtype.",
        "__repr__", meth);
    Py_DECREF(meth);
    return type;
}

PyMODINIT_FUNC PyInit__zinf(void);
PyMODINIT_FUNC PyInit__zinf(void)
{
    static int atfork_set;
    if (!atfork_set) {
        int r = pthread_atfork(NULL, NULL, atfork_child);
        if (r) {
            errno = r;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        atfork_set = 1;
    }
    if (PyType_Ready(&EngineType) || PyType_Ready(&PinnedType)) return NULL;
    PyObject *m = PyModule_Create(&zinf_module);
    if (!m) return NULL;
    ZinfError = PyErr_NewExceptionWithDoc(
        "zinf.Error", "A zinf call failed: .errno is the positive errno, .strerror zinf's "
                      "message.",
        PyExc_OSError, NULL);
    TensorType = make_tensor_type();
    if (!ZinfError || !TensorType || PyModule_AddObjectRef(m, "Error", ZinfError) ||
        PyModule_AddObjectRef(m, "Tensor", TensorType) ||
        PyModule_AddObjectRef(m, "Engine", (PyObject *)&EngineType) ||
        PyModule_AddObjectRef(m, "Pinned", (PyObject *)&PinnedType) ||
        PyModule_AddIntConstant(m, "DEVICE", ZINF_TIER_DEVICE) ||
        PyModule_AddIntConstant(m, "HOST", ZINF_TIER_HOST) ||
        PyModule_AddIntConstant(m, "NVME", ZINF_TIER_NVME) ||
        PyModule_AddStringConstant(m, "__version__", zinf_version())) {
        Py_DECREF(m);
        return NULL;
    }
    /* set_log's callback is undone at exit, before the interpreter it calls into goes. */
    PyObject *atexit = PyImport_ImportModule("atexit");
    PyObject *reset = PyObject_GetAttrString(m, "_log_reset");
    PyObject *r = atexit && reset ? PyObject_CallMethod(atexit, "register", "O", reset) : NULL;
    Py_XDECREF(atexit);
    Py_XDECREF(reset);
    if (!r) {
        Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(r);
    return m;
}

