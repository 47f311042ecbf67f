"""The plug-in surface: everything a user's rollout function imports, and nothing else (docs/agents.md).

A recipe names an async function with `rollout.function` (a registered name, `package.module:name` or
`path/to/file.py:name`). The run calls it once per prompt group with a `RolloutContext` and expects one
`RolloutResult` per sample (ctx.n of them), so GRPO groups stay whole:

    from m2po_megatron.api import RolloutContext, RolloutResult, Trajectory

    async def rollout(ctx: RolloutContext) -> list[RolloutResult]:
        out = []
        for i in range(ctx.n):
            traj = Trajectory(ctx.prompt_ids)
            gen = (await ctx.client.generate(traj.context, ctx.sampling_params, seed=ctx.seed + i))[0]
            traj.add_generation(gen)                              # policy tokens: trained on (mask 1)
            hint = ctx.tokenizer("\\nok", add_special_tokens=False)["input_ids"]  # no BOS mid-sequence
            traj.add_environment(hint)                            # environment tokens: never trained (mask 0)
            out.append(traj.result(reward=None))                  # None: the recipe's reward scores the text
        return out

A None in the list rejects that sample alone (dropped, counted as rollout_fn/dropped/rejected); raising
drops the whole group. Token ids the policy generated are kept exactly as the engine returned them (never decoded and encoded
again); the environment's tokens are appended after them. This module only
re-exports m2po_megatron.agents' public names (types.py, loader.py, tools.py), so the names users
import stay put while the modules behind them change.

- tool_parser(name): rollout.tool_call_parser's parser (a registered name first, else SGLang's of that
  --tool-call-parser name, where sglang is installed).
- render_messages(tokenizer, messages, tools): token ids through the tokenizer's chat template (tools=).
- render_suffix(tokenizer, new_messages, tools): the ids the template puts after an assistant turn for the
  environment's messages and the next generation prompt (append with Trajectory.add_environment).
- register_rollout(name, "package.module:function"), register_tool_parser(name, factory).

A reward function (`reward.function`, `reward.terms[i].function`; docs/tasks.md) needs no import at all:
`def reward(response, token_ids, row, **args) -> float | dict` (RewardFunction); register_reward(name,
"package.module:function") gives it a short name."""
from __future__ import annotations

from m2po_megatron.agents.loader import register_rollout, registered_rollouts
from m2po_megatron.agents.tools import make_tool_parser as tool_parser
from m2po_megatron.agents.tools import register_tool_parser, registered_tool_parsers, render_suffix
from m2po_megatron.agents.tools import render_ids as render_messages
from m2po_megatron.agents.types import (Generation, RolloutContext, RolloutFunction, RolloutResult, ServerUnavailable,
                                        TokenClient, ToolCall, ToolParser, Trajectory)
from m2po_megatron.reward.functions import register_reward, registered_rewards
from m2po_megatron.reward.types import RewardFunction

__all__ = ["Generation", "TokenClient", "RolloutContext", "RolloutResult", "Trajectory", "RolloutFunction",
           "ServerUnavailable",
           "ToolCall", "ToolParser", "register_rollout", "registered_rollouts", "register_tool_parser",
           "registered_tool_parsers", "tool_parser", "render_messages", "render_suffix", "RewardFunction",
           "register_reward", "registered_rewards"]
