/* pinned.c - zinf.Pinned and its DLPack exports: see _zinf.h. */
#include "_zinf.h"

/* ---- Pinned ---------------------------------------------------------------------------- */




/* A Pinned for a pin already taken (the engine's pin count covers it). */
PyObject *make_pinned(EngineObject *eng, zinf_tensor h, int tier, void *ptr,
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
    p->buffers = 0;
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



/* Calls zinf_release for a pin of eng; GIL held (dropped around it). Where zinf refuses
 * flags and keeps the pin, and a clean release loses nothing (a read-only engine's, a spent
 * release's: the content stays as it is), may_clean releases it clean instead. *kept: the
 * pin is still held. */
int eng_release(EngineObject *eng, zinf_tensor h, int tier, unsigned flags,
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
void orphans_settle(EngineObject *self, bool last)
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
int pin_drop(PinnedObject *p, unsigned flags, enum drop_mode mode)
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
    if (p->buffers) {
        /* Unlike a DLPack view's, a buffer's end cannot be waited for: its owner may write
         * through it for as long as it lives, and after the pin went that memory is another
         * copy's. So the release is refused, and the pin kept. */
        PyErr_Format(PyExc_BufferError,
                     "release: %zd buffer view%s of this pin (a memoryview, a numpy array) %s "
                     "alive: release %s first (memoryview.release(), del the array), so that "
                     "nothing writes to the memory once it is not pinned",
                     p->buffers, p->buffers == 1 ? "" : "s", p->buffers == 1 ? "is" : "are",
                     p->buffers == 1 ? "it" : "them");
        return NULL;
    }
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

static PyObject *Pinned_get_dropped(PinnedObject *p, void *c)
{
    return PyBool_FromLong(p->state == PIN_RELEASED);
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

/* The buffer protocol: the pinned bytes, 1-D unsigned bytes whatever the tensor's dtype
 * (numpy.frombuffer(pin, dtype) types them). Readable always; writable only where the pin
 * was fetched dirty (dirty=True), as only then is what is written saved. Each buffer holds
 * the Pinned (Python's reference), and release() is refused while one is alive. */
static int Pinned_getbuffer(PinnedObject *p, Py_buffer *view, int flags)
{
    view->obj = NULL;
    if (eng_foreign(p->eng)) {
        raise_foreign();
        return -1;
    }
    if (p->state != PIN_HELD) {
        PyErr_SetString(PyExc_BufferError, "this pin was released: fetch the tensor again");
        return -1;
    }
    if (p->tier == ZINF_TIER_DEVICE && p->eng->device_is_cuda) {
        PyErr_SetString(PyExc_BufferError,
                        "the copy is in GPU memory, which the buffer protocol cannot reach: "
                        "take it through DLPack (torch.from_dlpack(pin)), or fetch it to "
                        "\"host\"");
        return -1;
    }
    int writable = p->dirty && !p->eng->readonly;
    if ((flags & PyBUF_WRITABLE) && !writable) {
        PyErr_SetString(PyExc_BufferError,
                        p->eng->readonly
                            ? "a writable buffer of a read-only engine's pin: nothing written "
                              "to it could be saved"
                            : "a writable buffer of a pin fetched clean: what is written "
                              "through it would be lost; fetch with dirty=True to write");
        return -1;
    }
    if (p->nbytes > (size_t)PY_SSIZE_T_MAX) {
        PyErr_SetString(PyExc_BufferError, "the copy is larger than a buffer can be");
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)p, p->ptr, (Py_ssize_t)p->nbytes, !writable, flags) < 0)
        return -1;
    p->buffers++;
    return 0;
}

static void Pinned_releasebuffer(PinnedObject *p, Py_buffer *view)
{
    (void)view;
    p->buffers--;
}

static PyBufferProcs Pinned_as_buffer = {
    .bf_getbuffer = (getbufferproc)Pinned_getbuffer,
    .bf_releasebuffer = (releasebufferproc)Pinned_releasebuffer,
};

static PyMethodDef Pinned_methods[] = {
    {"release", (PyCFunction)(void (*)(void))Pinned_release, METH_VARARGS | METH_KEYWORDS,
     "release(dirty=None, spent=False): drop the pin (dirty: the caller wrote through it; "
     "None: as fetch said; spent: nobody needs the content again, and the tensor, homed on "
     "NVMe and held by nobody else, becomes zeros without a byte moved, ZINF_RELEASE_ZERO). "
     "A refusal keeps the pin (release() again; after a refused dirty release the default "
     "is dirty). With DLPack views alive, the pin is dropped when the last one is deleted: "
     "a spent release zinf refuses then goes clean, a dirty one keeps the pin and the "
     "Pinned is held again (a RuntimeWarning). Refused (BufferError, the pin kept) while a "
     "buffer of it (memoryview, numpy.frombuffer) is alive."},
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
    {"dropped", (getter)Pinned_get_dropped, NULL,
     "whether the pin is gone: released, and no DLPack view of it left", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject PinnedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "zinf.Pinned",
    .tp_basicsize = sizeof(PinnedObject),
    .tp_dealloc = (destructor)Pinned_dealloc,
    .tp_repr = (reprfunc)Pinned_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A pinned copy of a tensor (Engine.fetch): its memory stays put until release. "
              "Its bytes are a buffer (memoryview(pin), numpy.frombuffer(pin)), writable "
              "where it was fetched with dirty=True; release() is refused while one is alive.",
    .tp_methods = Pinned_methods,
    .tp_getset = Pinned_getset,
    .tp_as_buffer = &Pinned_as_buffer,
};

