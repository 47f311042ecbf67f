"""One rollout server's settings and the checks that run before it starts: ServerSpec (SGLang's
server_args names), the command line of SGLang or the CPU server, and preflight (engine, flags, model
directory, port, the CPU server's limits). No process is started here: rollout/launcher.py starts them."""
from __future__ import annotations

import dataclasses
import pathlib
import shlex
import socket
import sys
from typing import Sequence


class ServerStartError(RuntimeError):
    """A server could not be started; the message carries the cause and the tail of its log."""


@dataclasses.dataclass
class ServerSpec:
    """One server; field names are SGLang's server_args (CLI: --model-path, --tp-size, ...)."""
    model_path: str
    engine: str = "local"                  # "local" (CPU server) | "sglang"
    host: str = "127.0.0.1"                # "auto": the Ray node's address (actor mode)
    port: int = 0                          # 0: a free port chosen at start
    tp_size: int = 1
    dp_size: int = 1
    mem_fraction_static: float | None = None
    context_length: int | None = None
    dtype: str = "auto"
    quantization: str | None = None        # e.g. "fp8" (sglang only)
    api_key: str | None = None
    skip_tokenizer_init: bool = True
    random_seed: int | None = None
    max_running_requests: int | None = None
    weight_version: str | None = None
    enable_deterministic_inference: bool = False  # sampling_seed takes effect only with it (SGLang and ours)
    served_model_name: str | None = None   # the run's identity: checked in /get_server_info before use
    enable_return_routed_experts: bool = False  # R3 (algo.routing_replay=r3, MoE): answer routed experts
    extra_args: tuple[str, ...] = ()       # further SGLang flags, checked against the contract


# Flags our CPU server understands (a subset of SGLang's); anything else is refused for engine="local".
LOCAL_DTYPES = ("auto", "float", "float32", "bfloat16")  # SGLang --dtype values the CPU server serves
LOCAL_FLAGS = {"model_path", "host", "port", "api_key", "skip_tokenizer_init", "dtype", "context_length",
               "max_running_requests", "random_seed", "weight_version", "log_level", "tp_size", "dp_size",
               "mem_fraction_static", "quantization", "trust_remote_code", "served_model_name",
               "enable_deterministic_inference", "allow_auto_truncate", "enable_return_routed_experts"}
_FIELD_FLAGS = ["tp_size", "dp_size", "mem_fraction_static", "context_length", "dtype", "quantization",
                "random_seed", "max_running_requests", "weight_version", "served_model_name"]


def build_command(spec: ServerSpec, python: str = sys.executable) -> list[str]:
    """argv for the server. Every flag is one of SGLang's (the contract generated from sglang's own parser);
    extra_args are checked as that parser would check them, and deprecated flags are refused."""
    from m2po_megatron.rollout.protocol import check_launch_args, launch_flag, launch_flags

    if spec.engine == "sglang":
        cmd = [python, "-m", "sglang.launch_server"]
    elif spec.engine == "local":
        cmd = [python, "-m", "m2po_megatron.rollout.local_server"]
    else:
        raise ValueError(f"engine {spec.engine!r} must be 'local' or 'sglang'")
    cmd += [launch_flag("model_path"), str(spec.model_path), launch_flag("host"), spec.host,
            launch_flag("port"), str(spec.port)]
    for name in _FIELD_FLAGS:
        v = getattr(spec, name)
        default = {"tp_size": 1, "dp_size": 1, "dtype": "auto"}.get(name)
        if v is not None and v != default:
            cmd += [launch_flag(name), str(v)]
    for name in ("skip_tokenizer_init", "enable_deterministic_inference", "enable_return_routed_experts"):
        if getattr(spec, name):
            cmd.append(launch_flag(name))
    if spec.api_key:
        cmd += [launch_flag("api_key"), spec.api_key]
    check_launch_args(list(spec.extra_args))
    if spec.engine == "local":
        flags = launch_flags()
        local = [a for a in spec.extra_args if a.startswith("--")
                 and flags[a.split("=", 1)[0]]["dest"] not in LOCAL_FLAGS]
        if local:
            raise ValueError(f"extra_args flag(s) {local} are not supported by the CPU server (engine='local')")
    if spec.enable_return_routed_experts:  # R3 needs the model's expert ids (rollout/routing.py)
        from m2po_megatron.rollout.routing import expert_location_settings, physical_routing_refusal

        settings = expert_location_settings(flag_values(spec.extra_args))
        if settings:
            raise ValueError(physical_routing_refusal("extra_args", settings))
    cmd += list(spec.extra_args)
    return cmd


def flag_values(args: Sequence[str]) -> dict:
    """SGLang server_args name -> value of a checked flag list (check_launch_args): True for a switch, the
    string for a one-value flag, the list for a many-value one."""
    from m2po_megatron.rollout.protocol import launch_flags

    flags, out, i = launch_flags(), {}, 0
    while i < len(args):
        name, eq, val = args[i].partition("=")
        spec = flags[name]
        if not spec["takes_value"]:
            out[spec["dest"]] = True
        elif eq:
            out[spec["dest"]] = val
        else:
            vals = []
            while i + 1 < len(args) and not args[i + 1].startswith("--"):
                i += 1
                vals.append(args[i])
                if spec["nargs"] in (None, "?"):
                    break
            out[spec["dest"]] = vals[0] if spec["nargs"] in (None, "?") and vals else vals
        i += 1
    return out


def redact(cmd: Sequence[str]) -> str:
    """The command for logs, with the API key hidden."""
    out = list(cmd)
    for i, a in enumerate(out[:-1]):
        if a == "--api-key":
            out[i + 1] = "***"
    return shlex.join(out)


def preflight(spec: ServerSpec) -> None:
    """Fail before anything starts: bad engine/flags, missing model directory, port in use."""
    if spec.engine not in ("local", "sglang"):
        raise ValueError(f"engine {spec.engine!r} must be 'local' or 'sglang'")
    mp = pathlib.Path(spec.model_path)
    looks_like_hub_id = not mp.is_absolute() and spec.model_path.count("/") == 1 and not mp.exists()
    if spec.engine == "local" or not looks_like_hub_id:
        if not (mp / "config.json").is_file():
            raise ServerStartError(f"model_path {spec.model_path!r}: no config.json there; point it at a HF model "
                                   "directory (or a hub id for engine='sglang')")
    if spec.engine == "local":
        if spec.tp_size != 1 or spec.dp_size != 1:
            raise ValueError(f"tp_size/dp_size must be 1 for engine='local' (got {spec.tp_size}/{spec.dp_size})")
        if spec.quantization:
            raise ValueError(f"quantization={spec.quantization!r} needs engine='sglang' on a GPU")
        if spec.dtype not in LOCAL_DTYPES:
            raise ValueError(f"dtype={spec.dtype!r}: the CPU server runs {' | '.join(LOCAL_DTYPES)} (auto is "
                             "float32; bfloat16 makes a real engine/trainer mismatch on CPU)")
    if spec.port:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no conflict
            try:
                s.bind((spec.host, spec.port))
            except OSError as e:
                raise ServerStartError(f"port {spec.port} on {spec.host} is not free ({e.strerror}); pick another "
                                       "port or 0 for a free one") from e
    build_command(spec)  # flag checks
