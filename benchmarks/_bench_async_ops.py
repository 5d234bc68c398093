"""Worker side of ``bench_async.py``: the training loop, the save methods, the physical limits, verification.

Every function called by the driver runs in a fresh process (``_common.run_solo``), so each method starts with
no buffer pool, stager or checkpoint daemon left over from another.

The loop: each step is ``k`` matmuls of two fixed ``m × m`` fp32 tensors (``k`` calibrated to ``--step-ms`` at
one thread), then the "update": +1 on the int32 bit pattern of the first ``UPDATE_ELEMS`` elements of every
tensor of the state (cheap, and it makes the snapshot checkable: a checkpoint must hold exactly the updates
made before the save started, so a snapshot that races the update is caught). A save starts at the start of
step ``save_at``; overlapped modes wait for their snapshot right before that step's update; the loop runs at
least ``steps`` steps and goes on until the save is durable.
"""

from __future__ import annotations

import gc
import math
import mmap
import os
import shutil
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import _bench_ranks as W
import torch
import torch.distributed as dist
from _common import PeakRss, cpu_now, drop_cache, med_range, small_pages

UPDATE_ELEMS = 256
TAIL_STEPS = 10     # steps the loop runs on after the save is durable: with the steps before it, the slowdown's base
LIFERAFT = ["liferaft-blocking", "liferaft-overlapped", "liferaft-sync", "liferaft-blocking-zstd"]
DCP = ["dcp-sync", "dcp-thread", "dcp-thread-async-staging", "dcp-process-shm"]
METHODS = LIFERAFT + DCP


class Workload:
    """The fixed CPU work of one step: ``k`` matmuls of ``m × m`` fp32, ``k`` calibrated at one thread."""

    def __init__(self, m: int, step_ms: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.a, self.b = torch.randn(m, m, generator=g), torch.randn(m, m, generator=g)
        self.out = torch.empty(m, m)
        torch.set_num_threads(1)
        self.k = 1
        self.step()
        t0 = time.perf_counter()
        for _ in range(3):
            self.step()
        self.k = max(1, round(step_ms / 1e3 / ((time.perf_counter() - t0) / 3)))

    def step(self) -> None:
        for _ in range(self.k):
            torch.mm(self.a, self.b, out=self.out)


class Updates:
    """The "optimizer update": +1 on the int32 view of the first UPDATE_ELEMS elements of every tensor."""

    def __init__(self, state: dict[str, Any], cfg: W.Config) -> None:
        self.views = [_head(t) for _, _, t in W.leaves_of(state, cfg)]
        self.count = 0

    def apply(self) -> None:
        for v in self.views:
            v.add_(1)
        self.count += 1


def _head(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32).view(-1)[:UPDATE_ELEMS]


@dataclass
class Running:
    """A save in flight: ``staged()`` waits for its snapshot, ``finish()`` for its commit (returns details)."""

    staged: Callable[[], Any]
    finish: Callable[[], Any]
    t_start: float = 0.0
    t_return: float = 0.0
    t_durable: float = 0.0
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def watch(self) -> None:
        """Wait for the commit in a thread that records the time it became durable."""
        def run() -> None:
            try:
                self.result = self.finish()
            except BaseException as e:  # noqa: BLE001 - re-raised by the loop
                self.error = e
            self.t_durable = time.perf_counter()
            self.done.set()

        threading.Thread(target=run, name="bench-durable-watch", daemon=True).start()


def _timings(res: Any) -> dict[str, Any]:
    return {**res.timings, "staging_bytes": res.staging_bytes}


def _wait(fut: Any) -> None:
    fut.result()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Saver:
    """One save method, with what it keeps per process (DCP stagers, the 1-rank gloo group for PROCESS)."""

    def __init__(self, method: str) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.method = method
        self.stager: Any = None
        if method == "dcp-thread-async-staging":
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                       use_async_staging=True, use_non_blocking_copy=False))
        elif method == "dcp-process-shm":   # the PROCESS executor needs a process group and MASTER_ADDR/PORT
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(_free_port())
            dist.init_process_group("gloo", rank=0, world_size=1)
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                       use_async_staging=False, use_non_blocking_copy=False))

    def start(self, path: str, state: dict[str, Any], timeout: float) -> Running:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        import liferaft

        def none() -> None:
            return None

        m, t0 = self.method, time.perf_counter()
        if m in ("liferaft-blocking", "liferaft-overlapped", "liferaft-blocking-zstd"):
            h = liferaft.async_save(path, state, options=liferaft.SaveOptions(
                staging=m.split("-")[1], compression="on" if m.endswith("zstd") else "off"))
            assert h is not None
            run = Running(lambda: h.wait_staged(timeout), lambda: _timings(h.wait()))
        elif m == "liferaft-sync":
            res = liferaft.save(path, state)
            run = Running(none, lambda: _timings(res))
        elif m == "dcp-sync":
            dcp.save(state, checkpoint_id=path, no_dist=True)
            run = Running(none, none)
        elif m == "dcp-thread":
            fut = dcp.async_save(state, checkpoint_id=path, no_dist=True)
            run = Running(none, lambda: _wait(fut))
        elif m == "dcp-thread-async-staging":
            resp = dcp.async_save(state, checkpoint_id=path, async_stager=self.stager, no_dist=True)
            run = Running(lambda: resp.staging_completion.result(timeout), lambda: _wait(resp.upload_completion))
        elif m == "dcp-process-shm":
            fut = dcp.async_save(state, checkpoint_id=path, async_stager=self.stager,
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            run = Running(none, lambda: _wait(fut))
        else:
            raise ValueError(m)
        run.t_start, run.t_return = t0, time.perf_counter()
        run.watch()
        return run

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        if self.method == "dcp-process-shm":
            import torch.distributed.checkpoint._async_process_executor as ape

            if ape._CHECKPOINT_PROCESS is not None:   # stop the checkpoint daemon now, not at interpreter exit
                ape._CHECKPOINT_PROCESS.__del__()
                ape._CHECKPOINT_PROCESS = None
            dist.destroy_process_group()


def train_loop(work: Workload, upd: Updates, steps: int, state: dict[str, Any], saver: Saver | None = None,
               path: str = "", save_at: int = 3, timeout: float = 600.0) -> dict[str, Any]:
    """Run the loop; with ``saver``, start a save at step ``save_at`` and go on until it is durable."""
    spans: list[tuple[float, float]] = []
    run: Running | None = None
    rss: PeakRss | None = None
    snap, wait_staged, fg_cpu = -1, 0.0, 0.0
    daemon = saver is not None and saver.method == "dcp-process-shm"
    gc.collect()        # (as timeit and pyperf do: a full cyclic-GC pass owed to the objects this fresh process
    #                     made before, ~0.15 s, would otherwise land in whichever timed window first allocates)
    c_loop = cpu_now(children=daemon)
    t_loop = time.perf_counter()
    i, after = 0, 0
    while i < steps or (run is not None and (not run.done.is_set() or after < TAIL_STEPS)):
        if time.perf_counter() - t_loop > timeout:
            raise TimeoutError(f"{saver and saver.method}: save to {path} not durable after {timeout:.0f} s")
        t0 = time.perf_counter()
        if saver is not None and i == save_at:
            rss = PeakRss(children=daemon).start()   # (a scan of /proc costs ~1 ms)
            snap = upd.count
            c = time.thread_time()
            run = saver.start(path, state, timeout)
            fg_cpu += time.thread_time() - c
        work.step()
        if run is not None and i == save_at:
            t, c = time.perf_counter(), time.thread_time()
            run.staged()
            wait_staged = time.perf_counter() - t
            fg_cpu += time.thread_time() - c
        upd.apply()
        spans.append((t0, time.perf_counter()))
        i += 1
        if run is not None and run.done.is_set() and t0 >= run.t_durable:
            after += 1
    loop_s = time.perf_counter() - t_loop
    out: dict[str, Any] = {"loop_s": loop_s, "steps": i, "step_s": [b - a for a, b in spans]}
    if run is None or rss is None:
        out["cpu_s"] = cpu_now() - c_loop
        return out
    run.done.wait()
    extra = rss.stop()
    out["cpu_s"] = cpu_now(children=daemon) - c_loop - rss.cpu     # (less the RSS sampler's own CPU)
    out["fg_cpu_s"] = fg_cpu
    if run.error is not None:
        raise run.error
    inflight = [b - a for k, (a, b) in enumerate(spans) if k > save_at and a < run.t_durable]
    around = [b - a for k, (a, b) in enumerate(spans) if k < save_at or a >= run.t_durable]
    out.update(around_step_s=around, snap_updates=snap, call_return_s=run.t_return - run.t_start, wait_staged_s=wait_staged,
               durable_s=run.t_durable - run.t_start, inflight_step_s=inflight, rss_peak=rss.peak,
               extra_rss_call=extra, children_rss_peak=rss.child_peak, detail=run.result or {})
    return out


def verify_checkpoint(method: str, path: str, cfg: W.Config, updates: int) -> None:
    """Read the checkpoint (liferaft.read / DCP load into empty tensors), undo the ``updates`` made before the
    snapshot, and compare bit-exact with the reference; raise AssertionError on any difference."""
    if method.startswith("liferaft"):
        import liferaft

        tree = liferaft.read(path)
    else:
        import torch.distributed.checkpoint as dcp

        tree = W.build_state(cfg, "full", filled=False)
        dcp.load(tree, checkpoint_id=path, no_dist=True)
    for _, _, t in W.leaves_of(tree, cfg):
        _head(t).sub_(updates)
    W.verify(tree, cfg, f"{method} checkpoint {path} (snapshot after {updates} updates)")


def _summarize(run: dict[str, Any], base: dict[str, Any], rss0: int, threads: int) -> dict[str, Any]:
    """One timed save's figures against the loop without a save (``base``). CPU: ``save_cpu_s`` is the process's
    CPU over the loop with the save (every thread; a PROCESS checkpoint daemon included) less the same number
    of steps at the base loop's CPU per step; ``fg_cpu_s`` is the part the training thread spent inside the save
    call and the wait for its snapshot; ``bg_cpu_s`` the rest (threads or daemon working in the background)."""
    base_step = base["loop_s"] / base["steps"]
    inflight = run.pop("inflight_step_s")
    around = run.pop("around_step_s")
    run.pop("step_s")
    save_cpu = run["cpu_s"] - run["steps"] * base["cpu_s"] / base["steps"]
    return {**run, "threads": threads, "base_step_s": base_step, "stall_s": run["loop_s"] - run["steps"] * base_step,
            "save_cpu_s": save_cpu, "bg_cpu_s": save_cpu - run["fg_cpu_s"],
            "inflight_steps": len(inflight),
            "slowdown_pct": 100 * (statistics.mean(inflight) / statistics.mean(around) - 1) if inflight else None,
            "slowdown_vs_base_pct": 100 * (statistics.mean(inflight) / base_step - 1) if inflight else None,
            "extra_rss": run["rss_peak"] - rss0}


def method_op(method: str, tmp: str, cfg: W.Config, steps: int, step_ms: float, m: int, save_at: int,
              idle: float, timeout: float) -> dict[str, Any]:
    """One method in this (fresh) process: a first (cold) save in a 1-thread loop, then the timed saves in a
    1-thread and a 2-thread loop, each against a loop without a save just before. The checkpoints are left in
    ``tmp`` for ``verify_op`` (run in another process, so that its reads do not inflate this one's RSS)."""
    try:
        state = W.build_state(cfg, "full", filled=True)
        work, upd = Workload(m, step_ms), Updates(state, cfg)
        saver = Saver(method)
        rss0 = PeakRss().proc.memory_info().rss
        out: dict[str, Any] = {"method": method, "matmuls_per_step": work.k, "rss_before_first_save": rss0,
                               "checkpoints": []}
        for label, threads in (("cold", 1), ("warm1", 1), ("warm2", 2)):
            torch.set_num_threads(threads)
            for _ in range(2):
                work.step()
            base = train_loop(work, upd, steps, state)
            time.sleep(idle)
            path = os.path.join(tmp, f"{method}-{label}")
            run = train_loop(work, upd, steps, state, saver, path, save_at, timeout)
            out["checkpoints"].append((path, run["snap_updates"]))
            out[label] = _summarize(run, base, rss0, threads)
        saver.close()
        return out
    except Exception as e:
        if method in LIFERAFT:
            raise
        return {"method": method, "error": f"{type(e).__name__}: {e}"}


def verify_op(method: str, checkpoints: list[tuple[str, int]], cfg: W.Config) -> None:
    """Verify (``verify_checkpoint``) and delete each checkpoint; raise AssertionError on wrong data."""
    for path, updates in checkpoints:
        verify_checkpoint(method, path, cfg, updates)
        shutil.rmtree(path, ignore_errors=True)


LIMITS = [("memcpy_1t_s", "memcpy into prefaulted tensors, 1 thread"),
          ("memcpy_2t_s", "memcpy into prefaulted tensors, 2 threads"),
          ("write_fsync_s", "Python write + fsync, one file"),
          ("direct_write_s", "O_DIRECT write + fsync from an aligned 64 MiB buffer"), ("read_s", "read of that file")]
INFLIGHT = (1, 4)                # requests in flight of the path grid (threads, 8 MiB requests)
#: the grid's paths: O_DIRECT from buffers of 4 KiB pages, O_DIRECT from 2 MiB (transparent huge) pages, which
#: reach the device in larger pieces (``liferaft.storage.iobuf``), and the page cache
MODES = {"direct": "O_DIRECT", "hugedirect": "O_DIRECT from 2 MiB pages", "buffered": "buffered"}
GRID = [(f"{io}_{mode}_{k}_s", f"{io} {MODES[mode]}, {k} in flight, 8 MiB "
         f"requests{' + fsync' if io == 'write' else ' (cold)'}")
        for io in ("write", "read") for mode in MODES for k in INFLIGHT]
LIMITS += GRID


def best_write_s(r: dict[str, Any]) -> float:
    """Seconds of the fastest durable write path measured in one limits run (NaN paths left out)."""
    return min(v for k, v in r.items() if (k.startswith("write_") or k == "direct_write_s") and not math.isnan(v))


def best_read_s(r: dict[str, Any]) -> float:
    """Seconds of the fastest cold read path measured in one limits run."""
    return min(v for k, v in r.items() if k.startswith("read_") and k.endswith("_s") and not math.isnan(v))


def limits_table(limits: list[dict[str, Any]], nbytes: int) -> str:
    """Markdown table of the limits measured per rep (median [min–max] seconds, GB/s at the median)."""
    lines = [f"Physical limits on the same {nbytes / 1e9:.2f} GB (seconds, GB/s at the median):", "",
             "| limit | seconds | GB/s |", "|---|---|---|"]
    for key, label in LIMITS:
        v = [r[key] for r in limits]
        if key == "read_s":
            label = f"{limits[0]['read_mode']} {label}"
        lines.append(f"| {label} | {med_range(v, '.3f')} | {nbytes / statistics.median(v) / 1e9:.2f} |")
    return "\n".join(lines)


def limits_op(tmp: str, cfg: W.Config, idle: float) -> dict[str, Any]:
    """The physical limits on the same bytes: memcpy into prefaulted tensors (torch copy_, 1 and 2 threads),
    Python write + fsync of every tensor's bytes to one file, O_DIRECT write of as many bytes from an aligned
    buffer, O_DIRECT read of the file (buffered if refused)."""
    state = W.build_state(cfg, "full", filled=True)
    src = [t for _, _, t in W.leaves_of(state, cfg)]
    dst = [torch.empty_like(t) for t in src]
    out: dict[str, Any] = {"bytes": sum(t.numel() * 4 for t in src)}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for d, s in zip(dst, src):          # first pass faults the destination pages
            d.copy_(s)
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s)
        out[f"memcpy_{threads}t_s"] = time.perf_counter() - t0
    del dst
    os.makedirs(tmp, exist_ok=True)
    file = os.path.join(tmp, "limits.bin")
    time.sleep(idle)
    t0 = time.perf_counter()
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in src:
            mv = memoryview(t.numpy()).cast("B")
            while mv:
                mv = mv[os.write(fd, mv):]
        os.fsync(fd)
    finally:
        os.close(fd)
    out["write_fsync_s"] = time.perf_counter() - t0
    drop_cache(file)
    buf = small_pages(64 << 20)
    buf.write(b"\0" * len(buf))              # prefault the (page-aligned) buffer
    out["direct_write_s"] = _direct_write(os.path.join(tmp, "limits-direct.bin"), buf, out["bytes"])
    time.sleep(idle)
    out["read_mode"] = "O_DIRECT"
    try:
        out["read_s"] = _read_file(file, buf, os.O_DIRECT)
    except OSError as e:
        out["read_mode"] = f"buffered after fadvise(DONTNEED) (O_DIRECT refused: {e.strerror})"
        drop_cache(file)
        out["read_s"] = _read_file(file, buf, 0)
    from liferaft.storage.iobuf import huge_buffer

    huge = huge_buffer(len(buf))
    huge[:] = b"\0" * len(huge)             # (prefaulted, as ``buf``)
    for mode in MODES:
        flag = os.O_DIRECT if mode != "buffered" else 0
        for k in INFLIGHT:
            time.sleep(idle / 4)
            out[f"write_{mode}_{k}_s"] = _grid_write(file, huge if mode == "hugedirect" else buf, out["bytes"], flag, k)
            if os.path.exists(file):
                drop_cache(file)
            out[f"read_{mode}_{k}_s"] = _grid_read(file, buf, out["bytes"], flag, k, mode == "hugedirect")
    os.unlink(file)
    return out


def _grid_write(file: str, buf: mmap.mmap | memoryview, nbytes: int, flag: int, inflight: int) -> float:
    """Seconds to write ``nbytes`` in 8 MiB requests from ``buf`` with ``inflight`` threads, plus fsync; NaN
    where the file system refuses ``flag``."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError:
        return float("nan")
    req = 8 << 20
    view = memoryview(buf)

    def one(at: int) -> None:
        n = min(req, nbytes - at)
        os.pwrite(fd, view[(at % len(buf)):(at % len(buf)) + n], at)

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(inflight) as ex:
            list(ex.map(one, range(0, nbytes // req * req, req)))
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _grid_read(file: str, buf: mmap.mmap, nbytes: int, flag: int, inflight: int, huge: bool = False) -> float:
    """Seconds to read the file cold in 8 MiB requests with ``inflight`` threads, into a buffer per thread (of
    2 MiB pages where ``huge``); NaN where ``flag`` is refused."""
    from concurrent.futures import ThreadPoolExecutor

    from liferaft.storage.iobuf import huge_buffer

    try:
        fd = os.open(file, os.O_RDONLY | flag)
    except OSError:
        return float("nan")
    req, size = 8 << 20, os.fstat(fd).st_size
    bufs: list[Any] = [huge_buffer(req) if huge else small_pages(req) for _ in range(inflight)]
    local = threading.local()

    def one(at: int) -> None:
        if not hasattr(local, "buf"):
            local.buf = bufs.pop()
        os.preadv(fd, [local.buf], at)

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(inflight) as ex:
            list(ex.map(one, range(0, size // req * req, req)))
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _direct_write(file: str, buf: mmap.mmap, nbytes: int) -> float:
    """Seconds to write ``nbytes`` (whole buffers) from a prefaulted aligned buffer with O_DIRECT, plus fsync;
    NaN where the file system refuses O_DIRECT."""
    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:
        return float("nan")
    t0 = time.perf_counter()
    try:
        done = 0
        while done < nbytes:
            done += os.pwrite(fd, buf, done)
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(file)
    return time.perf_counter() - t0


def _read_file(file: str, buf: mmap.mmap, flags: int) -> float:
    t0 = time.perf_counter()
    fd = os.open(file, os.O_RDONLY | flags)
    try:
        while os.readv(fd, [buf]) > 0:
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - t0
