"""The built-in rollout (`rollout.function: single_turn`, the default): one request of n samples per prompt
group, every generated token the policy's, scored by the recipe's reward. The paper's math recipes use it."""
from __future__ import annotations

from m2po_megatron.agents.types import RolloutContext, RolloutResult


async def rollout(ctx: RolloutContext) -> list[RolloutResult]:
    gens = await ctx.client.generate(ctx.prompt_ids, ctx.sampling_params, n=ctx.n, seed=ctx.seed)
    return [RolloutResult(token_ids=g.token_ids, loss_mask=[1] * len(g.token_ids), logprobs=g.logprobs,
                          versions=g.versions, finish_reason=g.finish_reason, routed_experts=g.routed_experts)
            for g in gens]
