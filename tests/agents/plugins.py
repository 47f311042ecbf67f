"""Rollout functions for the plug-in tests, named by file path (`tests/agents/plugins.py:NAME`) as a user's
own file would be. Only m2po_megatron.api is imported, as docs/agents.md says."""
import asyncio

from m2po_megatron.api import RolloutContext, RolloutResult, Trajectory

HINT = " Check:"


async def two_turns(ctx: RolloutContext) -> list[RolloutResult]:
    """Generate, append an environment hint, generate again: each sample's ids are the engine's outputs
    and the hint's tokens; the group stays on one server."""
    hint = ctx.tokenizer(HINT, add_special_tokens=False)["input_ids"]
    first = dict(ctx.sampling_params, max_new_tokens=int(ctx.args.get("first_tokens", 6)))

    async def episode(i: int) -> RolloutResult:
        traj = Trajectory(ctx.prompt_ids)
        (g,) = await ctx.client.generate(traj.context, first, seed=ctx.seed + i)
        traj.add_generation(g)
        if g.finish_reason != "abort":
            traj.add_environment(hint)
            (g2,) = await ctx.client.generate(traj.context, ctx.sampling_params, seed=ctx.seed + i + ctx.n)
            traj.add_generation(g2)
            ctx.log(turns=traj.turns, same_server=float(g.server == g2.server))
        return traj.result(metadata={"episode": i})

    return list(await asyncio.gather(*(episode(i) for i in range(ctx.n))))


async def always_raises(ctx: RolloutContext) -> list[RolloutResult]:
    raise ValueError("my environment is not configured")


def not_async(ctx):
    return []


async def two_args(ctx, extra):
    return []
