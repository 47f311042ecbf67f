"""Rollout routing replay (R3, arXiv 2510.23027): the experts the rollout engine chose, as data of a sample.

SGLang 0.5.23 (server flag --enable-return-routed-experts, request field return_routed_experts) answers
meta_info["routed_experts"]: base64 of the raw bytes of an int32 tensor [rows, num_hidden_layers, top_k]
(DetokenizerManager._b64_encode_per_request: `b64encode(tensor.numpy().tobytes())`; C order, the host's byte
order, little-endian on every machine SGLang runs on). Row p holds the top-k expert ids of the token at
position p of prompt + output when it went through the model, for positions [routed_experts_start_len,
seqlen - 1) (BaseTopkCapturer.get_topk): the last output token is sampled but never fed, so it has no row.
With start_len 0 (what the project sends) that is prompt_len + response_len - 1 rows. The key is absent when
the server was started without the flag (SGLang ignores the request field then) and for aborted requests.

The project keeps the rows of EVERY fed position, prompt included, not only the response's: the trainer's
forward runs over prompt + response, and a response token's log-prob depends on the prompt positions' MoE
outputs through attention, so replay must pin the prompt's routing too (verl's R3 replays the whole sequence).

The array is numpy, not torch: a sample is plain data carried through the staleness buffer, Ray and JSON
checkpoints without torch; the trainer takes `torch.from_numpy(a).long()`. It is stored as int16 when every
expert id fits (num_experts <= 32767, any MoE in use today), halving its memory against SGLang's int32.

Pure: numpy and the standard library only."""
from __future__ import annotations

import base64
import binascii
from typing import Optional

import numpy as np

# Why a sample's routing data is unusable; each drops the sample (ledger reason "bad_routing") and is counted
# as routing/dropped/<problem>. Stable strings: they are metric names.
ROUTING_PROBLEMS = (
    "routing_missing",  # no meta_info.routed_experts although requested (server without the flag?)
    "routing_undecodable",  # not base64, or a byte count that is no whole number of int32 values
    "routing_layers",  # a layer count other than the model's
    "routing_topk",  # a top-k other than the model's
    "routing_length",  # a row count other than prompt + response - 1
    "routing_expert_range",  # an expert id outside [0, num_experts)
    "routing_duplicate_expert",  # the same expert twice in one token's top-k of one layer
)
_WIRE = np.dtype("<i4")  # SGLang's int32 (BaseDeviceCache / BaseHostCache buffers), little-endian


class RoutingError(ValueError):
    """Routing data that cannot be used; `.problem` is one of ROUTING_PROBLEMS."""

    def __init__(self, problem: str, message: str):
        super().__init__(f"{problem}: {message}")
        self.problem = problem


def expected_rows(prompt_len: int, response_len: int) -> int:
    """Rows SGLang returns with routed_experts_start_len 0: every fed position, i.e. all but the last token."""
    return max(0, prompt_len + response_len - 1)


def storage_dtype(num_experts: int) -> np.dtype:
    """int16 when every expert id fits in it, else int32."""
    return np.dtype(np.int16) if num_experts <= np.iinfo(np.int16).max else np.dtype(np.int32)


def encode(arr) -> str:
    """SGLang's wire format of a [rows, layers, top_k] array of expert ids (what the CPU server answers)."""
    return base64.b64encode(np.ascontiguousarray(arr, dtype=_WIRE).tobytes()).decode("ascii")


def decode(b64: str, *, num_layers: int, topk: int, num_tokens: Optional[int] = None) -> np.ndarray:
    """SGLang's meta_info["routed_experts"] -> int32 array [rows, layers, top_k]. The wire carries no shape, so
    it is read with the model's layers x top_k per row; when that does not divide the data and num_tokens (the
    expected rows) is given, the per-row width tells which of the two is off. Raises RoutingError."""
    if not isinstance(b64, str):
        raise RoutingError("routing_undecodable", f"expected a base64 string, got {type(b64).__name__}")
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RoutingError("routing_undecodable", f"not base64 ({e})") from None
    if len(raw) % _WIRE.itemsize:
        raise RoutingError("routing_undecodable", f"{len(raw)} bytes is no whole number of int32 ids")
    flat = np.frombuffer(raw, dtype=_WIRE)
    per_row = num_layers * topk
    width = flat.size // num_tokens if num_tokens and flat.size % num_tokens == 0 else 0
    if width and width != per_row:  # one row per expected token, of another width: which dimension differs?
        if width % topk == 0:
            raise RoutingError("routing_layers", f"{width // topk} layers of top-{topk} per token, the model "
                               f"has {num_layers} layers")
        if width % num_layers == 0:
            raise RoutingError("routing_topk", f"top-{width // num_layers} per layer, the model routes "
                               f"top-{topk}")
    if per_row > 0 and flat.size % per_row == 0:
        return flat.reshape(-1, num_layers, topk)
    raise RoutingError("routing_length", f"{flat.size} ids are no whole number of rows of {num_layers} layers "
                       f"x top-{topk}")


def routing_problem(arr, *, num_layers: int, topk: int, num_experts: int, num_tokens: int) -> Optional[str]:
    """The first reason (ROUTING_PROBLEMS) why `arr` is not [num_tokens, num_layers, topk] distinct expert ids
    in [0, num_experts) per token and layer, or None when it is."""
    a = np.asarray(arr)
    if a.ndim != 3 or not np.issubdtype(a.dtype, np.integer):
        return "routing_undecodable"
    if a.shape[1] != num_layers:
        return "routing_layers"
    if a.shape[2] != topk:
        return "routing_topk"
    if a.shape[0] != num_tokens:
        return "routing_length"
    if a.size and (a.min() < 0 or a.max() >= num_experts):
        return "routing_expert_range"
    if topk > 1 and a.size and (np.diff(np.sort(a, axis=-1), axis=-1) == 0).any():
        return "routing_duplicate_expert"
    return None


def parse(b64: Optional[str], *, num_layers: int, topk: int, num_experts: int,
          num_tokens: int) -> tuple[Optional[np.ndarray], Optional[str]]:
    """(array in storage_dtype, None) for good routing data from the wire, or (None, problem)."""
    if b64 is None:
        return None, "routing_missing"
    try:
        arr = decode(b64, num_layers=num_layers, topk=topk, num_tokens=num_tokens)
    except RoutingError as e:
        return None, e.problem
    problem = routing_problem(arr, num_layers=num_layers, topk=topk, num_experts=num_experts,
                              num_tokens=num_tokens)
    if problem is not None:
        return None, problem
    return arr.astype(storage_dtype(num_experts)), None


def to_state(arr: Optional[np.ndarray]) -> Optional[dict]:
    """JSON-safe form for run checkpoints (base64 of the stored dtype, little-endian, with its shape)."""
    if arr is None:
        return None
    a = np.asarray(arr)
    wire = a.dtype.newbyteorder("<")
    return {"dtype": wire.name, "shape": list(a.shape),
            "b64": base64.b64encode(np.ascontiguousarray(a, dtype=wire).tobytes()).decode("ascii")}


def from_state(d) -> Optional[np.ndarray]:
    """Inverse of to_state; an array passes through (a sample that was never serialised)."""
    if d is None or isinstance(d, np.ndarray):
        return d
    if not isinstance(d, dict) or set(d) != {"dtype", "shape", "b64"} or d["dtype"] not in ("int16", "int32"):
        raise ValueError(f"routed_experts in a checkpoint must be {{dtype: int16|int32, shape, b64}}, got "
                         f"{str(d)[:120]}")
    a = np.frombuffer(base64.b64decode(d["b64"]), dtype=np.dtype(d["dtype"]).newbyteorder("<"))
    return a.reshape(d["shape"]).astype(d["dtype"])  # native order, writable (frombuffer's is read-only)


# SGLang server args (server_args names -> the value that keeps the identity map) that turn on expert-location
# dispatch: EPLB's rebalancing, redundant copies of experts, a non-trivial initial placement, elastic backups.
# With any of them an expert id SGLang records is a physical slot of its expert-location map, which changes as
# EPLB rebalances; the HTTP API (contracts/sglang-http-0.5.23.json) gives no physical -> logical map per step
# to translate it back, so R3 refuses such a server (docs/moe.md).
EXPERT_LOCATION_IDENTITY = {"enable_eplb": False, "ep_num_redundant_experts": 0, "init_expert_location": "trivial",
                            "enable_elastic_expert_backup": False}


def expert_location_settings(server_args: dict) -> list[str]:
    """`name=value` of each expert-location dispatch setting in `server_args` (SGLang's server_args names, as
    /get_server_info answers them; an absent name is SGLang's default): empty when recorded ids are logical."""
    out = []
    for name, identity in EXPERT_LOCATION_IDENTITY.items():
        v = server_args.get(name, identity)
        if v not in (identity, None) and str(v) != str(identity):
            out.append(f"{name}={v}")
    return out


def physical_routing_refusal(where: str, settings: list[str]) -> str:
    """The message refusing R3 with a server whose recorded expert ids are physical."""
    return (f"algo.routing_replay = r3 with {where} running expert-location dispatch ({', '.join(settings)}): "
            "SGLang then records physical expert slots, not the model's experts, and its HTTP API gives no "
            "physical -> logical map to translate them; start SGLang without --enable-eplb, "
            "--ep-num-redundant-experts, --init-expert-location and --enable-elastic-expert-backup, or use "
            "algo.routing_replay = r2 or none")
