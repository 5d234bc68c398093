"""The chunk codecs this liferaft reads and writes, by the name the manifest stores (``ChunkRecord.codec``).

As DCP's ``ExtensionRegistry`` maps a stored descriptor to an extension class, ``CODECS`` maps a stored codec name
to its implementation (``codecs.base.Codec``). The writer, the block readers and the manifest check
(``core.commit.open_checkpoint`` passes ``names()`` to ``format.manifest.decode_manifest``) all look codecs up
here, so adding a codec is: write its ``Codec`` (in its own module), list it in ``_BUILTIN`` below (or call
``register`` for one that lives outside liferaft), document its frame in docs/FORMAT.md §4.1; the conformance
test (tests/unit/test_codec_conformance.py) then runs on it.

The registry is a process-wide table, changed only by an explicit ``register`` call; nothing registers itself
on import.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from liferaft.codecs.base import Codec
from liferaft.codecs.bytegroup import ByteGroupZstd
from liferaft.codecs.quantize import Q8Block
from liferaft.errors import CorruptCheckpointError

#: the lossless codec of ``SaveOptions(compression="on")`` (and of XOR deltas)
LOSSLESS = "bytegroup-zstd"
#: the lossy codec of ``SaveOptions(quantize=[...])``
QUANTIZE = "q8-block"

_NAME = re.compile(r"[a-z0-9][a-z0-9.+-]{0,63}")


class CodecRegistry:
    """Stored codec name → ``Codec``."""

    def __init__(self, codecs: tuple[Codec, ...] = ()) -> None:
        self._codecs: dict[str, Codec] = {}
        for c in codecs:
            self.register(c)

    def register(self, codec: Codec) -> None:
        """Add ``codec`` under ``codec.name`` (lower-case letters, digits, ``.+-``). Raises ValueError for a
        malformed name or a name already taken (a name denotes one frame layout forever)."""
        if not isinstance(codec, Codec) or not _NAME.fullmatch(getattr(codec, "name", "") or ""):
            raise ValueError(f"a codec is a liferaft.codecs.base.Codec with a name of lower-case letters, digits "
                             f"and '.+-', got {codec!r}")
        if codec.name in self._codecs:
            raise ValueError(f"codec {codec.name!r} is already registered ({self._codecs[codec.name]!r})")
        self._codecs[codec.name] = codec

    def get(self, name: str, where: str = "chunk") -> Codec:
        """The codec stored as ``name``. Raises CorruptCheckpointError naming ``where`` for an unknown one."""
        codec = self._codecs.get(name)
        if codec is None:
            raise CorruptCheckpointError(
                f"{where}: chunk codec {name!r} is unknown to this liferaft (known: {', '.join(self._codecs)}); "
                "the checkpoint was written by a newer liferaft or with a codec registered there: upgrade "
                "liferaft (or register that codec) to read it")
        return codec

    def names(self) -> tuple[str, ...]:
        """Every registered codec name (what manifest validation needs)."""
        return tuple(self._codecs)

    def __iter__(self) -> Iterator[Codec]:
        return iter(tuple(self._codecs.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._codecs


_BUILTIN: tuple[Codec, ...] = (ByteGroupZstd(), Q8Block())

#: this process's codecs: the built-in ones, and any added by ``register``
CODECS = CodecRegistry(_BUILTIN)


def get(name: str, where: str = "chunk") -> Codec:
    """``CODECS.get``: the codec stored as ``name`` (CorruptCheckpointError naming ``where`` when unknown)."""
    return CODECS.get(name, where)


def register(codec: Codec) -> None:
    """``CODECS.register``: make ``codec`` available to saves and loads of this process."""
    CODECS.register(codec)


def names() -> tuple[str, ...]:
    """``CODECS.names``: every registered codec name."""
    return CODECS.names()
