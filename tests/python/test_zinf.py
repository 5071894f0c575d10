"""test_zinf.py - the zinf Python package (python/zinf) against the library it wraps.

Each call of the API with its success and its errors (the errno zinf.Error carries), DLPack
exports read by numpy and by a small consumer written here with ctypes (both capsule kinds,
writes through the view), a view kept past its release, threads sharing one engine, an engine
attached to a `zinf serve` daemon, and fetch/release cycles that must not leak references or
memory. Plain unittest; tests that need numpy skip without it. It is not a test of the engine
itself (tests/*.c do that): only of what the binding adds.
"""

import ctypes
import errno
import gc
import os
import shutil
import sys
import tempfile
import threading
import tracemalloc
import unittest

import zinf

import daemon

try:
    import numpy
except ImportError:  # numpy is optional: its tests skip
    numpy = None

needs_numpy = unittest.skipIf(numpy is None, "numpy is not installed (Debian: python3-numpy)")

MIB = 1 << 20


def tmpdir(tag):
    base = os.environ.get("ZINF_TEST_TMPDIR") or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix="py-" + tag + ".", dir=base)


# Set by meson in sanitizer builds: ASan's quarantine holds freed memory, so RSS is no
# measure of leaks there (references still are).
SANITIZED = os.environ.get("ZINF_TEST_SANITIZED", "")


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- a DLPack consumer, written from the specification, to check what numpy does not ----


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


_capsule_get = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get.restype = ctypes.c_void_p
_capsule_get.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.restype = ctypes.c_int
_capsule_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_rename = ctypes.pythonapi.PyCapsule_SetName
_capsule_rename.restype = ctypes.c_int
_capsule_rename.argtypes = [ctypes.py_object, ctypes.c_char_p]
# The names a consumer gives the capsules it took; they must outlive the capsules.
USED = {b"dltensor": b"used_dltensor", b"dltensor_versioned": b"used_dltensor_versioned"}


# A consumer that asks for a writable buffer as C code does (PyObject_GetBuffer with
# PyBUF_WRITABLE), and sees the exporter's own error: the library's ctypes and memoryview
# ask for read-only ones and say only "not writable".
class PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int),
                ("ndim", ctypes.c_int), ("format", ctypes.c_char_p),
                ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


PyBUF_WRITABLE = 0x0001
_get_buffer = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(PyBuffer),
                                ctypes.c_int)(("PyObject_GetBuffer", ctypes.pythonapi))
_release_buffer = ctypes.PYFUNCTYPE(None, ctypes.POINTER(PyBuffer))(
    ("PyBuffer_Release", ctypes.pythonapi))


def writable_buffer(obj):
    """The address and length of a writable buffer of obj, taken and given back at once."""
    view = PyBuffer()
    _get_buffer(obj, ctypes.byref(view), PyBUF_WRITABLE)
    try:
        return view.buf, view.len, view.readonly
    finally:
        _release_buffer(ctypes.byref(view))


class View:
    """What a consumer holds after taking a capsule: the managed tensor, until delete()."""

    def __init__(self, capsule, versioned):
        name = b"dltensor_versioned" if versioned else b"dltensor"
        assert _capsule_valid(capsule, name), "the capsule is not named %r" % name
        addr = _capsule_get(capsule, name)
        _capsule_rename(capsule, USED[name])
        kind = DLManagedTensorVersioned if versioned else DLManagedTensor
        self.addr = addr
        self.managed = kind.from_address(addr)
        self.tensor = self.managed.dl_tensor

    @property
    def shape(self):
        return tuple(self.tensor.shape[i] for i in range(self.tensor.ndim))

    def delete(self):
        DELETER(self.managed.deleter)(self.addr)
        self.managed = self.tensor = None


class Base(unittest.TestCase):
    """An emulated engine with 4 MiB tiers and a swap directory in a scratch folder."""

    def setUp(self):
        self.dir = tmpdir(self.id().rsplit(".", 1)[-1])
        self.swap = os.path.join(self.dir, "swap")

    def tearDown(self):
        gc.collect()
        shutil.rmtree(self.dir, ignore_errors=True)

    def engine(self, **kw):
        opts = dict(nvme_path=self.swap, device="emulated", device_bytes=4 * MIB,
                    host_bytes=4 * MIB)
        opts.update(kw)
        return zinf.Engine(**opts)

    def assertErrno(self, err, fn, *args, **kw):
        with self.assertRaises(zinf.Error) as cm:
            fn(*args, **kw)
        self.assertIsInstance(cm.exception, OSError)
        self.assertEqual(cm.exception.errno, err, str(cm.exception))
        self.assertIn(zinf.strerror(err), str(cm.exception))
        return cm.exception


class TestEngine(Base):
    def test_open_with_options_and_close(self):
        e = self.engine()
        self.assertFalse(e.closed)
        st = e.stats()
        self.assertEqual(st["tier"][zinf.DEVICE]["capacity_bytes"], 4 * MIB)
        self.assertEqual(st["tier"][zinf.HOST]["capacity_bytes"], 4 * MIB)
        self.assertEqual(st["device_is_cuda"], 0)
        e.close()
        self.assertTrue(e.closed)
        e.close()  # twice: nothing
        with self.assertRaises(ValueError):
            e.stats()
        with self.assertRaises(ValueError):
            e.register("x", 10)

    def test_context_manager_closes_and_flushes(self):
        with self.engine() as e:
            t = e.register("t", 4096)
            e.write(t, b"\x07" * 4096)
        self.assertTrue(e.closed)
        with self.engine(resume=True) as e:
            t = e.lookup("t")
            self.assertEqual(t.nbytes, 4096)
            self.assertEqual(e.read(t), b"\x07" * 4096)

    def test_bad_options(self):
        with self.assertRaises(ValueError):
            self.engine(device="tpu")
        with self.assertRaises(ValueError):
            self.engine(device_bytes=-1)
        with self.assertRaises(TypeError):
            self.engine(device_bytes="4M")
        with self.assertRaises(TypeError):
            zinf.Engine({"zinf": {}}, nvme_path=self.swap)
        with self.assertRaises(TypeError):
            zinf.Engine(3)
        # Library refusals: RESUME with OVERWRITE, and RESUME with nothing saved.
        self.assertErrno(errno.EINVAL, self.engine, resume=True, overwrite=True)
        self.assertErrno(errno.ENOENT, self.engine, resume=True)

    def test_saved_state_is_kept_unless_resumed_or_overwritten(self):
        with self.engine() as e:
            e.register("t", 100)
        self.assertErrno(errno.EEXIST, self.engine)
        with self.engine(overwrite=True) as e:
            self.assertErrno(errno.ENOENT, e.lookup, "t")

    def test_set_log(self):
        got = []
        zinf.set_log(lambda level, msg: got.append((level, msg)), "notice")
        try:
            with self.engine() as e:
                e.register("t", 100)
            self.assertErrno(errno.EEXIST, self.engine)   # logs why, naming the directory
            self.assertTrue(any(lv == 0 and self.swap in m for lv, m in got), got)
            # Below the level: not passed on.
            zinf.set_log(lambda level, msg: got.append((level, msg)), 0)
            del got[:]
            zinf.Engine(nvme_path=self.swap, device="emulated", device_bytes=MIB,
                        host_bytes=MIB, pin=False, resume=True).close()
            self.assertTrue(all(lv == 0 for lv, _ in got), got)
            # A callback that raises is reported, not raised into the library's caller.
            zinf.set_log(lambda level, msg: 1 / 0, "error")
            unraisable, hook = [], sys.unraisablehook
            sys.unraisablehook = unraisable.append
            try:
                self.assertErrno(errno.EEXIST, self.engine)
            finally:
                sys.unraisablehook = hook
            self.assertTrue(unraisable)
            self.assertIsInstance(unraisable[0].exc_value, ZeroDivisionError)
        finally:
            zinf.set_log(None, "notice")
        with self.assertRaises(TypeError):
            zinf.set_log(5)
        with self.assertRaises(ValueError):
            zinf.set_log(None, "loud")
        with self.assertRaises(ValueError):
            zinf.set_log(None, 7)
        with self.assertRaises(TypeError):
            zinf.set_log(None, 1.5)

    def test_config_path_and_dict(self):
        cfg = {"zero_optimization": {"offload_param": {"device": "nvme",
                                                       "nvme_path": self.swap}},
               "zinf": {"device": "emulated", "device_bytes": "2M", "host_bytes": "3M"}}
        with zinf.Engine(cfg) as e:
            self.assertEqual(e.stats()["tier"][zinf.HOST]["capacity_bytes"], 3 * MIB)
            e.register("t", 10)
        path = os.path.join(self.dir, "zinf.json")
        with open(path, "w") as f:
            import json
            json.dump(cfg, f)
        with zinf.Engine(path, resume=True) as e:
            self.assertEqual(e.stats()["tier"][zinf.DEVICE]["capacity_bytes"], 2 * MIB)
            e.lookup("t")
        # A missing config: the error names it.
        missing = os.path.join(self.dir, "missing.json")
        err = self.assertErrno(errno.ENOENT, zinf.Engine, missing)
        self.assertIn(missing, str(err))
        self.assertEqual(err.filename, missing)
        # A config the parser refuses.
        self.assertErrno(errno.EINVAL, zinf.Engine, {"zinf": {"device": "bogus"}})

    def test_readonly_refuses_changes(self):
        with self.engine() as e:
            t = e.register("t", 4096)
            e.write(t, b"\x01" * 4096)
        with self.engine(readonly=True) as e:
            t = e.lookup("t")
            self.assertEqual(e.read(t, 0, 4), b"\x01" * 4)
            self.assertErrno(errno.EROFS, e.write, t, b"x")
            self.assertErrno(errno.EROFS, e.register, "u", 10)
            self.assertErrno(errno.EROFS, e.unregister, t)
            self.assertErrno(errno.EROFS, e.flush)
            p = e.fetch(t, "host")
            # A dirty release is refused and keeps the pin; a clean one drops it.
            self.assertErrno(errno.EROFS, p.release, dirty=True)
            self.assertFalse(p.released)
            self.assertErrno(errno.EROFS, p.release, spent=True)
            self.assertFalse(p.released)
            p.release()
            self.assertTrue(p.released)
            self.assertErrno(errno.EROFS, e.zero, t)
            self.assertEqual(e.read(t, 0, 4), b"\x01" * 4)
            if numpy is not None:
                with e.fetch(t, "host") as p:
                    cap = p.__dlpack__(max_version=(1, 0))
                    v = View(cap, True)
                    self.assertEqual(v.managed.flags & 1, 1, "READ_ONLY flag")
                    v.delete()
        self.assertEqual(e.closed, True)


class TestSavedState(Base):
    """Closing without the flush, flushes tagged with a step and a previous version kept, and
    what zinf.saved_* read of a swap directory."""

    def test_with_block_that_raises_keeps_the_last_flush(self):
        with self.engine() as e:
            t = e.register("t", 8192)
            e.write(t, b"\x01" * 8192)
        with self.assertRaises(KeyError):
            with self.engine(resume=True) as e:
                t = e.lookup("t")
                e.write(t, b"\x02" * 8192)
                e.flush()                               # the last good state
                e.write(t, b"\x03" * 4096)             # an update torn half way
                with e.fetch(t, "host", dirty=True) as p:
                    ctypes.memset(p.ptr + 4096, 0x04, 10)
                raise KeyError("interrupted")
        self.assertTrue(e.closed)
        with self.engine(resume=True) as e:
            self.assertEqual(e.read(e.lookup("t")), b"\x02" * 8192)
            e.write(e.lookup("t"), b"\x05" * 8192)
        # Left normally, the block flushes as before.
        with self.engine(resume=True) as e:
            self.assertEqual(e.read(e.lookup("t")), b"\x05" * 8192)

    def test_close_unflushed(self):
        e = self.engine()
        t = e.register("t", 4096)
        e.write(t, b"\x01" * 4096)
        e.flush()
        e.write(t, b"\x02" * 4096)
        p = e.fetch(t, "host", dirty=True)
        e.close_unflushed()                 # waits for the pin, then closes without a flush
        self.assertTrue(e.closed)
        with self.assertRaises(ValueError):
            e.write(t, b"x")
        e.close()                           # asked for after it: still no flush
        ctypes.memset(p.ptr, 0x03, 4096)
        p.release()
        del p
        gc.collect()
        e.close_unflushed()                 # closed already: nothing
        with self.engine(resume=True) as e:
            self.assertEqual(e.read(e.lookup("t")), b"\x01" * 4096)
        # Without an NVMe tier there is nothing to keep.
        zinf.Engine(device="emulated", device_bytes=MIB, host_bytes=MIB).close_unflushed()

    def test_barriers_run_before_a_flush_and_a_close(self):
        """_add_barrier (zinf.torch's deferred updates): each barrier runs before flush()
        and before a close() that flushes, and may write; one that raises aborts the flush
        (the last one stands) or makes the close one without a flush."""
        e = self.engine()
        t = e.register("t", 4096)
        ran = []

        def writes():
            ran.append(1)
            e.write(t, bytes([len(ran)]) * 4096)

        e._add_barrier(writes)
        with self.assertRaises(TypeError):
            e._add_barrier(3)
        e.flush()
        self.assertEqual(ran, [1])
        e._remove_barrier(writes)
        e.flush()
        self.assertEqual(ran, [1])

        def fails():
            raise KeyError("barrier")

        e._add_barrier(writes)
        e._add_barrier(fails)
        with self.assertRaises(KeyError):
            e.flush()                           # aborted: the last flush stands
        self.assertEqual(len(ran), 2)
        self.assertFalse(e.closed)
        e.write(t, b"\x09" * 4096)
        with self.assertRaises(KeyError):
            e.close()                           # closes, without the flush
        self.assertTrue(e.closed)
        with self.engine(resume=True) as e:
            self.assertEqual(e.read(e.lookup("t")), b"\x01" * 4096)
            self.assertEqual(e.stats()["tensors"], 1)

    def test_flush_steps_and_previous_version(self):
        swap = self.swap
        self.assertErrno(errno.ENOENT, zinf.saved_steps, swap)
        err = self.assertErrno(errno.ENOENT, zinf.saved_at, swap)
        self.assertEqual(err.filename, swap)
        self.assertErrno(errno.ENOENT, zinf.saved_tensors, swap)
        with self.engine() as e:
            t = e.register("t", 4096)
            e.register("u", 100)
            e.write(t, b"\x01" * 4096)
            e.flush(step=3)
            self.assertEqual(zinf.saved_steps(swap), (3, None))
            e.write(t, b"\x02" * 4096)
            e.flush(step=4, keep_previous=True)
            self.assertEqual(zinf.saved_steps(swap), (4, 3))
            self.assertEqual(zinf.saved_tensors(swap), 2)
            at = zinf.saved_at(swap)
            self.assertIsInstance(at, int)
            self.assertLess(abs(at - __import__("time").time_ns()), 60 * 10**9)
            with self.assertRaises(ValueError):
                e.flush(step=-1)
            with self.assertRaises(TypeError):
                e.flush(step="5")
            with self.assertRaises(TypeError):
                e.flush(step=True)
            with self.assertRaises(TypeError):
                e.flush(3, True, 1)
            e.write(t, b"\x03" * 4096)
            e.close_unflushed()
        # The previous version, inspected and then resumed.
        with self.engine(readonly=True, previous=True) as e:
            self.assertEqual(e.read(e.lookup("t")), b"\x01" * 4096)
            self.assertErrno(errno.EROFS, e.flush, step=9)
            self.assertErrno(errno.EROFS, e.drop_previous)
        with self.engine(resume=True) as e:
            self.assertEqual(e.read(e.lookup("t")), b"\x02" * 4096)
            e.flush(keep_previous=True)     # keeps step 4's state as the previous one
            self.assertEqual(zinf.saved_steps(swap)[1], 4)
            e.drop_previous()
            self.assertIsNone(zinf.saved_steps(swap)[1])
            e.drop_previous()               # none: nothing
            e.flush(step=7)
        self.assertEqual(zinf.saved_steps(swap), (7, None))
        self.assertErrno(errno.EINVAL, self.engine, previous=True, overwrite=True)
        with self.assertRaises(TypeError):
            zinf.saved_steps(3.5)
        # No NVMe tier: tagged flushes and drop_previous do nothing.
        with zinf.Engine(device="emulated", device_bytes=MIB, host_bytes=MIB) as e:
            e.flush(step=1, keep_previous=True)
            e.drop_previous()

    def test_open_options(self):
        extra = os.path.join(self.dir, "swap2")
        with self.engine(nvme_paths=[extra], block_size=256 * 1024, queue_depth=8,
                         cuda_device=0) as e:
            t = e.register("t", 4 * MIB)
            e.write(t, b"\x07" * (4 * MIB))
            e.flush()
        self.assertTrue(os.listdir(extra), "nothing was striped over the extra directory")
        with self.engine(resume=True, nvme_paths=(extra,), block_size=256 * 1024) as e:
            self.assertEqual(e.read(e.lookup("t"), 4 * MIB - 4), b"\x07" * 4)
            self.assertEqual(e.tensor_info(e.lookup("t")), ("nvme", 4 * MIB))
            h = e.register("h", 100, home="host")
            self.assertEqual(e.tensor_info(h), ("host", 100))
            self.assertErrno(errno.ENOENT, e.tensor_info, 987654321)
            with self.assertRaises(TypeError):
                e.tensor_info("t")
        with self.assertRaises(TypeError):
            self.engine(nvme_paths=extra)   # one directory, not a sequence of them
        with self.assertRaises(TypeError):
            self.engine(nvme_paths=[3])
        with self.assertRaises(ValueError):
            zinf.Engine(device="emulated", nvme_paths=[extra])
        with self.assertRaises(ValueError):
            self.engine(queue_depth=-1)
        with self.assertRaises(ValueError):
            self.engine(cuda_device=-2)
        with self.assertRaises(TypeError):
            self.engine(block_size="1M")
        with self.assertRaises(TypeError):
            zinf.Engine({"zinf": {}}, queue_depth=4)


class TestTensors(Base):
    def test_nvme_home_without_an_nvme_tier_names_the_missing_path(self):
        # It used to answer "invalid argument (bad handle, unaligned or out-of-range
        # request)", which points at nothing the caller did.
        got = []
        zinf.set_log(lambda level, msg: got.append(msg), "error")
        try:
            with zinf.Engine(device="emulated", device_bytes=MIB, host_bytes=MIB) as e:
                with self.assertRaises(zinf.Error) as cm:
                    e.register("w", 4096)
                err = cm.exception
                self.assertEqual(err.errno, errno.EINVAL)
                self.assertIn("no NVMe tier", str(err))
                self.assertIn("nvme_path=", str(err))
                self.assertIn("default home", str(err))
                self.assertEqual(err.filename, "w")
                with self.assertRaises(zinf.Error) as cm:
                    e.register("w", 4096, home="nvme")
                self.assertIn("nvme_path=", str(cm.exception))
                self.assertNotIn("default home", str(cm.exception))
                e.register("w", 4096, home="host")    # the success twin
            cfg = {"zinf": {"device": "emulated", "device_bytes": "1M", "host_bytes": "1M"}}
            with zinf.Engine(cfg) as e:
                with self.assertRaises(zinf.Error) as cm:
                    e.register("w", 4096)
                self.assertEqual(cm.exception.errno, errno.EINVAL)
                self.assertIn("offload_param.nvme_path", str(cm.exception))
                # A refusal for another reason keeps its own message.
                self.assertErrno(errno.EINVAL, e.register, "", 4096)
                e.register("w", 4096, home="device")
            # What the library logs names the setting too.
            self.assertTrue(any("offload_param.nvme_path" in m for m in got), got)
        finally:
            zinf.set_log(None, "notice")
        # With a swap directory the same call works.
        with zinf.Engine(cfg | {"zero_optimization": {"offload_param": {
                "device": "nvme", "nvme_path": self.swap}}}) as e:
            e.register("w", 4096)

    def test_register_lookup_unregister(self):
        with self.engine() as e:
            t = e.register("a", 1000, home="host")
            self.assertIsInstance(t, int)
            self.assertIsInstance(t, zinf.Tensor)
            self.assertEqual((t.name, t.nbytes, t.shape, t.dtype), ("a", 1000, None, None))
            u = e.register("b", ((3, 5), "float16"), home=zinf.DEVICE)
            self.assertEqual((u.nbytes, u.shape, u.dtype), (30, (3, 5), "float16"))
            if numpy is not None:
                w = e.register("c", ([7], numpy.dtype("int64")))
                self.assertEqual((w.nbytes, w.dtype), (56, "int64"))
                x = e.register("d", ((2,), numpy.float32))
                self.assertEqual(x.dtype, "float32")
            look = e.lookup("b")
            self.assertEqual(int(look), int(u))
            self.assertEqual((look.shape, look.dtype, look.nbytes), ((3, 5), "float16", 30))
            self.assertIn("'b'", repr(look))
            self.assertEqual(e.stats()["tensors"], 4 if numpy is not None else 2)
            e.unregister(u)
            self.assertErrno(errno.ENOENT, e.lookup, "b")
            self.assertErrno(errno.EEXIST, e.register, "a", 10)
            self.assertErrno(errno.ENOSPC, e.register, "huge", 64 * MIB, home="device")
            self.assertErrno(errno.ENOENT, e.lookup, "nope")

    def test_bad_arguments(self):
        with self.engine() as e:
            t = e.register("a", 100)
            with self.assertRaises(ValueError):
                e.register("x", 10, home="gpu")
            with self.assertRaises(ValueError):
                e.register("x", 10, home=7)
            with self.assertRaises(TypeError):
                e.register("x", 10, home=1.5)
            with self.assertRaises(ValueError):
                e.register("x", -1)
            with self.assertRaises(ValueError):
                e.register("x", ((2, 2), "float8"))
            with self.assertRaises(ValueError):
                e.register("x", ((2, -2), "float32"))
            with self.assertRaises(TypeError):
                e.register("x", ((2, 2), 3))
            with self.assertRaises(TypeError):
                e.register("x", (2, 2, 2))
            with self.assertRaises(TypeError):
                e.register(5, 10)
            with self.assertRaises(ValueError):
                e.fetch(t, "cpu")
            with self.assertRaises(TypeError):
                e.fetch("a")
            with self.assertRaises(ValueError):
                e.fetch(-1)
            with self.assertRaises(ValueError):
                e.read(t, -1)
            with self.assertRaises(TypeError):
                e.write(t, "text is no buffer")
            with self.assertRaises(TypeError):
                e.read_into(t, b"read-only")

    def test_unknown_handle(self):
        with self.engine() as e:
            e.register("a", 100)
            bogus = 123456789
            self.assertErrno(errno.ENOENT, e.fetch, bogus)
            self.assertErrno(errno.ENOENT, e.read, bogus)
            self.assertErrno(errno.ENOENT, e.fetch_all, [bogus], "host")
            for fn in (e.unregister, e.prefetch):
                with self.assertRaises(zinf.Error) as cm:
                    fn(bogus)
                self.assertIn(cm.exception.errno, (errno.ENOENT, errno.EINVAL))
            with self.assertRaises(zinf.Error) as cm:
                e.write(bogus, b"x")
            self.assertIn(cm.exception.errno, (errno.ENOENT, errno.EINVAL))

    def test_read_write(self):
        with self.engine() as e:
            t = e.register("a", 10000)
            self.assertEqual(e.read(t), bytes(10000))
            data = bytes(range(256)) * 4
            e.write(t, data, offset=100)
            e.write(t, memoryview(b"xyz"), 0)
            self.assertEqual(e.read(t, 100, 1024), data)
            self.assertEqual(e.read(t, nbytes=3), b"xyz")
            self.assertEqual(len(e.read(t, 9000)), 1000)
            buf = bytearray(1024)
            self.assertEqual(e.read_into(t, buf, offset=100), 1024)
            self.assertEqual(bytes(buf), data)
            self.assertErrno(errno.EINVAL, e.read, t, 20000)
            self.assertErrno(errno.EINVAL, e.write, t, b"x" * 20, 9990)
            self.assertErrno(errno.EINVAL, e.read_into, t, bytearray(20), 9990)
            if numpy is not None:
                arr = numpy.arange(10, dtype=numpy.int32)
                e.write(t, arr)
                out = numpy.zeros(10, dtype=numpy.int32)
                e.read_into(t, out)
                self.assertTrue((out == arr).all())
            e.flush()
            self.assertGreaterEqual(e.stats()["flushes"], 1)


class TestFetch(Base):
    def test_fetch_release(self):
        with self.engine() as e:
            t = e.register("a", 8192)
            e.write(t, b"\x05" * 8192)
            for tier in ("device", "host", zinf.DEVICE, zinf.HOST):
                p = e.fetch(t, tier)
                self.assertIsInstance(p, zinf.Pinned)
                self.assertNotEqual(p.ptr, 0)
                self.assertEqual(p.nbytes, 8192)
                self.assertIn(p.tier, ("device", "host"))
                self.assertEqual(p.tensor, int(t))
                self.assertEqual(ctypes.string_at(p.ptr, 8192), b"\x05" * 8192)
                self.assertErrno(errno.EBUSY, e.unregister, t)
                p.release()
                self.assertTrue(p.released)
                with self.assertRaises(ValueError):
                    p.release()
            self.assertErrno(errno.EINVAL, e.fetch, t, "nvme")
            # Written through the pointer and released dirty: the tensor has it.
            with e.fetch(t, "host", dirty=True) as p:
                ctypes.memset(p.ptr, 0x33, 100)
            self.assertEqual(e.read(t, 0, 101), b"\x33" * 100 + b"\x05")
            # release(dirty=True) overrides fetch's default.
            p = e.fetch(t, "device")
            ctypes.memset(p.ptr, 0x44, 10)
            p.release(dirty=True)
            self.assertEqual(e.read(t, 0, 10), b"\x44" * 10)
            # Released inside its with-block: the exit does nothing more.
            with e.fetch(t, "host") as p:
                p.release()
            # Dropped without a release: the pin goes with the object.
            p = e.fetch(t, "host")
            del p
            self.assertEqual(e.stats()["tier"][zinf.HOST]["pinned_bytes"], 0)
            e.unregister(t)

    def test_spent_release(self):
        with self.engine() as e:
            t = e.register("g", 8192)                      # homed on NVMe
            h = e.register("h", 4096, "host")
            e.write(t, b"\x07" * 8192)
            e.flush()
            p = e.fetch(t, "host")
            with self.assertRaises(ValueError):
                p.release(dirty=True, spent=True)
            q = e.fetch(t, "device")
            self.assertErrno(errno.EBUSY, p.release, spent=True)   # another holder
            self.assertFalse(p.released)
            q.release()
            read0 = e.stats()["nvme_bytes_read"]
            p.release(spent=True)
            self.assertTrue(p.released)
            self.assertEqual(e.read(t, 0, 8192), b"\x00" * 8192)
            with e.fetch(t, "device") as q:
                self.assertEqual(ctypes.string_at(q.ptr, 8192), b"\x00" * 8192)
            self.assertEqual(e.stats()["nvme_bytes_read"], read0, "zeros read from the drive")
            with e.fetch(h, "host") as p:
                self.assertErrno(errno.EINVAL, p.release, spent=True)  # a home in memory
                self.assertFalse(p.released)
            self.assertEqual(e.stats()["tier"][zinf.HOST]["pinned_bytes"], 0)
            if numpy is not None:
                # With a view alive the spent release waits for it; then the tensor is zeros.
                e.write(t, b"\x09" * 8192)
                p = e.fetch(t, "host")
                a = numpy.from_dlpack(p)
                p.release(spent=True)
                self.assertEqual(bytes(a[:4]), b"\x09" * 4)
                del a
                self.assertEqual(e.read(t, 0, 8192), b"\x00" * 8192)
                # Refused then (a pin of another tier): the deleter releases it clean.
                e.write(t, b"\x0a" * 8192)
                p, q = e.fetch(t, "host"), e.fetch(t, "device")
                a = numpy.from_dlpack(p)
                p.release(spent=True)
                del a
                q.release()
                self.assertEqual(e.read(t, 0, 8192), b"\x0a" * 8192)
                self.assertEqual(e.stats()["tier"][zinf.HOST]["pinned_bytes"], 0)

    def test_refused_dirty_release_keeps_the_pin(self):
        with self.engine() as e:
            t = e.register("t", 8192)
            e.write(t, b"\x01" * 8192)
            p, q = e.fetch(t, "host"), e.fetch(t, "device")
            ctypes.memset(p.ptr, 0x22, 8192)
            # The device copy is pinned: zinf refuses the dirty release and keeps the pin.
            self.assertErrno(errno.EBUSY, p.release, dirty=True)
            self.assertFalse(p.released)
            self.assertEqual(e.stats()["tier"][zinf.HOST]["pinned_bytes"], 8192)
            self.assertErrno(errno.EBUSY, e.unregister, t)
            q.release()
            p.release()                     # the default is dirty now: the bytes are kept
            self.assertTrue(p.released)
            self.assertEqual(e.read(t), b"\x22" * 8192)
            self.assertEqual(e.stats()["tier"][zinf.HOST]["pinned_bytes"], 0)

    def test_refused_dirty_release_through_a_view(self):
        with self.engine() as e:
            t = e.register("t", 8192)
            e.write(t, b"\x01" * 8192)
            p = e.fetch(t, "host")
            v = View(p.__dlpack__(), False)
            ctypes.memset(v.tensor.data, 0x33, 8192)
            q = e.fetch(t, "device")
            p.release(dirty=True)           # pending: the view holds the pin
            self.assertTrue(p.released)
            with self.assertWarns(RuntimeWarning) as cm:
                v.delete()                  # refused (EBUSY): the pin stays, p is held again
            self.assertIn("refused", str(cm.warning))
            self.assertFalse(p.released)
            self.assertEqual(e.stats()["tier"][zinf.HOST]["pinned_bytes"], 8192)
            self.assertErrno(errno.EBUSY, e.unregister, t)
            self.assertErrno(errno.EBUSY, p.release)   # retried: still refused, still held
            self.assertFalse(p.released)
            q.release()
            p.release()
            self.assertTrue(p.released)
            self.assertEqual(e.read(t), b"\x33" * 8192)
            self.assertEqual(e.stats()["tier"][zinf.HOST]["pinned_bytes"], 0)

            # Collected with its dirty release refused: the engine keeps the pin and
            # releases it dirty once the other pin goes.
            p = e.fetch(t, "host")
            ctypes.memset(p.ptr, 0x44, 8192)
            q = e.fetch(t, "device")
            self.assertErrno(errno.EBUSY, p.release, dirty=True)
            del p
            gc.collect()
            self.assertEqual(e.stats()["tier"][zinf.HOST]["pinned_bytes"], 8192)
            self.assertErrno(errno.EBUSY, e.unregister, t)
            q.release()
            self.assertEqual(e.stats()["tier"][zinf.HOST]["pinned_bytes"], 0)
            self.assertEqual(e.read(t), b"\x44" * 8192)

            # The same through a view, and the engine closed meanwhile: it closes once the
            # orphan went, with the bytes flushed.
            p = e.fetch(t, "host")
            v = View(p.__dlpack__(max_version=(1, 0)), True)
            ctypes.memset(v.tensor.data, 0x55, 8192)
            q = e.fetch(t, "device")
            p.release(dirty=True)
            with self.assertWarns(RuntimeWarning):
                v.delete()
            del p
            gc.collect()
            e.close()
            self.assertTrue(e.closed)
            q.release()
        with self.engine(resume=True) as e:
            self.assertEqual(e.read(e.lookup("t")), b"\x55" * 8192)

    def test_refused_release_on_a_readonly_engine_through_a_view(self):
        with self.engine() as e:
            t = e.register("t", 4096)
            e.write(t, b"\x01" * 4096)
        with self.engine(readonly=True) as e:
            t = e.lookup("t")
            p = e.fetch(t, "host")
            v = View(p.__dlpack__(), False)
            # Refused at once (the view alive or not): the pin stays with p.
            self.assertErrno(errno.EROFS, p.release, dirty=True)
            self.assertErrno(errno.EROFS, p.release, spent=True)
            self.assertFalse(p.released)
            v.delete()
            self.assertFalse(p.released)
            self.assertEqual(e.stats()["tier"][zinf.HOST]["pinned_bytes"], 4096)
            p.release()
            self.assertTrue(p.released)
            self.assertEqual(e.stats()["tier"][zinf.HOST]["pinned_bytes"], 0)
            self.assertEqual(e.read(t), b"\x01" * 4096)

    def test_zero(self):
        with self.engine() as e:
            t = e.register("g", 8192)                      # homed on NVMe
            h = e.register("h", 4096, "host")
            e.write(t, b"\x05" * 8192)
            e.flush()
            with e.fetch(t, "host"):
                self.assertErrno(errno.EBUSY, e.zero, t)    # held
            self.assertEqual(e.read(t, 0, 8192), b"\x05" * 8192)
            self.assertErrno(errno.EINVAL, e.zero, h)       # a home in memory
            with self.assertRaises(TypeError):
                e.zero("g")
            io0 = (e.stats()["nvme_bytes_read"], e.stats()["nvme_bytes_written"])
            e.zero(t)
            with e.fetch(t, "device") as q:
                self.assertEqual(ctypes.string_at(q.ptr, 8192), b"\x00" * 8192)
            e.flush()
            self.assertEqual((e.stats()["nvme_bytes_read"], e.stats()["nvme_bytes_written"]), io0,
                             "zinf_zero moved bytes")
            if numpy is not None:
                # A pin whose release waits for a view still holds the tensor.
                e.write(t, b"\x06" * 8192)
                p = e.fetch(t, "host")
                a = numpy.from_dlpack(p)
                p.release()
                self.assertErrno(errno.EBUSY, e.zero, t)
                del a
                e.zero(t)
                self.assertEqual(e.read(t, 0, 8192), b"\x00" * 8192)

    def test_fetch_all_async_prefetch_step(self):
        with self.engine() as e:
            ts = [e.register("t%d" % i, 4096 * (i + 1)) for i in range(4)]
            ps = e.fetch_all(ts, "device")
            self.assertEqual([p.nbytes for p in ps], [4096 * (i + 1) for i in range(4)])
            self.assertEqual(len({p.ptr for p in ps}), 4)
            for p in ps:
                p.release()
            self.assertEqual(e.fetch_all([], "host"), [])
            with self.assertRaises(TypeError):
                e.fetch_all(5)
            ticket = e.fetch_async(ts[0], "host")
            self.assertIsInstance(ticket, int)
            p = e.wait(ticket)
            self.assertEqual(p.nbytes, 4096)
            p.release()
            self.assertErrno(errno.EINVAL, e.wait, ticket)
            e.prefetch(ts[1], "device")
            e.step()
            e.step()
            self.assertEqual(e.stats()["steps"], 2)

    def test_close_waits_for_pins(self):
        e = self.engine()
        t = e.register("a", 4096)
        p = e.fetch(t, "host", dirty=True)
        e.close()
        self.assertTrue(e.closed)
        with self.assertRaises(ValueError):
            e.fetch(t)
        # The pin still works and goes; then the engine closes for real (and flushes).
        ctypes.memset(p.ptr, 0x11, 4096)
        p.release()
        del p
        gc.collect()
        with self.engine(resume=True) as e2:
            self.assertEqual(e2.read(e2.lookup("a")), b"\x11" * 4096)

    def test_stats_has_every_field(self):
        with self.engine() as e:
            st = e.stats()
        want = {"tier", "tensors", "nvme_bytes_read", "nvme_bytes_written", "prefetches",
                "prefetch_in_time", "prefetch_late", "prefetch_wasted", "blocked_ns", "steps",
                "schedule_length", "schedule_resets", "flushes", "io_buffered",
                "device_is_cuda", "tensors_damaged", "compactions", "blocked_nvme_ns",
                "blocked_copy_ns", "blocked_room_ns", "blocked_pin_ns", "flush_bytes_total",
                "flush_bytes_done", "host_staging_bytes", "host_pinned", "write_behinds"}
        self.assertEqual(set(st), want)
        self.assertEqual(len(st["tier"]), 3)
        for t in st["tier"]:
            self.assertEqual(set(t), {"capacity_bytes", "used_bytes", "peak_bytes",
                                      "pinned_bytes", "fetches", "hits", "evictions",
                                      "writebacks"})


class TestDLPack(Base):
    @needs_numpy
    def test_numpy_view_is_the_pinned_memory(self):
        with self.engine() as e:
            t = e.register("w", ((4, 8), "float32"))
            e.write(t, numpy.arange(32, dtype=numpy.float32))
            for tier in ("host", "device"):
                with e.fetch(t, tier) as p:
                    self.assertEqual(p.__dlpack_device__(), (1, 0))  # kDLCPU: emulated
                    a = numpy.from_dlpack(p)
                    self.assertEqual(a.__array_interface__["data"][0], p.ptr)
                    self.assertEqual((a.shape, a.dtype), ((4, 8), numpy.float32))
                    self.assertTrue((a.ravel() == numpy.arange(32)).all())
                    del a
            # Without a shape: 1-D uint8 of its bytes.
            u = e.register("raw", 100)
            with e.fetch(u, "host") as p:
                a = numpy.from_dlpack(p)
                self.assertEqual((a.shape, a.dtype), ((100,), numpy.uint8))
                del a

    @needs_numpy
    def test_numpy_writes_through_a_view(self):
        with self.engine() as e:
            t = e.register("w", ((16,), "int32"))
            with e.fetch(t, "host", dirty=True) as p:
                a = numpy.from_dlpack(p)
                # numpy before 2.x marks DLPack arrays read-only; a writable view over the
                # same address stands in for it there.
                if not a.flags.writeable:
                    a = numpy.ctypeslib.as_array(
                        ctypes.cast(a.__array_interface__["data"][0],
                                    ctypes.POINTER(ctypes.c_int32)), (16,))
                a[:] = numpy.arange(16, dtype=numpy.int32) * 3
                del a
            out = numpy.frombuffer(e.read(t), dtype=numpy.int32)
            self.assertTrue((out == numpy.arange(16) * 3).all())

    def test_capsules_by_the_specification(self):
        with self.engine() as e:
            t = e.register("w", ((2, 3, 4), "bfloat16"))
            with e.fetch(t, "host", dirty=True) as p:
                for versioned, kw in ((False, {}), (False, {"max_version": (0, 8)}),
                                      (True, {"max_version": (1, 0)}),
                                      (True, {"max_version": (1, 3), "dl_device": (1, 0),
                                              "copy": False, "stream": None})):
                    cap = p.__dlpack__(**kw)
                    v = View(cap, versioned)
                    if versioned:
                        self.assertEqual((v.managed.major, v.managed.minor), (1, 0))
                        self.assertEqual(v.managed.flags, 0)
                    self.assertEqual(v.tensor.data, p.ptr)
                    self.assertEqual((v.tensor.device.device_type, v.tensor.device.device_id),
                                     (1, 0))
                    self.assertEqual(v.shape, (2, 3, 4))
                    self.assertEqual([v.tensor.strides[i] for i in range(3)], [12, 4, 1])
                    self.assertEqual((v.tensor.dtype.code, v.tensor.dtype.bits,
                                      v.tensor.dtype.lanes), (4, 16, 1))
                    self.assertEqual(v.tensor.byte_offset, 0)
                    ctypes.memset(v.tensor.data, 0x5A, 48)
                    v.delete()
                    del cap
            self.assertEqual(e.read(t), b"\x5A" * 48)
            with e.fetch(t, "host") as p:
                with self.assertRaises(BufferError):
                    p.__dlpack__(dl_device=(2, 0))
                with self.assertRaises(BufferError):
                    p.__dlpack__(copy=True)
                with self.assertRaises(TypeError):
                    p.__dlpack__(max_version=1)
                with self.assertRaises(TypeError):
                    p.__dlpack__(dl_device="cpu")
            with self.assertRaises(BufferError):
                p.__dlpack__()  # released

    def test_unconsumed_capsule_drops_its_pin(self):
        with self.engine() as e:
            t = e.register("w", 4096)
            p = e.fetch(t, "host")
            cap = p.__dlpack__(max_version=(1, 0))
            cap2 = p.__dlpack__()
            p.release()
            self.assertErrno(errno.EBUSY, e.unregister, t)
            del cap
            self.assertErrno(errno.EBUSY, e.unregister, t)
            del cap2
            e.unregister(t)

    @needs_numpy
    def test_view_kept_past_release(self):
        with self.engine() as e:
            t = e.register("w", ((1024,), "float32"))
            e.write(t, numpy.full(1024, 2.5, dtype=numpy.float32))
            with e.fetch(t, "device") as p:
                a = numpy.from_dlpack(p)
                self.assertFalse(p.dropped)
            self.assertTrue(p.released)
            self.assertFalse(p.dropped)         # the view holds the pin
            # Other tensors come and go through the tier: the view's memory stays the tensor's.
            others = [e.register("o%d" % i, 512 * 1024) for i in range(12)]
            for o in others:
                with e.fetch(o, "device", dirty=True) as q:
                    ctypes.memset(q.ptr, 0xFF, q.nbytes)
            self.assertTrue((a == 2.5).all())
            self.assertErrno(errno.EBUSY, e.unregister, t)
            self.assertGreater(e.stats()["tier"][zinf.DEVICE]["pinned_bytes"], 0)
            del a
            gc.collect()
            self.assertTrue(p.dropped)
            e.unregister(t)
            self.assertEqual(e.stats()["tier"][zinf.DEVICE]["pinned_bytes"], 0)

    @needs_numpy
    def test_view_keeps_the_engine_open(self):
        e = self.engine()
        t = e.register("w", ((8,), "int64"))
        e.write(t, numpy.arange(8, dtype=numpy.int64))
        with e.fetch(t, "host") as p:
            a = numpy.from_dlpack(p)
        del p
        e.close()
        self.assertTrue((a == numpy.arange(8)).all())
        del a, e
        gc.collect()


class TestBuffer(Base):
    """zinf.Pinned's buffer protocol: memoryview(pin), numpy.frombuffer(pin)."""

    def pinned_bytes(self, e):
        return e.stats()["tier"][zinf.HOST]["pinned_bytes"]

    def test_memoryview_reads_the_pinned_bytes(self):
        data = bytes(range(256)) * 32
        with self.engine() as e:
            t = e.register("t", len(data))
            e.write(t, data)
            for tier in ("host", "device"):
                with e.fetch(t, tier) as p:
                    with memoryview(p) as m:
                        self.assertEqual((m.nbytes, m.format, m.ndim), (len(data), "B", 1))
                        self.assertTrue(m.readonly, "fetched clean")
                        self.assertEqual(bytes(m), data)
                        with self.assertRaises(TypeError):
                            m[0] = 1
            # The buffer keeps the pin (and the Pinned) alive; its end drops both.
            m = memoryview(e.fetch(t, "host"))
            gc.collect()
            self.assertEqual(bytes(m[:256]), data[:256])
            self.assertEqual(self.pinned_bytes(e), len(data))
            m.release()
            gc.collect()
            self.assertEqual(self.pinned_bytes(e), 0)
            # A released pin exports nothing.
            p = e.fetch(t, "host")
            p.release()
            with self.assertRaises(BufferError) as cm:
                memoryview(p)
            self.assertIn("released", str(cm.exception))

    def test_writes_through_a_dirty_pin_are_saved(self):
        with self.engine() as e:
            t = e.register("t", 8192)
            e.write(t, b"\x01" * 8192)
            p = e.fetch(t, "host", dirty=True)
            with memoryview(p) as m:
                self.assertFalse(m.readonly)
                m[:4] = b"abcd"
                m[-2:] = b"yz"
            p.release()
            want = b"abcd" + b"\x01" * 8186 + b"yz"
            self.assertEqual(e.read(t), want)
            e.flush()
            with e.fetch(t, "device") as q, memoryview(q) as m:
                self.assertEqual(bytes(m), want)
        with self.engine(resume=True) as e:
            self.assertEqual(e.read(e.lookup("t")), want)

    @needs_numpy
    def test_numpy_writes_through_a_dirty_pin_are_saved(self):
        with self.engine() as e:
            t = e.register("w", ((16,), "float32"))
            p = e.fetch(t, "host", dirty=True)
            a = numpy.frombuffer(p, dtype=numpy.float32)
            self.assertTrue(a.flags.writeable)
            self.assertEqual(a.__array_interface__["data"][0], p.ptr)
            a[:] = numpy.arange(16, dtype=numpy.float32) * 2
            del a
            p.release()
            with e.fetch(t, "host") as p:
                b = numpy.frombuffer(p, dtype=numpy.float32)
                self.assertFalse(b.flags.writeable, "a clean pin gives a read-only array")
                self.assertTrue((b == numpy.arange(16) * 2).all())
                with self.assertRaises(ValueError):
                    b[0] = 5
                del b
            with e.fetch(t, "device", dirty=True) as p:
                with memoryview(p) as m:
                    a = numpy.asarray(m).view(numpy.float32)
                    a += 1
                    del a
            out = numpy.frombuffer(e.read(t), dtype=numpy.float32)
            self.assertTrue((out == numpy.arange(16) * 2 + 1).all())

    def test_writable_buffer_of_a_clean_pin_is_refused(self):
        with self.engine() as e:
            t = e.register("t", 4096)
            with e.fetch(t, "host") as p:
                with self.assertRaises(BufferError) as cm:
                    writable_buffer(p)
                self.assertIn("fetched clean", str(cm.exception))
                self.assertIn("dirty=True", str(cm.exception))
                with self.assertRaises(TypeError):
                    (ctypes.c_char * 4096).from_buffer(p)
                if numpy is not None:
                    self.assertFalse(numpy.frombuffer(p, dtype=numpy.uint8).flags.writeable)
            with e.fetch(t, "host", dirty=True) as p:     # the success twin
                self.assertEqual(writable_buffer(p), (p.ptr, 4096, 0))
                c = (ctypes.c_char * 4096).from_buffer(p)
                c[0] = b"q"
                del c
            self.assertEqual(e.read(t, 0, 1), b"q")
        # A read-only engine's pins give read-only buffers, dirty or not.
        with self.engine(readonly=True) as e:
            for dirty in (False, True):
                p = e.fetch(e.lookup("t"), "host", dirty=dirty)
                with memoryview(p) as m:
                    self.assertTrue(m.readonly)
                    self.assertEqual(bytes(m[:1]), b"q")
                with self.assertRaises(BufferError) as cm:
                    writable_buffer(p)
                self.assertIn("read-only engine", str(cm.exception))
                p.release(dirty=False)

    def test_release_while_a_buffer_is_alive_is_refused(self):
        with self.engine() as e:
            t = e.register("t", 4096)
            p = e.fetch(t, "host", dirty=True)
            m = memoryview(p)
            n = memoryview(p)
            with self.assertRaises(BufferError) as cm:
                p.release()
            self.assertIn("2 buffer views", str(cm.exception))
            self.assertFalse(p.released)
            self.assertEqual(self.pinned_bytes(e), 4096)
            m[:2] = b"ok"
            m.release()
            with self.assertRaises(BufferError) as cm:
                p.release()
            self.assertIn("1 buffer view of", str(cm.exception))
            n.release()
            p.release()
            self.assertTrue(p.released)
            self.assertEqual(self.pinned_bytes(e), 0)
            self.assertEqual(e.read(t, 0, 2), b"ok")
            if numpy is not None:
                p = e.fetch(t, "host", dirty=True)
                a = numpy.frombuffer(p, dtype=numpy.uint8)
                with self.assertRaises(BufferError):
                    p.release()
                a[:2] = (7, 8)
                del a
                p.release()
                self.assertEqual(e.read(t, 0, 2), b"\x07\x08")
            # A with-block that ends with a buffer alive says so, and keeps the pin.
            with self.assertRaises(BufferError):
                with e.fetch(t, "host") as p:
                    m = memoryview(p)
            self.assertFalse(p.released)
            m.release()
            p.release()
            self.assertEqual(self.pinned_bytes(e), 0)


@unittest.skipIf(numpy is None, "numpy is not importable (Debian: python3-numpy)")
class TestAdamW(Base):
    def arrays(self, n, seed):
        rng = numpy.random.default_rng(seed)
        p = rng.standard_normal(n, dtype=numpy.float32)
        g = rng.standard_normal(n, dtype=numpy.float32)
        m = (rng.standard_normal(n, dtype=numpy.float32) * 0.1).astype(numpy.float32)
        v = (rng.random(n, dtype=numpy.float32) * 0.01).astype(numpy.float32)
        return p, g, m, v

    def test_step_is_torchs_adamw(self):
        p, g, m, v = self.arrays(100003, 1)
        p0, m0, v0 = p.astype(numpy.float64), m.astype(numpy.float64), v.astype(numpy.float64)
        lr, b1, b2, eps, wd, step = 1e-3, 0.9, 0.999, 1e-8, 0.01, 3
        zinf.adamw_step(p, g, m, v, step)  # the defaults are torch's
        g64 = g.astype(numpy.float64)
        m1 = b1 * m0 + (1 - b1) * g64
        v1 = b2 * v0 + (1 - b2) * g64 * g64
        want = p0 * (1 - lr * wd) - lr / (1 - b1 ** step) * m1 / (
            numpy.sqrt(v1) / numpy.sqrt(1 - b2 ** step) + eps)
        self.assertLess(numpy.max(numpy.abs(p - want)), 1e-6)
        self.assertLess(numpy.max(numpy.abs(m - m1)), 1e-6)
        # (beta2 is a float32: 1 - beta2 differs from 0.001 by 1.3e-5 of it)
        self.assertLess(numpy.max(numpy.abs(v - v1)), 1e-6)

    def test_pinned_copies_step_as_buffers_do(self):
        n = 4096
        with self.engine() as e:
            arrs = self.arrays(n, 2)
            ts = []
            for name, a in zip("pgmv", arrs):
                t = e.register(name, ((n,), "float32"), "nvme")
                e.write(t, a)
                ts.append(t)
            pins = e.fetch_all(ts, "host", dirty=True)
            for step in (1, 2):
                zinf.adamw_step(*pins, step, lr=0.01, weight_decay=0.1, grad_scale=0.5)
                zinf.adamw_step(*arrs, step, lr=0.01, weight_decay=0.1, grad_scale=0.5)
            for pin in pins:
                pin.release()
            for t, a in zip(ts, arrs):
                self.assertEqual(e.read(t), a.tobytes(), t.name)
            gone = e.fetch(ts[0], "host")
            gone.release()  # a released copy is refused
            with self.assertRaises(ValueError):
                zinf.adamw_step(gone, *arrs[1:], 3)

    def test_other_dtypes_are_refused(self):
        p, g, m, v = self.arrays(1024, 4)
        keep = [a.tobytes() for a in (p, g, m, v)]
        args = [p, g, m, v]
        for i, name in enumerate(("param", "grad", "m", "v")):
            for dtype in ("float64", "float16", "int32", "uint8", "int8"):
                bad = list(args)
                bad[i] = args[i].view(dtype)  # the same 4096 bytes, typed otherwise
                with self.assertRaises(TypeError) as cm:
                    zinf.adamw_step(*bad, 1)
                self.assertIn(name + " is " + dtype, str(cm.exception))
        # Buffer-protocol objects of another type (no dtype of their own), by their format.
        for fmt, called in (("d", "float64"), ("i", "int32"), ("h", "int16"), ("b", "int8")):
            bad = memoryview(bytearray(g.tobytes())).cast("B").cast(fmt)
            with self.assertRaises(TypeError) as cm:
                zinf.adamw_step(p, bad, m, v, 1)
            self.assertIn("grad is " + called, str(cm.exception))
        with self.assertRaises(TypeError) as cm:
            zinf.adamw_step(p, g, [0.0] * 1024, v, 1)
        self.assertIn("m is a list", str(cm.exception))
        self.assertEqual([a.tobytes() for a in (p, g, m, v)], keep, "a refused step changed")
        # Untyped bytes of a length that is no whole number of floats.
        with self.assertRaises(ValueError):
            zinf.adamw_step(p[:1], bytes(6), m[:1], v[:1], 1)
        # Pinned copies of tensors registered with another dtype.
        with self.engine() as e:
            ts = {}
            for name, dtype in (("p", "float32"), ("g", "float16"), ("m", "bfloat16"),
                                ("v", "int32")):
                n = 1024 * 4 // numpy.dtype(dtype if dtype != "bfloat16" else "float16").itemsize
                ts[name] = e.register(name, ((n,), dtype))
            f32 = [e.register(n + "32", ((1024,), "float32")) for n in "gmv"]
            pins = e.fetch_all(list(ts.values()) + f32, "host", dirty=True)
            pp, pg, pm, pv, g32, m32, v32 = pins
            for args, name, dtype in (((pp, pg, m32, v32), "grad", "float16"),
                                      ((pp, g32, pm, v32), "m", "bfloat16"),
                                      ((pp, g32, m32, pv), "v", "int32")):
                with self.assertRaises(TypeError) as cm:
                    zinf.adamw_step(*args, 1)
                self.assertIn("%s is a pinned %s tensor" % (name, dtype), str(cm.exception))
            # A numpy view of a typed Pinned is refused as the Pinned is.
            with self.assertRaises(TypeError):
                zinf.adamw_step(pp, numpy.from_dlpack(pg), m32, v32, 1)
            zinf.adamw_step(pp, g32, m32, v32, 1)  # float32 all: stepped
            for pin in pins:
                pin.release()
            self.assertEqual(e.stats()["tier"][zinf.HOST]["pinned_bytes"], 0)

    def test_untyped_pinned_copies_are_float32_bytes(self):
        n = 2048
        arrs = self.arrays(n, 5)
        want = [a.copy() for a in arrs]
        zinf.adamw_step(*want, 1, lr=0.01)
        with self.engine() as e:
            ts = [e.register(name, n * 4) for name in "pgmv"]   # by size: no dtype
            for t, a in zip(ts, arrs):
                e.write(t, a)
            pins = e.fetch_all(ts, "host", dirty=True)
            zinf.adamw_step(*pins, 1, lr=0.01)
            for pin in pins:
                pin.release()
            for t, a in zip(ts, want):
                self.assertEqual(e.read(t), a.tobytes(), t.name)
            odd = e.register("odd", 10)
            with e.fetch(odd, "host") as q, self.assertRaises(ValueError):
                zinf.adamw_step(q, bytes(8), bytearray(8), bytearray(8), 1)

    def test_bad_arguments_change_nothing(self):
        p, g, m, v = self.arrays(1000, 3)
        keep = [a.copy() for a in (p, m, v)]
        self.assertErrno(errno.EINVAL, zinf.adamw_step, p, g, m, v, 1, lr=-1.0)
        self.assertErrno(errno.EINVAL, zinf.adamw_step, p, g, m, v, 0)
        self.assertErrno(errno.EINVAL, zinf.adamw_step, p, g, m, v, 1, beta1=1.0)
        self.assertErrno(errno.EINVAL, zinf.adamw_step, p, g, m, v, 1, grad_scale=float("inf"))
        with self.assertRaises(ValueError):
            zinf.adamw_step(p, g[:10], m, v, 1)
        with self.assertRaises(BufferError):
            zinf.adamw_step(bytes(4000), g, m, v, 1)  # param is written: read-only refused
        with self.assertRaises(TypeError):
            zinf.adamw_step(p, g, m, v)
        for a, k in zip((p, m, v), keep):
            self.assertEqual(a.tobytes(), k.tobytes())
        zinf.adamw_step(p, bytes(g.tobytes()), m, v, 1)  # grad is only read


class TestThreads(Base):
    def test_threads_share_an_engine(self):
        nthreads, rounds = 6, 150
        with self.engine() as e:
            own = [e.register("t%d" % i, 64 * 1024, home="host" if i % 2 else "nvme")
                   for i in range(nthreads)]
            shared = e.register("shared", 64 * 1024)
            e.write(shared, b"\x09" * 64 * 1024)
            errors = []

            def work(i):
                try:
                    t = own[i]
                    for r in range(rounds):
                        byte = (i * 31 + r) & 0xFF
                        tier = "device" if r % 2 else "host"
                        with e.fetch(t, tier, dirty=True) as p:
                            ctypes.memset(p.ptr, byte, p.nbytes)
                        got = e.read(t, r * 100, 100)
                        if got != bytes([byte]) * 100:
                            raise AssertionError("thread %d round %d read %r" % (i, r, got[:4]))
                        e.write(t, bytes([byte ^ 0xFF]) * 10, 7)
                        with e.fetch(shared, tier) as s:
                            if ctypes.string_at(s.ptr + r, 4) != b"\x09" * 4:
                                raise AssertionError("the shared tensor changed")
                        if r % 25 == 0:
                            e.stats()
                            e.step()
                except Exception as ex:  # reported by the main thread
                    errors.append(ex)

            threads = [threading.Thread(target=work, args=(i,)) for i in range(nthreads)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            self.assertEqual(errors, [])
            st = e.stats()
            self.assertEqual(st["tier"][zinf.HOST]["pinned_bytes"], 0)
            self.assertEqual(st["tier"][zinf.DEVICE]["pinned_bytes"], 0)


class TestForks(Base):
    """A child of os.fork() has its parent's engines in memory but none of their threads:
    using one there must fail at once, collecting one must touch nothing, and the parent must
    carry on."""

    def wait_child(self, pid, timeout=60):
        import time
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        self.fail("the child hung")

    def test_child_refuses_the_parents_engine(self):
        e = self.engine()
        t = e.register("t", 64 * 1024)
        e.write(t, b"\x01" * 65536)
        e.flush()
        held = e.fetch(t, "host")
        cap = held.__dlpack__()
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:                                    # the child
            code = 0
            try:
                os.close(rfd)
                out = []
                for name, fn in (("fetch", lambda: e.fetch(t, "host")),
                                 ("read", lambda: e.read(t)),
                                 ("write", lambda: e.write(t, b"\x02")),
                                 ("flush", lambda: e.flush()),
                                 ("fetch_all", lambda: e.fetch_all([t], "host", wait=True)),
                                 ("release", lambda: held.release()),
                                 ("dlpack", lambda: held.__dlpack__()),
                                 ("enter", lambda: e.__enter__())):
                    try:
                        fn()
                        out.append("%s: no error" % name)
                    except RuntimeError as ex:
                        if "another process" not in str(ex):
                            out.append("%s: %s" % (name, ex))
                    except Exception as ex:
                        out.append("%s: %r" % (name, ex))
                # Collected or closed here, nothing of the parent's engine is touched.
                del cap
                e.close()
                if not e.closed:
                    out.append("close: not closed")
                os.write(wfd, "\n".join(out).encode())
            except BaseException as ex:
                os.write(wfd, repr(ex).encode())
                code = 1
            finally:
                os._exit(code)
        os.close(wfd)
        self.assertEqual(self.wait_child(pid), 0)
        with os.fdopen(rfd, "rb") as f:
            self.assertEqual(f.read().decode(), "")
        # The parent carries on: its pin, the view's pin and the engine are as they were.
        self.assertFalse(held.released)
        held.release()
        del cap
        self.assertEqual(e.stats()["tier"][zinf.HOST]["pinned_bytes"], 0)
        e.write(t, b"\x03" * 65536)
        with e.fetch(t, "device") as p:
            self.assertEqual(ctypes.string_at(p.ptr, 4), b"\x03" * 4)
        closer = threading.Thread(target=e.close)
        closer.start()
        closer.join(60)
        self.assertFalse(closer.is_alive(), "the parent's close hung")
        with self.engine(resume=True) as e:
            self.assertEqual(e.read(e.lookup("t"), 0, 4), b"\x03" * 4)

    def test_child_that_exits_normally(self):
        # A child that leaves through sys.exit runs every finalizer (the engine's, its
        # Pinned's) with the parent's engine still open in it.
        import subprocess
        script = (
            "import os, sys, zinf\n"
            "e = zinf.Engine(nvme_path=sys.argv[1], device='emulated', device_bytes=1 << 20,"
            " host_bytes=1 << 20)\n"
            "t = e.register('t', 4096)\n"
            "e.write(t, b'\\x05' * 4096)\n"
            "p = e.fetch(t, 'host')\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    sys.exit(0)\n"
            "_, st = os.waitpid(pid, 0)\n"
            "assert os.waitstatus_to_exitcode(st) == 0, st\n"
            "p.release()\n"
            "assert e.read(t, 0, 2) == b'\\x05\\x05'\n"
            "e.close()\n"
            "print('parent closed')\n")
        out = subprocess.run([sys.executable, "-c", script, self.swap], capture_output=True,
                             timeout=120, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("parent closed", out.stdout)


class TestWaitForRoom(Base):
    """fetch(wait=) and fetch_all(wait=): a tier full of other threads' pins."""

    def threads(self, n, work):
        errors, results = [], [None] * n

        def run(i):
            try:
                results[i] = work(i)
            except Exception as ex:  # reported by the main thread
                results[i] = ex

        ths = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(120)
            self.assertFalse(th.is_alive(), "a thread hung")
        return results

    def test_threads_wait_for_room(self):
        import time
        n = 8
        with self.engine() as e:
            ts = [e.register("t%d" % i, MIB) for i in range(n)]   # 1/4 of the host tier each
            for i, t in enumerate(ts):
                e.write(t, bytes([i + 1]) * MIB)
            # Without waiting, those that find the tier full of the others' pins fail.
            attempted = threading.Barrier(n)
            start = threading.Barrier(n)

            def at_once(i):
                start.wait()
                try:
                    p = e.fetch(ts[i], "host")
                except zinf.Error as ex:
                    attempted.wait()
                    return ex
                attempted.wait()                # held until every thread has tried
                p.release()
                return "ok"

            got = self.threads(n, at_once)
            failed = [r for r in got if isinstance(r, Exception)]
            self.assertTrue(failed, "no fetch found the tier full")
            self.assertLess(len(failed), n)
            for ex in failed:
                self.assertIsInstance(ex, zinf.Error, repr(ex))
                self.assertEqual(ex.errno, errno.ENOMEM)
            # With wait=True every thread gets its turn.
            start = threading.Barrier(n)

            def waiting(i):
                start.wait()
                if i % 2:
                    ps = e.fetch_all([ts[i]], "host", wait=True)
                    p = ps[0]
                else:
                    p = e.fetch(ts[i], "host", wait=True)
                ok = ctypes.string_at(p.ptr, 4) == bytes([i + 1]) * 4
                time.sleep(0.02)
                p.release()
                return "ok" if ok else "wrong bytes"

            self.assertEqual(self.threads(n, waiting), ["ok"] * n)
            self.assertEqual(e.stats()["tier"][zinf.HOST]["pinned_bytes"], 0)

    def test_wait_times_out_and_wakes(self):
        import time
        with self.engine() as e:
            ts = [e.register("t%d" % i, MIB) for i in range(5)]
            held = e.fetch_all(ts[:4], "host")
            t0 = time.monotonic()
            err = self.assertErrno(errno.ENOMEM, e.fetch, ts[4], "host", wait=0.3)
            self.assertGreaterEqual(time.monotonic() - t0, 0.3)
            self.assertIn("after waiting", str(err))
            self.assertErrno(errno.ENOMEM, e.fetch_all, [ts[4]], "host", wait=0.05)
            self.assertErrno(errno.ENOMEM, e.fetch, ts[4], "host")     # no wait: at once
            self.assertErrno(errno.ENOMEM, e.fetch, ts[4], "host", wait=0)
            # A pin released by another thread wakes the waiter.
            timer = threading.Timer(0.2, held[0].release)
            timer.start()
            with e.fetch(ts[4], "host", wait=30) as p:
                self.assertEqual(p.nbytes, MIB)
            timer.join()
            for p in held[1:]:
                p.release()

    def test_what_never_fits_fails_at_once(self):
        import time
        with self.engine() as e:
            big = e.register("big", 5 * MIB)
            small = [e.register("s%d" % i, 2 * MIB + 4096) for i in range(2)]
            other = e.register("other", MIB)
            q = e.fetch(other, "host")          # a pin that might go: not what stops these
            t0 = time.monotonic()
            err = self.assertErrno(errno.ENOMEM, e.fetch, big, "host", wait=True)
            self.assertIn("never fits", str(err))
            err = self.assertErrno(errno.ENOMEM, e.fetch_all, small, "host", wait=True)
            self.assertIn("never fits", str(err))
            self.assertLess(time.monotonic() - t0, 5)
            q.release()
        # A tier whose room homes take, no pin held: nothing to wait for.
        with self.engine(overwrite=True) as e:
            e.register("home", 3 * MIB, home="host")
            t = e.register("t", 2 * MIB)
            t0 = time.monotonic()
            err = self.assertErrno(errno.ENOMEM, e.fetch, t, "host", wait=True)
            self.assertIn("no pin", str(err))
            self.assertLess(time.monotonic() - t0, 5)

    def test_close_wakes_the_waiters(self):
        with self.engine() as e:
            ts = [e.register("t%d" % i, 2 * MIB) for i in range(3)]
            held = e.fetch_all(ts[:2], "host")
            started = threading.Event()

            def waiter(i):
                started.set()
                return e.fetch(ts[2], "host", wait=True)

            res = []
            th = threading.Thread(target=lambda: res.extend(self.threads(1, waiter)))
            th.start()
            started.wait()
            import time
            time.sleep(0.2)
            e.close()
            th.join(60)
            self.assertFalse(th.is_alive())
            self.assertIsInstance(res[0], ValueError)
            self.assertIn("closed", str(res[0]))
            for p in held:
                p.release()

    def test_bad_wait(self):
        with self.engine() as e:
            t = e.register("t", 4096)
            with self.assertRaises(ValueError):
                e.fetch(t, "host", wait=-1)
            with self.assertRaises(ValueError):
                e.fetch(t, "host", wait=float("nan"))
            with self.assertRaises(TypeError):
                e.fetch(t, "host", wait="1s")
            with self.assertRaises(TypeError):
                e.fetch_all([t], "host", wait=[1])
            for w in (None, False, True, 0, 0.5):
                e.fetch(t, "host", wait=w).release()


class TestDaemon(Base):
    def test_through_zinf_serve(self):
        sock = os.path.join(self.dir, "zinf.sock")
        # Nothing listens yet.
        with self.assertRaises(zinf.Error) as cm:
            zinf.connect(sock, "job1")
        self.assertIn(cm.exception.errno, (errno.ENOENT, errno.ECONNREFUSED))
        with daemon.serve(self, self.dir, self.swap) as sock:
            e = daemon.connect(sock, "job1")
            with self.assertRaises(zinf.Error) as cm:
                zinf.connect(sock, "bad/name")
            self.assertEqual(cm.exception.errno, errno.EINVAL)
            with e:
                t = e.register("t", ((256,), "uint8"))
                self.assertErrno(errno.EEXIST, e.register, "t", 10)
                e.write(t, bytes(range(256)))
                with e.fetch(t, "host", dirty=True) as p:
                    self.assertEqual(ctypes.string_at(p.ptr, 256), bytes(range(256)))
                    if numpy is not None:
                        a = numpy.from_dlpack(p)
                        self.assertEqual(a.__array_interface__["data"][0], p.ptr)
                        self.assertEqual(int(a[200]), 200)
                        del a
                    ctypes.memset(p.ptr, 0x61, 16)
                self.assertEqual(e.read(t, 0, 17), b"a" * 16 + b"\x10")
                self.assertEqual(e.stats()["tensors"], 1)
            # The job was flushed at close: a new session sees it.
            with zinf.connect(sock, "job1") as e:
                self.assertEqual(e.read(e.lookup("t"), 0, 2), b"aa")


class TestReferences(Base):
    def assertNoGrowth(self, run, warm, cycles, watched):
        """run(warm) to warm caches and free lists, then run(cycles): the references of the
        watched objects, the Python heap (tracemalloc) and, unsanitized, the RSS must not
        grow."""
        run(warm)
        gc.collect()
        refs = [sys.getrefcount(o) for o in watched]
        rss0 = rss_bytes()
        tracemalloc.start()
        base, _ = tracemalloc.get_traced_memory()
        run(cycles)
        gc.collect()
        now, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        self.assertEqual([sys.getrefcount(o) for o in watched], refs)
        self.assertLess(now - base, 64 * 1024, "Python memory grew by %d bytes" % (now - base))
        grew = rss_bytes() - rss0
        if not SANITIZED:
            self.assertLess(grew, 8 * MIB, "RSS grew by %d bytes" % grew)

    def test_fetch_release_cycles_do_not_leak(self):
        cycles = 100000
        with self.engine() as e:
            t = e.register("t", ((64,), "float32"))

            def run(n):
                for _ in range(n):
                    with e.fetch(t, "host") as p:
                        p.ptr

            self.assertNoGrowth(run, 1000, cycles, (t, e))
            st = e.stats()["tier"][zinf.HOST]
            self.assertEqual(st["pinned_bytes"], 0)
            self.assertGreaterEqual(st["fetches"], cycles)

    def test_dlpack_cycles_do_not_leak(self):
        cycles = 20000
        with self.engine() as e:
            t = e.register("t", ((64,), "float32"))

            def run(n):
                for i in range(n):
                    with e.fetch(t, "device") as p:
                        v = View(p.__dlpack__(max_version=(1, 0)) if i % 2 else p.__dlpack__(),
                                 bool(i % 2))
                        v.delete()
                        p.__dlpack__()  # never consumed

            self.assertNoGrowth(run, 500, cycles, (t,))
            self.assertEqual(e.stats()["tier"][zinf.DEVICE]["pinned_bytes"], 0)


if __name__ == "__main__":
    unittest.main()
