"""The checkpoint manager (when to save, what to keep, what to resume from) and its pure policies."""
