"""The reward-service protocol (recipe `reward.function: remote`): its arguments and their checks, the endpoint
and request body of each kind for a batch of samples, and the scores read back from an answer. Pure functions
with no HTTP and no third-party imports (the contract tests run them in SGLang's environment); remote.py sends.

Kinds (docs/reward-service.md):
- ``sglang_rm``: a reward model served by SGLang (a *ForSequenceClassification / *ForRewardModel checkpoint):
  POST {url}/classify with SGLang's EmbeddingReqInput ``{"text": [...]}``; the answer is one
  ``{"embedding": [score, ...], "meta_info": {...}}`` per text, in order.
- ``openai_judge``: a generative judge behind an OpenAI-compatible server (SGLang, vLLM, a hosted API): one
  POST {url}/v1/chat/completions per sample; the score is read from the reply's text.
- ``http``: a user's own service: POST {url} ``{"items": [{prompt, response, label, row, finish_reason}]}``
  -> ``{"scores": [number | {"score": number, <extra>: number} | null, ...]}``.
"""
from __future__ import annotations

import json
import math
import os
import re
import string
from dataclasses import dataclass, field, fields
from typing import Any, Optional
from urllib.parse import urlsplit

from .types import RewardInput, RewardValueError, normalize

KINDS = ("sglang_rm", "openai_judge", "http")
TEMPLATE_FIELDS = ("prompt", "response", "label")

# Our own wording; {{ }} are literal braces of str.format.
DEFAULT_JUDGE_TEMPLATE = (
    "You are grading an answer to a task.\n\n"
    "## Task\n{prompt}\n\n"
    "## Reference answer (may be empty)\n{label}\n\n"
    "## Answer to grade\n{response}\n\n"
    "Decide how correct and complete the answer is, using the reference answer when one is given. "
    "Finish with one line holding only a JSON object {{\"score\": s}}, where s is a number from 0 (wrong) "
    "to 1 (fully correct).")


class BadResponse(ValueError):
    """The service answered 2xx, but not with one finite score per item (non-JSON, wrong shape or count)."""


@dataclass
class RemoteArgs:
    """A reward term's `args` for the remote reward, with defaults (docs/reward-service.md, one by one)."""
    url: str = ""
    kind: str = ""
    model: Optional[str] = None  # openai_judge: the served model's name
    api_key_env: Optional[str] = None  # the NAME of the environment variable holding the bearer key
    batch_size: int = 32  # items per request (sglang_rm, http); openai_judge sends one item per request
    max_concurrency: int = 8  # requests in flight at once, per RemoteReward
    timeout_s: float = 60.0  # per request (connect + answer)
    max_retries: int = 3  # further attempts after a retryable failure (timeout, connection, 429, 5xx)
    backoff_s: float = 0.5  # first retry's delay; doubled each retry, jittered, capped at max_backoff_s
    max_backoff_s: float = 8.0
    label_key: Optional[str] = "answer"  # the row's column read as {label}
    prompt_key: Optional[str] = None  # a row column read as {prompt} instead of the rendered prompt
    rm_template: str = "{prompt}{response}"  # sglang_rm: the text the reward model reads
    judge_template: str = DEFAULT_JUDGE_TEMPLATE  # openai_judge: the user message
    judge_system: Optional[str] = None  # openai_judge: a system message, if any
    max_tokens: int = 1024  # openai_judge: sent as max_completion_tokens
    temperature: Optional[float] = 0.0  # openai_judge; null: the server's default
    score_index: int = 0  # sglang_rm: which value of the returned vector is the reward
    score_scale: float = 1.0  # every score is multiplied by it, then clamped to [min_score, max_score]
    min_score: Optional[float] = None
    max_score: Optional[float] = None
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body

    @classmethod
    def from_args(cls, args: dict) -> "RemoteArgs":
        """Assumes check_args(args) found nothing."""
        return cls(**{k: v for k, v in args.items() if v is not None or k in _NULLABLE})


_NAMES = tuple(f.name for f in fields(RemoteArgs))
_NULLABLE = {"model", "api_key_env", "label_key", "prompt_key", "judge_system", "temperature", "min_score",
             "max_score"}
_ONLY = {"model": ("openai_judge",), "judge_template": ("openai_judge",), "judge_system": ("openai_judge",),
         "max_tokens": ("openai_judge",), "temperature": ("openai_judge",), "rm_template": ("sglang_rm",),
         "score_index": ("sglang_rm",), "batch_size": ("sglang_rm", "http")}
_BODY_KEYS = {"sglang_rm": {"text"}, "openai_judge": {"messages", "model", "max_completion_tokens", "temperature"},
              "http": {"items"}}
_LITERAL_SECRETS = ("api_key", "key", "token", "password", "authorization", "headers")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def template_fields(template: str) -> set[str]:
    """The {names} a template uses; ValueError for positional fields, bad syntax or unknown names."""
    names = set()
    for _, name, spec, conv in string.Formatter().parse(template):
        if name is None:
            continue
        if name == "" or name.isdigit():
            raise ValueError("has a positional field {}; name it: {prompt}, {response} or {label} "
                             "(write literal braces as {{ and }})")
        if name not in TEMPLATE_FIELDS:
            raise ValueError(f"uses {{{name}}}; the fields are {{prompt}}, {{response}}, {{label}} "
                             f"(write literal braces as {{{{ and }}}})")
        names.add(name)
    template.format(prompt="p", response="r", label="l")  # a bad format spec or conversion raises here
    return names


def check_args(args: Any) -> list[str]:
    """Every problem with a remote reward term's args, each naming `args.<field>` and the fix."""
    if not isinstance(args, dict):
        return [f"args must be a mapping ({{url: ..., kind: ...}}), got {type(args).__name__}"]
    errors: list[str] = []
    for k in args:
        if k in _NAMES:
            continue
        if str(k).lower() in _LITERAL_SECRETS:  # never echo the value: it may be the key itself
            errors.append(f"args.{k}: a key is never written in the recipe; export it in an environment variable "
                          f"and name the variable with args.api_key_env")
        else:
            errors.append(f"args.{k}: unknown; the arguments are {', '.join(_NAMES)}")
    kind = args.get("kind")
    if kind not in KINDS:
        errors.append(f"args.kind: {'required' if kind is None else repr(kind) + ' is not a kind'}; one of "
                      f"{', '.join(KINDS)} (sglang_rm: a reward model served by SGLang, openai_judge: a judge "
                      f"behind /v1/chat/completions, http: your own service)")
    errors += _check_url(args.get("url"))
    for k, kinds in _ONLY.items():
        if args.get(k) is not None and kind in KINDS and kind not in kinds:
            errors.append(f"args.{k}: used only by kind {' / '.join(kinds)}, not {kind}; remove it")
    env = args.get("api_key_env")
    if env is not None:
        if not isinstance(env, str) or not _ENV_NAME.fullmatch(env):
            errors.append("args.api_key_env: must be the NAME of an environment variable (e.g. RM_API_KEY) that "
                          "holds the key, not the key itself")
        elif not os.environ.get(env):
            errors.append(f"args.api_key_env: the environment variable {env} is not set (or empty); export the "
                          f"service's key in it before the run")
    for k, lo in (("batch_size", 1), ("max_concurrency", 1), ("max_retries", 0), ("max_tokens", 1),
                  ("score_index", 0)):
        if k in args and not (_int(args[k]) and args[k] >= lo):
            errors.append(f"args.{k} = {args[k]!r}: must be an integer >= {lo}")
    for k, positive in (("timeout_s", True), ("backoff_s", False), ("max_backoff_s", False)):
        if k in args and not (_num(args[k]) and (args[k] > 0 if positive else args[k] >= 0)):
            errors.append(f"args.{k} = {args[k]!r}: must be a number {'>' if positive else '>='} 0 (seconds)")
    if _num(args.get("backoff_s")) and _num(args.get("max_backoff_s")) and args["max_backoff_s"] < args["backoff_s"]:
        errors.append(f"args.max_backoff_s = {args['max_backoff_s']} is below args.backoff_s = {args['backoff_s']}; "
                      f"raise it (it caps the doubled delays)")
    for k in ("temperature", "min_score", "max_score"):
        if args.get(k) is not None and not _num(args[k]):
            errors.append(f"args.{k} = {args[k]!r}: must be a finite number or null")
    if "score_scale" in args and not _num(args["score_scale"]):
        errors.append(f"args.score_scale = {args['score_scale']!r}: must be a finite number")
    if _num(args.get("temperature")) and args["temperature"] < 0:
        errors.append(f"args.temperature = {args['temperature']}: must be >= 0")
    if _num(args.get("min_score")) and _num(args.get("max_score")) and args["min_score"] > args["max_score"]:
        errors.append(f"args.min_score = {args['min_score']} > args.max_score = {args['max_score']}; swap them")
    for k in ("model", "label_key", "prompt_key", "judge_system"):
        if args.get(k) is not None and not (isinstance(args[k], str) and args[k]):
            errors.append(f"args.{k} = {args[k]!r}: must be a non-empty string or null")
    for k in ("rm_template", "judge_template"):
        if k in args:
            if not isinstance(args[k], str):
                errors.append(f"args.{k}: must be a string with {{prompt}}, {{response}}, {{label}} fields")
                continue
            try:
                if "response" not in template_fields(args[k]):
                    errors.append(f"args.{k}: has no {{response}}; the service would never see the answer")
            except (ValueError, IndexError, KeyError) as e:
                errors.append(f"args.{k}: {e}")
    extra = args.get("extra_body")
    if extra is not None:
        if not isinstance(extra, dict):
            errors.append("args.extra_body: must be a mapping merged into each request body")
        elif kind in KINDS and set(extra) & _BODY_KEYS[kind]:
            errors.append(f"args.extra_body: sets {', '.join(sorted(set(extra) & _BODY_KEYS[kind]))}, which "
                          f"the {kind} request builds itself; use the matching argument instead")
    return errors


def _check_url(url: Any) -> list[str]:
    if url is None:
        return ["args.url: required; the service's address, e.g. http://10.0.0.5:30000 (sglang_rm, "
                "openai_judge) or the full endpoint URL (http)"]
    if not isinstance(url, str):
        return [f"args.url: must be a string, got {type(url).__name__}"]
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a bad port raises here)
    except ValueError:
        return ["args.url: not a valid URL; write it as http(s)://host:port[/path]"]
    if parts.username or parts.password:  # never echo it: the part after the scheme holds a credential
        return ["args.url: carries a user name or password; remove it and name the variable that holds the "
                "key with args.api_key_env"]
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return [f"args.url: must be http(s)://host[:port][/path], got scheme {parts.scheme or 'none'!r}"
                f"{'' if parts.hostname else ' and no host'}"]
    return []


# -- requests -----------------------------------------------------------------------------------------------
def endpoint(a: RemoteArgs) -> str:
    """Where the requests of kind `a.kind` go."""
    base = a.url.rstrip("/")
    if a.kind == "sglang_rm":
        return base + "/classify"
    if a.kind == "openai_judge":  # an OpenAI base URL often ends in /v1 already
        if base.endswith("/chat/completions"):
            return base
        return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")
    return a.url


def headers(api_key: Optional[str]) -> dict[str, str]:
    """The request headers: JSON, and the key as a bearer token (what SGLang's --api-key and OpenAI expect)."""
    out = {"Content-Type": "application/json"}
    if api_key:
        out["Authorization"] = f"Bearer {api_key}"
    return out


def display_url(url: str) -> str:
    """scheme://host:port/path, for logs and messages (no query string: it may carry a token)."""
    p = urlsplit(url)
    return f"{p.scheme}://{p.hostname}{f':{p.port}' if p.port else ''}{p.path}"


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):  # chat messages
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in value)
    return "" if value is None else str(value)


def template_values(item: RewardInput, a: RemoteArgs) -> dict[str, str]:
    """{prompt}, {response}, {label} of one sample."""
    row = item.row or {}
    prompt = _text(row.get(a.prompt_key)) if a.prompt_key else item.prompt
    label = _text(row.get(a.label_key)) if a.label_key else ""
    return {"prompt": prompt, "response": item.response, "label": label}


def build_body(a: RemoteArgs, items: list[RewardInput]) -> dict:
    """The JSON body of one request for `items` (exactly one item for openai_judge)."""
    if a.kind == "sglang_rm":
        body: dict[str, Any] = {"text": [a.rm_template.format(**template_values(it, a)) for it in items]}
    elif a.kind == "openai_judge":
        if len(items) != 1:
            raise ValueError(f"openai_judge scores one item per request, got {len(items)}")
        messages = [{"role": "system", "content": a.judge_system}] if a.judge_system else []
        messages.append({"role": "user", "content": a.judge_template.format(**template_values(items[0], a))})
        body = {"messages": messages, "max_completion_tokens": a.max_tokens}
        if a.model:
            body["model"] = a.model
        if a.temperature is not None:
            body["temperature"] = a.temperature
    else:
        body = {"items": [{**template_values(it, a), "row": it.row, "finish_reason": it.finish_reason}
                          for it in items]}
    return {**a.extra_body, **body}


def _plain(v: Any) -> Any:
    """JSON for what rows of parquet files hold (numpy scalars and arrays) and other odd values."""
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, (set, frozenset, tuple)):
        return list(v)
    return str(v)


def encode(body: dict) -> bytes:
    return json.dumps(body, default=_plain).encode()


# -- answers ------------------------------------------------------------------------------------------------
Verdict = tuple[Optional[float], dict[str, float], str]  # (score or None, extras, why it is None)


def parse_answer(a: RemoteArgs, text: str, n: int) -> list[Verdict]:
    """One verdict per item of a 2xx answer; BadResponse when the answer as a whole is unusable."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise BadResponse(f"the answer is not JSON: {text[:80]!r}") from None
    if a.kind == "sglang_rm":
        if not isinstance(doc, list) or len(doc) != n:
            raise BadResponse(f"expected a list of {n} results (one per text), got {_shape(doc)}")
        return [_finish(a, *_embedding_score(r, a.score_index)) for r in doc]
    if a.kind == "openai_judge":
        return [_finish(a, *_judge_verdict(doc))]
    scores = doc.get("scores") if isinstance(doc, dict) else None
    if not isinstance(scores, list) or len(scores) != n:
        raise BadResponse(f'expected {{"scores": [...]}} with {n} entries, got {_shape(doc)}')
    return [_finish(a, *_item_score(s)) for s in scores]


def _shape(doc: Any) -> str:
    if isinstance(doc, list):
        return f"a list of {len(doc)}"
    if isinstance(doc, dict):
        inner = {k: (f"list of {len(v)}" if isinstance(v, list) else type(v).__name__) for k, v in doc.items()}
        return f"an object {str(inner)[:120]}"
    return type(doc).__name__


def _embedding_score(r: Any, index: int) -> tuple[Optional[float], dict, str]:
    vec = r.get("embedding") if isinstance(r, dict) else None
    if not isinstance(vec, list) or len(vec) <= index:
        return None, {}, f"a result without embedding[{index}] (got {_shape(r)})"
    return _item_score(vec[index])


def _item_score(s: Any) -> tuple[Optional[float], dict, str]:
    if s is None:
        return None, {}, "the service gave no score (null)"
    if isinstance(s, dict):
        try:
            score, extras = normalize(s)
        except RewardValueError as e:
            return None, {}, f"the service's result {e}"
        return score, extras, ""
    if not _num(s):
        return None, {}, f"the score {s!r} is not a finite number"
    return float(s), {}, ""


_JSON_OBJECT = re.compile(r"\{[^{}]*\}")
_SCORE_LINE = re.compile(r"score\s*[:=]\s*\**\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def judge_score(reply: str) -> float:
    """A judge's score: the last JSON object with a "score", else the last `score: x`, else the last number."""
    for m in reversed(_JSON_OBJECT.findall(reply)):
        try:
            obj = json.loads(m)
        except ValueError:
            continue
        if isinstance(obj, dict) and "score" in obj:
            if not _num(obj["score"]):
                raise BadResponse(f'the judge\'s {{"score": ...}} is {obj["score"]!r}, not a finite number')
            return float(obj["score"])
    found = _SCORE_LINE.findall(reply) or _NUMBER.findall(reply)
    if not found:
        raise BadResponse(f"no score in the judge's reply ({reply[-80:]!r})")
    v = float(found[-1])
    if not math.isfinite(v):
        raise BadResponse(f"the judge's score {found[-1]!r} is not finite")
    return v


def _judge_verdict(doc: Any) -> tuple[Optional[float], dict, str]:
    try:
        choice = doc["choices"][0]
        content = choice["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise BadResponse(f"not a chat completion (choices[0].message.content missing): {_shape(doc)}") from None
    if not isinstance(content, str):
        why = " (finish_reason length: raise args.max_tokens)" if choice.get("finish_reason") == "length" else ""
        return None, {}, f"the judge's reply has no text{why}"
    try:
        return judge_score(content), {}, ""
    except BadResponse as e:
        return None, {}, str(e)


def _finish(a: RemoteArgs, score: Optional[float], extras: dict, why: str) -> Verdict:
    if score is None:
        return None, {}, why
    score *= a.score_scale
    if a.min_score is not None:
        score = max(score, float(a.min_score))
    if a.max_score is not None:
        score = min(score, float(a.max_score))
    return score, extras, ""
