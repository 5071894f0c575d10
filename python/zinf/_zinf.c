/*
 * _zinf.c - the CPython extension under the zinf package: an Engine object over a
 * zinf_engine handle (zinf_open, zinf_open_config_flags or zinf_connect), tensor handles,
 * and Pinned objects for fetched copies that export their memory through DLPack without
 * copying. Every call that may block runs with the GIL dropped; the bookkeeping of the
 * objects (pins, exports, a close waiting for them) changes only with the GIL held.
 *
 * It is not a tensor library: no arithmetic, no copies beyond read/write, and nothing of
 * torch (a consumer takes the memory with from_dlpack).
 *
 * Lifetimes. A Pinned holds a reference to its Engine, and each DLPack export holds one to
 * its Pinned, so the memory a view points at stays pinned until the consumer's deleter has
 * run, whatever the caller released meanwhile. Engine.close() stops new calls at once, but
 * the engine is closed for real only when no call is in flight and no pin is held.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <zinf.h>

#include "dlpack.h"

static PyObject *ZinfError;  /* zinf.Error, an OSError */
static PyObject *TensorType; /* zinf.Tensor, an int with attributes */

/* ---- errors ---------------------------------------------------------------------------- */

/* Raises zinf.Error for a negative errno r; filename, when given, is named in it. */
static PyObject *raise_zinf(int r, const char *what, PyObject *filename)
{
    int err = r < 0 ? -r : r;
    PyObject *msg = PyUnicode_FromFormat("%s: %s", what, zinf_strerror(-err));
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

/* A RuntimeWarning where nothing can raise (a deleter, a dealloc); printed as unraisable
 * where warnings are errors. GIL held. */
static void warn_unraisable(PyObject *obj, const char *fmt, ...)
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
static int parse_tier(PyObject *o, int *out)
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
static int parse_handle(PyObject *o, zinf_tensor *out)
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
static int parse_size(PyObject *o, const char *what, size_t *out)
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
static const struct dtype_info {
    const char *name;
    uint8_t code, bits;
} dtypes[] = {
    {"float16", kDLFloat, 16},  {"float32", kDLFloat, 32},     {"float64", kDLFloat, 64},
    {"bfloat16", kDLBfloat, 16}, {"int8", kDLInt, 8},          {"int16", kDLInt, 16},
    {"int32", kDLInt, 32},      {"int64", kDLInt, 64},         {"uint8", kDLUInt, 8},
    {"uint16", kDLUInt, 16},    {"uint32", kDLUInt, 32},       {"uint64", kDLUInt, 64},
    {"bool", kDLBool, 8},       {"complex64", kDLComplex, 64}, {"complex128", kDLComplex, 128},
};

static const struct dtype_info *find_dtype(const char *name)
{
    for (size_t i = 0; i < sizeof(dtypes) / sizeof(dtypes[0]); i++)
        if (!strcmp(dtypes[i].name, name)) return &dtypes[i];
    return NULL;
}

/* A dtype as a str ("float32"), a numpy dtype (its .name) or a numpy scalar type (its
 * __name__); *out is its canonical name, a new reference. */
static const struct dtype_info *parse_dtype(PyObject *o, PyObject **out)
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

/* ---- Engine ---------------------------------------------------------------------------- */

/* Forks. A child of fork() has the parent's engines in its memory but not their threads, and
 * shares their files and io_uring queues with the parent: closing, flushing or fetching there
 * would hang the child and corrupt what the parent does. Each child bumps this count (a
 * pthread_atfork handler), and an Engine opened under another count is the parent's: every
 * call on it is refused, and collecting it (or its Pinned objects and views) touches nothing
 * of libzinf. */
static volatile unsigned long forks;

static void atfork_child(void)
{
    forks++;
}

typedef struct {
    PyObject_HEAD
    zinf_engine *e;       /* NULL once closed for real */
    int closing;          /* close() asked for: no new calls */
    int unflushed;        /* close without flushing (close_unflushed, a with-block that raised) */
    Py_ssize_t busy;      /* calls in flight with the GIL dropped */
    Py_ssize_t pins;      /* pins held through Pinned objects, pending tickets and orphans */
    int device_is_cuda, host_pinned, cuda_device, readonly;
    unsigned long forks;  /* `forks` when it was opened: another value, a forked child's copy */
    PyObject *meta;       /* {handle: (shape, dtype)} of tensors registered with a shape */
    PyObject *tickets;    /* {ticket: (handle, tier)} of fetch_async calls not waited yet */
    /* Dirty releases that zinf refused (-EBUSY: the other tier's copy was pinned) for Pinned
     * objects collected meanwhile: [(handle, tier, flags)], each pin still held and counted
     * in pins, tried again whenever a pin of this engine goes and at close. */
    PyObject *orphans;
    /* Fetches waiting for room (wait=): releases of this engine's pins bump room_gen and
     * wake them. room_releasing counts releases in flight (not counted yet). */
    pthread_mutex_t room_lock;
    pthread_cond_t room_cond;
    uint64_t room_gen;
    int room_releasing, room_ready;
} EngineObject;

static PyTypeObject EngineType;

static bool eng_foreign(EngineObject *self)
{
    return self->forks != forks;
}

static void raise_foreign(void)
{
    PyErr_SetString(PyExc_RuntimeError,
                    "the zinf engine was opened in another process (before a fork): it "
                    "cannot be used in this one; open an Engine here");
}

/* Takes the engine for one call: NULL (with ValueError) when it is closed, RuntimeError in a
 * forked child. Every success is paired with eng_leave(). */
static zinf_engine *eng_enter(EngineObject *self)
{
    if (eng_foreign(self)) {
        raise_foreign();
        return NULL;
    }
    if (!self->e || self->closing) {
        PyErr_SetString(PyExc_ValueError, "the zinf engine is closed");
        return NULL;
    }
    self->busy++;
    return self->e;
}

/* ---- waiting for room ------------------------------------------------------------------ */

static void room_init(EngineObject *self)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&self->room_lock, NULL);
    pthread_cond_init(&self->room_cond, &ca);
    pthread_condattr_destroy(&ca);
    self->room_ready = 1;
}

/* A release of a pin of this engine starts (GIL held or not)... */
static void room_release_begin(EngineObject *self)
{
    pthread_mutex_lock(&self->room_lock);
    self->room_releasing++;
    pthread_mutex_unlock(&self->room_lock);
}

/* ... and ends: dropped, whether the pin went (waiters look again). */
static void room_release_end(EngineObject *self, bool dropped)
{
    pthread_mutex_lock(&self->room_lock);
    self->room_releasing--;
    if (dropped) self->room_gen++;
    pthread_cond_broadcast(&self->room_cond);
    pthread_mutex_unlock(&self->room_lock);
}

/* Wakes the waiters (close). */
static void room_wake(EngineObject *self)
{
    pthread_mutex_lock(&self->room_lock);
    pthread_cond_broadcast(&self->room_cond);
    pthread_mutex_unlock(&self->room_lock);
}

/* The release count now, and whether a release is in flight. */
static uint64_t room_gen(EngineObject *self, int *releasing)
{
    pthread_mutex_lock(&self->room_lock);
    uint64_t g = self->room_gen;
    if (releasing) *releasing = self->room_releasing;
    pthread_mutex_unlock(&self->room_lock);
    return g;
}

static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Waits, GIL not held, until a release moves room_gen past gen, the engine closes, or until
 * (monotonic seconds) passes, whichever comes first. */
static void room_wait_until(EngineObject *self, uint64_t gen, double until)
{
    struct timespec ts;
    ts.tv_sec = (time_t)until;
    ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec >= 1000000000L) ts.tv_nsec = 999999999L;
    pthread_mutex_lock(&self->room_lock);
    while (self->room_gen == gen && !self->closing)
        if (pthread_cond_timedwait(&self->room_cond, &self->room_lock, &ts) == ETIMEDOUT) break;
    pthread_mutex_unlock(&self->room_lock);
}

static void orphans_settle(EngineObject *self, bool last);

/* Closes the engine once it was asked for and nothing holds it any more (but orphaned pins,
 * which it releases first). GIL held. */
static void eng_maybe_close(EngineObject *self)
{
    if (!self->closing || self->busy || !self->e) return;
    if (eng_foreign(self)) {
        self->e = NULL; /* the parent's: never closed here */
        return;
    }
    Py_ssize_t orphaned = self->orphans ? PyList_GET_SIZE(self->orphans) : 0;
    if (self->pins > orphaned) return;
    if (orphaned) {
        orphans_settle(self, true);
        if (self->busy || self->pins || !self->e) return;
    }
    zinf_engine *e = self->e;
    self->e = NULL;
    int unflushed = self->unflushed;
    Py_BEGIN_ALLOW_THREADS
    if (unflushed) zinf_close_unflushed(e);
    else zinf_close(e);
    Py_END_ALLOW_THREADS
}

static void eng_leave(EngineObject *self)
{
    self->busy--;
    eng_maybe_close(self);
}

/* What DLPack and the stats need to know of a freshly opened engine. */
static void eng_learn(EngineObject *self)
{
    struct zinf_stats st;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_stats(self->e, &st);
    Py_END_ALLOW_THREADS
    if (r == 0) {
        self->device_is_cuda = (int)st.device_is_cuda;
        self->host_pinned = (int)st.host_pinned;
    }
}

static EngineObject *eng_alloc(PyTypeObject *type)
{
    EngineObject *self = (EngineObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->forks = forks;
    room_init(self);
    self->meta = PyDict_New();
    self->tickets = PyDict_New();
    self->orphans = PyList_New(0);
    if (!self->meta || !self->tickets || !self->orphans) {
        Py_DECREF(self);
        return NULL;
    }
    return self;
}

/* A dict config is written as JSON to a memory file whose /proc path the parser opens. */
static int config_from_dict(PyObject *dict, int *fd_out, char *path, size_t path_len)
{
    PyObject *json = PyImport_ImportModule("json");
    if (!json) return -1;
    PyObject *text = PyObject_CallMethod(json, "dumps", "O", dict);
    Py_DECREF(json);
    if (!text) return -1;
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(text, &n);
    if (!s) {
        Py_DECREF(text);
        return -1;
    }
    int fd = memfd_create("zinf-config.json", MFD_CLOEXEC);
    if (fd < 0) {
        Py_DECREF(text);
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    for (Py_ssize_t off = 0; off < n;) {
        ssize_t w = write(fd, s + off, (size_t)(n - off));
        if (w < 0) {
            if (errno == EINTR) continue;
            PyErr_SetFromErrno(PyExc_OSError);
            close(fd);
            Py_DECREF(text);
            return -1;
        }
        off += w;
    }
    Py_DECREF(text);
    snprintf(path, path_len, "/proc/self/fd/%d", fd);
    *fd_out = fd;
    return 0;
}

/* nvme_paths: the extra swap directories, a sequence of paths; *bytes_out keeps their
 * encoded forms (a list) and *arr_out the NULL-terminated array of them (PyMem). */
static int parse_nvme_paths(PyObject *o, PyObject **bytes_out, const char ***arr_out)
{
    if (PyUnicode_Check(o) || PyBytes_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "nvme_paths is a sequence of directories, not one");
        return -1;
    }
    PyObject *seq = PySequence_Fast(o, "nvme_paths is a sequence of directories");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *list = PyList_New(n);
    const char **arr = PyMem_Calloc((size_t)n + 1, sizeof(*arr));
    if (!list || !arr) {
        Py_XDECREF(list);
        PyMem_Free(arr);
        Py_DECREF(seq);
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = NULL;
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, i), &b)) {
            Py_DECREF(list);
            PyMem_Free(arr);
            Py_DECREF(seq);
            return -1;
        }
        PyList_SET_ITEM(list, i, b);
        arr[i] = PyBytes_AS_STRING(b);
    }
    Py_DECREF(seq);
    *bytes_out = list;
    *arr_out = arr;
    return 0;
}

static int Engine_init(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"config", "nvme_path", "device_bytes", "host_bytes", "device",
                             "resume", "overwrite", "readonly", "pin", "previous",
                             "block_size", "queue_depth", "cuda_device", "nvme_paths", NULL};
    PyObject *config = Py_None, *nvme = Py_None, *dev_bytes = NULL, *host_bytes = NULL;
    PyObject *block_o = NULL, *qd_o = NULL, *paths_o = Py_None;
    const char *device = "auto";
    int resume = 0, overwrite = 0, readonly = 0, pin = 1, previous = 0, cuda_device = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O$OOOspppppOOiO", kwlist, &config, &nvme,
                                     &dev_bytes, &host_bytes, &device, &resume, &overwrite,
                                     &readonly, &pin, &previous, &block_o, &qd_o, &cuda_device,
                                     &paths_o))
        return -1;
    if (self->e) {
        PyErr_SetString(PyExc_ValueError, "the engine is open already");
        return -1;
    }
    unsigned flags = (resume ? ZINF_OPEN_RESUME : 0) | (overwrite ? ZINF_OPEN_OVERWRITE : 0) |
                     (readonly ? ZINF_OPEN_READONLY : 0) | (pin ? 0 : ZINF_OPEN_NO_PIN) |
                     (previous ? ZINF_OPEN_PREVIOUS : 0);
    zinf_engine *e = NULL;
    int r;
    if (config != Py_None) {
        if (nvme != Py_None || dev_bytes || host_bytes || strcmp(device, "auto") || block_o ||
            qd_o || cuda_device != -1 || paths_o != Py_None) {
            PyErr_SetString(PyExc_TypeError, "give a config or nvme_path/device_bytes/"
                                             "host_bytes/device/block_size/queue_depth/"
                                             "cuda_device/nvme_paths, not both");
            return -1;
        }
        PyObject *named; /* the path an error names */
        char memfd_path[64];
        int fd = -1;
        const char *path;
        PyObject *bytes = NULL;
        if (PyDict_Check(config)) {
            if (config_from_dict(config, &fd, memfd_path, sizeof(memfd_path))) return -1;
            path = memfd_path;
            named = PyUnicode_FromString("<config dict>");
        } else {
            if (!PyUnicode_FSConverter(config, &bytes)) return -1;
            path = PyBytes_AS_STRING(bytes);
            named = PyUnicode_DecodeFSDefault(path);
        }
        Py_BEGIN_ALLOW_THREADS
        r = zinf_open_config_flags(path, flags, &e);
        Py_END_ALLOW_THREADS
        if (fd >= 0) close(fd);
        Py_XDECREF(bytes);
        if (r) {
            if (named) raise_zinf(r, "zinf_open_config", named);
            Py_XDECREF(named);
            return -1;
        }
        Py_XDECREF(named);
    } else {
        struct zinf_options o;
        memset(&o, 0, sizeof(o));
        PyObject *nvme_bytes = NULL, *extra_bytes = NULL;
        const char **extra = NULL;
        size_t qd = 0;
        if (cuda_device < -1) {
            PyErr_Format(PyExc_ValueError, "cuda_device must be a CUDA ordinal, not %d",
                         cuda_device);
            return -1;
        }
        if (nvme != Py_None) {
            if (!PyUnicode_FSConverter(nvme, &nvme_bytes)) return -1;
            o.nvme_path = PyBytes_AS_STRING(nvme_bytes);
        }
        if ((dev_bytes && parse_size(dev_bytes, "device_bytes", &o.device_bytes)) ||
            (host_bytes && parse_size(host_bytes, "host_bytes", &o.host_bytes)) ||
            (block_o && parse_size(block_o, "block_size", &o.block_size)) ||
            (qd_o && parse_size(qd_o, "queue_depth", &qd))) {
            Py_XDECREF(nvme_bytes);
            return -1;
        }
        if (qd > UINT32_MAX) {
            PyErr_Format(PyExc_ValueError, "queue_depth %zu is too large", qd);
            Py_XDECREF(nvme_bytes);
            return -1;
        }
        o.queue_depth = (unsigned)qd;
        o.cuda_device = cuda_device < 0 ? 0 : cuda_device;
        if (!strcmp(device, "auto")) o.device_kind = ZINF_DEVICE_AUTO;
        else if (!strcmp(device, "cuda")) o.device_kind = ZINF_DEVICE_CUDA;
        else if (!strcmp(device, "emulated")) o.device_kind = ZINF_DEVICE_EMULATED;
        else {
            PyErr_Format(PyExc_ValueError, "unknown device \"%s\" (auto, cuda or emulated)",
                         device);
            Py_XDECREF(nvme_bytes);
            return -1;
        }
        if (paths_o != Py_None) {
            if (parse_nvme_paths(paths_o, &extra_bytes, &extra)) {
                Py_XDECREF(nvme_bytes);
                return -1;
            }
            if (!o.nvme_path && PyList_GET_SIZE(extra_bytes)) {
                PyErr_SetString(PyExc_ValueError, "nvme_paths are extra swap directories: "
                                                  "give nvme_path too");
                Py_XDECREF(extra_bytes);
                PyMem_Free(extra);
                return -1;
            }
            o.nvme_paths_extra = extra;
        }
        o.flags = flags;
        Py_BEGIN_ALLOW_THREADS
        r = zinf_open(&o, &e);
        Py_END_ALLOW_THREADS
        Py_XDECREF(extra_bytes);
        PyMem_Free(extra);
        if (r) {
            raise_zinf(r, "zinf_open", nvme);
            Py_XDECREF(nvme_bytes);
            return -1;
        }
        Py_XDECREF(nvme_bytes);
        self->cuda_device = o.cuda_device;
    }
    self->e = e;
    self->readonly = readonly;
    eng_learn(self);
    return 0;
}

static PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    return (PyObject *)eng_alloc(type);
}

static void Engine_dealloc(EngineObject *self)
{
    /* No Pinned is alive (each holds a reference), so no pin either, but orphans (released
     * as eng_maybe_close does) and tickets never waited (zinf_close drops their pins). In a
     * forked child the parent's engine is left alone: nothing of it is closed or freed. */
    if (self->e && !eng_foreign(self)) {
        self->closing = 1;
        self->busy = 0;
        self->pins = self->orphans ? PyList_GET_SIZE(self->orphans) : 0;
        eng_maybe_close(self);
    }
    if (self->room_ready && !eng_foreign(self)) {
        pthread_cond_destroy(&self->room_cond);
        pthread_mutex_destroy(&self->room_lock);
    }
    Py_XDECREF(self->meta);
    Py_XDECREF(self->tickets);
    Py_XDECREF(self->orphans);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* close() and close_unflushed(): no new calls from now on; the engine closes (with or
 * without its flush) once nothing holds it. In a forked child the parent's engine is only
 * forgotten. */
static PyObject *eng_close(EngineObject *self, bool unflushed)
{
    if (unflushed) self->unflushed = 1; /* and a close() after it does not flush either */
    self->closing = 1;
    if (self->room_ready && !eng_foreign(self)) room_wake(self);
    eng_maybe_close(self);
    Py_RETURN_NONE;
}

static PyObject *Engine_close(EngineObject *self, PyObject *unused)
{
    return eng_close(self, false);
}

static PyObject *Engine_close_unflushed(EngineObject *self, PyObject *unused)
{
    return eng_close(self, true);
}

static PyObject *Engine_enter(EngineObject *self, PyObject *unused)
{
    if (eng_foreign(self)) {
        raise_foreign();
        return NULL;
    }
    if (!self->e || self->closing) {
        PyErr_SetString(PyExc_ValueError, "the zinf engine is closed");
        return NULL;
    }
    return Py_NewRef(self);
}

/* The end of a with-block: close() when it ended normally; when it raised, close without the
 * flush, so that an update torn half way never replaces the last good saved state. */
static PyObject *Engine_exit(EngineObject *self, PyObject *args)
{
    PyObject *type = args && PyTuple_GET_SIZE(args) > 0 ? PyTuple_GET_ITEM(args, 0) : Py_None;
    return eng_close(self, type != Py_None);
}

static PyObject *Engine_get_closed(EngineObject *self, void *closure)
{
    return PyBool_FromLong(!self->e || self->closing);
}

/* A zinf.Tensor for handle h, with its name, size and (when registered with one) shape and
 * dtype. */
static PyObject *make_tensor(EngineObject *self, zinf_tensor h, PyObject *name, size_t nbytes)
{
    PyObject *t = PyObject_CallFunction(TensorType, "K", (unsigned long long)h);
    if (!t) return NULL;
    PyObject *key = PyLong_FromUnsignedLongLong(h);
    PyObject *m = key ? PyDict_GetItemWithError(self->meta, key) : NULL;
    Py_XDECREF(key);
    if (PyErr_Occurred()) goto err;
    PyObject *nb = PyLong_FromSize_t(nbytes);
    if (!nb || PyObject_SetAttrString(t, "nbytes", nb)) {
        Py_XDECREF(nb);
        goto err;
    }
    Py_DECREF(nb);
    if (PyObject_SetAttrString(t, "name", name) ||
        PyObject_SetAttrString(t, "shape", m ? PyTuple_GET_ITEM(m, 0) : Py_None) ||
        PyObject_SetAttrString(t, "dtype", m ? PyTuple_GET_ITEM(m, 1) : Py_None))
        goto err;
    return t;
err:
    Py_DECREF(t);
    return NULL;
}

static PyObject *Engine_register(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"name", "size", "home", NULL};
    PyObject *name, *size, *home = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "UO|O", kwlist, &name, &size, &home)) return NULL;
    int tier = ZINF_TIER_NVME;
    if (home && parse_tier(home, &tier)) return NULL;
    size_t nbytes;
    PyObject *meta = NULL;
    if (PyTuple_Check(size)) {
        /* (shape, dtype) */
        PyObject *shape_in, *dtype_in, *dtype_name = NULL;
        if (!PyArg_ParseTuple(size, "OO;a size is nbytes or (shape, dtype)", &shape_in,
                              &dtype_in))
            return NULL;
        const struct dtype_info *d = parse_dtype(dtype_in, &dtype_name);
        if (!d) return NULL;
        PyObject *seq = PySequence_Fast(shape_in, "a shape is a sequence of ints");
        if (!seq) {
            Py_DECREF(dtype_name);
            return NULL;
        }
        Py_ssize_t nd = PySequence_Fast_GET_SIZE(seq);
        PyObject *shape = PyTuple_New(nd);
        size_t count = 1;
        int bad = shape == NULL;
        for (Py_ssize_t i = 0; !bad && i < nd; i++) {
            PyObject *dim = PySequence_Fast_GET_ITEM(seq, i);
            size_t v;
            if (parse_size(dim, "a dimension", &v)) {
                bad = 1;
                break;
            }
            if (v && count > SIZE_MAX / v) {
                PyErr_SetString(PyExc_ValueError, "the shape is too large");
                bad = 1;
                break;
            }
            count *= v;
            PyTuple_SET_ITEM(shape, i, PyLong_FromSize_t(v));
        }
        Py_DECREF(seq);
        if (!bad && count > SIZE_MAX / (d->bits / 8)) {
            PyErr_SetString(PyExc_ValueError, "the shape is too large");
            bad = 1;
        }
        if (bad) {
            Py_XDECREF(shape);
            Py_DECREF(dtype_name);
            return NULL;
        }
        nbytes = count * (d->bits / 8);
        meta = PyTuple_Pack(2, shape, dtype_name);
        Py_DECREF(shape);
        Py_DECREF(dtype_name);
        if (!meta) return NULL;
    } else if (parse_size(size, "nbytes", &nbytes)) {
        return NULL;
    }
    const char *cname = PyUnicode_AsUTF8(name);
    zinf_engine *e = cname ? eng_enter(self) : NULL;
    if (!e) {
        Py_XDECREF(meta);
        return NULL;
    }
    zinf_tensor h = 0;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_register(e, cname, nbytes, (enum zinf_tier)tier, &h);
    Py_END_ALLOW_THREADS
    eng_leave(self);
    if (r) {
        Py_XDECREF(meta);
        return raise_zinf(r, "zinf_register", name);
    }
    PyObject *key = PyLong_FromUnsignedLongLong(h);
    int failed = !key;
    if (!failed) failed = meta ? PyDict_SetItem(self->meta, key, meta) : 0;
    Py_XDECREF(key);
    Py_XDECREF(meta);
    return failed ? NULL : make_tensor(self, h, name, nbytes);
}

/* The size and home of handle h; -errno. GIL held on entry and exit. */
static int tensor_info(EngineObject *self, zinf_engine *e, zinf_tensor h,
                       struct zinf_tensor_info *info)
{
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_tensor_info(e, h, info);
    Py_END_ALLOW_THREADS
    return r;
}

static PyObject *Engine_lookup(EngineObject *self, PyObject *args)
{
    PyObject *name;
    if (!PyArg_ParseTuple(args, "U", &name)) return NULL;
    const char *cname = PyUnicode_AsUTF8(name);
    zinf_engine *e = cname ? eng_enter(self) : NULL;
    if (!e) return NULL;
    zinf_tensor h = 0;
    struct zinf_tensor_info info;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_lookup(e, cname, &h);
    Py_END_ALLOW_THREADS
    if (r == 0) r = tensor_info(self, e, h, &info);
    eng_leave(self);
    if (r) return raise_zinf(r, "zinf_lookup", name);
    return make_tensor(self, h, name, info.bytes);
}

/* A call of the engine on one tensor (zinf_unregister, zinf_zero), the GIL dropped around it:
 * 0 with the handle in *h, or -1 with the exception set. */
static int tensor_call(EngineObject *self, PyObject *args, int (*fn)(zinf_engine *, zinf_tensor),
                       const char *what, zinf_tensor *h)
{
    PyObject *t;
    if (!PyArg_ParseTuple(args, "O", &t) || parse_handle(t, h)) return -1;
    zinf_engine *e = eng_enter(self);
    if (!e) return -1;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = fn(e, *h);
    Py_END_ALLOW_THREADS
    eng_leave(self);
    if (r) {
        raise_zinf(r, what, NULL);
        return -1;
    }
    return 0;
}

static PyObject *Engine_zero(EngineObject *self, PyObject *args)
{
    zinf_tensor h;
    if (tensor_call(self, args, zinf_zero, "zinf_zero", &h)) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Engine_unregister(EngineObject *self, PyObject *args)
{
    zinf_tensor h;
    if (tensor_call(self, args, zinf_unregister, "zinf_unregister", &h)) return NULL;
    PyObject *key = PyLong_FromUnsignedLongLong(h);
    if (!key) return NULL;
    if (PyDict_DelItem(self->meta, key)) PyErr_Clear(); /* none: registered without a shape */
    Py_DECREF(key);
    Py_RETURN_NONE;
}

/* ---- Pinned ---------------------------------------------------------------------------- */

/* A pin's states: HELD (fetched) -> PENDING (release() asked while views remain: the pin is
 * dropped by the last view's deleter) -> RELEASED; or HELD -> RELEASED directly. */
enum { PIN_HELD, PIN_PENDING, PIN_RELEASED };

typedef struct {
    PyObject_HEAD
    EngineObject *eng;
    zinf_tensor h;
    int tier;
    void *ptr;
    size_t nbytes;
    int dirty;          /* the default release flag, from fetch(dirty=) */
    int state;
    unsigned flags;     /* the flags a pending release will use, or a refused one used */
    int refused;        /* zinf refused a release with flags (kept the pin): collecting the
                           object tries those flags again, not a clean release */
    Py_ssize_t exports; /* DLPack views not deleted yet */
    PyObject *meta;     /* (shape, dtype) or NULL: 1-D uint8 */
} PinnedObject;

static PyTypeObject PinnedType;

/* A Pinned for a pin already taken (the engine's pin count covers it). */
static PyObject *make_pinned(EngineObject *eng, zinf_tensor h, int tier, void *ptr,
                             size_t nbytes, int dirty)
{
    PinnedObject *p = PyObject_New(PinnedObject, &PinnedType);
    if (!p) return NULL;
    p->eng = (EngineObject *)Py_NewRef(eng);
    p->h = h;
    p->tier = tier;
    p->ptr = ptr;
    p->nbytes = nbytes;
    p->dirty = dirty;
    p->state = PIN_HELD;
    p->flags = 0;
    p->refused = 0;
    p->exports = 0;
    p->meta = NULL;
    PyObject *key = PyLong_FromUnsignedLongLong(h);
    PyObject *m = key ? PyDict_GetItemWithError(eng->meta, key) : NULL;
    Py_XDECREF(key);
    if (PyErr_Occurred()) {
        /* The pin is the object's now: its dealloc drops it. */
        Py_DECREF(p);
        return NULL;
    }
    p->meta = Py_XNewRef(m);
    return (PyObject *)p;
}

/* Did zinf_release refuse and keep the pin? A read-only engine's DIRTY or ZERO (-EROFS), a
 * DIRTY one while the other tier's copy is pinned (-EBUSY), a ZERO one while another holds
 * the tensor (-EBUSY) or for a tensor homed in memory (-EINVAL). */
static bool release_kept(int r, unsigned flags)
{
    return r == -EROFS || (flags && r == -EBUSY) || ((flags & ZINF_RELEASE_ZERO) && r == -EINVAL);
}

/* Who drops a pin: release() itself (a refusal is raised, the pin kept), the last view's
 * deleter after a release() (nobody to raise to), or the Pinned being collected. */
enum drop_mode { DROP_ASKED, DROP_DEFERRED, DROP_DEALLOC };

static void warn_unraisable(PyObject *obj, const char *fmt, ...);

/* Calls zinf_release for a pin of eng; GIL held (dropped around it). Where zinf refuses
 * flags and keeps the pin, and a clean release loses nothing (a read-only engine's, a spent
 * release's: the content stays as it is), may_clean releases it clean instead. *kept: the
 * pin is still held. */
static int eng_release(EngineObject *eng, zinf_tensor h, int tier, unsigned flags,
                       bool may_clean, bool *kept)
{
    int r;
    bool k;
    zinf_engine *e = eng->e;
    eng->busy++;
    Py_BEGIN_ALLOW_THREADS
    room_release_begin(eng);
    r = zinf_release(e, h, (enum zinf_tier)tier, flags);
    k = r < 0 && release_kept(r, flags);
    if (k && may_clean && !((flags & ZINF_RELEASE_DIRTY) && r == -EBUSY)) {
        r = zinf_release(e, h, (enum zinf_tier)tier, 0);
        k = false;
    }
    room_release_end(eng, !k);
    Py_END_ALLOW_THREADS
    eng->busy--;
    *kept = k;
    return r;
}

/* Tries the orphaned releases again (a pin of the engine went, or it closes: last, where a
 * release still refused goes clean, with a warning, rather than keep the engine open).
 * GIL held; it does not close the engine. */
static void orphans_settle(EngineObject *self, bool last)
{
    if (!self->orphans || !PyList_GET_SIZE(self->orphans) || !self->e || eng_foreign(self))
        return;
    PyObject *todo = self->orphans;
    self->orphans = PyList_New(0);
    if (!self->orphans) {
        self->orphans = todo;
        PyErr_Clear();
        return;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(todo); i++) {
        PyObject *it = PyList_GET_ITEM(todo, i);
        unsigned long long h = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(it, 0));
        int tier = (int)PyLong_AsLong(PyTuple_GET_ITEM(it, 1));
        unsigned flags = (unsigned)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(it, 2));
        bool kept;
        int r = eng_release(self, h, tier, flags, false, &kept);
        if (kept && last) {
            warn_unraisable((PyObject *)self,
                            "zinf: the engine closes with tensor %llu's dirty release on %s "
                            "refused (%s): released clean, what was written through that "
                            "pin is lost", h, tier == ZINF_TIER_DEVICE ? "device" : "host",
                            zinf_strerror(r));
            r = eng_release(self, h, tier, 0, false, &kept);
        }
        if (kept) {
            if (PyList_Append(self->orphans, it)) PyErr_Clear();
        } else {
            self->pins--;
        }
    }
    Py_DECREF(todo);
}

/* Drops the pin for real. GIL held; it is dropped around the call. 0 when the pin went;
 * where zinf refuses the flags and keeps the pin, the -errno, and then by mode:
 *  DROP_ASKED: the Pinned stays held, as it was (release() raises);
 *  DROP_DEFERRED (the last view's deleter): a refusal that a clean release loses nothing by
 *    goes clean; a refused DIRTY one (-EBUSY) leaves the Pinned held again, dirty, with a
 *    RuntimeWarning: release() it again once the other tier's pin is gone;
 *  DROP_DEALLOC: as DEFERRED, but a refused DIRTY release becomes the engine's orphan,
 *    tried again as its other pins go and at close.
 * Any other error (the pin is gone: the daemon died, the handle is stale) releases it. In a
 * forked child nothing of libzinf is touched: the pin is the parent's. */
static int pin_drop(PinnedObject *p, unsigned flags, enum drop_mode mode)
{
    EngineObject *eng = p->eng;
    int was = p->state;
    p->state = PIN_RELEASED; /* no other thread releases it meanwhile */
    if (eng_foreign(eng)) {
        eng->pins--;
        return 0;
    }
    bool kept;
    int r = eng_release(eng, p->h, p->tier, flags, mode != DROP_ASKED, &kept);
    if (kept) {
        if (flags & ZINF_RELEASE_DIRTY) {
            p->dirty = 1; /* written through: never released clean by default from now on */
            p->refused = 1;
            p->flags = flags;
        }
        if (mode == DROP_ASKED) {
            p->state = was;
        } else if (mode == DROP_DEFERRED) {
            p->state = PIN_HELD;
            warn_unraisable((PyObject *)p,
                            "zinf: the dirty release of tensor %llu on %s, due as its last "
                            "view went, was refused (%s): the pin is kept and the Pinned is "
                            "held again; release() it once the other tier's pin is gone",
                            (unsigned long long)p->h, p->tier == ZINF_TIER_DEVICE ? "device"
                                                                                  : "host",
                            zinf_strerror(r));
        } else {
            PyObject *it = Py_BuildValue("(KiI)", (unsigned long long)p->h, p->tier, flags);
            if (!it || PyList_Append(eng->orphans, it)) {
                /* No memory to remember it: clean, rather than a pin held for ever. */
                PyErr_Clear();
                eng_release(eng, p->h, p->tier, 0, false, &kept);
                if (!kept) eng->pins--;
            }
            Py_XDECREF(it);
            eng_maybe_close(eng);
        }
        return r;
    }
    eng->pins--;
    orphans_settle(eng, false);
    eng_maybe_close(eng);
    return r;
}

/* release(), with the flags the caller chose (dirty's default: fetch's). */
static PyObject *pin_release(PinnedObject *p, unsigned flags)
{
    if (eng_foreign(p->eng)) {
        raise_foreign();
        return NULL;
    }
    if (p->state != PIN_HELD) {
        PyErr_SetString(PyExc_ValueError, "this pin was released already");
        return NULL;
    }
    if (flags && p->eng->readonly)
        /* What zinf would answer, now rather than when the last view goes: the pin stays. */
        return raise_zinf(-EROFS, "zinf_release", NULL);
    if (p->exports) {
        /* Views remain: the last one's deleter releases with these flags. */
        p->state = PIN_PENDING;
        p->flags = flags;
        p->refused = 0;
        Py_RETURN_NONE;
    }
    /* Where zinf refuses and keeps the pin (a read-only engine's dirty release, a dirty one
     * while the other tier's copy is pinned, a spent one that another holder or a home in
     * memory refuses), so do we. */
    int r = pin_drop(p, flags, DROP_ASKED);
    if (r) return raise_zinf(r, "zinf_release", NULL);
    p->refused = 0;
    Py_RETURN_NONE;
}

static PyObject *Pinned_release(PinnedObject *p, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"dirty", "spent", NULL};
    PyObject *dirty = Py_None;
    int spent = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|Op", kwlist, &dirty, &spent)) return NULL;
    int d = p->dirty;
    if (dirty != Py_None && (d = PyObject_IsTrue(dirty)) < 0) return NULL;
    if (spent && dirty != Py_None && d) {
        PyErr_SetString(PyExc_ValueError, "release: dirty and spent at once");
        return NULL;
    }
    return pin_release(p, spent ? ZINF_RELEASE_ZERO : d ? ZINF_RELEASE_DIRTY : 0);
}

static void Pinned_dealloc(PinnedObject *p)
{
    /* No view is alive (each holds a reference). A pin never released goes clean, or with
     * the flags a release asked for (and zinf refused). */
    if (p->state != PIN_RELEASED && p->eng) {
        unsigned flags = p->state == PIN_PENDING || p->refused ? p->flags : 0;
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        pin_drop(p, flags, DROP_DEALLOC);
        PyErr_Restore(et, ev, tb);
    }
    Py_XDECREF(p->meta);
    Py_XDECREF(p->eng);
    PyObject_Free(p);
}

static PyObject *Pinned_enter(PinnedObject *p, PyObject *unused)
{
    return Py_NewRef(p);
}

static PyObject *Pinned_exit(PinnedObject *p, PyObject *args)
{
    if (p->state != PIN_HELD) Py_RETURN_NONE; /* released inside the block */
    return pin_release(p, p->dirty ? ZINF_RELEASE_DIRTY : 0);
}

static const char *tier_name(int tier)
{
    return tier == ZINF_TIER_DEVICE ? "device" : tier == ZINF_TIER_HOST ? "host" : "nvme";
}

static PyObject *Pinned_repr(PinnedObject *p)
{
    return PyUnicode_FromFormat("<zinf.Pinned tensor %llu on %s, %zu bytes at %p%s>",
                                (unsigned long long)p->h, tier_name(p->tier), p->nbytes,
                                p->ptr, p->state == PIN_HELD ? "" : ", released");
}

static PyObject *Pinned_get_ptr(PinnedObject *p, void *c)
{
    return PyLong_FromVoidPtr(p->ptr);
}
static PyObject *Pinned_get_nbytes(PinnedObject *p, void *c)
{
    return PyLong_FromSize_t(p->nbytes);
}
static PyObject *Pinned_get_tier(PinnedObject *p, void *c)
{
    return PyUnicode_FromString(tier_name(p->tier));
}
static PyObject *Pinned_get_tensor(PinnedObject *p, void *c)
{
    return PyLong_FromUnsignedLongLong(p->h);
}
static PyObject *Pinned_get_released(PinnedObject *p, void *c)
{
    return PyBool_FromLong(p->state != PIN_HELD);
}

/* The DLPack device of a pinned copy. */
static DLDevice pinned_device(PinnedObject *p)
{
    DLDevice d = {kDLCPU, 0};
    if (p->eng->device_is_cuda && p->tier == ZINF_TIER_DEVICE) {
        d.device_type = kDLCUDA;
        d.device_id = p->eng->cuda_device;
    } else if (p->eng->device_is_cuda && p->eng->host_pinned && p->tier == ZINF_TIER_HOST) {
        d.device_type = kDLCUDAHost;
    }
    return d;
}

static PyObject *Pinned_dlpack_device(PinnedObject *p, PyObject *unused)
{
    DLDevice d = pinned_device(p);
    return Py_BuildValue("(ii)", (int)d.device_type, (int)d.device_id);
}

/* One export: the managed tensor the consumer gets, and the shape and strides it points at.
 * It holds a reference to its Pinned, dropped by the deleter. */
struct export {
    union {
        DLManagedTensor legacy;
        DLManagedTensorVersioned v;
    } m;
    PinnedObject *pinned;
    int64_t dims[]; /* ndim shape entries, then ndim strides */
};

/* The consumer is done with a view: the pin it kept goes once no view and no release()d
 * Pinned needs it. Called from any thread, with or without the GIL. */
static void export_free(struct export *x)
{
    PyGILState_STATE g = PyGILState_Ensure();
    PinnedObject *p = x->pinned;
    p->exports--;
    if (!p->exports && p->state == PIN_PENDING) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        pin_drop(p, p->flags, DROP_DEFERRED);
        PyErr_Restore(et, ev, tb);
    }
    Py_DECREF(p);
    PyMem_RawFree(x);
    PyGILState_Release(g);
}

static void deleter_versioned(DLManagedTensorVersioned *m)
{
    export_free(m->manager_ctx);
}

static void deleter_legacy(DLManagedTensor *m)
{
    export_free(m->manager_ctx);
}

/* A capsule the consumer never renamed (never took) still owns its tensor. */
static void capsule_versioned_destructor(PyObject *cap)
{
    if (!PyCapsule_IsValid(cap, "dltensor_versioned")) return;
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (m && m->deleter) m->deleter(m);
}

static void capsule_legacy_destructor(PyObject *cap)
{
    if (!PyCapsule_IsValid(cap, "dltensor")) return;
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    if (m && m->deleter) m->deleter(m);
}

static PyObject *Pinned_dlpack(PinnedObject *p, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOOO", kwlist, &stream, &max_version,
                                     &dl_device, &copy))
        return NULL;
    if (eng_foreign(p->eng)) {
        raise_foreign();
        return NULL;
    }
    if (p->state != PIN_HELD) {
        PyErr_SetString(PyExc_BufferError, "this pin was released: fetch the tensor again");
        return NULL;
    }
    int versioned = 0;
    if (max_version != Py_None) {
        unsigned major = 0, minor = 0;
        if (!PyTuple_Check(max_version)) {
            PyErr_SetString(PyExc_TypeError, "max_version is a tuple (major, minor)");
            return NULL;
        }
        if (!PyArg_ParseTuple(max_version, "II;max_version is (major, minor)", &major, &minor))
            return NULL;
        versioned = major >= 1;
    }
    DLDevice dev = pinned_device(p);
    if (dl_device != Py_None) {
        int type = 0, id = 0;
        if (!PyTuple_Check(dl_device)) {
            PyErr_SetString(PyExc_TypeError, "dl_device is a tuple (type, id)");
            return NULL;
        }
        if (!PyArg_ParseTuple(dl_device, "ii;dl_device is (type, id)", &type, &id)) return NULL;
        /* Pinned host memory (kDLCUDAHost) is CPU memory too: a consumer that knows only
         * kDLCPU may view it as that. */
        if (type == kDLCPU && id == 0 && dev.device_type == kDLCUDAHost) {
            dev.device_type = kDLCPU;
            dev.device_id = 0;
        } else if (type != (int)dev.device_type || id != dev.device_id) {
            PyErr_Format(PyExc_BufferError,
                         "the copy is on DLPack device (%d, %d); zinf exports views, never "
                         "copies to another device",
                         (int)dev.device_type, (int)dev.device_id);
            return NULL;
        }
    }
    if (copy != Py_None && PyObject_IsTrue(copy) == 1) {
        PyErr_SetString(PyExc_BufferError, "zinf exports views only (copy=True is refused)");
        return NULL;
    }
    /* The stream needs no wait: a fetch returns once the copy is in place, so the memory is
     * ready for work on any stream. */

    DLDataType dt = {kDLUInt, 8, 1};
    Py_ssize_t nd = 1;
    PyObject *shape = NULL;
    if (p->meta) {
        const struct dtype_info *d = find_dtype(PyUnicode_AsUTF8(PyTuple_GET_ITEM(p->meta, 1)));
        shape = PyTuple_GET_ITEM(p->meta, 0);
        dt.code = d->code;
        dt.bits = d->bits;
        nd = PyTuple_GET_SIZE(shape);
    }
    struct export *x = PyMem_RawCalloc(1, sizeof(*x) + 2 * (size_t)(nd ? nd : 1) * sizeof(int64_t));
    if (!x) return PyErr_NoMemory();
    int64_t *dims = x->dims, *strides = x->dims + nd;
    if (shape) {
        for (Py_ssize_t i = 0; i < nd; i++)
            dims[i] = (int64_t)PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
    } else {
        dims[0] = (int64_t)p->nbytes;
    }
    int64_t step = 1; /* row-major, in elements */
    for (Py_ssize_t i = nd - 1; i >= 0; i--) {
        strides[i] = step;
        step *= dims[i] ? dims[i] : 1;
    }
    DLTensor t = {.data = p->ptr, .device = dev, .ndim = (int32_t)nd, .dtype = dt,
                  .shape = dims, .strides = strides, .byte_offset = 0};
    x->pinned = (PinnedObject *)Py_NewRef(p);
    PyObject *cap;
    if (versioned) {
        x->m.v.version.major = DLPACK_MAJOR_VERSION;
        x->m.v.version.minor = DLPACK_MINOR_VERSION;
        x->m.v.manager_ctx = x;
        x->m.v.deleter = deleter_versioned;
        x->m.v.flags = p->eng->readonly ? DLPACK_FLAG_BITMASK_READ_ONLY : 0;
        x->m.v.dl_tensor = t;
        cap = PyCapsule_New(&x->m.v, "dltensor_versioned", capsule_versioned_destructor);
    } else {
        x->m.legacy.dl_tensor = t;
        x->m.legacy.manager_ctx = x;
        x->m.legacy.deleter = deleter_legacy;
        cap = PyCapsule_New(&x->m.legacy, "dltensor", capsule_legacy_destructor);
    }
    if (!cap) {
        Py_DECREF(p);
        PyMem_RawFree(x);
        return NULL;
    }
    p->exports++;
    return cap;
}

static PyMethodDef Pinned_methods[] = {
    {"release", (PyCFunction)(void (*)(void))Pinned_release, METH_VARARGS | METH_KEYWORDS,
     "release(dirty=None, spent=False): drop the pin (dirty: the caller wrote through it; "
     "None: as fetch said; spent: nobody needs the content again, and the tensor, homed on "
     "NVMe and held by nobody else, becomes zeros without a byte moved, ZINF_RELEASE_ZERO). "
     "A refusal keeps the pin (release() again; after a refused dirty release the default "
     "is dirty). With DLPack views alive, the pin is dropped when the last one is deleted: "
     "a spent release zinf refuses then goes clean, a dirty one keeps the pin and the "
     "Pinned is held again (a RuntimeWarning)."},
    {"__enter__", (PyCFunction)Pinned_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Pinned_exit, METH_VARARGS, NULL},
    {"__dlpack__", (PyCFunction)(void (*)(void))Pinned_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(stream=None, max_version=None, dl_device=None, copy=None): a zero-copy "
     "DLPack capsule of the pinned copy."},
    {"__dlpack_device__", (PyCFunction)Pinned_dlpack_device, METH_NOARGS,
     "(device_type, device_id) of the pinned copy."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pinned_getset[] = {
    {"ptr", (getter)Pinned_get_ptr, NULL, "the copy's address", NULL},
    {"nbytes", (getter)Pinned_get_nbytes, NULL, "the tensor's size in bytes", NULL},
    {"tier", (getter)Pinned_get_tier, NULL, "\"device\" or \"host\"", NULL},
    {"tensor", (getter)Pinned_get_tensor, NULL, "the tensor's handle", NULL},
    {"released", (getter)Pinned_get_released, NULL, "whether release() was called", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PinnedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "zinf.Pinned",
    .tp_basicsize = sizeof(PinnedObject),
    .tp_dealloc = (destructor)Pinned_dealloc,
    .tp_repr = (reprfunc)Pinned_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A pinned copy of a tensor (Engine.fetch): its memory stays put until release.",
    .tp_methods = Pinned_methods,
    .tp_getset = Pinned_getset,
};

/* ---- Engine: fetches ------------------------------------------------------------------- */

/* wait= of fetch and fetch_all: None or False, -1 (fail at once); True, INFINITY (no
 * limit); or seconds, >= 0. */
static int parse_wait(PyObject *o, double *out)
{
    *out = -1;
    if (!o || o == Py_None || o == Py_False) return 0;
    if (o == Py_True) {
        *out = INFINITY;
        return 0;
    }
    if (!PyFloat_Check(o) && !PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "wait is None, True or seconds (a number), not %s",
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    double v = PyFloat_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) return -1;
    if (isnan(v) || v < 0) {
        PyErr_Format(PyExc_ValueError, "wait must be seconds >= 0, True or None, not %R", o);
        return -1;
    }
    *out = v;
    return 0;
}

/* The bytes a set takes in tier at most: each distinct member not homed there, rounded up
 * to 4 KiB (as zinf_fetch_all counts them). */
static uint64_t set_bytes(const zinf_tensor *hs, const struct zinf_tensor_info *info, size_t n,
                          int tier)
{
    uint64_t sum = 0;
    for (size_t i = 0; i < n; i++) {
        bool seen = false;
        for (size_t j = 0; j < i && !seen && n <= 4096; j++) seen = hs[j] == hs[i];
        if (seen || (int)info[i].home == tier) continue;
        sum += (info[i].bytes + 4095) & ~(uint64_t)4095;
    }
    return sum;
}

/* zinf_fetch (single) or zinf_fetch_all of hs, waiting for room as wait says (< 0: not at
 * all): where zinf answers -ENOMEM, the set fits in the tier, and a pin of the tier is held
 * that may go, it waits (the GIL dropped, in slices that let signals in) until a pin of this
 * engine is released, and tries again; until it succeeds or wait seconds have passed. GIL
 * held; the caller holds the engine (eng_enter). Returns 0 or the -errno, with what (the
 * call's name and why it gave up waiting) for the message; or -EINTR with a Python
 * exception set (a signal, or the engine closed meanwhile). */
static int fetch_room(EngineObject *self, zinf_engine *e, const zinf_tensor *hs,
                      const struct zinf_tensor_info *info, size_t n, bool single, int tier,
                      void **ptrs, double wait, char *what, size_t what_len)
{
    const char *call = single ? "zinf_fetch" : "zinf_fetch_all";
    double start = mono_now(), until = start + wait;
    snprintf(what, what_len, "%s", call);
    for (;;) {
        uint64_t gen = room_gen(self, NULL);
        int r, releasing = 0;
        Py_BEGIN_ALLOW_THREADS
        r = single ? zinf_fetch(e, hs[0], (enum zinf_tier)tier, &ptrs[0])
                   : zinf_fetch_all(e, hs, n, (enum zinf_tier)tier, ptrs);
        Py_END_ALLOW_THREADS
        if (r != -ENOMEM || wait < 0) return r;
        struct zinf_stats st;
        int sr;
        Py_BEGIN_ALLOW_THREADS
        sr = zinf_stats(e, &st);
        Py_END_ALLOW_THREADS
        if (sr) return r;
        uint64_t need = set_bytes(hs, info, n, tier), cap = st.tier[tier].capacity_bytes;
        if (need > cap) {
            snprintf(what, what_len, "%s (%s of %llu bytes in a tier of %llu: it never fits, "
                     "waiting is no use)", call, single ? "a tensor" : "a set",
                     (unsigned long long)need, (unsigned long long)cap);
            return r;
        }
        if (room_gen(self, &releasing) != gen) continue; /* a pin went meanwhile */
        if (!releasing && st.tier[tier].pinned_bytes == 0) {
            snprintf(what, what_len, "%s (no pin held in the tier to wait for: the rest of it "
                     "is homes)", call);
            return r;
        }
        for (;;) {
            double now = mono_now();
            if (now >= until) {
                snprintf(what, what_len, "%s (no room after waiting %.3g s)", call,
                         now - start);
                return r;
            }
            double slice = now + 0.1 < until ? now + 0.1 : until;
            Py_BEGIN_ALLOW_THREADS
            room_wait_until(self, gen, slice);
            Py_END_ALLOW_THREADS
            if (PyErr_CheckSignals()) return -EINTR;
            if (self->closing) {
                PyErr_Format(PyExc_ValueError, "the zinf engine was closed while %s waited "
                             "for room", call);
                return -EINTR;
            }
            if (room_gen(self, NULL) != gen) break;
        }
    }
}

static PyObject *Engine_fetch(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"tensor", "tier", "dirty", "wait", NULL};
    PyObject *t, *tier_o = NULL, *wait_o = NULL;
    int dirty = 0, tier = ZINF_TIER_DEVICE;
    double wait;
    zinf_tensor h;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OpO", kwlist, &t, &tier_o, &dirty, &wait_o) ||
        parse_handle(t, &h) || (tier_o && parse_tier(tier_o, &tier)) ||
        parse_wait(wait_o, &wait))
        return NULL;
    zinf_engine *e = eng_enter(self);
    if (!e) return NULL;
    struct zinf_tensor_info info;
    void *ptr = NULL;
    char what[200];
    snprintf(what, sizeof(what), "zinf_fetch");
    int r = tensor_info(self, e, h, &info);
    if (r == 0) r = fetch_room(self, e, &h, &info, 1, true, tier, &ptr, wait, what, sizeof(what));
    if (r) {
        eng_leave(self);
        return PyErr_Occurred() ? NULL : raise_zinf(r, what, NULL);
    }
    self->pins++;
    eng_leave(self);
    return make_pinned(self, h, tier, ptr, info.bytes, dirty);
}

static PyObject *Engine_fetch_all(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"tensors", "tier", "dirty", "wait", NULL};
    PyObject *list, *tier_o = NULL, *wait_o = NULL;
    int dirty = 0, tier = ZINF_TIER_DEVICE;
    double wait;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OpO", kwlist, &list, &tier_o, &dirty,
                                     &wait_o) ||
        (tier_o && parse_tier(tier_o, &tier)) || parse_wait(wait_o, &wait))
        return NULL;
    PyObject *seq = PySequence_Fast(list, "fetch_all takes a sequence of tensors");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    zinf_tensor *hs = PyMem_Calloc((size_t)n + 1, sizeof(*hs));
    void **ptrs = PyMem_Calloc((size_t)n + 1, sizeof(*ptrs));
    struct zinf_tensor_info *info = PyMem_Calloc((size_t)n + 1, sizeof(*info));
    PyObject *out = NULL;
    zinf_engine *e = NULL;
    char what[200];
    if (!hs || !ptrs || !info) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (parse_handle(PySequence_Fast_GET_ITEM(seq, i), &hs[i])) goto done;
    e = eng_enter(self);
    if (!e) goto done;
    int r = 0;
    snprintf(what, sizeof(what), "zinf_fetch_all");
    for (Py_ssize_t i = 0; i < n && !r; i++) r = tensor_info(self, e, hs[i], &info[i]);
    if (r == 0)
        r = fetch_room(self, e, hs, info, (size_t)n, false, tier, ptrs, wait, what,
                       sizeof(what));
    if (r) {
        eng_leave(self);
        if (!PyErr_Occurred()) raise_zinf(r, what, NULL);
        goto done;
    }
    self->pins += n;
    eng_leave(self);
    out = PyList_New(n);
    /* Each pin goes into a Pinned (whose dealloc drops it), even when the list cannot be
     * built: none is leaked. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = make_pinned(self, hs[i], tier, ptrs[i], info[i].bytes, dirty);
        if (!p) {
            bool kept;
            self->pins--;
            eng_release(self, hs[i], tier, 0, false, &kept);
            Py_CLEAR(out);
            continue;
        }
        if (out) PyList_SET_ITEM(out, i, p);
        else Py_DECREF(p);
    }
    if (!out && !PyErr_Occurred()) PyErr_NoMemory();
    if (!out) eng_maybe_close(self);
done:
    PyMem_Free(hs);
    PyMem_Free(ptrs);
    PyMem_Free(info);
    Py_DECREF(seq);
    return out;
}

static PyObject *Engine_fetch_async(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"tensor", "tier", NULL};
    PyObject *t, *tier_o = NULL;
    int tier = ZINF_TIER_DEVICE;
    zinf_tensor h;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O", kwlist, &t, &tier_o) ||
        parse_handle(t, &h) || (tier_o && parse_tier(tier_o, &tier)))
        return NULL;
    zinf_engine *e = eng_enter(self);
    if (!e) return NULL;
    uint64_t ticket = 0;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_fetch_async(e, h, (enum zinf_tier)tier, &ticket);
    Py_END_ALLOW_THREADS
    if (r) {
        eng_leave(self);
        return raise_zinf(r, "zinf_fetch_async", NULL);
    }
    /* The pin is taken now: it counts until wait() hands it to a Pinned. */
    self->pins++;
    eng_leave(self);
    PyObject *key = PyLong_FromUnsignedLongLong(ticket);
    PyObject *val = Py_BuildValue("(Ki)", (unsigned long long)h, tier);
    if (!key || !val || PyDict_SetItem(self->tickets, key, val)) {
        Py_XDECREF(val);
        Py_XDECREF(key);
        return NULL;
    }
    Py_DECREF(val);
    return key;
}

static PyObject *Engine_wait(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"ticket", "dirty", NULL};
    PyObject *key;
    int dirty = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!|p", kwlist, &PyLong_Type, &key, &dirty))
        return NULL;
    if (eng_foreign(self)) {
        raise_foreign();
        return NULL;
    }
    PyObject *val = PyDict_GetItemWithError(self->tickets, key);
    if (!val) {
        if (!PyErr_Occurred()) raise_zinf(-EINVAL, "zinf_wait: no such ticket", NULL);
        return NULL;
    }
    unsigned long long h;
    int tier;
    if (!PyArg_ParseTuple(val, "Ki", &h, &tier)) return NULL;
    uint64_t ticket = PyLong_AsUnsignedLongLong(key);
    if (PyDict_DelItem(self->tickets, key)) return NULL;
    /* The ticket's pin keeps the engine open: it may be in closing, but not closed. */
    zinf_engine *e = self->e;
    struct zinf_tensor_info info;
    void *ptr = NULL;
    self->busy++;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_wait(e, ticket, &ptr);
    Py_END_ALLOW_THREADS
    if (r == 0) {
        r = tensor_info(self, e, h, &info);
        if (r) {
            bool kept;
            eng_release(self, h, tier, 0, false, &kept);
        }
    }
    if (r) {
        self->pins--; /* a failed wait drops the pin */
        eng_leave(self);
        return raise_zinf(r, "zinf_wait", NULL);
    }
    self->busy--;
    return make_pinned(self, h, tier, ptr, info.bytes, dirty);
}

/* ---- Engine: the rest of zinf.h -------------------------------------------------------- */

static PyObject *Engine_prefetch(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"tensor", "tier", NULL};
    PyObject *t, *tier_o = NULL;
    int tier = ZINF_TIER_DEVICE;
    zinf_tensor h;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O", kwlist, &t, &tier_o) ||
        parse_handle(t, &h) || (tier_o && parse_tier(tier_o, &tier)))
        return NULL;
    zinf_engine *e = eng_enter(self);
    if (!e) return NULL;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_prefetch(e, h, (enum zinf_tier)tier);
    Py_END_ALLOW_THREADS
    eng_leave(self);
    if (r) return raise_zinf(r, "zinf_prefetch", NULL);
    Py_RETURN_NONE;
}

/* A call of the engine alone (zinf_step, zinf_flush), the GIL dropped around it. */
static PyObject *engine_call(EngineObject *self, int (*fn)(zinf_engine *), const char *what)
{
    zinf_engine *e = eng_enter(self);
    if (!e) return NULL;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = fn(e);
    Py_END_ALLOW_THREADS
    eng_leave(self);
    if (r) return raise_zinf(r, what, NULL);
    Py_RETURN_NONE;
}

static PyObject *Engine_step(EngineObject *self, PyObject *unused)
{
    return engine_call(self, zinf_step, "zinf_step");
}

/* flush(step=None, keep_previous=False): zinf_flush, or zinf_flush_step where a step or
 * keep_previous is given. */
static PyObject *Engine_flush(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"step", "keep_previous", NULL};
    PyObject *step_o = Py_None;
    int keep = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|Op", kwlist, &step_o, &keep)) return NULL;
    if (step_o == Py_None && !keep) return engine_call(self, zinf_flush, "zinf_flush");
    long long step = -1;
    if (step_o != Py_None) {
        if (!PyLong_Check(step_o) || PyBool_Check(step_o)) {
            PyErr_Format(PyExc_TypeError, "a step is an int, not %s", Py_TYPE(step_o)->tp_name);
            return NULL;
        }
        int overflow = 0;
        step = PyLong_AsLongLongAndOverflow(step_o, &overflow);
        if (step == -1 && PyErr_Occurred()) return NULL;
        if (overflow || step < 0) {
            PyErr_Format(PyExc_ValueError, "a step is an int >= 0 (None: no tag), not %R", step_o);
            return NULL;
        }
    }
    zinf_engine *e = eng_enter(self);
    if (!e) return NULL;
    int r;
    unsigned flags = keep ? ZINF_FLUSH_KEEP_PREVIOUS : 0;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_flush_step(e, (int64_t)step, flags);
    Py_END_ALLOW_THREADS
    eng_leave(self);
    if (r) return raise_zinf(r, "zinf_flush_step", NULL);
    Py_RETURN_NONE;
}

static PyObject *Engine_drop_previous(EngineObject *self, PyObject *unused)
{
    return engine_call(self, zinf_drop_previous, "zinf_drop_previous");
}

/* tensor_info(tensor) -> (home, nbytes): where its permanent copy lives, and its size. */
static PyObject *Engine_tensor_info(EngineObject *self, PyObject *args)
{
    PyObject *t;
    zinf_tensor h;
    if (!PyArg_ParseTuple(args, "O", &t) || parse_handle(t, &h)) return NULL;
    zinf_engine *e = eng_enter(self);
    if (!e) return NULL;
    struct zinf_tensor_info info;
    int r = tensor_info(self, e, h, &info);
    eng_leave(self);
    if (r) return raise_zinf(r, "zinf_tensor_info", NULL);
    const char *home = info.home == ZINF_TIER_DEVICE ? "device"
                       : info.home == ZINF_TIER_HOST ? "host" : "nvme";
    return Py_BuildValue("(sK)", home, (unsigned long long)info.bytes);
}

static PyObject *Engine_read(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"tensor", "offset", "nbytes", NULL};
    PyObject *t, *off_o = NULL, *n_o = Py_None;
    zinf_tensor h;
    size_t off = 0, n = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OO", kwlist, &t, &off_o, &n_o) ||
        parse_handle(t, &h) || (off_o && parse_size(off_o, "offset", &off)) ||
        (n_o != Py_None && parse_size(n_o, "nbytes", &n)))
        return NULL;
    zinf_engine *e = eng_enter(self);
    if (!e) return NULL;
    int r = 0;
    if (n_o == Py_None) {
        struct zinf_tensor_info info;
        r = tensor_info(self, e, h, &info);
        if (r == 0 && off > info.bytes) r = -EINVAL;
        if (r == 0) n = (size_t)info.bytes - off;
    }
    if (r) {
        eng_leave(self);
        return raise_zinf(r, "zinf_read", NULL);
    }
    if (n > PY_SSIZE_T_MAX) {
        eng_leave(self);
        PyErr_SetString(PyExc_ValueError, "nbytes is too large");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n);
    if (!out) {
        eng_leave(self);
        return NULL;
    }
    char *dst = PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    r = zinf_read(e, h, off, dst, n);
    Py_END_ALLOW_THREADS
    eng_leave(self);
    if (r) {
        Py_DECREF(out);
        return raise_zinf(r, "zinf_read", NULL);
    }
    return out;
}

static PyObject *Engine_read_into(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"tensor", "buffer", "offset", NULL};
    PyObject *t, *buf_o, *off_o = NULL;
    zinf_tensor h;
    size_t off = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O", kwlist, &t, &buf_o, &off_o) ||
        parse_handle(t, &h) || (off_o && parse_size(off_o, "offset", &off)))
        return NULL;
    Py_buffer buf;
    if (PyObject_GetBuffer(buf_o, &buf, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)) {
        if (PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "read_into needs a writable contiguous buffer, "
                                          "not %s", Py_TYPE(buf_o)->tp_name);
        }
        return NULL;
    }
    zinf_engine *e = eng_enter(self);
    if (!e) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_read(e, h, off, buf.buf, (size_t)buf.len);
    Py_END_ALLOW_THREADS
    eng_leave(self);
    Py_ssize_t len = buf.len;
    PyBuffer_Release(&buf);
    if (r) return raise_zinf(r, "zinf_read", NULL);
    return PyLong_FromSsize_t(len);
}

static PyObject *Engine_write(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"tensor", "data", "offset", NULL};
    PyObject *t, *buf_o, *off_o = NULL;
    zinf_tensor h;
    size_t off = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O", kwlist, &t, &buf_o, &off_o) ||
        parse_handle(t, &h) || (off_o && parse_size(off_o, "offset", &off)))
        return NULL;
    Py_buffer buf;
    if (PyObject_GetBuffer(buf_o, &buf, PyBUF_C_CONTIGUOUS)) return NULL;
    zinf_engine *e = eng_enter(self);
    if (!e) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_write(e, h, off, buf.buf, (size_t)buf.len);
    Py_END_ALLOW_THREADS
    eng_leave(self);
    PyBuffer_Release(&buf);
    if (r) return raise_zinf(r, "zinf_write", NULL);
    Py_RETURN_NONE;
}

/* Sets key to an unsigned value in dict d; -1 on failure. */
static int set_u64(PyObject *d, const char *key, uint64_t v)
{
    PyObject *o = PyLong_FromUnsignedLongLong(v);
    int r = o ? PyDict_SetItemString(d, key, o) : -1;
    Py_XDECREF(o);
    return r;
}

static PyObject *Engine_stats(EngineObject *self, PyObject *unused)
{
    zinf_engine *e = eng_enter(self);
    if (!e) return NULL;
    struct zinf_stats s;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_stats(e, &s);
    Py_END_ALLOW_THREADS
    eng_leave(self);
    if (r) return raise_zinf(r, "zinf_stats", NULL);
    PyObject *d = PyDict_New(), *tiers = PyList_New(3);
    if (!d || !tiers) goto err;
    for (int i = 0; i < 3; i++) {
        const struct zinf_tier_stats *t = &s.tier[i];
        PyObject *td = PyDict_New();
        if (!td) goto err;
        PyList_SET_ITEM(tiers, i, td);
        if (set_u64(td, "capacity_bytes", t->capacity_bytes) ||
            set_u64(td, "used_bytes", t->used_bytes) || set_u64(td, "peak_bytes", t->peak_bytes) ||
            set_u64(td, "pinned_bytes", t->pinned_bytes) || set_u64(td, "fetches", t->fetches) ||
            set_u64(td, "hits", t->hits) || set_u64(td, "evictions", t->evictions) ||
            set_u64(td, "writebacks", t->writebacks))
            goto err;
    }
    if (PyDict_SetItemString(d, "tier", tiers) || set_u64(d, "tensors", s.tensors) ||
        set_u64(d, "nvme_bytes_read", s.nvme_bytes_read) ||
        set_u64(d, "nvme_bytes_written", s.nvme_bytes_written) ||
        set_u64(d, "prefetches", s.prefetches) ||
        set_u64(d, "prefetch_in_time", s.prefetch_in_time) ||
        set_u64(d, "prefetch_late", s.prefetch_late) ||
        set_u64(d, "prefetch_wasted", s.prefetch_wasted) ||
        set_u64(d, "blocked_ns", s.blocked_ns) || set_u64(d, "steps", s.steps) ||
        set_u64(d, "schedule_length", s.schedule_length) ||
        set_u64(d, "schedule_resets", s.schedule_resets) || set_u64(d, "flushes", s.flushes) ||
        set_u64(d, "io_buffered", s.io_buffered) ||
        set_u64(d, "device_is_cuda", s.device_is_cuda) ||
        set_u64(d, "tensors_damaged", s.tensors_damaged) ||
        set_u64(d, "compactions", s.compactions) ||
        set_u64(d, "blocked_nvme_ns", s.blocked_nvme_ns) ||
        set_u64(d, "blocked_copy_ns", s.blocked_copy_ns) ||
        set_u64(d, "blocked_room_ns", s.blocked_room_ns) ||
        set_u64(d, "blocked_pin_ns", s.blocked_pin_ns) ||
        set_u64(d, "flush_bytes_total", s.flush_bytes_total) ||
        set_u64(d, "flush_bytes_done", s.flush_bytes_done) ||
        set_u64(d, "host_staging_bytes", s.host_staging_bytes) ||
        set_u64(d, "host_pinned", s.host_pinned) ||
        set_u64(d, "write_behinds", s.write_behinds))
        goto err;
    Py_DECREF(tiers);
    return d;
err:
    Py_XDECREF(tiers);
    Py_XDECREF(d);
    return NULL;
}

#define KW (PyCFunction)(void (*)(void))
static PyMethodDef Engine_methods[] = {
    {"close", (PyCFunction)Engine_close, METH_NOARGS,
     "Close the engine (flushing when it has an NVMe tier, unless close_unflushed was asked "
     "for). New calls are refused at once; the engine closes when no call is in flight and "
     "no pin or view is held."},
    {"__enter__", (PyCFunction)Engine_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Engine_exit, METH_VARARGS, NULL},
    {"register", KW Engine_register, METH_VARARGS | METH_KEYWORDS,
     "register(name, nbytes or (shape, dtype), home=\"nvme\") -> Tensor"},
    {"lookup", (PyCFunction)Engine_lookup, METH_VARARGS, "lookup(name) -> Tensor"},
    {"unregister", (PyCFunction)Engine_unregister, METH_VARARGS, "unregister(tensor)"},
    {"zero", (PyCFunction)Engine_zero, METH_VARARGS,
     "zero(tensor): nobody needs its content again: it becomes zeros without a byte moved, "
     "and its next fetch reads nothing from the drive (homed on NVMe, nobody holding it: "
     "zinf_zero)"},
    {"fetch", KW Engine_fetch, METH_VARARGS | METH_KEYWORDS,
     "fetch(tensor, tier=\"device\", dirty=False, wait=None) -> Pinned. wait: where the tier "
     "is full of pins (ENOMEM), seconds (or True: no limit) to wait for a pin of this engine "
     "to go and try again; None: fail at once. What never fits fails at once."},
    {"fetch_all", KW Engine_fetch_all, METH_VARARGS | METH_KEYWORDS,
     "fetch_all(tensors, tier=\"device\", dirty=False, wait=None) -> [Pinned]: all pinned, "
     "or none; wait as fetch's."},
    {"fetch_async", KW Engine_fetch_async, METH_VARARGS | METH_KEYWORDS,
     "fetch_async(tensor, tier=\"device\") -> ticket"},
    {"wait", KW Engine_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(ticket, dirty=False) -> Pinned"},
    {"prefetch", KW Engine_prefetch, METH_VARARGS | METH_KEYWORDS,
     "prefetch(tensor, tier=\"device\"): a hint"},
    {"step", (PyCFunction)Engine_step, METH_NOARGS, "Mark the end of a training step."},
    {"read", KW Engine_read, METH_VARARGS | METH_KEYWORDS,
     "read(tensor, offset=0, nbytes=None) -> bytes"},
    {"read_into", KW Engine_read_into, METH_VARARGS | METH_KEYWORDS,
     "read_into(tensor, buffer, offset=0) -> bytes read (len(buffer))"},
    {"write", KW Engine_write, METH_VARARGS | METH_KEYWORDS,
     "write(tensor, data, offset=0)"},
    {"close_unflushed", (PyCFunction)Engine_close_unflushed, METH_NOARGS,
     "Close the engine without flushing (zinf_close_unflushed): the last flush stays the "
     "saved state, as after a crash. For tensors known to be torn (an update interrupted "
     "half way); a with-block that raises closes the engine so."},
    {"flush", KW Engine_flush, METH_VARARGS | METH_KEYWORDS,
     "flush(step=None, keep_previous=False): make every tensor durable (zinf_flush); with "
     "a step (an int >= 0, read back by zinf.saved_steps) or keep_previous (the state it "
     "replaces is kept as the previous version, which Engine(previous=True) opens): "
     "zinf_flush_step."},
    {"drop_previous", (PyCFunction)Engine_drop_previous, METH_NOARGS,
     "Forget the previous version a flush(keep_previous=True) kept (zinf_drop_previous)."},
    {"tensor_info", (PyCFunction)Engine_tensor_info, METH_VARARGS,
     "tensor_info(tensor) -> (home, nbytes): where its permanent copy lives (\"device\", "
     "\"host\" or \"nvme\") and its size (zinf_tensor_info)."},
    {"stats", (PyCFunction)Engine_stats, METH_NOARGS, "struct zinf_stats as a dict."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Engine_getset[] = {
    {"closed", (getter)Engine_get_closed, NULL, "whether close() was called", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "zinf.Engine",
    .tp_basicsize = sizeof(EngineObject),
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Engine(config=None, *, nvme_path=None, device_bytes=0, host_bytes=0, "
              "device=\"auto\", resume=False, overwrite=False, readonly=False, pin=True, "
              "previous=False, block_size=0, queue_depth=0, cuda_device=0, nvme_paths=None)\n"
              "previous: open the version a flush(keep_previous=True) kept (with resume or "
              "readonly); nvme_paths: extra swap directories striped with nvme_path. A "
              "with-block closes it on exit: with the flush, or without it "
              "(close_unflushed) when the block raised.",
    .tp_methods = Engine_methods,
    .tp_getset = Engine_getset,
    .tp_init = (initproc)Engine_init,
    .tp_new = Engine_new,
};

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

/* One float32 array of adamw_step: a Pinned copy it holds (in host memory, whatever the
 * tier: the emulated device tier is host memory, a GPU's is refused), or an object with the
 * buffer protocol (writable where the step writes). A Pinned's pin is kept through the
 * call as a view keeps it (exports), so a release from another thread meanwhile waits.
 *
 * Only float32 is stepped: a Pinned of a tensor registered with another dtype, or a buffer
 * whose format is another type (float64, float16, int32, ...), is a TypeError. Bytes that
 * carry no type are taken as float32 ones: a Pinned of a tensor registered by size alone
 * (or resumed: a saved run keeps no dtype), and a buffer of unsigned bytes (format "B":
 * bytes, bytearray, a memoryview of them) from an object that has no dtype of its own. */
struct f32_arg {
    float *f;
    size_t n;
    PinnedObject *pinned; /* held (exports + 1), or NULL */
    Py_buffer view;
    int have_view;
};

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

static int f32_get(PyObject *o, const char *what, int write, struct f32_arg *a)
{
    memset(a, 0, sizeof(*a));
    if (PyObject_TypeCheck(o, &PinnedType)) {
        PinnedObject *p = (PinnedObject *)o;
        if (eng_foreign(p->eng)) {
            raise_foreign();
            return -1;
        }
        if (p->state != PIN_HELD) {
            PyErr_Format(PyExc_ValueError, "adamw_step: %s: its copy was released", what);
            return -1;
        }
        if (p->meta && strcmp(PyUnicode_AsUTF8(PyTuple_GET_ITEM(p->meta, 1)), "float32")) {
            PyErr_Format(PyExc_TypeError, "adamw_step: %s is a pinned %U tensor: the step "
                         "takes float32 only", what, PyTuple_GET_ITEM(p->meta, 1));
            return -1;
        }
        if (p->nbytes % sizeof(float)) {
            PyErr_Format(PyExc_ValueError, "adamw_step: %s holds %zu bytes, not a whole "
                         "number of float32", what, p->nbytes);
            return -1;
        }
        if (p->tier == ZINF_TIER_DEVICE && p->eng->device_is_cuda) {
            PyErr_Format(PyExc_ValueError, "adamw_step: %s is in GPU memory: the step runs on "
                         "the host (fetch it to \"host\")", what);
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
            PyErr_Format(PyExc_TypeError, "adamw_step: %s is a %s, which exports no buffer: "
                         "give a float32 array (numpy) or a zinf.Pinned", what,
                         Py_TYPE(o)->tp_name);
        }
        return -1;
    }
    a->have_view = 1;
    int kind = buffer_kind(o, &a->view);
    if (kind < 0) {
        PyObject *name = buffer_type_name(o, &a->view);
        if (name) {
            PyErr_Format(PyExc_TypeError, "adamw_step: %s is %U, not float32: the step takes "
                         "float32 only", what, name);
            Py_DECREF(name);
        }
        PyBuffer_Release(&a->view);
        a->have_view = 0;
        return -1;
    }
    if (a->view.len % (Py_ssize_t)sizeof(float)) {
        PyErr_Format(PyExc_ValueError, "adamw_step: %s holds %zd bytes, not a whole number of "
                     "float32", what, a->view.len);
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
        if (f32_get(o[got], what[got], got != 1, &a[got]) < 0) break;
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
