"""The limits of liferaft's on-disk contract (docs/FORMAT.md §6): what a reader refuses and a writer never writes.

One place for each bound, so that the save side and the read side agree (liferaft never writes what it would
refuse to read). Pure constants; imports nothing.
"""

from __future__ import annotations

#: Container levels a plain value may nest (a list in a dict in a tuple ...: 3), and parts a key's path may have.
#: Saving a deeper state is refused up front; a manifest holding a deeper value or a longer path is corrupt.
MAX_NESTING = 100

#: Nesting of any JSON document liferaft parses (manifest, commit marker, LEASE, PINS, STARTS). A plain value of
#: MAX_NESTING levels takes up to 3 JSON levels per level (``{"$dict": [[k, v]]}``), under a manifest's 4.
MAX_JSON_DEPTH = 3 * MAX_NESTING + 16

#: Every integer of a manifest (offsets, sizes, shapes, byte ranges, file sizes, counts, steps, ranks) lies in
#: ``[0, MAX_INT]``, and so does every product of them (a tensor's elements × item size).
MAX_INT = 2 ** 63 - 1

#: Most dimensions a stored tensor may have (torch's own limit is lower for most operations).
MAX_NDIM = 64

#: Smallest ``SaveOptions.chunk_bytes`` (a save's chunks are at most this small only at a tensor's edges): a
#: version 4 index planned with a smaller one is refused (a reader replays the plan chunk by chunk).
MIN_CHUNK_BYTES = 64 << 10

#: Fewest bytes one chunk's record takes in a chunk table (version 4): a table listed with more chunks than its
#: size holds at this rate is refused before it is read.
MIN_CHUNK_RECORD_BYTES = 64

#: Most ranks a save may record (a value stored per rank holds one item per rank).
MAX_WORLD_SIZE = 1 << 20

#: Largest time (seconds since 1970) a manifest may record: year 9999.
MAX_UNIX_TIME = 253402300799.0

#: Size caps of the small JSON files (bytes), checked before parsing.
MAX_MANIFEST_BYTES = 1 << 30
MAX_MARKER_BYTES = 64 << 10
MAX_ROOT_FILE_BYTES = 1 << 20       # LEASE, PINS, STARTS of a manager root

#: Longest file or folder name (one path component, in UTF-8 bytes) liferaft writes or opens: the limit of every
#: common local file system (NAME_MAX); a manifest or foreign index naming a longer one is refused by name.
MAX_NAME_BYTES = 255


def name_bytes(name: str) -> int:
    """The bytes the one-component ``name`` takes on disk (UTF-8; a lone surrogate counted, not an error)."""
    return len(name.encode("utf-8", "surrogatepass"))


#: Most chunks one tensor may have in a manifest or a DCP checkpoint (far above any real layout: 100k ranks × a few
#: chunks each); a tiling check of more is refused as corrupt rather than run.
MAX_CHUNKS_PER_TENSOR = 1 << 20

#: Pairwise comparisons per chunk the tiling check's sweep may make when the chunks are not one grid (a real
#: layout needs a handful: the chunks sharing a row); beyond it the layout is refused as too fragmented.
SWEEP_BUDGET = 64
