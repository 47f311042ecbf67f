"""The plug-in types (re-exported by m2po_megatron.api, which users import): what a rollout function gets
and returns. Nothing of the package is imported here."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Awaitable, Callable, Optional, Protocol, Sequence, runtime_checkable

class ServerUnavailable(RuntimeError):
    """No rollout server could serve a request within the client's retries: the run's failure, not the
    plug-in's. A rollout function lets it propagate; the run then stops as it does without plug-ins."""


@dataclasses.dataclass
class Generation:
    """One sample of one `TokenClient.generate` call: what the engine generated after `input_ids`."""

    token_ids: list[int]  # exactly the engine's output ids (nothing re-tokenized)
    logprobs: list[float]  # the behaviour log-prob of each token under the weights that generated it
    versions: list[int]  # the weight version (optimizer updates) that generated each token
    finish_reason: str  # "stop" | "length" | "abort" (a weight update with rollout.pause_mode=abort)
    weight_version: int = 0  # the server's version when the sample finished
    server: str = ""  # the server's URL (an episode's turns go to one server, for its prefix cache)
    routed_experts: Optional[str] = None  # R3 only: SGLang's base64 top-k experts of every fed position


@runtime_checkable
class TokenClient(Protocol):
    """Token-in/token-out access to the rollout servers, bound to one prompt group: every call of the group
    goes to the server its first call chose (unless that server is down), so turns reuse its prefix cache."""

    async def generate(self, input_ids: Sequence[int], sampling_params: Optional[dict] = None, *, n: int = 1,
                       seed: Optional[int] = None) -> list[Generation]:
        """n samples continuing `input_ids`. sampling_params uses SGLang's names (temperature, top_p, top_k,
        max_new_tokens, stop_token_ids, ...); `seed` is sample 0's sampling_seed (sample i gets seed + i)."""
        ...


@dataclasses.dataclass
class RolloutContext:
    """What the run hands a rollout function for one prompt group."""

    row: dict  # the data row with all its fields (`prompt`, `answer`, `id` and any others)
    prompt_ids: list[int]  # the row's prompt (data.input_key) as the run renders and tokenizes it (templates applied)
    tokenizer: Any  # the run's HF tokenizer
    sampling_params: dict  # the recipe's SGLang sampling params (temperature, top_p, top_k, max_new_tokens)
    n: int  # samples in the group (rollout.n_samples_per_prompt): return exactly n results
    seed: int  # this group's seed; sample i of turn t may use seed + i + t * n
    client: TokenClient
    # the recipe's reward (reward.function / reward.terms) of a response text, with the row: await
    # ctx.reward(text) or ctx.reward(text, token_ids); a failed term gives reward.error_score
    reward: Callable[..., Awaitable[float]]
    log: Callable[..., None]  # log(name=value, ...): per-episode numbers, averaged per step as rollout/custom/<name>
    group_id: str = ""
    max_context: int = 0  # longest prompt + response the servers take (0: unknown)
    tool_parser: Optional["ToolParser"] = None  # rollout.tool_call_parser's parser, when the recipe names one
    args: dict = dataclasses.field(default_factory=dict)  # rollout.function_args: the recipe's options for it
    evaluation: bool = False  # True when in-run evaluation calls it (eval.function); no sample is trained on


@dataclasses.dataclass
class RolloutResult:
    """One sample: the tokens after the prompt, and which of them the policy generated.

    token_ids, loss_mask, logprobs and versions have one entry per token. loss_mask is 1 for tokens the
    policy generated (trained on) and 0 for environment, tool and template tokens; logprobs and versions
    are read on mask-1 tokens only (give anything, e.g. 0.0 and -1, elsewhere). A sample's staleness is the
    version of its oldest policy token."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: Optional[float] = None  # None: the recipe's reward scores the decoded text of the policy's tokens
    finish_reason: str = "stop"  # "stop" | "length" | "abort" (an aborted sample is dropped, counted)
    metadata: dict = dataclasses.field(default_factory=dict)  # kept with the sample (JSON-safe values)
    routed_experts: Optional[str] = None  # R3: the last turn's routed experts (covering every fed position)


class Trajectory:
    """Builds a RolloutResult turn by turn: generations are appended as the engine returned them (mask 1),
    environment tokens after them (mask 0). `context` is the next turn's input."""

    def __init__(self, prompt_ids: Sequence[int]):
        self.prompt_ids = list(prompt_ids)
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason = "stop"
        self.turns = 0
        self._routed: Optional[str] = None

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def add_generation(self, gen: Generation) -> "Trajectory":
        self.token_ids += list(gen.token_ids)
        self.loss_mask += [1] * len(gen.token_ids)
        self.logprobs += list(gen.logprobs)
        self.versions += list(gen.versions)
        self.turns += 1
        if gen.finish_reason == "abort" or self.finish_reason != "abort":
            self.finish_reason = gen.finish_reason  # an aborted turn aborts the episode
        self._routed = gen.routed_experts  # covers the whole context of this turn: keep the last
        return self

    def add_environment(self, token_ids: Sequence[int]) -> "Trajectory":
        ids = list(token_ids)
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self._routed = None  # the engine never fed these tokens: no turn's routing covers them yet
        return self

    def result(self, reward: Optional[float] = None, metadata: Optional[dict] = None,
               finish_reason: Optional[str] = None) -> RolloutResult:
        return RolloutResult(list(self.token_ids), list(self.loss_mask), list(self.logprobs), list(self.versions),
                             reward=reward, finish_reason=finish_reason or self.finish_reason,
                             metadata=dict(metadata or {}, turns=self.turns), routed_experts=self._routed)


RolloutFunction = Callable[[RolloutContext], Awaitable[Sequence[RolloutResult]]]


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict
    raw: str = ""  # the call's text as the model wrote it
    error: str = ""  # why the call could not be parsed ("" when it could)


@runtime_checkable
class ToolParser(Protocol):
    """Finds tool calls in generated text (rollout.tool_call_parser names one: SGLang's --tool-call-parser
    names where sglang is installed, or one registered with api.register_tool_parser)."""

    def parse(self, text: str, tools: Sequence[dict]) -> tuple[str, list[ToolCall]]:
        """(the text without the calls, the calls in order)."""
        ...


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
