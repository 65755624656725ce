"""What every routing policy is: ``Router.route`` picks a replica and says why
(``RoutingDecision``); ``remove`` forgets a replica that left."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingDecision:
    replica: Hashable
    matched_blocks: int = 0  # prompt blocks the chosen replica is believed to hold
    affinity_hit: bool = False  # chosen because it holds the prefix or adapter, not for its load


class Router:
    name = ""

    def route(self, replicas: Sequence[Hashable], prompt_token_ids: Sequence[int],
              loads: Mapping[Hashable, int], adapter: Hashable | None = None) -> RoutingDecision:
        raise NotImplementedError

    def remove(self, replica: Hashable) -> None:
        """Forget a replica that left (died, scaled down)."""
