"""On-disk format: manifest and commit marker (pure data, JSON, versioned)."""

from liferaft.format.manifest import (  # noqa: F401
    CHECKSUM_ALGO,
    COMMIT_MARKER,
    DTYPE_ITEMSIZE,
    FORMAT_NAME,
    FORMAT_VERSION,
    ChunkRecord,
    CommitMarker,
    ContainerEntry,
    Manifest,
    TensorEntry,
    ValueEntry,
    check_relative_path,
    decode_commit_marker,
    decode_manifest,
)
