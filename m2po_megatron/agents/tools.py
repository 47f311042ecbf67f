"""Tool calls in generated text, and chat-template rendering of the environment's turns.

Parsers (`rollout.tool_call_parser`): `make_tool_parser(name)` gives, in this order, a parser registered with
`m2po_megatron.api.register_tool_parser`, or SGLang's parser of that `--tool-call-parser` name (qwen25,
llama3, mistral, ...) when sglang is installed (the `[gpu]` extra; imported only then).

The built-in `m2po_tags` format, for tiny models whose chat template has no tool format of its own:

    <call name="NAME">ARGUMENTS</call>

ARGUMENTS is either a JSON object (`<call name="search">{"query": "cats", "k": 3}</call>`) or, when it does
not start with `{`, bare text given to the tool's single required parameter (`<call name="calculator">
12*34</call>` is `{"expression": "12*34"}` for a calculator whose one required parameter is `expression`);
empty ARGUMENTS is `{}`. The name may be quoted with " or '. ARGUMENTS cannot contain `</call>`. Text
outside the calls is the message's text. A call that cannot be used (no closing tag, no name, a tool not
in `tools`, bad JSON, bare text for a tool without exactly one required parameter) still comes back, as a
ToolCall whose `error` says why, so environments can answer it and count failures.

Rendering: a multi-turn sample keeps the engine's output ids as they are (never decoded and encoded again)
and appends only the environment's tokens. `render_suffix` computes those tokens from the chat template by
rendering a fixed conversation with and without the new messages and taking the difference.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping, Optional, Sequence

from m2po_megatron.agents.types import ToolCall, ToolParser

__all__ = ["make_tool_parser", "register_tool_parser", "registered_tool_parsers", "TagToolParser",
           "SGLangToolParser", "format_call", "render_ids", "render_suffix"]

KEY = "rollout.tool_call_parser"
TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {}  # name -> factory (registered names before SGLang's)


def register_tool_parser(name: str, factory: Callable[[], ToolParser]) -> None:
    """Make `rollout.tool_call_parser: name` build its parser with factory()."""
    TOOL_PARSERS[name] = factory


def registered_tool_parsers() -> dict[str, Callable[[], ToolParser]]:
    return dict(TOOL_PARSERS)


def _function(tool: Mapping) -> dict:
    """The function part of an OpenAI-style tool ({"type": "function", "function": {...}}) or of a bare one."""
    fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ValueError(f"a tool schema needs a function name: got {tool!r}; write tools as "
                         '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}')
    return dict(fn)


# ---------------------------------------------------------------------------------------------------------
# The m2po_tags format


_OPEN = re.compile(r"<call\b([^>]*)>")
_NAME = re.compile(r"""^\s*name\s*=\s*(?:"([^"]*)"|'([^']*)')\s*$""")
_CLOSE = "</call>"


def format_call(name: str, arguments: Any = None) -> str:
    """A call in the m2po_tags format: JSON arguments for a dict, bare text for a string (prompt examples,
    SFT data and tests write calls with this)."""
    if arguments is None:
        arguments = {}
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'<call name="{name}">{text}</call>'


class TagToolParser:
    """The `m2po_tags` parser (the format is in this module's docstring)."""

    def parse(self, text: str, tools: Sequence[dict]) -> tuple[str, list[ToolCall]]:
        schemas = {fn["name"]: fn for fn in map(_function, tools or ())}
        kept, calls, pos = [], [], 0
        for m in _OPEN.finditer(text):
            if m.start() < pos:  # an opening tag inside a call's arguments belongs to that call
                continue
            kept.append(text[pos:m.start()])
            end = text.find(_CLOSE, m.end())
            name_m = _NAME.match(m.group(1))
            name = (name_m.group(1) if name_m.group(1) is not None else name_m.group(2)) if name_m else ""
            if end < 0:  # unclosed: the rest of the text is the broken call (the model stopped or ran on)
                calls.append(ToolCall(name, {}, text[m.start():], error="no closing </call> tag"))
                pos = len(text)
                break
            raw = text[m.start():end + len(_CLOSE)]
            calls.append(self._call(name if name_m else None, text[m.end():end], raw, schemas))
            pos = end + len(_CLOSE)
        kept.append(text[pos:])
        return "".join(kept).strip(), calls

    @staticmethod
    def _call(name: Optional[str], body: str, raw: str, schemas: dict) -> ToolCall:
        if not name:
            return ToolCall("", {}, raw, error='no name: write <call name="TOOL">...</call>')
        if name not in schemas:
            return ToolCall(name, {}, raw, error=f"unknown tool {name!r} (tools: {', '.join(schemas) or 'none'})")
        body = body.strip()
        if not body:
            return ToolCall(name, {}, raw)
        if body.startswith("{"):
            try:
                args = json.loads(body)
            except json.JSONDecodeError as e:
                return ToolCall(name, {}, raw, error=f"arguments are not valid JSON: {e}")
            if not isinstance(args, dict):
                return ToolCall(name, {}, raw, error="arguments are JSON but not an object")
            return ToolCall(name, args, raw)
        params = schemas[name].get("parameters") or {}
        required = list(params.get("required") or [])
        if not required and len(params.get("properties") or {}) == 1:
            required = list(params["properties"])  # one optional parameter: bare text can only mean it
        if len(required) != 1:
            return ToolCall(name, {}, raw, error=f"bare-text arguments need a tool with one required parameter; "
                                                 f"{name!r} has {len(required)}: write a JSON object")
        return ToolCall(name, {required[0]: body}, raw)


# ---------------------------------------------------------------------------------------------------------
# SGLang's parsers


def _sglang_parsers() -> Optional[dict]:
    """SGLang's --tool-call-parser names -> detector classes, or None without sglang."""
    try:
        from sglang.srt.function_call.function_call_parser import FunctionCallParser
    except Exception:  # not installed, or installed without what its import needs here (CUDA, a kernel)
        return None
    return dict(FunctionCallParser.ToolCallParserEnum)


class SGLangToolParser:
    """SGLang's parser of one --tool-call-parser name, behind the ToolParser protocol: the same parsing the
    rollout servers' OpenAI endpoints do. SGLang drops the calls it cannot parse or whose tool is not in
    `tools`; when that leaves no call although the text has the format's call marker, one ToolCall with an
    `error` (raw: the whole text) stands for them (a dropped call next to good ones goes unreported)."""

    def __init__(self, name: str):
        self.name = name
        self._cache: tuple[str, Any] = ("", None)  # (the tools' JSON, FunctionCallParser): tools rarely change

    def _parser(self, tools: Sequence[dict]):
        from sglang.srt.entrypoints.openai.protocol import Function, Tool
        from sglang.srt.function_call.function_call_parser import FunctionCallParser

        key = json.dumps(list(tools or ()), sort_keys=True, default=str)
        if self._cache[0] != key or self._cache[1] is None:
            fns = [_function(t) for t in tools or ()]
            sg_tools = [Tool(type="function", function=Function(name=fn["name"], description=fn.get("description"),
                                                                 parameters=fn.get("parameters") or {}))
                        for fn in fns]
            self._cache = (key, FunctionCallParser(tools=sg_tools, tool_call_parser=self.name))
        return self._cache[1]

    def parse(self, text: str, tools: Sequence[dict]) -> tuple[str, list[ToolCall]]:
        parser = self._parser(tools)
        normal, items = parser.parse_non_stream(text)
        if not items and parser.has_tool_call(text):
            # SGLang logs and drops what it cannot parse; keep one failed call so the environment can count it
            return normal or "", [ToolCall("", {}, text, error=f"SGLang's {self.name!r} parser found a tool call "
                                                              "it could not parse (bad JSON or a tool not in tools)")]
        calls = []
        for item in items:  # SGLang gives no call text: raw stays "" unless the arguments are broken
            name, args_text = item.name or "", item.parameters or ""
            try:
                args = json.loads(args_text) if args_text.strip() else {}
            except json.JSONDecodeError as e:
                calls.append(ToolCall(name, {}, args_text, error=f"arguments are not valid JSON: {e}"))
                continue
            if isinstance(args, dict):
                calls.append(ToolCall(name, args))
            else:
                calls.append(ToolCall(name, {}, args_text, error="arguments are JSON but not an object"))
        return normal or "", calls


def make_tool_parser(name: str):
    """The ToolParser of `rollout.tool_call_parser: name`: a registered one first, else SGLang's."""
    factories = registered_tool_parsers()
    if name in factories:
        return factories[name]()
    sglang = _sglang_parsers()
    if sglang is not None and name in sglang:
        return SGLangToolParser(name)
    where = (f"SGLang's --tool-call-parser names: {', '.join(sorted(sglang))}" if sglang is not None else
             "sglang is not installed, so SGLang's parser names are unavailable (install the [gpu] extra)")
    raise ValueError(f"{KEY}: unknown tool-call parser {name!r}; registered: {', '.join(sorted(factories))}; "
                     f"{where}. Fix: name one of these, or register yours with "
                     "m2po_megatron.api.register_tool_parser(name, factory)")


if "m2po_tags" not in registered_tool_parsers():  # a user's own "m2po_tags" registered earlier wins
    register_tool_parser("m2po_tags", TagToolParser)


# ---------------------------------------------------------------------------------------------------------
# Chat-template rendering


def render_ids(tokenizer, messages: list[dict], tools: Optional[Sequence[dict]] = None, *,
               add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template, with `tools` schemas."""
    out = tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                        add_generation_prompt=add_generation_prompt, tokenize=True)
    # transformers 5 returns a BatchEncoding by default (return_dict=True), 4.x a list of ids
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):  # a batch of one
        out = out[0]
    return [int(t) for t in out]


# The conversation the environment's messages are rendered after; only the difference is kept, so its
# words do not matter. Templates that check tool-call ids against earlier assistant calls need `context`.
_DUMMY = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def render_suffix(tokenizer, new_messages: list[dict], tools: Optional[Sequence[dict]] = None, *,
                  add_generation_prompt: bool = True, context: Optional[list[dict]] = None) -> list[int]:
    """The token ids that follow an assistant turn's generated ids for `new_messages` (tool results, user
    follow-ups), plus the next generation prompt when add_generation_prompt.

    The model's generation of a turn ends with its end-of-turn special token (<|im_end|>, <|eot_id|>, </s>);
    what the template writes after that token (Qwen's "\\n") is not generated, so it starts the suffix. Then
    prompt + generated ids + suffix equals the template's own render of the whole conversation. `context`
    (a conversation ending with an assistant message) replaces the fixed one the difference is taken after.
    """
    base = list(context) if context is not None else _DUMMY
    if not base or base[-1].get("role") != "assistant":
        raise ValueError("render_suffix: `context` must end with an assistant message")
    prompt = render_ids(tokenizer, base[:-1], tools, add_generation_prompt=True)
    turn = render_ids(tokenizer, base, tools, add_generation_prompt=False)
    full = render_ids(tokenizer, base + list(new_messages), tools, add_generation_prompt=add_generation_prompt)
    if full[:len(turn)] != turn:
        at = next((i for i, (a, b) in enumerate(zip(full, turn)) if a != b), len(full))
        raise ValueError(
            f"{KEY}: the chat template does not render a conversation as an extension of its earlier turns "
            f"(token {at} of {len(turn)} differs once {[m.get('role') for m in new_messages]} messages follow); "
            "appending the environment's tokens after the generated ones would not match the template. Fix: "
            "use a chat template that only appends (e.g. without reasoning removed from earlier turns), or "
            "pass a `context` conversation the template renders stably")
    # where the generated part of the assistant turn ends: after its last special token, if any
    start = next((i for i, (a, b) in enumerate(zip(prompt, turn)) if a != b), min(len(prompt), len(turn)))
    special = _special_ids(tokenizer)
    end = len(turn)
    for i in range(len(turn) - 1, start - 1, -1):
        if turn[i] in special:
            end = i + 1
            break
    return turn[end:] + full[len(turn):]
