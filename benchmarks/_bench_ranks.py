"""Worker side of ``bench_sync.py``: the benchmark state, the timed operations and their verification.

Every function here runs in a fresh process (a 1-process op through a one-worker process pool, a 2-rank op
through ``liferaft.testing.run_ranks``), so that each save and load starts with an empty page cache for the
checkpoint and no memory left over from another method.

Tensor values are a pure function of (key, global element index): the int32 bit pattern of element ``i`` of
tensor ``k`` is ``i XOR salt(k)``, viewed as float32. Any box of any tensor (a Shard(0) or Shard(1) shard, a
full tensor) can thus be generated and checked on its own, unique per element inside a tensor and different
between tensors. Checks compare the int32 views (bit-exact, NaN patterns included).
"""

from __future__ import annotations

import gc
import os
import shutil
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from _common import PeakRss, cpu_seconds, fsync_path

# DCP warns on every no_dist call that it assumes a single process; that is what we ask for.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

VOCAB, CONTEXT = 32000, 1024
# peer libraries (benchmarks/_peers.py) and whether their "fast" mode is used: ByteCheckpoint's fast_saving /
# fast_loading (its recommended pipelined path; the save still waits until the files are durable)
PEER_FAST = {"bytecheckpoint": True, "torchsnapshot": False}


@dataclass(frozen=True)
class Config:
    """A GPT-like model: ``layers`` blocks of width ``d``; the state is params + Adam exp_avg/exp_avg_sq/step."""

    d: int
    layers: int

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        d = self.d
        out: list[tuple[str, tuple[int, ...]]] = [("tok_emb.weight", (VOCAB, d)), ("pos_emb.weight", (CONTEXT, d))]
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [(p + "ln1.weight", (d,)), (p + "ln1.bias", (d,))]
            for n in ("q", "k", "v", "o"):
                out += [(p + f"attn.{n}.weight", (d, d)), (p + f"attn.{n}.bias", (d,))]
            out += [(p + "ln2.weight", (d,)), (p + "ln2.bias", (d,)),
                    (p + "mlp.fc.weight", (4 * d, d)), (p + "mlp.fc.bias", (4 * d,)),
                    (p + "mlp.proj.weight", (d, 4 * d)), (p + "mlp.proj.bias", (d,))]
        return out + [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]

    def leaves(self) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
        """(path, shape) of every tensor of the state, in a fixed order."""
        out: list[tuple[tuple[str, ...], tuple[int, ...]]] = []
        for name, shape in self.param_shapes():
            out.append((("model", name), shape))
        for name, shape in self.param_shapes():
            out += [(("optim", name, "exp_avg"), shape), (("optim", name, "exp_avg_sq"), shape),
                    (("optim", name, "step"), ())]
        return out

    def nbytes(self) -> int:
        return sum(4 * _numel(s) for _, s in self.leaves())


def pick_config(size_gib: float, layers: int = 9) -> Config:
    """The width (a multiple of 64) with ``layers`` blocks whose state is closest to ``size_gib`` GiB."""
    target = size_gib * 2**30
    return min((Config(d, layers) for d in range(64, 16384 + 1, 64)), key=lambda c: abs(c.nbytes() - target))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def salt(path: tuple[str, ...]) -> int:
    s = zlib.crc32("/".join(path).encode())
    return s - 2**32 if s >= 2**31 else s


def fill_box(path: tuple[str, ...], shape: tuple[int, ...], offsets: tuple[int, ...],
             sizes: tuple[int, ...]) -> torch.Tensor:
    """The values of box (offsets, sizes) of tensor ``path`` (global ``shape``), as a new float32 tensor."""
    if _numel(shape) >= 2**31:
        raise ValueError(f"{path}: too large for the int32 value pattern")
    idx = torch.zeros(sizes, dtype=torch.int32)
    stride = 1
    for dim in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[dim] = sizes[dim]
        idx += (torch.arange(offsets[dim], offsets[dim] + sizes[dim], dtype=torch.int32) * stride).view(view)
        stride *= shape[dim]
    return idx.bitwise_xor_(salt(path)).view(torch.float32)


# ---------------------------------------------------------------- building and checking states

def _placements(layout: str, ndim: int) -> list[Any] | None:
    """DTensor placements for a tensor of ``ndim`` dims in ``layout`` (None: a plain tensor)."""
    from torch.distributed.tensor import Replicate, Shard

    if layout == "full" or ndim == 0:
        return None
    if layout == "shard0":
        return [Shard(0)]
    if layout == "shard1":
        return [Shard(1)] if ndim >= 2 else [Replicate()]
    raise ValueError(layout)


def _box(t: Any, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """(offsets, sizes, local tensor) of what this process holds of a tensor or DTensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(t, DTensor):
        sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return tuple(offsets), tuple(sizes), t.to_local()
    return tuple(0 for _ in shape), shape, t


def build_state(cfg: Config, layout: str, filled: bool, mesh: Any = None) -> dict[str, Any]:
    """The state in ``layout`` ("full", "shard0", "shard1"): reference values, or zeros (load targets)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    state: dict[str, Any] = {}
    for path, shape in cfg.leaves():
        placements = _placements(layout, len(shape))
        if placements is None:
            offsets, sizes = tuple(0 for _ in shape), shape
        else:
            sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
        local = fill_box(path, shape, tuple(offsets), tuple(sizes)) if filled else torch.zeros(sizes)
        value: Any = local
        if placements is not None:
            stride = torch.empty(shape, device="meta").stride()
            value = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                       stride=stride)
        node = state
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return state


def leaves_of(state: dict[str, Any], cfg: Config) -> Iterator[tuple[tuple[str, ...], tuple[int, ...], Any]]:
    for path, shape in cfg.leaves():
        node: Any = state
        for part in path:
            node = node[part]
        yield path, shape, node


def verify(state: dict[str, Any], cfg: Config, what: str) -> None:
    """Raise AssertionError unless every tensor (or this rank's part of it) holds exactly the reference bits."""
    bad: list[str] = []
    for path, shape, t in leaves_of(state, cfg):
        offsets, sizes, local = _box(t, shape)
        if tuple(local.shape) != tuple(sizes) or local.dtype != torch.float32:
            bad.append(f"{'/'.join(path)}: got {local.dtype} {list(local.shape)}, want float32 {list(sizes)}")
            continue
        want = fill_box(path, shape, offsets, sizes)
        if not torch.equal(local.contiguous().view(torch.int32), want.view(torch.int32)):
            bad.append(f"{'/'.join(path)}: values differ from the reference")
    if bad:
        raise AssertionError(f"{what}: loaded data is WRONG in {len(bad)} tensor(s): " + "; ".join(bad[:5]))


def flat_names(state: dict[str, Any], cfg: Config) -> dict[str, torch.Tensor]:
    return {"/".join(p): t for p, _, t in leaves_of(state, cfg)}


# ---------------------------------------------------------------- the operations

def do_save(method: str, path: str, state: dict[str, Any], cfg: Config | None, solo: bool) -> dict[str, Any]:
    """Save ``state`` to directory ``path`` with ``method``, durably (fsync); return liferaft's phase timings."""
    if method == "liferaft":
        import liferaft

        return dict(liferaft.save(path, state).timings)
    if method == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=path, no_dist=solo)   # FileSystemWriter fsyncs by default (sync_files)
        return {}
    if method in PEER_FAST:
        import _peers

        _peers.peer_save(method, path, state, solo, fast=PEER_FAST[method])   # durable on return
        return {}
    os.makedirs(path, exist_ok=True)
    if method == "torch":
        file = os.path.join(path, "state.pt")
        with open(file, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    elif method == "safetensors":
        from safetensors.torch import save_file

        file = os.path.join(path, "state.safetensors")
        save_file(flat_names(state, cfg) if cfg else state, file)
        fsync_path(file)
    else:
        raise ValueError(method)
    fsync_path(path)
    return {}


def do_load(method: str, path: str, targets: dict[str, Any], cfg: Config | None, solo: bool,
            share_reads: bool | None = None) -> Any:
    """Load directory ``path`` with ``method``: in place into ``targets`` (liferaft, DCP, safetensors + copy_),
    or as a new state (torch.load). Returns the loaded state (liferaft: also its phase timings).
    ``share_reads``: liferaft's ``LoadOptions.share_reads`` (None: its default)."""
    if method == "liferaft":
        import liferaft

        opts = liferaft.LoadOptions() if share_reads is None else liferaft.LoadOptions(share_reads=share_reads)
        res = liferaft.load(path, targets, options=opts)
        return targets, dict(res.timings)
    if method == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.load(targets, checkpoint_id=path, no_dist=solo)
        return targets
    if method in PEER_FAST:
        import _peers

        _peers.peer_load(method, path, targets, solo, fast=PEER_FAST[method])
        return targets
    if method == "torch":
        return torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=True)
    if method == "safetensors":
        from safetensors.torch import load_file

        loaded = load_file(os.path.join(path, "state.safetensors"))
        dest = flat_names(targets, cfg) if cfg else targets
        with torch.no_grad():
            for k, t in dest.items():
                t.copy_(loaded[k])
        return targets
    raise ValueError(method)


def _warm_up(method: str, path: str, solo: bool, mesh: Any = None) -> None:
    """A tiny save and load with ``method``, so lazy imports and first-call set-up (liferaft: the probe of the
    device's I/O path, reported as ``io``) are not timed."""
    small: dict[str, Any] = {"w": torch.arange(64, dtype=torch.float32)}
    if mesh is not None:
        from torch.distributed.tensor import DTensor, Shard

        small["s"] = DTensor.from_local(torch.ones(8), mesh, [Shard(0)], run_check=False)
    do_save(method, path, small, None, solo)
    do_load(method, path, small, None, solo)
    if method == "liferaft" and os.path.isdir(path):   # the device's I/O path, probed once per process
        try:
            from liferaft.storage import iopath
        except ImportError:                            # (a liferaft from before the run-time choice)
            pass
        else:
            iopath.choice_for(path)
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


CPU: dict[str, float] = {}     # CPU seconds of the last ``_measure`` in this process (``cpu_s`` of the result)


def _measure(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """(seconds, peak RSS above the RSS before the call in bytes, fn's return value); RSS sampled every 10 ms.
    The call's CPU seconds (every thread of this process and its waited-for children, less the RSS sampler's)
    are left in ``CPU["last"]``. A full garbage collection runs first, as ``timeit`` and pyperf do, so that no
    method pays for a cyclic-GC pass triggered by the objects the harness made before the call (a full pass
    takes ~0.15–0.2 s in a process holding torch, as much as a whole 0.5 GiB load)."""
    gc.collect()
    rss = PeakRss().start()
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    try:
        out = fn()
        dt = time.perf_counter() - t0
    finally:
        extra = rss.stop()
        CPU["last"] = cpu_seconds() - c0 - rss.cpu
    return dt, extra, out


def io_choice() -> str:
    """The I/O path(s) liferaft chose in this process, per device probed ("" if none was)."""
    try:
        from liferaft.storage import iopath
    except ImportError:                                # (a liferaft from before the run-time choice)
        return ""
    return "; ".join(f"{c}, " + ("probed by another process of this host" if getattr(p, "shared", False)
                                 else f"probed in {p.seconds:.2f} s") for c, p in iopath.probed().values())


def solo_op(op: str, method: str, path: str, warm_path: str, cfg: Config, idle: float) -> dict[str, Any]:
    """One process, no process group: save the full state, or load into full tensors (then verify)."""
    _warm_up(method, warm_path, solo=True)
    if op == "save":
        state = build_state(cfg, "full", filled=True)
        time.sleep(idle)
        dt, rss, detail = _measure(lambda: do_save(method, path, state, cfg, solo=True))
        return {"seconds": dt, "extra_rss": rss, "detail": detail, "cpu_s": CPU["last"], "io": io_choice()}
    targets = build_state(cfg, "full", filled=False) if method != "torch" else {}
    time.sleep(idle)
    dt, rss, loaded = _measure(lambda: do_load(method, path, targets, cfg, solo=True))
    loaded, detail = loaded if isinstance(loaded, tuple) else (loaded, {})
    cpu = CPU["last"]
    verify(loaded, cfg, f"{method} load of {path} into full tensors")
    return {"seconds": dt, "extra_rss": rss, "detail": detail, "cpu_s": cpu, "io": io_choice()}


def rank_op(rank: int, world: int, op: str, method: str, path: str, warm_path: str, cfg: Config, idle: float,
            layout: str, share_reads: bool | None = None) -> dict[str, Any]:
    """One rank of a ``world``-rank save (layout shard0) or load into ``layout`` (then verify); ``share_reads``
    as in ``do_load``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    _warm_up(method, warm_path, solo=False, mesh=mesh)
    state = build_state(cfg, layout, filled=(op in ("save", "async_save")), mesh=mesh)
    if op == "async_save":
        return _async_rank(rank, method, path, state, idle)
    time.sleep(idle)
    dist.barrier()
    if op == "save":
        dt, rss, detail = _measure(lambda: do_save(method, path, state, None, solo=False))
    else:
        dt, rss, loaded = _measure(lambda: do_load(method, path, state, None, solo=False, share_reads=share_reads))
        detail = loaded[1] if isinstance(loaded, tuple) else {}
    cpu = CPU["last"]
    if op != "save":
        verify(state, cfg, f"rank {rank}: {method} load of {path} into {layout}")
    dist.barrier()
    return {"seconds": dt, "extra_rss": rss, "detail": detail, "cpu_s": cpu, "io": io_choice()}


def _start_async(method: str, path: str, state: dict[str, Any]) -> Callable[[], Any]:
    """Start an async save; return the function that waits until it is durable."""
    if method == "liferaft":
        import liferaft

        h = liferaft.async_save(path, state)
        assert h is not None
        return h.wait
    if method == "dcp":
        import torch.distributed.checkpoint as dcp

        fut = dcp.async_save(state, checkpoint_id=path)      # thread executor, default stager
        return fut.result
    raise ValueError(f"no async save for {method}")


def _async_rank(rank: int, method: str, path: str, state: dict[str, Any], idle: float) -> dict[str, Any]:
    """A warm async save: one untimed full-size save first (pool / stager set up), then the timed one:
    seconds until the call returns (training may go on) and until the checkpoint is durable."""
    first = path + "-first"
    _start_async(method, first, state)()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(first, ignore_errors=True)
    time.sleep(idle)
    dist.barrier()
    gc.collect()                # (as in ``_measure``)
    rss = PeakRss().start()
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    wait = _start_async(method, path, state)
    t_call = time.perf_counter() - t0
    wait()
    total = time.perf_counter() - t0
    extra = rss.stop()
    cpu = cpu_seconds() - c0 - rss.cpu
    dist.barrier()
    return {"seconds": total, "extra_rss": extra, "detail": {"call_s": t_call}, "cpu_s": cpu}
