"""The test launcher (``liferaft.testing.run_ranks``): a rendezvous port another process took between the launcher
finding it free and rank 0 listening on it (tests side by side: a CI run once failed so) launches again; a module
of the fork server's optional preload that fails to import does not take the fork server down."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

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


def test_an_optional_preload_that_fails_to_import_leaves_the_fork_server_running(tmp_path):
    """``torch._dynamo`` raises OSError at import when its inductor cache folder cannot be made; the fork server dies
    on any preload error but an ImportError (review helper-130: every ``run_ranks`` then failed with an EOFError), so
    ``liferaft.testing._preload`` skips it. In a fresh process: its own fork server."""
    code = ("from liferaft.testing import run_ranks\n"
            "if __name__ == '__main__':\n"
            "    print(run_ranks(max, 2, timeout=120))\n")
    script = tmp_path / "job.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": "/proc/no-such-folder/inductor"})
    assert out.returncode == 0 and out.stdout.strip().endswith("[2, 2]"), (out.returncode, out.stderr[-3000:])
