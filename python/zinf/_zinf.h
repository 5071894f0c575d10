/*
 * _zinf.h - what the extension's files share: the Engine and Pinned objects, the module's
 * exception and tensor types, and the functions one file calls in another:
 *   _zinf.c         errors, arguments, the module's functions and its init;
 *   engine.c        the Engine: opening, closing, forks, waiting for room;
 *   engine_calls.c  its calls: fetches and the rest of zinf.h, its methods and type;
 *   pinned.c        Pinned objects and their DLPack exports.
 */
#ifndef ZINF_PY_H
#define ZINF_PY_H
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

extern PyObject *ZinfError;  /* zinf.Error, an OSError */
extern PyObject *TensorType; /* zinf.Tensor, an int with attributes */
extern volatile unsigned long forks; /* fork() children made (engine.c) */

typedef struct {
    PyObject_HEAD
    zinf_engine *e;       /* NULL once closed for real */
    int closing;          /* close() asked for: no new calls */
    int unflushed;        /* close without flushing (close_unflushed, a with-block that raised) */
    Py_ssize_t busy;      /* calls in flight with the GIL dropped */
    Py_ssize_t pins;      /* pins held through Pinned objects, pending tickets and orphans */
    int device_is_cuda, host_pinned, cuda_device, readonly;
    /* How it was opened: ENG_OPENED_ARGS (keyword arguments; nvme_tier says whether
     * nvme_path was given), ENG_OPENED_CONFIG or ENG_OPENED_CONNECT. A refusal whose reason
     * the errno does not tell (an NVMe home without an NVMe tier) is explained by it. */
    int opened, nvme_tier;
    unsigned long forks;  /* `forks` when it was opened: another value, a forked child's copy */
    PyObject *meta;       /* {handle: (shape, dtype)} of tensors registered with a shape */
    PyObject *tickets;    /* {ticket: (handle, tier)} of fetch_async calls not waited yet */
    /* Dirty releases that zinf refused (-EBUSY: the other tier's copy was pinned) for Pinned
     * objects collected meanwhile: [(handle, tier, flags)], each pin still held and counted
     * in pins, tried again whenever a pin of this engine goes and at close. */
    PyObject *orphans;
    /* Callables (zinf.torch's) run before a flush and before a close that flushes, so that
     * work they deferred (an optimizer's update) is in what is saved: _add_barrier. */
    PyObject *barriers;
    /* Fetches waiting for room (wait=): releases of this engine's pins bump room_gen and
     * wake them. room_releasing counts releases in flight (not counted yet). */
    pthread_mutex_t room_lock;
    pthread_cond_t room_cond;
    uint64_t room_gen;
    int room_releasing, room_ready;
} EngineObject;

enum { ENG_OPENED_ARGS, ENG_OPENED_CONFIG, ENG_OPENED_CONNECT };

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
    Py_ssize_t buffers; /* buffer-protocol views (memoryview, numpy) not released yet */
    PyObject *meta;     /* (shape, dtype) or NULL: 1-D uint8 */
} PinnedObject;

#define KW (PyCFunction)(void (*)(void))

/* A dtype DLPack can carry, by numpy's name. */
struct dtype_info {
    const char *name;
    uint8_t code, bits;
};

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

/* Who drops a pin: release() itself (a refusal is raised, the pin kept), the last view's
 * deleter after a release() (nobody to raise to), or the Pinned being collected. */
enum drop_mode { DROP_ASKED, DROP_DEFERRED, DROP_DEALLOC };

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

extern PyTypeObject EngineType;
extern PyTypeObject PinnedType;

PyObject *raise_zinf(int r, const char *what, PyObject *filename);
PyObject *raise_zinf_why(int r, PyObject *filename, const char *fmt, ...);
void warn_unraisable(PyObject *obj, const char *fmt, ...);
int parse_tier(PyObject *o, int *out);
int parse_handle(PyObject *o, zinf_tensor *out);
int py_parse_size(PyObject *o, const char *what, size_t *out);
const struct dtype_info *find_dtype(const char *name);
const struct dtype_info *parse_dtype(PyObject *o, PyObject **out);
void atfork_child(void);
bool eng_foreign(EngineObject *self);
void raise_foreign(void);
zinf_engine *eng_enter(EngineObject *self);
void room_release_begin(EngineObject *self);
void room_release_end(EngineObject *self, bool dropped);
uint64_t room_gen(EngineObject *self, int *releasing);
double mono_now(void);
void room_wait_until(EngineObject *self, uint64_t gen, double until);
void eng_maybe_close(EngineObject *self);
void eng_leave(EngineObject *self);
void eng_learn(EngineObject *self);
int run_barriers(EngineObject *self);
EngineObject *eng_alloc(PyTypeObject *type);
int Engine_init(EngineObject *self, PyObject *args, PyObject *kw);
PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kw);
void Engine_dealloc(EngineObject *self);
PyObject *Engine_close(EngineObject *self, PyObject *unused);
PyObject *Engine_close_unflushed(EngineObject *self, PyObject *unused);
PyObject *Engine_enter(EngineObject *self, PyObject *unused);
PyObject *Engine_exit(EngineObject *self, PyObject *args);
PyObject *Engine_get_closed(EngineObject *self, void *closure);
PyObject *Engine_register(EngineObject *self, PyObject *args, PyObject *kw);
int tensor_info(EngineObject *self, zinf_engine *e, zinf_tensor h,
                struct zinf_tensor_info *info);
PyObject *Engine_lookup(EngineObject *self, PyObject *args);
PyObject *Engine_zero(EngineObject *self, PyObject *args);
PyObject *Engine_unregister(EngineObject *self, PyObject *args);
PyObject *make_pinned(EngineObject *eng, zinf_tensor h, int tier, void *ptr,
                      size_t nbytes, int dirty);
int eng_release(EngineObject *eng, zinf_tensor h, int tier, unsigned flags,
                bool may_clean, bool *kept);
void orphans_settle(EngineObject *self, bool last);
int pin_drop(PinnedObject *p, unsigned flags, enum drop_mode mode);
PyObject *grad_add_into(PyObject *dst, unsigned long long src_addr, Py_ssize_t count,
                        int src_dtype, double scale, int fresh);

#endif
