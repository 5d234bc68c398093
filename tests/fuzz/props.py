"""Every API call and CLI command on one mutated input, each checked against the property of ``harness``."""

from __future__ import annotations

import os
import shutil
from typing import Any

import harness
from harness import Bounds, call, flat, run_cli, same, template
from hypothesis import strategies as st

import liferaft

CONVERT_TO = ("liferaft", "safetensors", "torch", "dcp")
CLI = ("inspect", "verify", "read", "diff", "convert", "ls")


def _compare(bounds: Bounds, name: str, got: Any, want: Any) -> None:
    if not harness.same(got, want):
        gf, wf = flat(got), flat(want)
        diff = sorted(k for k in set(gf) | set(wf) if k not in gf or k not in wf or not same(gf[k], wf[k]))
        bounds.failures.append(f"{name}: returned data that is not the saved data (keys {diff[:5]})")


def _tensors_match(bounds: Bounds, name: str, got: Any, want: Any) -> None:
    """A converted copy read back: each of its tensors equals the original's under the same flat key."""
    gf, wf = flat(got), flat(want)
    for k, v in gf.items():
        if hasattr(v, "dtype") and hasattr(v, "shape") and not same(v, wf.get(k)):
            bounds.failures.append(f"{name}: tensor {k!r} of the converted copy differs from the saved one")
            return


def exercise(data: st.DataObject, bounds: Bounds, src: str, *, fmt: str, expected: Any, original: str,
             strict: bool, out: str, root: str | None = None, refuse: str | None = None) -> None:
    """Call everything on ``src`` (format ``fmt``; ``original``: the untouched copy; ``expected``: what reading it
    gives). ``strict``: a success must give ``expected`` exactly; else only a well-formed answer. ``refuse``: why
    the input is invalid (the test knows it): reading its tensors must raise. One convert target and one CLI command
    are drawn per example (each example costs every API call)."""
    r = call(bounds, "read", lambda: liferaft.read(src))
    if strict and r.ok:
        _compare(bounds, "read", r.value, expected)
    i = call(bounds, "inspect", lambda: liferaft.inspect(src))
    if i.ok:
        call(bounds, "str(inspect)", lambda: str(i.value))
    if r.ok and i.ok and fmt == "liferaft":            # whatever a sealed manifest says, read returns all of it
        lost = sorted({t.key for t in i.value.tensors} - set(flat(r.value)))
        if lost:
            bounds.failures.append(f"read dropped tensors the manifest declares: {lost[:5]}")
    v = call(bounds, "verify", lambda: liferaft.verify(src))
    if strict and v.ok and not r.ok:
        bounds.failures.append(f"verify said OK where read refused: {r.error}")
    state = template(expected)
    ld = call(bounds, "load", lambda: liferaft.load(src, state, strict=True))
    if strict and ld.ok:
        _compare(bounds, "load", state, expected)
    d = call(bounds, "diff", lambda: liferaft.diff(original, src))
    if strict and d.ok and not d.value.identical:
        bounds.failures.append(f"diff against the original found changes: {[k.key for k in d.value.changed][:5]}")
    to = data.draw(st.sampled_from([t for t in CONVERT_TO if t != fmt]), label="convert to")
    dst = os.path.join(out, f"conv-{to}")
    c = call(bounds, f"convert to {to}", lambda: liferaft.convert(src, dst, to))
    if c.ok and strict and to in ("liferaft", "safetensors", "torch"):
        back = call(bounds, f"read of convert to {to}", lambda: liferaft.read(dst))
        if back.ok:
            _tensors_match(bounds, f"convert to {to}", back.value, expected)
    shutil.rmtree(dst, ignore_errors=True) if os.path.isdir(dst) else None
    if os.path.lexists(dst) and not os.path.isdir(dst):
        os.unlink(dst)
    cmd = data.draw(st.sampled_from([c for c in CLI if c != "ls" or root is not None]), label="cli")
    argv = {"inspect": ["inspect", src], "verify": ["verify", src], "read": ["read", src],
            "diff": ["diff", original, src], "convert": ["convert", src, os.path.join(out, "cli-conv"), "--to",
                                                         "liferaft" if fmt != "liferaft" else "safetensors"],
            "ls": ["ls", root or "", "--verify"]}[cmd]
    rc, _, _ = run_cli(bounds, argv)
    if strict and cmd == "verify" and rc == 0 and not r.ok:
        bounds.failures.append("liferaft verify exit 0 where read refused")
    if refuse:
        for o in (r, v, ld, c):
            if o.ok:
                bounds.failures.append(f"{o.name} accepted an invalid input ({refuse})")
    harness.canary_check(bounds)


class Workspace:
    """A fresh copy of a seed per example: ``src`` (the copy to damage), ``out`` (convert destinations), ``secret``
    (a file outside the checkpoint that nothing may open); removed on exit."""

    def __init__(self, seed: Any, timeout: int) -> None:
        import tempfile

        self.seed = seed
        self.top = tempfile.mkdtemp(prefix="liferaft-fuzz-")
        self.base = os.path.join(self.top, "in")
        shutil.copytree(seed.base, self.base, symlinks=True)
        self.src = os.path.join(self.base, seed.rel)
        self.out = os.path.join(self.top, "out")
        os.makedirs(self.out)
        os.makedirs(os.path.join(self.top, "secret"))
        self.secret = os.path.join(self.top, "secret", "secret.bin")
        with open(self.secret, "wb") as f:
            f.write(b"secret bytes no checkpoint may reach" * 4)
        self.bounds = Bounds(timeout, (self.base, self.out, seed.base))

    def __enter__(self) -> Workspace:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.top, ignore_errors=True)

    def run(self, data: st.DataObject, strict: bool, refuse: str | None = None) -> None:
        """Exercise every call on ``src`` and fail with every broken promise found."""
        exercise(data, self.bounds, self.src, fmt=self.seed.fmt, expected=self.seed.expected,
                 original=self.seed.path, strict=strict, out=self.out,
                 root=self.base if self.seed.fmt == "liferaft" and "native" in self.seed.base else None,
                 refuse=refuse)
        assert not self.bounds.failures, "\n".join(self.bounds.failures)
