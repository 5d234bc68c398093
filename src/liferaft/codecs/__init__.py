"""Per-chunk transforms: block checksums (``checksum``), and the chunk codecs (the contract in ``base``, the codecs
by stored name in ``registry``, their frames on worker threads in ``frames``, the ``compression="auto"`` rule in
``advisor``)."""
