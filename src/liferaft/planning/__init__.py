"""Pure planning: frozen inputs, frozen outputs, no process group, no storage, no torch."""
