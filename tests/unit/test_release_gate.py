"""``liferaft.release()`` from another thread waits for the liferaft calls running there (a save, a load), and
refuses to run from inside one of its own thread."""

from __future__ import annotations

import threading
import time
from typing import ClassVar

import pytest
import torch

import liferaft
from liferaft.errors import CheckpointBusyError
from liferaft.storage import PosixStorage


class _SlowStorage(PosixStorage):
    """A posix storage whose data-file writes say when they start and linger after each piece (so that another
    thread's ``release()`` lands in the middle of the save, while pieces are still being encoded)."""

    writing = threading.Event()
    released = threading.Event()
    seen_released: ClassVar[list[bool]] = []

    def open_writer(self, name: str):  # type: ignore[no-untyped-def]
        writer = super().open_writer(name)
        if name.startswith("data/"):
            pwrite = writer.pwrite

            def lingering(data, offset):  # type: ignore[no-untyped-def]
                pwrite(data, offset)
                type(self).seen_released.append(type(self).released.is_set())
                type(self).writing.set()
                time.sleep(0.05)

            writer.pwrite = lingering  # type: ignore[method-assign]
        return writer


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(8)}


@pytest.mark.parametrize("compression", ["on", "off"])
def test_release_from_another_thread_waits_for_a_sync_save(tmp_path, compression):
    state = _state()
    _SlowStorage.writing.clear()
    _SlowStorage.released.clear()
    _SlowStorage.seen_released.clear()
    errors: list[BaseException] = []

    def release_when_writing() -> None:
        _SlowStorage.writing.wait(30)
        try:
            liferaft.release()
            _SlowStorage.released.set()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=release_when_writing)
    t.start()
    liferaft.save(_SlowStorage(str(tmp_path / "ck")), state, options=liferaft.SaveOptions(compression=compression))
    t.join(60)
    assert not t.is_alive() and errors == []
    assert len(_SlowStorage.seen_released) > 2 and not any(_SlowStorage.seen_released)   # it waited for the save
    back = liferaft.read(str(tmp_path / "ck"))
    assert all(torch.equal(back[k], v) for k, v in state.items())
    liferaft.verify(str(tmp_path / "ck"))


def test_release_from_another_thread_waits_for_a_load(tmp_path):
    state = _state()
    liferaft.save(str(tmp_path / "ck"), state, options=liferaft.SaveOptions(compression="on"))
    started = threading.Event()

    class Hook:
        def state_dict(self) -> dict:
            return {"x": 1}

        def load_state_dict(self, sd: dict) -> None:
            started.set()
            time.sleep(0.3)

    liferaft.save(str(tmp_path / "ck2"), {**state, "hook": Hook()})
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    t = threading.Thread(target=lambda: (started.wait(30), liferaft.release()))
    t.start()
    liferaft.load(str(tmp_path / "ck2"), {**dest, "hook": Hook()})
    t.join(60)
    assert not t.is_alive()
    assert all(torch.equal(dest[k], v) for k, v in state.items())


def test_release_inside_a_call_of_its_own_thread_is_refused(tmp_path):
    class Releases:
        def state_dict(self) -> dict:
            liferaft.release()
            return {}

        def load_state_dict(self, sd: dict) -> None:
            pass

    with pytest.raises(CheckpointBusyError, match="inside a liferaft call"):
        liferaft.save(str(tmp_path / "ck"), {"r": Releases(), "t": torch.ones(3)})
    liferaft.release()                       # between calls it runs
    liferaft.save(str(tmp_path / "ck"), {"t": torch.ones(3)})
