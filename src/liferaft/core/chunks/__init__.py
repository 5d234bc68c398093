"""Moving chunk bytes between live tensors and data files, following a plan: ``writer`` (encode, hash and
write a rank's chunks), ``reader`` (fetch, verify, decode and copy planned reads), ``blocks`` (one chunk's
blocks), ``rehome`` (copy referenced chunks in)."""
