/* engine.c - zinf.Engine: see _zinf.h. */
#include "_zinf.h"

/* ---- Engine ---------------------------------------------------------------------------- */

/* Forks. A child of fork() has the parent's engines in its memory but not their threads, and
 * shares their files and io_uring queues with the parent: closing, flushing or fetching there
 * would hang the child and corrupt what the parent does. Each child bumps this count (a
 * pthread_atfork handler), and an Engine opened under another count is the parent's: every
 * call on it is refused, and collecting it (or its Pinned objects and views) touches nothing
 * of libzinf. */
volatile unsigned long forks;

void atfork_child(void)
{
    forks++;
}



bool eng_foreign(EngineObject *self)
{
    return self->forks != forks;
}

void raise_foreign(void)
{
    PyErr_SetString(PyExc_RuntimeError,
                    "the zinf engine was opened in another process (before a fork): it "
                    "cannot be used in this one; open an Engine here");
}

/* Takes the engine for one call: NULL (with ValueError) when it is closed, RuntimeError in a
 * forked child. Every success is paired with eng_leave(). */
/* 0 where the engine takes calls; -1 with the error set where it is closed or foreign. */
static int eng_open_here(EngineObject *self)
{
    if (eng_foreign(self)) {
        raise_foreign();
        return -1;
    }
    if (!self->e || self->closing) {
        PyErr_SetString(PyExc_ValueError, "the zinf engine is closed");
        return -1;
    }
    return 0;
}

zinf_engine *eng_enter(EngineObject *self)
{
    if (eng_open_here(self)) return NULL;
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
void room_release_begin(EngineObject *self)
{
    pthread_mutex_lock(&self->room_lock);
    self->room_releasing++;
    pthread_mutex_unlock(&self->room_lock);
}

/* ... and ends: dropped, whether the pin went (waiters look again). */
void room_release_end(EngineObject *self, bool dropped)
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
uint64_t room_gen(EngineObject *self, int *releasing)
{
    pthread_mutex_lock(&self->room_lock);
    uint64_t g = self->room_gen;
    if (releasing) *releasing = self->room_releasing;
    pthread_mutex_unlock(&self->room_lock);
    return g;
}

double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Waits, GIL not held, until a release moves room_gen past gen, the engine closes, or until
 * (monotonic seconds) passes, whichever comes first. */
void room_wait_until(EngineObject *self, uint64_t gen, double until)
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


/* Closes the engine once it was asked for and nothing holds it any more (but orphaned pins,
 * which it releases first). GIL held. */
void eng_maybe_close(EngineObject *self)
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

void eng_leave(EngineObject *self)
{
    self->busy--;
    eng_maybe_close(self);
}

/* What DLPack and the stats need to know of a freshly opened engine. */
void eng_learn(EngineObject *self)
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

EngineObject *eng_alloc(PyTypeObject *type)
{
    EngineObject *self = (EngineObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->forks = forks;
    room_init(self);
    self->meta = PyDict_New();
    self->tickets = PyDict_New();
    self->orphans = PyList_New(0);
    self->barriers = PyList_New(0);
    if (!self->meta || !self->tickets || !self->orphans || !self->barriers) {
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

int Engine_init(EngineObject *self, PyObject *args, PyObject *kw)
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
        self->opened = ENG_OPENED_CONFIG;
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
        if ((dev_bytes && py_parse_size(dev_bytes, "device_bytes", &o.device_bytes)) ||
            (host_bytes && py_parse_size(host_bytes, "host_bytes", &o.host_bytes)) ||
            (block_o && py_parse_size(block_o, "block_size", &o.block_size)) ||
            (qd_o && py_parse_size(qd_o, "queue_depth", &qd))) {
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
        self->opened = ENG_OPENED_ARGS;
        self->nvme_tier = nvme != Py_None;
    }
    self->e = e;
    self->readonly = readonly;
    eng_learn(self);
    return 0;
}

PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    return (PyObject *)eng_alloc(type);
}

void Engine_dealloc(EngineObject *self)
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
    Py_XDECREF(self->barriers);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* close() and close_unflushed(): no new calls from now on; the engine closes (with or
 * without its flush) once nothing holds it. In a forked child the parent's engine is only
 * forgotten. */
/* Runs the barriers (each may fetch and release through this engine): 0, or -1 with the
 * first one's exception set. GIL held, the engine not entered. */
int run_barriers(EngineObject *self)
{
    if (!self->barriers || !PyList_GET_SIZE(self->barriers) || self->closing || !self->e ||
        eng_foreign(self))
        return 0;
    PyObject *todo = PyList_GetSlice(self->barriers, 0, PyList_GET_SIZE(self->barriers));
    if (!todo) return -1;
    int r = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(todo) && !r; i++) {
        PyObject *out = PyObject_CallNoArgs(PyList_GET_ITEM(todo, i));
        if (!out) r = -1;
        Py_XDECREF(out);
    }
    Py_DECREF(todo);
    return r;
}

static PyObject *eng_close(EngineObject *self, bool unflushed)
{
    if (!unflushed && !self->unflushed && run_barriers(self)) {
        /* What a barrier was to finish failed: nothing torn is saved. */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        self->unflushed = 1;
        self->closing = 1;
        if (self->room_ready && !eng_foreign(self)) room_wake(self);
        eng_maybe_close(self);
        PyErr_Restore(et, ev, tb);
        return NULL;
    }
    if (unflushed) self->unflushed = 1; /* and a close() after it does not flush either */
    self->closing = 1;
    if (self->room_ready && !eng_foreign(self)) room_wake(self);
    eng_maybe_close(self);
    Py_RETURN_NONE;
}

PyObject *Engine_close(EngineObject *self, PyObject *unused)
{
    return eng_close(self, false);
}

PyObject *Engine_close_unflushed(EngineObject *self, PyObject *unused)
{
    return eng_close(self, true);
}

PyObject *Engine_enter(EngineObject *self, PyObject *unused)
{
    if (eng_open_here(self)) return NULL;
    return Py_NewRef(self);
}

/* The end of a with-block: close() when it ended normally; when it raised, close without the
 * flush, so that an update torn half way never replaces the last good saved state. */
PyObject *Engine_exit(EngineObject *self, PyObject *args)
{
    PyObject *type = args && PyTuple_GET_SIZE(args) > 0 ? PyTuple_GET_ITEM(args, 0) : Py_None;
    return eng_close(self, type != Py_None);
}

PyObject *Engine_get_closed(EngineObject *self, void *closure)
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

PyObject *Engine_register(EngineObject *self, PyObject *args, PyObject *kw)
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
            if (py_parse_size(dim, "a dimension", &v)) {
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
    } else if (py_parse_size(size, "nbytes", &nbytes)) {
        return NULL;
    }
    const char *cname = PyUnicode_AsUTF8(name);
    zinf_engine *e = cname ? eng_enter(self) : NULL;
    if (!e) {
        Py_XDECREF(meta);
        return NULL;
    }
    const char *dflt = home ? "" : " (register's default home)";
    if (tier == ZINF_TIER_NVME && self->opened == ENG_OPENED_ARGS && !self->nvme_tier) {
        eng_leave(self);
        Py_XDECREF(meta);
        return raise_zinf_why(-EINVAL, name,
                              "zinf_register: %R is homed on NVMe%s, but this Engine has no "
                              "NVMe tier: open it with nvme_path= (a swap directory), or "
                              "register it with home=\"host\" or home=\"device\"",
                              name, dflt);
    }
    zinf_tensor h = 0;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_register(e, cname, nbytes, (enum zinf_tier)tier, &h);
    Py_END_ALLOW_THREADS
    eng_leave(self);
    if (r) {
        Py_XDECREF(meta);
        /* zinf answers an NVMe home on an engine without an NVMe tier as it answers a bad
         * name or size (-EINVAL): with a name and a size it takes (a name of 1 to 1023 bytes,
         * as the engine's registry.c has it in NAME_MAX_BYTES), that is the reason. */
        if (r == -EINVAL && tier == ZINF_TIER_NVME && self->opened == ENG_OPENED_CONFIG && *cname &&
            strlen(cname) < 1024 && nbytes > 0)
            return raise_zinf_why(r, name,
                                  "zinf_register: %R is homed on NVMe%s, but the engine's "
                                  "config gives no swap directory: set "
                                  "zero_optimization.offload_param.nvme_path (or "
                                  "zinf.nvme_paths), or register it with home=\"host\" or "
                                  "home=\"device\"",
                                  name, dflt);
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
int tensor_info(EngineObject *self, zinf_engine *e, zinf_tensor h,
                struct zinf_tensor_info *info)
{
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = zinf_tensor_info(e, h, info);
    Py_END_ALLOW_THREADS
    return r;
}

PyObject *Engine_lookup(EngineObject *self, PyObject *args)
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

PyObject *Engine_zero(EngineObject *self, PyObject *args)
{
    zinf_tensor h;
    if (tensor_call(self, args, zinf_zero, "zinf_zero", &h)) return NULL;
    Py_RETURN_NONE;
}

PyObject *Engine_unregister(EngineObject *self, PyObject *args)
{
    zinf_tensor h;
    if (tensor_call(self, args, zinf_unregister, "zinf_unregister", &h)) return NULL;
    PyObject *key = PyLong_FromUnsignedLongLong(h);
    if (!key) return NULL;
    if (PyDict_DelItem(self->meta, key)) PyErr_Clear(); /* none: registered without a shape */
    Py_DECREF(key);
    Py_RETURN_NONE;
}


