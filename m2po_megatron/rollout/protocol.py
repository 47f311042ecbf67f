"""SGLang's HTTP protocol as the project speaks it, checked against the contract generated from the installed
package (tools/gen_sglang_contract.py -> m2po_megatron/contracts/sglang-http-0.5.23.json).

Both sides use this module, with one difference:
- the client validates its OWN bodies strictly (a field SGLang does not know is a typo of ours: refused
  before anything is sent);
- the CPU server validates as SGLang's HTTP layer does: unknown top-level fields are ignored (the request
  classes and the /generate contract gate drop them), unknown `sampling_params` keys and wrong types are
  refused (HTTP 400), then SamplingParams' own rules (`sampling_params`), the refusals under
  --skip-tokenizer-init and the context-length limits (`check_lengths`) apply.
The contract stores each field's Python type as a string ("Optional[Union[List[int], int]]"); a small parser
turns it into a checker. Names it does not know (SGLang's own classes) accept any value."""
from __future__ import annotations

import functools
import math
import re
from typing import Any, Callable

from m2po_megatron import contracts

# SGLang 0.5.23's scheduler (managers/tp_worker.py, scheduler.py): max_req_len = context_len - 1, a request's
# max_new_tokens is capped at max_req_len - input_len - 1, and an input of max_req_len - 5 tokens or more is
# refused. So the last 2 positions of the context are never generated, and prompts need 6 spare positions.
OUTPUT_RESERVED_TOKENS = 2
INPUT_RESERVED_TOKENS = 6
DEFAULT_SAMPLING_SEED = 42  # what deterministic inference uses for a request without sampling_seed
TOP_K_ALL = 1 << 30


class ProtocolError(ValueError):
    """A request SGLang would refuse (HTTP 400)."""


def contract() -> dict:
    return contracts.load()


def routes() -> dict[str, list[str]]:
    """path -> HTTP methods of the real server's route table."""
    return contract()["routes"]


def endpoint_fields(endpoint: str) -> dict[str, dict]:
    """Fields of e.g. "POST /generate" as {name: {"type": str, "default": ...}}."""
    eps = contract()["endpoints"]
    if endpoint not in eps:
        raise KeyError(f"endpoint {endpoint!r} is not in the SGLang contract; known: {sorted(eps)}")
    return eps[endpoint]["fields"]


def sampling_param_defaults() -> dict[str, Any]:
    return {k: v["default"] for k, v in contract()["sampling_params_fields"].items()}


def launch_flags() -> dict[str, dict]:
    """Every flag of `python -m sglang.launch_server` (aliases included) -> its parser spec."""
    return contract()["launch_server"]["flags"]


def launch_flag(dest: str) -> str:
    """The CLI spelling of a server_args field, e.g. tp_size -> --tp-size."""
    cli = "--" + dest.replace("_", "-")
    if launch_flags().get(cli, {}).get("dest") != dest:
        raise KeyError(f"{cli} is not a flag of sglang.launch_server {contract()['sglang_version']}")
    return cli


def check_launch_args(args: list[str] | tuple[str, ...], what: str = "extra_args") -> None:
    """Refuse what SGLang's argument parser would refuse (unknown flag, missing or extra value, a value outside
    the choices or of the wrong type) and deprecated flags, naming the flag and the fix."""
    flags = launch_flags()
    version = contract()["sglang_version"]
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--"):
            raise ValueError(f"{what}: {a!r} is not a flag (values follow their flag)")
        name, eq, val = a.partition("=")
        spec = flags.get(name)
        if spec is None:
            raise ValueError(f"{what}: {name!r} is not a flag of sglang.launch_server {version}")
        if spec["deprecated"]:
            raise ValueError(f"{what}: {name} is deprecated in sglang {version} ({spec['deprecated']})")
        values: list[str] = [val] if eq else []
        if not eq and spec["takes_value"]:
            j = i + 1
            while j < len(args) and not args[j].startswith("--"):
                values.append(args[j])
                j += 1
                if spec["nargs"] in (None, "?"):
                    break
            i = j - 1
        nargs = spec["nargs"]
        if not spec["takes_value"] and values:
            raise ValueError(f"{what}: {name} takes no value, got {values[0]!r}")
        if nargs is None and len(values) != 1 or nargs == "+" and not values \
                or isinstance(nargs, int) and nargs > 0 and len(values) != nargs:
            raise ValueError(f"{what}: {name} needs a value")
        for v in values:
            if spec["choices"] and v not in [str(c) for c in spec["choices"]]:
                raise ValueError(f"{what}: {name} {v!r} is not one of {spec['choices']}")
            if spec["type"] in ("int", "float"):
                try:
                    (int if spec["type"] == "int" else float)(v)
                except ValueError:
                    raise ValueError(f"{what}: {name} needs an {spec['type']}, got {v!r}") from None
        i += 1


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


class _Bad(Exception):
    pass


def _strict(test):
    def conv(v):
        if not test(v):
            raise _Bad
        return v
    return conv


_BOOL_WORDS = {"0": False, "off": False, "f": False, "false": False, "n": False, "no": False,
               "1": True, "on": True, "t": True, "true": True, "y": True, "yes": True}


def _lax_int(v):
    """pydantic's lax int: ints, bools, integral floats and strings of them ("12", " 12", "12.0")."""
    if isinstance(v, (bool, int)):
        return int(v)
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            raise _Bad from None
    if isinstance(v, float) and v.is_integer():
        return int(v)
    raise _Bad


def _lax_float(v):
    if isinstance(v, (bool, int, float)):
        return float(v)
    if not isinstance(v, str):
        raise _Bad
    try:
        return float(v.strip())
    except ValueError:
        raise _Bad from None


def _lax_bool(v):
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _BOOL_WORDS:
        return _BOOL_WORDS[v.strip().lower()]
    raise _Bad


_SIMPLE = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "bytes": lambda v: isinstance(v, str),  # base64 in JSON
    "dict": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "NoneType": lambda v: v is None,
    "None": lambda v: v is None,
    "Any": lambda v: True,
}
_LAX = {"int": _lax_int, "float": _lax_float, "bool": _lax_bool}


def _parse(toks: list[str], i: int, lax: bool) -> tuple[Callable[[Any], Any], int]:
    """A converter for the type at toks[i]: returns the (coerced) value or raises _Bad."""
    t = toks[i]
    i += 1
    if t.startswith("<class '"):
        t = t[8:-2]
    elif t.startswith("<"):
        return (lambda v: v), i
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
            sub, i = _parse(toks, i, lax)
            args.append(sub)
        i += 1
    if t in _SIMPLE and not args:
        return (_LAX[t] if lax and t in _LAX else _strict(_SIMPLE[t])), i
    if t == "Optional":
        a = args[0]
        return (lambda v: None if v is None else a(v)), i
    if t == "Union":
        def union(v):
            for a in args:
                try:
                    return a(v)
                except _Bad:
                    pass
            raise _Bad
        return union, i
    if t in ("List", "list", "Set", "set"):  # a JSON array either way
        a = args[0] if args else (lambda v: v)
        return (lambda v: [a(x) for x in v] if isinstance(v, list) else _strict(lambda _: False)(v)), i
    if t in ("Dict", "dict"):
        if len(args) == 2:
            k, val = args
            return (lambda v: {k(x): val(y) for x, y in v.items()} if isinstance(v, dict)
                    else _strict(lambda _: False)(v)), i
        return _strict(_SIMPLE["dict"]), i
    if t == "Literal":
        return _strict(lambda v: isinstance(v, str) and v in args), i
    if t == "Annotated":
        return args[0], i
    return (lambda v: v), i  # a class of SGLang's own


@functools.cache
def converter(type_str: str, lax: bool = False) -> Callable[[Any], Any]:
    """value -> value as SGLang's parser reads it (lax: pydantic's coercions of the control endpoints), raising
    ValueError when it would refuse it."""
    try:
        while re.search(r"\([^()]*\)", type_str):  # drop call arguments, e.g. PlainValidator(fn)
            type_str = re.sub(r"\([^()]*\)", "", type_str)
        toks = _tokens(type_str)
        if "?" in toks[:1]:
            raise ValueError
        conv, _ = _parse(toks, 0, lax)
    except (ValueError, IndexError):
        return lambda v: v

    def run(v):
        try:
            return conv(v)
        except _Bad:
            raise ValueError(f"not a valid {type_str}") from None
    return run


def type_checker(type_str: str) -> Callable[[Any], bool]:
    """True when SGLang's strict JSON decoding accepts the value for this type."""
    conv = converter(type_str)

    def check(v):
        try:
            conv(v)
            return True
        except ValueError:
            return False
    return check


def validate_request(endpoint: str, body: Any, *, strict: bool = True) -> dict:
    """Raise ProtocolError naming the field when `body` is not a valid SGLang request for `endpoint`.
    strict=True (the client, for its own bodies) also refuses fields SGLang does not know; strict=False is
    SGLang's own behaviour: they are ignored."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{endpoint}: the body must be a JSON object, got {type(body).__name__}")
    fields = endpoint_fields(endpoint)
    unknown = sorted(set(body) - set(fields))
    if unknown and strict:
        cls = contract()["endpoints"][endpoint]["request_class"]
        raise ProtocolError(f"{endpoint}: unknown field(s) {unknown}: not in SGLang's {cls} "
                            f"(sglang {contract()['sglang_version']}); remove them")
    # /generate passes SGLang's strict contract gate; the control endpoints' request classes are parsed by
    # pydantic in lax mode ("12" or 12.0 for an int, "yes" or 1 for a bool), so the server coerces there.
    lax = not strict and endpoint != "POST /generate"
    out = dict(body)
    for name, spec in fields.items():
        if name not in body:
            if spec["default"] == "<required>":
                raise ProtocolError(f"{endpoint}: required field {name!r} is missing")
            continue
        try:
            out[name] = converter(spec["type"], lax)(body[name])
        except ValueError:
            raise ProtocolError(f"{endpoint}: field {name!r} must be {spec['type']}, got {body[name]!r:.80}") \
                from None
    if endpoint == "POST /generate":
        sps = body.get("sampling_params")
        for sp in sps if isinstance(sps, list) else [sps or {}]:
            validate_sampling_params(sp)
        return body
    return out if lax else body


def validate_sampling_params(sp: Any) -> dict:
    """The /generate contract gate: sampling_params is an object of known keys with well-typed values (null
    means "the default")."""
    if not isinstance(sp, dict):
        raise ProtocolError(f"sampling_params must be an object, got {type(sp).__name__}")
    known = contract()["sampling_params_fields"]
    unknown = sorted(set(sp) - set(known))
    if unknown:
        raise ProtocolError(f"sampling_params: unknown field(s) {unknown}; SGLang accepts {sorted(known)}")
    for k, v in sp.items():
        if v is not None and not type_checker(known[k]["type"])(v):
            raise ProtocolError(f"sampling_params.{k} must be {known[k]['type']}, got {v!r:.80}")
    return sp


def sampling_params(sp: dict, *, tokenizer: bool = False, vocab_size: int | None = None) -> dict:
    """What SGLang's SamplingParams(**sp), .normalize(tokenizer) and .verify(vocab_size) make of a validated
    sampling_params object: the effective values, or ProtocolError with SGLang's reason. tokenizer=False is
    --skip-tokenizer-init (always the case for the project's servers)."""
    validate_sampling_params(sp)
    out = sampling_param_defaults()
    out.update({k: v for k, v in sp.items() if v is not None or k in ("max_new_tokens", "sampling_seed")})
    if 0 <= out["temperature"] < 1e-6:  # greedy: SGLang samples with top_k = 1 at temperature 1
        out["temperature"], out["top_k"] = 1.0, 1
    if out["top_k"] == -1:
        out["top_k"] = TOP_K_ALL
    if not math.isfinite(out["temperature"]) or out["temperature"] < 0:
        raise ProtocolError(f"temperature must be a non-negative finite number, got {out['temperature']}.")
    if not 0.0 < out["top_p"] <= 1.0:
        raise ProtocolError(f"top_p must be in (0, 1], got {out['top_p']}.")
    if not 0.0 <= out["min_p"] <= 1.0:
        raise ProtocolError(f"min_p must be in [0, 1], got {out['min_p']}.")
    if out["top_k"] < 1:
        raise ProtocolError(f"top_k must be -1 (disable) or at least 1, got {out['top_k']}.")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= out[name] <= 2.0:
            raise ProtocolError(f"{name} must be in [-2, 2], got {out[name]}.")
    if not 0.0 < out["repetition_penalty"] <= 2.0:
        raise ProtocolError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got "
                            f"{out['repetition_penalty']}.")
    if out["min_new_tokens"] < 0:
        raise ProtocolError(f"min_new_tokens must be in [0, max_new_tokens], got {out['min_new_tokens']}.")
    if out["max_new_tokens"] is not None:
        if out["max_new_tokens"] < 0:
            raise ProtocolError(f"max_new_tokens must be at least 0, got {out['max_new_tokens']}.")
        if out["min_new_tokens"] > out["max_new_tokens"]:
            raise ProtocolError(f"min_new_tokens must be in [0, max_new_tokens({out['max_new_tokens']})], got "
                                f"{out['min_new_tokens']}.")
    if vocab_size is not None and out["logit_bias"]:
        for token_id in out["logit_bias"]:
            if not 0 <= int(token_id) < vocab_size:
                raise ProtocolError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")
    if out["sampling_seed"] is not None and not -(2**63) <= out["sampling_seed"] <= 2**63 - 1:
        raise ProtocolError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {out['sampling_seed']}.")
    if sum(out[g] is not None and out[g] != "" for g in ("json_schema", "regex", "ebnf", "structural_tag")) > 1:
        raise ProtocolError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
    if not tokenizer:  # SGLang's raise_if_tokenizer_required; note stop="" is a list with one (empty) string
        for key in ("stop", "stop_regex"):
            value = out[key]
            strs = [value] if isinstance(value, str) else value
            if strs:
                raise ProtocolError(f"{key}={strs!r} is unavailable when skip_tokenizer_init=True (requires "
                                    "tokenizer to decode tokens to text for matching).")
        if out["min_new_tokens"] > 0:
            raise ProtocolError(f"min_new_tokens={out['min_new_tokens']} is unavailable when "
                                "skip_tokenizer_init=True (requires tokenizer for eos_token_id).")
    return out


def check_lengths(input_len: int, requested: int | None, limit: int | None, context_len: int, *,
                  allow_auto_truncate: bool = False) -> tuple[int, int]:
    """SGLang's length rules for one request: (kept input tokens, effective max_new_tokens) or ProtocolError.
    requested: max_new_tokens as the request gave it (absent or null: not checked against the context, as in
    SGLang's tokenizer manager); limit: the normalized value (128 when absent, None = no limit)."""
    if input_len >= context_len:
        if not allow_auto_truncate:
            raise ProtocolError(f"The input ({input_len} tokens) is longer than the model's context length "
                                f"({context_len} tokens).")
        input_len = context_len
    if requested is not None and requested + input_len > context_len:
        if not allow_auto_truncate:
            raise ProtocolError(
                f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
                f"You requested a total of {requested + input_len} tokens: {input_len} tokens from the "
                f"input messages and {requested} tokens for the completion. Please reduce the number of "
                "tokens in the input messages or the completion to fit within the limit.")
        limit = max(0, context_len - input_len)
    max_input = context_len - INPUT_RESERVED_TOKENS
    if input_len >= max_input:
        if not allow_auto_truncate:
            raise ProtocolError(f"Input length ({input_len} tokens) exceeds the maximum allowed length "
                                f"({max_input} tokens). Use a shorter input or enable --allow-auto-truncate.")
        input_len = max_input
    cap = context_len - OUTPUT_RESERVED_TOKENS - input_len
    return input_len, max(0, cap if limit is None else min(limit, cap))


def expand_weight_versions(meta_info: dict, num_tokens: int) -> list[str]:
    """Per-output-token weight version from SGLang's `weight_versions` spans ({version, start, end}, end
    exclusive, contiguous from 0), which every /generate answer of SGLang 0.5.23 carries."""
    spans = meta_info.get("weight_versions")
    if spans is None:
        raise ValueError("the /generate answer has no meta_info.weight_versions (SGLang 0.5.23 always sends "
                         "them); is the server an older SGLang?")
    out: list[str] = []
    for s in spans:
        version, start, end = (s["version"], s["start"], s["end"]) if isinstance(s, dict) else s
        if start != len(out):
            raise ValueError(f"weight_versions spans are not contiguous at token {len(out)}: {spans}")
        out.extend([str(version)] * (end - start))
    if len(out) < num_tokens:  # spans are clamped to completion_tokens; never trust them to over-cover
        out.extend([out[-1] if out else str(meta_info.get("weight_version"))] * (num_tokens - len(out)))
    return out[:num_tokens]


def spans_from_versions(versions: list[str], current: str) -> list[dict]:
    """The inverse of expand_weight_versions: [{version, start, end}] over output positions; a sample without
    tokens gets one empty span of the server's current version, as SGLang sends."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans or [{"version": current, "start": 0, "end": 0}]
