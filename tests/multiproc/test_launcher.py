"""The test launcher (``liferaft.testing.run_ranks``): a rendezvous port another process took between the launcher
finding it free and rank 0 listening on it (tests side by side: a CI run once failed so) launches again."""

from __future__ import annotations

import socket

from liferaft.testing import launcher, run_ranks


def test_a_rendezvous_port_taken_meanwhile_is_launched_again(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = [busy.getsockname()[1]]
        real = launcher.free_port
        monkeypatch.setattr(launcher, "free_port", lambda: taken.pop() if taken else real())
        assert run_ranks(max, 2, timeout=120) == [2, 2]        # (max(rank, world): run on both ranks)
        assert not taken
