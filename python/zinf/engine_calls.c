/* engine_calls.c - zinf.Engine's calls: fetches and the rest of zinf.h, its method table and type: see _zinf.h. */
#include "_zinf.h"

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

/* zinf_fetch of h into tier, as a Pinned (NULL: an exception is set). */
static PyObject *fetch_one(EngineObject *self, zinf_tensor h, int tier, int dirty, double wait)
{
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
    return fetch_one(self, h, tier, dirty, wait);
}

/* zinf.torch's accumulation of a gradient into its float32 tensor in one call: fetched to
 * the host tier, _grad_add (see the module's), released dirty where it was written (clean
 * where _grad_add refused). A refused dirty release raises, and the pin is kept as a
 * collected Pinned's is (tried again as other pins go, and at close): nothing is lost. */
static PyObject *Engine_grad_add(EngineObject *self, PyObject *args)
{
    PyObject *t;
    unsigned long long src;
    Py_ssize_t count;
    int code, fresh;
    double scale, wait = -1;
    PyObject *wait_o = NULL;
    zinf_tensor h;
    if (!PyArg_ParseTuple(args, "OKnidp|O", &t, &src, &count, &code, &scale, &fresh,
                          &wait_o) ||
        parse_handle(t, &h) || parse_wait(wait_o, &wait))
        return NULL;
    if (self->readonly) /* refused before a byte of the cached copy is written */
        return raise_zinf(-EROFS, "zinf_release", NULL);
    PyObject *pin = fetch_one(self, h, ZINF_TIER_HOST, 1, wait);
    if (!pin) return NULL;
    PyObject *sum = grad_add_into(pin, src, count, code, scale, fresh);
    PinnedObject *p = (PinnedObject *)pin;
    int r = pin_drop(p, sum ? ZINF_RELEASE_DIRTY : 0, DROP_ASKED);
    if (r && sum) {
        Py_CLEAR(sum);
        raise_zinf(r, "zinf_release", NULL);
    }
    Py_DECREF(pin);
    return sum;
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

/* (tensor, tier="device") of fetch_async and prefetch. */
static int parse_tensor_tier(PyObject *args, PyObject *kw, zinf_tensor *h, int *tier)
{
    static char *kwlist[] = {"tensor", "tier", NULL};
    PyObject *t, *tier_o = NULL;
    *tier = ZINF_TIER_DEVICE;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O", kwlist, &t, &tier_o) ||
        parse_handle(t, h) || (tier_o && parse_tier(tier_o, tier)))
        return -1;
    return 0;
}

static PyObject *Engine_fetch_async(EngineObject *self, PyObject *args, PyObject *kw)
{
    int tier;
    zinf_tensor h;
    if (parse_tensor_tier(args, kw, &h, &tier)) return NULL;
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
    int tier;
    zinf_tensor h;
    if (parse_tensor_tier(args, kw, &h, &tier)) return NULL;
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
    if (run_barriers(self)) return NULL;
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
        parse_handle(t, &h) || (off_o && py_parse_size(off_o, "offset", &off)) ||
        (n_o != Py_None && py_parse_size(n_o, "nbytes", &n)))
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
        parse_handle(t, &h) || (off_o && py_parse_size(off_o, "offset", &off)))
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
        parse_handle(t, &h) || (off_o && py_parse_size(off_o, "offset", &off)))
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

static PyObject *Engine_add_barrier(EngineObject *self, PyObject *fn)
{
    if (!PyCallable_Check(fn)) {
        PyErr_Format(PyExc_TypeError, "a barrier is a callable, not %s", Py_TYPE(fn)->tp_name);
        return NULL;
    }
    if (PyList_Append(self->barriers, fn)) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Engine_remove_barrier(EngineObject *self, PyObject *fn)
{
    for (Py_ssize_t i = PyList_GET_SIZE(self->barriers) - 1; i >= 0; i--)
        if (PyList_GET_ITEM(self->barriers, i) == fn)
            return PySequence_DelItem(self->barriers, i) ? NULL : Py_NewRef(Py_None);
    Py_RETURN_NONE;
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
    {"_add_barrier", (PyCFunction)Engine_add_barrier, METH_O,
     "_add_barrier(fn): fn() runs before each flush() and before a close() that flushes "
     "(zinf.torch's deferred updates); an exception from it aborts the flush, or closes "
     "without the flush."},
    {"_remove_barrier", (PyCFunction)Engine_remove_barrier, METH_O, "_remove_barrier(fn)"},
    {"_grad_add", (PyCFunction)Engine_grad_add, METH_VARARGS,
     "_grad_add(tensor, src_address, count, src_dtype, scale, fresh, wait=None) -> sum of "
     "squares: zinf._zinf._grad_add into tensor fetched to the host tier (zinf.torch's; "
     "src_address is trusted)."},
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

PyTypeObject EngineType = {
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

