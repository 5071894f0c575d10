"""daemon.py - a `zinf serve` daemon for the Python tests: started in a scratch folder with
an emulated device, answered once it listens, stopped (and checked to exit 0) at the end."""

import contextlib
import errno
import os
import subprocess
import time

import zinf


@contextlib.contextmanager
def serve(testcase, folder, swap, device_bytes="4M", host_bytes="4M"):
    """Yields the socket's path; skips the test where ZINF_BIN (set by meson) is not."""
    zbin = os.environ.get("ZINF_BIN")
    if not zbin:
        testcase.skipTest("ZINF_BIN is not set (meson test sets it)")
    cfg = os.path.join(folder, "serve.json")
    sock = os.path.join(folder, "zinf.sock")
    with open(cfg, "w") as f:
        f.write('{"zero_optimization": {"offload_param": {"device": "nvme", '
                '"nvme_path": "%s"}}, "aio": {"block_size": 65536}, '
                '"zinf": {"device": "emulated", "device_bytes": "%s", '
                '"host_bytes": "%s"}}' % (swap, device_bytes, host_bytes))
    with open(os.path.join(folder, "serve.out"), "w") as log:
        daemon = subprocess.Popen([zbin, "serve", "--socket", sock, "--config", cfg,
                                   "--foreground"], stdout=log, stderr=subprocess.STDOUT)
        try:
            yield sock
        finally:
            daemon.terminate()
            daemon.wait(timeout=60)
    testcase.assertEqual(daemon.returncode, 0)


def connect(sock, job, tries=1000):
    """zinf.connect once the daemon listens."""
    for _ in range(tries):
        try:
            return zinf.connect(sock, job)
        except zinf.Error as ex:
            if ex.errno not in (errno.ENOENT, errno.ECONNREFUSED):
                raise
            time.sleep(0.01)
    raise AssertionError("the daemon did not answer at " + sock)
