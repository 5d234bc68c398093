"""Per-chunk transforms. Today: block checksums (xxh3_64)."""
