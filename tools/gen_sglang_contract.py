"""Generate m2po_megatron/contracts/sglang-http-<version>.json from the INSTALLED sglang and sglang-router.

    python tools/gen_sglang_contract.py [--out PATH] [--check]

Run it in the environment `make test-sglang` builds (tools/sglang_env.sh prints its python). Nothing in the
file is written by hand: routes and methods come from the real FastAPI app, request fields and defaults from
the request classes its routes parse bodies into, query parameters from the routes, the sampling-params
fields from SGLang's SamplingParams, which unknown keys /generate ignores or rejects from its contract gate,
and every launch/router flag from the real argument parsers. --check exits 1 when the file on disk differs
(the contract test suite runs it so a stale file fails CI)."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import pathlib
import re
import sys
import typing
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The endpoints the project calls (client, weight sync, launcher, health checks) or answers (CPU server).
USED = ["POST /generate", "POST /init_weights_update_group", "POST /destroy_weights_update_group",
        "POST /begin_weight_update", "POST /end_weight_update", "POST /update_weights_from_distributed",
        "POST /update_weights_from_tensor", "POST /update_weight_version", "POST /pause_generation",
        "POST /continue_generation", "POST /abort_request", "POST /flush_cache", "GET /flush_cache",
        "GET /health", "GET /health_generate", "GET /get_model_info", "GET /model_info",
        "GET /get_server_info", "GET /server_info", "POST /release_memory_occupation",
        "POST /resume_memory_occupation"]


def _jsonable(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple, set, frozenset)):
        items = [_jsonable(x) for x in v]
        return sorted(items, key=repr) if isinstance(v, (set, frozenset)) else items
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return repr(v)


def _type_str(tp) -> str:
    s = tp if isinstance(tp, str) else repr(tp)
    s = re.sub(r"<class '([\w.]+)'>", r"\1", s)
    s = re.sub(r" at 0x[0-9a-f]+>", ">", s)  # reprs of validator objects and functions
    s = re.sub(r"\b(typing|typing_extensions|builtins)\.", "", s)
    return re.sub(r"\b(?:[a-z_][\w]*\.)+([A-Z]\w*)", r"\1", s)  # module paths of SGLang's own classes


def request_fields(cls) -> dict:
    """{name: {type, default}} of a dataclass or msgspec.Struct request class; '<required>' = no default."""
    import msgspec

    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except Exception:  # noqa: BLE001 - a forward reference SGLang never resolves: keep the raw annotation
        hints = {}
    out = {}
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                default = _jsonable(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = _jsonable(f.default_factory())
            else:
                default = "<required>"
            out[f.name] = {"type": _type_str(hints.get(f.name, f.type)), "default": default}
    else:
        for f in msgspec.structs.fields(cls):
            if f.required:
                default = "<required>"
            elif f.default is not msgspec.NODEFAULT:
                default = _jsonable(f.default)
            else:
                default = _jsonable(f.default_factory())
            out[f.name] = {"type": _type_str(hints.get(f.name, f.type)), "default": default}
    return out


def routes(app) -> tuple[dict, dict]:
    from fastapi.routing import APIRoute

    table: dict[str, list[str]] = {}
    endpoints: dict[str, dict] = {}
    for r in app.routes:
        if not isinstance(r, APIRoute):
            continue
        table[r.path] = sorted(set(table.get(r.path, [])) | set(r.methods))
        for m in sorted(r.methods):
            key = f"{m} {r.path}"
            if key not in USED:
                continue
            d = r.dependant
            ep: dict = {"request_class": None, "fields": {}, "query": {}}
            if d.body_params:
                cls = d.body_params[0].field_info.annotation
                ep["request_class"] = cls.__name__
                ep["fields"] = request_fields(cls)
            for q in d.query_params:
                default = q.field_info.default
                ep["query"][q.name] = {"type": _type_str(q.field_info.annotation),
                                       "default": "<required>" if repr(default) == "PydanticUndefined"
                                       else _jsonable(default),
                                       "constraints": [repr(c) for c in q.field_info.metadata]}
            endpoints[key] = ep
    missing = sorted(set(USED) - set(endpoints))
    if missing:
        raise SystemExit(f"the installed sglang has no route for {missing}; the project calls them")
    return dict(sorted(table.items())), dict(sorted(endpoints.items()))


def unknown_key_policy() -> dict:
    """What the /generate contract gate does with a key it does not know, probed on the real decoders."""
    from sglang.api.v1.api_types import GenerateRequest, JsonContractError, SamplingParams

    def policy(cls, body):
        try:
            cls.from_json_value(body)
            return "ignored"
        except JsonContractError:
            return "rejected"

    return {"top_level": policy(GenerateRequest, {"input_ids": [1], "m2po_probe_unknown": 1}),
            "sampling_params": policy(SamplingParams, {"m2po_probe_unknown": 1})}


def sampling_params_fields() -> dict:
    """The wire fields of sampling_params (the contract gate's SamplingParams) with the defaults SGLang's own
    SamplingParams applies."""
    from sglang.api.v1.api_types import SamplingParams as Wire
    from sglang.srt.sampling.sampling_params import SamplingParams

    real = request_fields(SamplingParams)
    wire = request_fields(Wire)
    return {k: real.get(k, wire[k]) for k in wire}


def flags(parser: argparse.ArgumentParser) -> dict:
    out = {}
    for a in parser._actions:
        if not a.option_strings or isinstance(a, argparse._HelpAction):
            continue
        kind = type(a).__name__
        spec = {"dest": a.dest, "nargs": a.nargs if a.nargs is None or isinstance(a.nargs, (int, str)) else None,
                "takes_value": a.nargs != 0,
                "choices": sorted(_jsonable(list(a.choices)), key=str) if a.choices else None,  # some are sets
                "type": getattr(a.type, "__name__", None) if a.type else None, "default": _jsonable(a.default),
                "action": kind, "aliases": sorted(o for o in a.option_strings if o != a.option_strings[-1]),
                "deprecated": None}
        if kind.startswith("Deprecated"):
            new = getattr(a, "new_flag", None)
            err = getattr(a, "error_message", None)
            spec["deprecated"] = err or ("use " + new if new else "deprecated, no replacement")
            spec["deprecated_is_error"] = bool(err)
        for opt in a.option_strings:
            out[opt] = spec
    return dict(sorted(out.items()))


def generate() -> dict:
    warnings.filterwarnings("ignore")
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.server_args import ServerArgs
    from sglang_router.router_args import RouterArgs

    table, endpoints = routes(app)
    server = argparse.ArgumentParser(prog="python -m sglang.launch_server")
    ServerArgs.add_cli_args(server)
    router = argparse.ArgumentParser(prog="python -m sglang_router.launch_router")
    RouterArgs.add_cli_args(router, use_router_prefix=False)
    return {
        "sglang_version": importlib.metadata.version("sglang"),
        "sglang_router_version": importlib.metadata.version("sglang-router"),
        "generated_by": "tools/gen_sglang_contract.py (do not edit by hand; re-run it in the make test-sglang "
                        "environment)",
        "routes": table,
        "endpoints": endpoints,
        "unknown_keys": unknown_key_policy(),
        "sampling_params_fields": sampling_params_fields(),
        "launch_server": {"command": "python -m sglang.launch_server", "flags": flags(server)},
        "launch_router": {"command": "python -m sglang_router.launch_router", "flags": flags(router)},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="default: m2po_megatron/contracts/sglang-http-<version>.json")
    p.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    args = p.parse_args(argv)
    data = generate()
    out = pathlib.Path(args.out or ROOT / "m2po_megatron" / "contracts" / f"sglang-http-{data['sglang_version']}.json")
    text = json.dumps(data, indent=1, sort_keys=False) + "\n"
    if args.check:
        if not out.exists() or out.read_text() != text:
            print(f"{out} differs from what the installed sglang {data['sglang_version']} generates; run "
                  f"python tools/gen_sglang_contract.py in the make test-sglang environment", file=sys.stderr)
            return 1
        print(f"{out} is up to date")
        return 0
    out.write_text(text)
    print(f"wrote {out}: {len(data['routes'])} routes, {len(data['endpoints'])} endpoints, "
          f"{len(data['launch_server']['flags'])} launch flags, {len(data['launch_router']['flags'])} router flags")
    return 0


if __name__ == "__main__":
    sys.exit(main())
