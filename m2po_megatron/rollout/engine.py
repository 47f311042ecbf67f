"""The CPU generation engine behind local_server: a transformers causal LM in fp32 plus a scheduler thread.

Scheduling (continuous-batching-ish): one thread loops; each iteration admits waiting sequences (prefilled
together, left-padded), merges their KV cache into the running batch, then runs ONE decode step for every
running sequence together. Finished sequences leave the batch after any step, new ones join at the next
iteration, so concurrent requests share forward passes. The running batch keeps its own left-padded KV
tensors per layer plus a [B, T] attention mask; positions come from the mask.

Weights change only between steps (under `lock`), so every output token is produced by one weight version,
which is recorded per token (SGLang's `weight_versions` spans)."""
from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections import deque
from typing import Any, Callable

import torch

from m2po_megatron.infra import trace
from m2po_megatron.rollout import sampling
from m2po_megatron.rollout.protocol import DEFAULT_SAMPLING_SEED, TOP_K_ALL


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    sampling_seed: int | None = None


@dataclasses.dataclass
class Sequence:
    rid: str
    prompt: list[int]
    sp: SamplingParams
    seed: int  # the sampler's counter-based noise is a function of (seed, position, token)
    on_done: Callable[["Sequence"], None]
    out: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[str] = dataclasses.field(default_factory=list)
    finish: dict | None = None
    created: float = dataclasses.field(default_factory=time.monotonic)
    # return_routed_experts: int32 [positions, layers, top_k] chunks of every token fed so far (prefill, then
    # one row per decode step), so the last sampled token has none, as in SGLang
    routing: list = dataclasses.field(default_factory=list)

    def routed_experts(self) -> torch.Tensor | None:
        return torch.cat(self.routing) if self.routing else None

    def result(self) -> dict:
        return {"output_ids": list(self.out), "logprobs": list(self.logprobs), "versions": list(self.versions),
                "finish_reason": self.finish, "prompt_tokens": len(self.prompt), "rid": self.rid,
                "latency": time.monotonic() - self.created}


class Engine:
    def __init__(self, model, *, weight_version: str = "default", max_running_requests: int = 256,
                 context_length: int | None = None, random_seed: int | None = None,
                 deterministic: bool = False, return_routed_experts: bool = False):
        """deterministic: SGLang's --enable-deterministic-inference. Only then does a request's sampling_seed
        choose its samples (a request without one uses seed 42, as SGLang does); otherwise every sample draws
        from the server's own generator, seeded by random_seed, and sampling_seed is ignored.
        return_routed_experts: SGLang's --enable-return-routed-experts: record every sequence's router choices
        (a MoE model only; ValueError otherwise)."""
        from m2po_megatron.rollout.moe_engine import RouterRecorder

        self.model = model.eval()
        self.router = RouterRecorder(model) if return_routed_experts else None
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.context_length = context_length or getattr(cfg, "max_position_embeddings", 1 << 30)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = eos if eos is not None else getattr(cfg, "eos_token_id", None)
        self.eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        self.vocab_size = cfg.vocab_size
        self.weight_version = weight_version
        self.max_running = max_running_requests
        self.deterministic = deterministic
        self._seed_rng = torch.Generator().manual_seed(random_seed if random_seed is not None else 0)
        self.lock = threading.RLock()  # held for each step and for every state change
        # New sequences land in an inbox with its own lock, never held across a step: a submit that waited
        # for the step lock would let the scheduler re-take it first, so the samples of one request would
        # join the batch a few per step (hundreds of small steps instead of ~max_new_tokens large ones).
        self._inbox: list[Sequence] = []
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.paused = False
        self.released: set[str] = set()  # SGLang's offload_tags: memory given back (release_memory)
        self._shapes: dict[str, torch.Size] = {}  # each released parameter's shape, to reallocate it
        self._check_nan = False  # weights resumed: NaN until every parameter is updated (nan_weights)
        self._stop = False
        self.steps = 0
        self.error: BaseException | None = None
        self._params = dict(model.named_parameters())
        self._params.update({n: b for n, b in model.named_buffers() if n not in self._params})
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public, any thread
    def submit(self, prompt: list[int], sp: SamplingParams, n: int, on_done: Callable[[Sequence], None],
               rid: str | None = None) -> list[Sequence]:
        return self.submit_many([(prompt, sp, n, on_done, rid)])[0]

    def submit_many(self, jobs: list[tuple]) -> list[list[Sequence]]:
        """Submit (prompt, sp, n, on_done, rid) jobs together: all are checked first (ValueError, nothing
        submitted), then they enter the batch at the same step, as the samples of one batch request do."""
        for prompt, *_ in jobs:
            if not prompt:
                raise ValueError("input_ids is empty")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"input_ids contain ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        out, queued = [], []
        with self._inbox_lock:  # also serialises the server generator's seeds
            for prompt, sp, n, on_done, rid in jobs:
                rid = rid or uuid.uuid4().hex
                seqs = [Sequence(rid=rid if n == 1 else f"{rid}-{i}", prompt=list(prompt), sp=sp,
                                 seed=self._sequence_seed(sp), on_done=on_done) for i in range(n)]
                out.append(seqs)
                if sp.max_new_tokens > 0:
                    queued += seqs
            self._inbox.extend(queued)
        for seqs, (_, sp, *_rest) in zip(out, jobs):
            if sp.max_new_tokens == 0:
                for s in seqs:
                    self._finish(s, {"type": "length", "length": 0})
        if queued:
            self._wake.set()
        return out

    def _sequence_seed(self, sp: SamplingParams) -> int:
        if self.deterministic:  # SGLang's n copies of a request share its seed, so their samples are equal
            return (DEFAULT_SAMPLING_SEED if sp.sampling_seed is None else sp.sampling_seed) % 2**63
        return int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))

    def _admit_inbox(self) -> None:
        """Move submitted sequences into `waiting` (caller holds the step lock)."""
        with self._inbox_lock:
            new, self._inbox = self._inbox, []
        self.waiting.extend(new)

    def abort(self, rid: str | None = None, message: str = "Abort request") -> int:
        """Abort matching waiting/running sequences (rid=None: all); they return with finish type 'abort'."""
        with self.lock:
            self._admit_inbox()
            hit = lambda s: rid is None or s.rid == rid or s.rid.startswith(f"{rid}-")
            gone = [s for s in self.waiting if hit(s)]
            self.waiting = deque(s for s in self.waiting if not hit(s))
            rows = [i for i, s in enumerate(self.running) if hit(s)]
            gone += [self.running[i] for i in rows]
            self._drop_rows(rows)
            for s in gone:
                self._finish(s, {"type": "abort", "message": message})
            return len(gone)

    def pause(self, mode: str) -> None:
        with self.lock:
            if mode == "abort":
                self.abort(message="Abort by pause_generation")
            elif mode == "retract":  # drop the KV cache; sequences re-prefill (prompt + output) on continue
                self.waiting.extendleft(reversed(self.running))
                self._drop_rows(list(range(len(self.running))))
            elif mode != "in_place":
                raise ValueError(f"pause mode {mode!r} is not one of abort, retract, in_place")
            self.paused = True

    def resume(self) -> None:
        with self.lock:
            self.paused = False
        self._wake.set()

    def load_weights(self, named: list[tuple[str, torch.Tensor]], weight_version: str | None) -> None:
        """Copy HF-named tensors into the model between steps; raise KeyError/ValueError naming the tensor.
        A MoE model's per-expert on-disk names fill their slice of the fused expert tensors (moe_engine.py)."""
        from m2po_megatron.rollout.moe_engine import fused_expert_view

        if "weights" in self.released and named:
            raise ValueError("the weights are released; POST /resume_memory_occupation {\"tags\": [\"weights\"]} "
                             "before updating them")
        targets = []
        for name, t in named:
            dst = fused_expert_view(self._params, name)
            if dst is None and name not in self._params:
                raise KeyError(f"tensor {name!r} is not a parameter of the served model")
            dst = self._params[name] if dst is None else dst
            if tuple(t.shape) != tuple(dst.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, the served model expects "
                                 f"{tuple(dst.shape)}")
            targets.append(dst)
        with self.lock, torch.no_grad():
            for dst, (_, t) in zip(targets, named):
                dst.copy_(t)
            if weight_version is not None:
                self.weight_version = str(weight_version)

    def release_memory(self, tags: set[str]) -> None:
        """SGLang's release_memory_occupation on CPU. "weights": every parameter's storage is replaced by an
        empty one (name, dtype and the Parameter object are kept, the shape is recorded), buffers stay, as
        SGLang keeps the model's static state; "kv_cache": the KV cache is dropped (the caller checked that
        nothing runs); "cuda_graph": nothing to free. No step runs while any tag is released."""
        with self.lock:
            if "weights" in tags:
                for name, p in self.model.named_parameters():
                    self._shapes[name] = p.shape
                    p.data = torch.empty(0, dtype=p.dtype)
            if "kv_cache" in tags:
                self._drop_rows(list(range(len(self.running))))
                self.keys, self.values, self.mask = [], [], torch.zeros(0, 0, dtype=torch.long)
            self.released |= set(tags)

    def resume_memory(self, tags: set[str]) -> None:
        """Reallocate released memory. Resumed weights hold NaN until a weight update fills them (SGLang's
        resumed weights hold whatever the GPU memory held), so a forgotten update cannot pass unnoticed."""
        with self.lock:
            if "weights" in tags:
                for name, p in self.model.named_parameters():
                    p.data = torch.full(self._shapes.pop(name), float("nan"), dtype=p.dtype)
                self._check_nan = True
            self.released -= set(tags)
        self._wake.set()

    def nan_weights(self) -> list[str]:
        """Parameters still NaN since the weights were resumed (a missing update); no step runs while there
        are any. One scan after each resume, until a scan finds none."""
        with self.lock:
            if not self._check_nan:
                return []
            bad = [n for n, p in self.model.named_parameters() if p.is_floating_point() and bool(p.isnan().any())]
            self._check_nan = bool(bad)
            return bad

    def idle(self, ignore_waiting: bool = False) -> bool:
        """SGLang's is_fully_idle: nothing running (and nothing queued, unless ignore_waiting)."""
        with self.lock:
            self._admit_inbox()
            return not self.running and (ignore_waiting or not self.waiting)

    def stats(self) -> dict:
        with self.lock:
            self._admit_inbox()
            return {"waiting": len(self.waiting), "running": len(self.running), "paused": self.paused,
                    "released": sorted(self.released),
                    "steps": self.steps, "weight_version": self.weight_version}

    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def shutdown(self) -> None:
        with self.lock:
            self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ scheduler thread
    def _loop(self) -> None:
        try:
            while True:
                self._wake.wait()
                with self.lock:
                    self._wake.clear()  # before reading the inbox: a later submit sets it again
                    if self._stop:
                        return
                    self._admit_inbox()
                    if not self.paused and not self.released and (self.waiting or self.running) \
                            and not self.nan_weights():
                        self._step()
                        self._wake.set()  # step again while there is work (the lock is released between)
                # Let the HTTP thread run between steps. Without this yield the server's handlers ran in
                # bursts 60-190 ms apart, so a step's requests, all sent within 3 ms, reached the engine in
                # 5-9 prefills over 60-70 % of the rollout and it ran three to four times the decode steps
                # (traced, 2026-12-06; docs/rollout.md), where SGLang, its HTTP in another process than its
                # scheduler, admits them together.
                time.sleep(0)
        except BaseException as e:  # noqa: BLE001 - fail every request loudly rather than hang them
            self.error = e
            with self.lock:
                self._admit_inbox()
                for s in list(self.waiting) + self.running:
                    self._finish(s, {"type": "abort", "message": f"engine error: {e!r}"})
                self.waiting.clear()
                self._drop_rows(list(range(len(self.running))))
            raise

    @torch.no_grad()
    def _step(self) -> None:
        # Each decode step and prefill is a span of the run timeline (row "engine"): batch size and KV tokens
        # are what `m2po plan --calibrate` fits the server's cost model on.
        self.steps += 1
        traced = trace.enabled()  # the spans' args walk the batch: only when a timeline is open
        if self.running:
            if traced:
                args = {"b": len(self.running), "kv": sum(len(s.prompt) + len(s.out) for s in self.running)}
                t0 = time.perf_counter()
            self._decode()
            if traced:
                trace.complete("decode", "engine", t0, time.perf_counter(), tid="engine", args=args)
        room = self.max_running - len(self.running)
        if room > 0 and self.waiting:
            new = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
            t0 = time.perf_counter()
            self._prefill(new)
            if traced:
                trace.complete("prefill", "engine", t0, time.perf_counter(), tid="engine",
                               args={"seqs": len(new), "tokens": sum(len(s.prompt) + len(s.out) for s in new)})

    def _prefill(self, seqs: list[Sequence]) -> None:
        # Fresh samples of one request share one prefill row; retracted ones carry their own output.
        groups: dict[tuple, list[Sequence]] = {}
        for s in seqs:
            key = tuple(s.prompt) if not s.out else (s.rid, "retracted")  # equal prompts -> equal KV
            groups.setdefault(key, []).append(s)
        rows = [g[0].prompt + g[0].out for g in groups.values()]
        length = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, length - len(r):] = torch.tensor(r)
            mask[i, length - len(r):] = 1
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        index = torch.tensor([i for i, g in enumerate(groups.values()) for _ in g])
        order = [s for g in groups.values() for s in g]
        if self.router is not None:  # each row's own positions (left padding cut); a re-prefill starts over
            routed = self.router.take(len(rows), length)
            for i, (g, r) in enumerate(zip(groups.values(), rows)):
                for s in g:
                    s.routing = [routed[i, length - len(r):].clone()]
        cache = out.past_key_values
        keys = [cache.layers[l].keys[index] for l in range(self.num_layers)]
        values = [cache.layers[l].values[index] for l in range(self.num_layers)]
        self._merge(order, keys, values, mask[index])
        self._sample(order, out.logits[:, -1][index], first_row=len(self.running) - len(order))

    def _decode(self) -> None:
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=list(zip(self.keys, self.values)))
        ids = torch.tensor([[s.out[-1]] for s in self.running])
        pos = self.mask.sum(1, keepdim=True)
        self.mask = torch.cat([self.mask, torch.ones(len(self.running), 1, dtype=torch.long)], 1)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=pos, cache=cache,
                         use_cache=True)
        self.keys = [cache.layers[l].keys for l in range(self.num_layers)]
        self.values = [cache.layers[l].values for l in range(self.num_layers)]
        if self.router is not None:  # row i of the batch is self.running[i]'s fed token
            routed = self.router.take(len(self.running), 1)
            for i, s in enumerate(self.running):
                s.routing.append(routed[i])
        self._sample(list(self.running), out.logits[:, -1], first_row=0)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, first_row: int) -> None:
        f = lambda name, dt: torch.tensor([getattr(s.sp, name) for s in seqs], dtype=dt)
        temp = f("temperature", torch.float32)
        logp = sampling.returned_logprobs(logits, temp)
        probs = sampling.filtered_probs(logits, temp, f("top_p", torch.float32), f("top_k", torch.long),
                                        f("min_p", torch.float32))
        chosen = sampling.sample_rows(probs, torch.tensor([s.seed for s in seqs], dtype=torch.long),
                                      torch.tensor([len(s.prompt) + len(s.out) for s in seqs], dtype=torch.long))
        tokens, token_logps = chosen.tolist(), logp.gather(-1, chosen[:, None])[:, 0].tolist()
        done_rows = []
        for j, (s, tok) in enumerate(zip(seqs, tokens)):
            s.out.append(tok)
            s.logprobs.append(token_logps[j])
            s.versions.append(self.weight_version)
            reason = self._finish_reason(s, tok)
            if reason is not None:
                done_rows.append(first_row + j)
                self._finish(s, reason)
        self._drop_rows(done_rows)

    def _finish_reason(self, s: Sequence, tok: int) -> dict | None:
        if len(s.out) >= s.sp.min_new_tokens:
            if tok in s.sp.stop_token_ids or (not s.sp.ignore_eos and tok in self.eos_ids):
                return {"type": "stop", "matched": tok}
        if len(s.out) >= s.sp.max_new_tokens:
            return {"type": "length", "length": s.sp.max_new_tokens}
        if len(s.prompt) + len(s.out) >= self.context_length:
            return {"type": "length", "length": len(s.out)}
        return None

    def _finish(self, s: Sequence, reason: dict) -> None:
        s.finish = reason
        s.on_done(s)

    # ------------------------------------------------------------------ batch bookkeeping
    def _merge(self, seqs: list[Sequence], keys, values, mask) -> None:
        if not self.running:
            self.running, self.keys, self.values, self.mask = list(seqs), keys, values, mask
            return
        t = max(self.mask.shape[1], mask.shape[1])
        lpad = lambda x, n: torch.nn.functional.pad(x, (0, 0, n, 0)) if x.dim() == 4 else \
            torch.nn.functional.pad(x, (n, 0))
        a, b = t - self.mask.shape[1], t - mask.shape[1]
        self.keys = [torch.cat([lpad(k0, a), lpad(k1, b)]) for k0, k1 in zip(self.keys, keys)]
        self.values = [torch.cat([lpad(v0, a), lpad(v1, b)]) for v0, v1 in zip(self.values, values)]
        self.mask = torch.cat([lpad(self.mask, a), lpad(mask, b)])
        self.running += seqs

    def _drop_rows(self, rows: list[int]) -> None:
        if not rows:
            return
        gone = set(rows)
        keep = [i for i in range(len(self.running)) if i not in gone]
        self.running = [self.running[i] for i in keep]
        if not keep:
            self.keys, self.values, self.mask = [], [], torch.zeros(0, 0, dtype=torch.long)
            return
        idx = torch.tensor(keep)
        self.mask = self.mask[idx]
        # Trim columns that are padding for every remaining row, so the cache does not grow without bound.
        start = int((self.mask.sum(0) > 0).nonzero()[0]) if self.mask.numel() else 0
        self.mask = self.mask[:, start:]
        self.keys = [k[idx][:, :, start:] for k in self.keys]
        self.values = [v[idx][:, :, start:] for v in self.values]


def load_model(model_path: str, dtype: str = "float32"):
    """HF causal LM on CPU: fp32 by default (auto, float, float32: the trainer's CPU precision, so log-probs
    match it), or bf16 weights, activations and KV cache (bfloat16: the engine/trainer mismatch of a GPU
    rollout in bf16 against an fp32 trainer; sampling and the returned log-probs are computed in fp32 from
    the bf16 logits, as SGLang does)."""
    from transformers import AutoModelForCausalLM

    dtypes = {"auto": torch.float32, "float": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise ValueError(f"--dtype {dtype}: the CPU server runs one of {sorted(dtypes)}")
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtypes[dtype])


def request_params(sp: dict[str, Any], max_new_tokens: int) -> SamplingParams:
    """SGLang's normalized sampling params (protocol.sampling_params) -> SamplingParams, with the effective
    max_new_tokens (protocol.check_lengths). Knobs this CPU server cannot honour (penalties, logit bias,
    grammars, beam search) raise ValueError (HTTP 400) when set to anything but their neutral value."""
    neutral = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
               "logit_bias": (None, {}), "json_schema": (None, ""), "regex": (None, ""), "ebnf": (None, ""),
               "structural_tag": (None, ""), "beam_width": (None, 1), "custom_params": (None, {}),
               "watermark": (None,), "choice": ([],)}
    unsupported = sorted(k for k, ok in neutral.items() if sp.get(k) not in ok)
    if unsupported:
        raise ValueError(f"sampling_params {unsupported} are not supported by the CPU server "
                         "(no tokenizer, no penalties, no grammars); leave them at SGLang's defaults")
    top_k = int(sp["top_k"])
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=float(sp["temperature"]),
                          top_p=float(sp["top_p"]), top_k=-1 if top_k >= TOP_K_ALL else top_k,
                          min_p=float(sp["min_p"]), stop_token_ids=tuple(t for t in sp["stop_token_ids"] or ()
                                                                         if t is not None),
                          ignore_eos=bool(sp["ignore_eos"]), min_new_tokens=int(sp["min_new_tokens"]),
                          sampling_seed=sp["sampling_seed"])
