"""The TokenClient a rollout function gets: the run's RolloutClient bound to one prompt group, so that every
turn of the group's episodes goes to the server its first call chose (its prefix cache holds the context)."""
from __future__ import annotations

from typing import Optional, Sequence

from m2po_megatron.agents.types import Generation


class GroupClient:
    """api.TokenClient over a RolloutClient, for one group. Counts its calls and generated tokens."""

    def __init__(self, client, routed_experts: bool = False):
        self.client = client
        self.routed_experts = routed_experts  # algo.routing_replay = r3 on a MoE model: ask for the routing
        self.server: Optional[str] = None
        self.calls = 0
        self.tokens = 0

    async def generate(self, input_ids: Sequence[int], sampling_params: Optional[dict] = None, *, n: int = 1,
                       seed: Optional[int] = None) -> list[Generation]:
        sp = dict(sampling_params or {})
        if seed is not None:
            sp["sampling_seed"] = int(seed)
        res = await self.client.generate(list(input_ids), sp, n=n, return_routed_experts=self.routed_experts,
                                         server=self.server)
        if res:
            self.server = res[0].server  # later turns follow (the client falls back if it goes down)
        self.calls += 1
        self.tokens += sum(len(r.output_ids) for r in res)
        return [Generation(token_ids=list(r.output_ids), logprobs=list(r.output_logprobs),
                           versions=[int(v) for v in r.token_versions], finish_reason=r.finish_reason,
                           weight_version=r.weight_version, server=r.server, routed_experts=r.routed_experts)
                for r in res]
