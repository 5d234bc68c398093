"""liferaft's collectives over its own gloo groups: ``Coordinator`` (``coordinator``: exchanges, broadcasts,
gathers and scatters, votes and sends, each failing on every rank alike) and the framing of their byte messages
(``wire``)."""

from liferaft.dist.coordinator import Coordinator, MaxVote, release_groups

__all__ = ["Coordinator", "MaxVote", "release_groups"]
