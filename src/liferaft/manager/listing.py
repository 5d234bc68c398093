"""The steps under a manager root: their names (``step-<step, 10 digits>``), what each holds and whether it is
committed, incomplete or corrupt. Reads only (no lease, no collective)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from liferaft.core.commit import check_files, open_checkpoint
from liferaft.errors import LiferaftError
from liferaft.format.layout import COMMIT_MARKER, STEP_PREFIX, is_layout_name, parse_step, step_name
from liferaft.storage import Storage
from liferaft.storage.refs import with_references

_parse_step = parse_step


@dataclass(frozen=True)
class StepInfo:
    """One step under the root. ``status``: "committed", "incomplete" (no commit marker: a save that did not
    finish, or one in flight) or "corrupt" (``reason`` says why)."""

    step: int
    path: str
    status: str
    reason: str = ""
    nbytes: int = 0
    created_unix: float | None = None
    world_size: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    pinned: bool = False
    depends_on: tuple[int, ...] = ()       # steps holding chunks this one references (incremental saves)
    tiers: tuple[str, ...] = ()            # where a committed copy is: "root", "memory" (this node's namespace)
    job_id: str | None = None              # the job that wrote it
    since_full: int | None = None          # saves since the last full (self-contained) one; 0: this is one



def list_steps(storage: Storage, pins: frozenset[int] = frozenset(), deep: bool = False,
               progress: Callable[[int], None] | None = None) -> list[StepInfo]:
    """Every step under the manager root ``storage``, oldest first, with its status (committed / incomplete /
    corrupt and why), own bytes, writer, metrics and the steps it references; ``deep`` re-hashes committed steps
    (``progress`` is called with the bytes of each read). Reads only (no lease, no collective)."""
    names: dict[int, list[str]] = {}
    for name in storage.list():
        step = _parse_step(name)
        if step is not None:
            names.setdefault(step, []).append(name)
    out = []
    for step in sorted(names):
        st = with_references(storage.child(step_name(step)))
        path, pinned = st.url, step in pins
        if f"{step_name(step)}/{COMMIT_MARKER}" not in names[step]:
            out.append(StepInfo(step, path, "incomplete", "no commit marker", pinned=pinned))
            continue
        try:
            m = open_checkpoint(st)
            check_files(st, m, m.files)
            if deep:
                from liferaft.core.read import verify

                verify(st, progress=progress)
        except LiferaftError as e:
            out.append(StepInfo(step, path, "corrupt", str(e), pinned=pinned))
            continue
        metrics = m.extra.get("metrics") if isinstance(m.extra.get("metrics"), dict) else {}
        since = m.extra.get("since_full")
        out.append(StepInfo(step, path, "committed", nbytes=sum(v for k, v in m.files.items() if k[:3] != "../"),
                            created_unix=m.created_unix, world_size=m.world_size, metrics=dict(metrics),
                            pinned=pinned, depends_on=_references(m.files),
                            since_full=since if type(since) is int else None,
                            job_id=str(m.extra["job_id"]) if "job_id" in m.extra else None, tiers=("root",)))
    return out


def _foreign_steps(names: Iterable[str]) -> dict[int, str]:
    """Steps under a root that hold a file liferaft never writes in a step folder (a DCP or torchtitan folder
    under the same name, a user's file), each with one such name: cleaning up never deletes those."""
    out: dict[int, str] = {}
    for name in names:
        step, _, rest = name.partition("/")
        n = _parse_step(step)
        if n is None or not rest or n in out:
            continue
        if not is_layout_name(rest):
            out[n] = rest
    return out


def _references(files: Mapping[str, int]) -> tuple[int, ...]:
    """The steps whose files a manifest's ``files`` table references (``../step-<n>/...``)."""
    out = set()
    for name in files:
        if name.startswith("../"):
            step = _parse_step(name[3:])
            if step is not None:
                out.add(step)
    return tuple(sorted(out))


__all__ = ["StepInfo", "STEP_PREFIX", "step_name", "list_steps"]
