"""The proxy keeps its C heap small: its threads share the arenas it allows, and glibc's malloc_trim runs at most
once a period."""

import os
import platform
import subprocess
import sys

from kvtrace.proxy import heap

# A fresh process fills its C heap with 1 KiB blocks, frees all but every hundredth (the holes cannot
# be returned from the heap's top), and prints its RSS before and after release_free_memory().
_FRAGMENTED_HEAP = """
import ctypes
from kvtrace.proxy import heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss_kib():
    return int(open("/proc/self/statm").read().split()[1]) * 4
blocks = [libc.malloc(1024) for _ in range(200_000)]
for index, block in enumerate(blocks):
    ctypes.memset(block, 1, 1024)
for index, block in enumerate(blocks):
    if index % 100:
        libc.free(block)
before = rss_kib()
released = heap.release_free_memory()
print(before, rss_kib(), released)
"""


def test_freed_pages_go_back_to_the_system_on_glibc():
    out = subprocess.run([sys.executable, "-c", _FRAGMENTED_HEAP], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, released = out.stdout.split()
    if platform.libc_ver()[0] != "glibc":
        assert released == "False"  # nothing to call: the proxy runs as it did
        return
    assert released == "True"
    # About 195 MiB of the 200 MiB written were freed; most of it must leave the process.
    assert int(before) - int(after) > 100 * 1024, (before, after)


def test_the_trim_runs_at_most_once_a_period(monkeypatch):
    now, calls = [0.0], []
    monkeypatch.setattr(heap, "release_free_memory", lambda: calls.append(now[0]) or True)
    trim = heap.PeriodicTrim(every_s=60, clock=lambda: now[0])
    for second in range(0, 181):
        now[0] = float(second)
        trim.tick()
    assert calls == [60.0, 120.0, 180.0]


# A fresh process (arenas limited or not) lets 8 threads allocate, then counts the heaps glibc's malloc_info lists.
_ARENAS_USED = """
import ctypes, sys, threading
from kvtrace.proxy import heap
limited = heap.limit_arenas(1) if sys.argv[1] == "limit" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.open_memstream.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
ready, release = threading.Barrier(9), threading.Event()
def allocate():
    libc.malloc(64)
    ready.wait()
    release.wait()
threads = [threading.Thread(target=allocate) for _ in range(8)]
for thread in threads:
    thread.start()
ready.wait()
buffer, size = ctypes.c_char_p(), ctypes.c_size_t()
stream = libc.open_memstream(ctypes.byref(buffer), ctypes.byref(size))
libc.malloc_info(0, stream)
libc.fclose(stream)
release.set()
print(limited, buffer.value.decode().count("<heap nr="))
"""


def test_threads_share_the_arenas_the_limit_allows():
    if platform.libc_ver()[0] != "glibc":
        assert heap.limit_arenas() is False
        return
    heaps, env = {}, {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's defaults
    for mode in ("limit", "default"):
        out = subprocess.run([sys.executable, "-c", _ARENAS_USED, mode], capture_output=True, text=True, timeout=120,
                             env=env)
        assert out.returncode == 0, out.stderr
        heaps[mode] = out.stdout.split()
    assert heaps["limit"] == ["True", "1"]
    assert int(heaps["default"][1]) > 1  # without the limit glibc gives the threads arenas of their own


# A fresh process: the young generation's threshold, and whether start-up's objects left the collections.
_COLLECT_LESS_OFTEN = """
import gc
from kvtrace.proxy import heap
heap.collect_less_often()
print(gc.get_threshold()[0], gc.get_freeze_count() > 0)
"""


def test_the_proxy_collects_young_objects_on_its_own_scale_with_start_up_frozen():
    out = subprocess.run([sys.executable, "-c", _COLLECT_LESS_OFTEN], capture_output=True, text=True, timeout=60,
                         check=True).stdout.split()
    assert out == [str(heap.YOUNG_COLLECTION_EVERY), "True"]
