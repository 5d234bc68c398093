"""State layer: flatten nested training state; adapters for modules, optimizers, DTensor and Sharded."""
