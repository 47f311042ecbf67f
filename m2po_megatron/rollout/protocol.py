"""The subset of SGLang's HTTP protocol we speak, checked against the frozen contract file.

Both sides use this module: the CPU server rejects what SGLang would reject (unknown fields, wrong types,
missing required fields), and the tests check that every body the client builds is a valid SGLang body.
The contract stores each field's Python type as a string (e.g. "Optional[Union[List[int], int]]"); a
small parser turns it into a checker. Names the contract does not define (SGLang's own classes) accept
any value."""
from __future__ import annotations

import functools
import re
from typing import Any, Callable

from m2po_megatron import contracts


class ProtocolError(ValueError):
    """A request body that SGLang would refuse (HTTP 400)."""


def contract() -> dict:
    return contracts.load()


def endpoint_fields(endpoint: str) -> dict[str, dict]:
    """Fields of e.g. "POST /generate" as {name: {"type": str, "default": ...}}."""
    eps = contract()["endpoints"]
    if endpoint not in eps:
        raise KeyError(f"endpoint {endpoint!r} is not in the SGLang contract; known: {sorted(eps)}")
    return eps[endpoint]["fields"]


def sampling_param_defaults() -> dict[str, Any]:
    return dict(contract()["sampling_params_fields"])


def launch_flags() -> dict[str, str]:
    """server_args name -> CLI flag of `python -m sglang.launch_server`."""
    return {k: v["cli"] for k, v in contract()["launch_server"]["server_args"].items()}


# ---------------------------------------------------------------- type strings -> checkers
_TOKEN = re.compile(r"\s*(\[|\]|,|'[^']*'|\"[^\"]*\"|[A-Za-z_][\w.]*|<class '[^']*'>|<[^>]*>)")


def _tokens(s: str) -> list[str]:
    out, pos = [], 0
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if not m:  # anything exotic (e.g. an object repr): stop parsing, caller treats as Any
            out.append("?")
            break
        out.append(m.group(1))
        pos = m.end()
        while pos < len(s) and s[pos].isspace():
            pos += 1
    return out


def _any(_v):
    return True


_SIMPLE: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "bytes": lambda v: isinstance(v, str),  # base64 in JSON
    "dict": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "NoneType": lambda v: v is None,
    "None": lambda v: v is None,
    "Any": _any,
}


def _parse(toks: list[str], i: int) -> tuple[Callable[[Any], bool], int]:
    t = toks[i]
    i += 1
    if t.startswith("<class '"):
        return _SIMPLE.get(t[8:-2], _any), i
    if t.startswith("<"):
        return _any, i
    args: list = []
    if i < len(toks) and toks[i] == "[":
        i += 1
        while toks[i] != "]":
            if toks[i] == ",":
                i += 1
                continue
            if toks[i][0] in "'\"":
                args.append(toks[i][1:-1])
                i += 1
                continue
            if toks[i] == "?":
                raise ValueError
            sub, i = _parse(toks, i)
            args.append(sub)
        i += 1
    if t in _SIMPLE and not args:
        return _SIMPLE[t], i
    if t == "Optional":
        a = args[0]
        return (lambda v: v is None or a(v)), i
    if t == "Union":
        return (lambda v: any(a(v) for a in args)), i
    if t in ("List", "list"):
        a = args[0] if args else _any
        return (lambda v: isinstance(v, list) and all(a(x) for x in v)), i
    if t in ("Dict", "dict"):
        if len(args) == 2:
            k, val = args
            return (lambda v: isinstance(v, dict) and all(k(x) and val(y) for x, y in v.items())), i
        return _SIMPLE["dict"], i
    if t == "Literal":
        return (lambda v: v in args), i
    if t == "Annotated":
        return args[0], i
    return _any, i  # a class of SGLang's own


@functools.cache
def type_checker(type_str: str) -> Callable[[Any], bool]:
    try:
        while re.search(r"\([^()]*\)", type_str):  # drop call arguments, e.g. PlainValidator(fn)
            type_str = re.sub(r"\([^()]*\)", "", type_str)
        toks = _tokens(type_str)
        if "?" in toks[:1]:
            return _any
        check, _ = _parse(toks, 0)
        return check
    except (ValueError, IndexError):
        return _any


def validate_request(endpoint: str, body: Any) -> dict:
    """Raise ProtocolError naming the field when `body` is not a valid SGLang request for `endpoint`."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{endpoint}: the body must be a JSON object, got {type(body).__name__}")
    fields = endpoint_fields(endpoint)
    unknown = sorted(set(body) - set(fields))
    if unknown:
        cls = contract()["endpoints"][endpoint]["request_class"]
        raise ProtocolError(f"{endpoint}: unknown field(s) {unknown}: not in SGLang's {cls} "
                            f"(sglang {contract()['sglang_version']}); remove them")
    for name, spec in fields.items():
        if name not in body:
            if spec["default"] == "<required>":
                raise ProtocolError(f"{endpoint}: required field {name!r} is missing")
            continue
        if not type_checker(spec["type"])(body[name]):
            raise ProtocolError(f"{endpoint}: field {name!r} must be {spec['type']}, got {body[name]!r:.80}")
    if endpoint == "POST /generate":
        sps = body.get("sampling_params")
        for sp in sps if isinstance(sps, list) else [sps or {}]:
            validate_sampling_params(sp)
    return body


_SP_TYPES = {
    "max_new_tokens": "Optional[int]", "stop": "Optional[Union[str, List[str]]]",
    "stop_token_ids": "Optional[List[int]]", "temperature": "float", "top_p": "float", "top_k": "int",
    "min_p": "float", "frequency_penalty": "float", "presence_penalty": "float",
    "repetition_penalty": "float", "min_new_tokens": "int", "n": "int", "ignore_eos": "bool",
    "skip_special_tokens": "bool", "no_stop_trim": "bool", "sampling_seed": "Optional[int]",
    "logit_bias": "Optional[Dict[str, float]]",
}


def validate_sampling_params(sp: Any) -> dict:
    if not isinstance(sp, dict):
        raise ProtocolError(f"sampling_params must be an object, got {type(sp).__name__}")
    known = sampling_param_defaults()
    unknown = sorted(set(sp) - set(known))
    if unknown:
        raise ProtocolError(f"sampling_params: unknown field(s) {unknown}; SGLang accepts {sorted(known)}")
    for k, v in sp.items():
        if not type_checker(_SP_TYPES.get(k, "Any"))(v):
            raise ProtocolError(f"sampling_params.{k} must be {_SP_TYPES[k]}, got {v!r:.80}")
    if sp.get("temperature", 1.0) < 0:
        raise ProtocolError("sampling_params.temperature must be >= 0")
    if not 0 < sp.get("top_p", 1.0) <= 1:
        raise ProtocolError("sampling_params.top_p must be in (0, 1]")
    if sp.get("top_k", -1) == 0 or sp.get("top_k", -1) < -1:
        raise ProtocolError("sampling_params.top_k must be -1 (all) or >= 1")
    if sp.get("n", 1) < 1:
        raise ProtocolError("sampling_params.n must be >= 1")
    if sp.get("max_new_tokens") is not None and sp["max_new_tokens"] < 0:
        raise ProtocolError("sampling_params.max_new_tokens must be >= 0")
    return sp


def expand_weight_versions(meta_info: dict, num_tokens: int) -> list[str]:
    """Per-output-token weight version from SGLang's `weight_versions` spans ({version, start, end}, end
    exclusive, contiguous from 0). Without spans every token has `weight_version`."""
    spans = meta_info.get("weight_versions")
    out: list[str] = []
    if spans:
        for s in spans:
            version, start, end = (s["version"], s["start"], s["end"]) if isinstance(s, dict) else s
            if start != len(out):
                raise ValueError(f"weight_versions spans are not contiguous at token {len(out)}: {spans}")
            out.extend([str(version)] * (end - start))
    if len(out) < num_tokens:  # the last span may be reported before the final tokens are counted
        out.extend([str(meta_info.get("weight_version", out[-1] if out else "default"))] * (num_tokens - len(out)))
    return out[:num_tokens]


def spans_from_versions(versions: list[str]) -> list[dict]:
    """The inverse of expand_weight_versions: [{version, start, end}] over output positions."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans
