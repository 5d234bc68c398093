"""liferaft's collectives over its own gloo groups: ``Coordinator`` (``coordinator``: exchanges, broadcasts,
gathers and scatters, votes and sends, each failing on every rank alike), the gloo groups they run on
(``groups``) and the framing of their byte messages (``wire``)."""

from liferaft.dist.coordinator import Coordinator, MaxVote
from liferaft.dist.groups import release_groups

__all__ = ["Coordinator", "MaxVote", "release_groups"]
