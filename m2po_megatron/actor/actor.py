"""MegatronActor: one trainer rank (megatron-core): model, optimizer, log-probs, train step, checkpoints.

One process per rank, launched with torchrun-style env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK) by tests/benchmarks (actor.launch) or by Ray. Every rank receives the same full batch; the
actor shards it over data-parallel ranks deterministically (packing.shard_for_dp) and packs each rank's
sequences into micro-batches by a token budget (packing.plan_microbatches).

Gradient scaling: megatron's schedule divides each micro-batch loss by the local number of micro-batches
and DDP averages over data-parallel ranks. Every micro-batch loss here is already normalised by the
*global* mini-batch denominators (token or sequence counts over all ranks), so the loss handed to Megatron
is multiplied by (local micro-batches x DP size) to undo both: the resulting gradient is exactly the
gradient of the global mini-batch loss.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from functools import partial
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist


from . import checkpoint
from .batch import TrainBatch
from .dp_share import even_microbatches, rank_share, skipped_update
from .fused_logprobs import output_layer_log_probs
from .logprob_pass import LogProbPasses
from .correction import three_policy_batch
from .global_mask import behav_and_advantages, global_keep_masks
from .metrics import StepTimes, combine_updates, read_step_values, reduce_minibatch
from .optim import build_optimizer, wrap_ddp
from .packing import (
    MicroBatch,
    model_inputs,
    plan_microbatches,
    row_multiple,
    split_minibatches,
    to_device,
)
from .precision import resolve_machine
from .reference import ReferenceModel
from .routing_replay import RoutingReplay, check_routing_replay
from .settings import check_options, recompute_overrides

log = logging.getLogger(__name__)

# train_step's parts timed on the host (perf_counter, no added device sync) as time/actor/<part> seconds: the
# no-grad forward of M2PO's batch-level mask, the forward/backward schedule (up to the loss stats' host read)
# and optimizer + scheduler (on CUDA, its kernels after the grad-norm read land in the next waiting timer);
# ref_pass: the reference model's no-grad forward (KL to the reference), its weights' copy to the device included.
STEP_TIMES = ("logprob_pass", "forward_backward", "optimizer", "ref_pass")


class MegatronActor(LogProbPasses):
    """A megatron-core trainer rank. See docs/actor.md for the full contract. Parameters are named as the
    recipe's keys (actor.options.actor_kwargs maps a recipe onto them).

    Args:
        hf_path: HF model directory (config.json; weights are read from it when load_from is None and it
            holds *.safetensors). Either this or hf_config is required.
        hf_config: an HF config (dict / PretrainedConfig / config.json path) when hf_path is absent.
        load_from: initial weights: an HF model directory or a Megatron dist checkpoint directory (model
            weights only; use load() to resume optimizer/scheduler/RNG). None: hf_path's weights if
            present, else Megatron's random init (tests).
        micro_batch_tokens: token budget of one packed micro-batch (a row of several sequences); required,
            the recipe's train.micro_batch_tokens.
        tensor_model_parallel_size, pipeline_model_parallel_size, sequence_parallel,
        virtual_pipeline_model_parallel_size, context_parallel_size: Megatron's parallel settings. Data
            parallel size = WORLD_SIZE / (TP * PP * CP).
        expert_model_parallel_size, expert_tensor_parallel_size, moe_aux_loss_coeff: MoE models: Megatron's
            expert parallel sizes (ETP None = TP) and the load-balancing loss weight. moe_grouped_gemm: the
            local layers' experts as one grouped GEMM (models.grouped_experts; TE's spec always groups them).
        routing_replay: MoE models: "none" | "r2" | "r3" (actor.routing_replay).
        use_distributed_optimizer: shard optimizer state over data-parallel ranks (Megatron's ZeRO-1).
        recompute_granularity (None | "selective" | "full"), recompute_method, recompute_num_layers:
            Megatron's activation recompute.
        params_dtype: "fp32" (CPU) or "bf16" (GPU; fp32 main params and grads). fp8: None | "e4m3" | "hybrid"
            with fp8_recipe "delayed" | "tensorwise" | "blockwise" | "mxfp8" (Transformer Engine, GPU).
        optimizer: "adam" (AdamW: decoupled weight decay) or "sgd". lr, min_lr, warmup_updates,
            lr_decay_steps, lr_schedule ("constant" | "cosine" | "linear"), weight_decay, adam_beta1,
            adam_beta2, adam_eps, clip_grad (0 = off). Scheduler steps count optimizer updates.
        attention_backend: "auto" (TE where usable, else "sdpa") | "te" | "sdpa" (FlexAttention per packed
            row on CUDA, fused SDPA per sequence elsewhere) | "local" (megatron's dense-mask attention; a
            reference), see models.builder.resolve_attention_backend.
        loss_name: a loss of m2po_megatron.algo.losses (e.g. "m2po", "grpo"); loss_kwargs: its options.
        m2po_tau, m2po_rule ("remove" | "cap"), m2po_scope: "global" (the paper's batch-level mask over
            the whole optimizer mini-batch across DP ranks, from a no-grad forward at the current weights)
            or "microbatch" (per micro-batch mask inside the loss, no extra forward; the released code).
        rollout_correction: algo.rollout_correction's fields (mode, level, threshold, threshold_lower,
            geometric_action; algo.rollout_correction.CorrectionSpec). Any mode but "bypass" (the default)
            makes the objective three-policy: one no-grad pass at the step's starting weights gives the
            proximal log-probs; the loss and the M2PO mask act on theta/proximal, and the correction's
            weight (a function of proximal/behaviour) multiplies each token's loss (docs/algo.md).
        reference: a frozen reference model (the initial weights; actor.reference), a dict of param_offload
            (its weights on the host between its passes) and, for the KL loss term, kl_loss_coef and
            kl_loss_type (algo.kl.KL_TYPES); None: no reference model and no KL term.
        entropy_coeff: the entropy bonus's weight (verl's entropy_coeff; 0: the entropy is a metric only).
        seed: Megatron's model-parallel RNG seed.
    """

    def __init__(
        self,
        hf_path: Optional[str] = None,
        *,
        micro_batch_tokens: int,
        hf_config: Any = None,
        load_from: Any = None,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: Optional[int] = None,
        context_parallel_size: int = 1,
        sequence_parallel: bool = False,
        expert_model_parallel_size: int = 1,
        expert_tensor_parallel_size: Optional[int] = None,
        moe_aux_loss_coeff: float = 0.0,
        moe_grouped_gemm: bool = False,
        routing_replay: str = "none",
        use_distributed_optimizer: bool = True,
        recompute_granularity: Optional[str] = None,
        recompute_method: str = "uniform",
        recompute_num_layers: int = 1,
        params_dtype: str = "fp32",
        fp8: Optional[str] = None,
        fp8_recipe: Optional[str] = None,
        optimizer: str = "adam",
        lr: float = 1e-6,
        min_lr: float = 0.0,
        warmup_updates: int = 0,
        lr_decay_steps: Optional[int] = None,
        lr_schedule: str = "constant",
        weight_decay: float = 0.01,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.999,
        adam_eps: float = 1e-8,
        clip_grad: float = 1.0,
        attention_backend: str = "auto",
        loss_name: str = "m2po",
        loss_kwargs: Optional[dict] = None,
        m2po_tau: float = 0.04,
        m2po_rule: str = "remove",
        m2po_scope: str = "global",
        rollout_correction: Optional[dict] = None,
        reference: Optional[dict] = None,
        entropy_coeff: float = 0.0,
        seed: int = 1234,
    ):
        # Cheap checks first, before any distributed or model work.
        if hf_path is None and hf_config is None:
            raise ValueError("MegatronActor needs hf_path or hf_config (the model architecture)")
        check_options(
            micro_batch_tokens=micro_batch_tokens, context_parallel_size=context_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size, optimizer=optimizer,
            use_distributed_optimizer=use_distributed_optimizer, lr_schedule=lr_schedule,
            lr_decay_steps=lr_decay_steps, m2po_scope=m2po_scope, recompute_granularity=recompute_granularity,
            recompute_method=recompute_method, loss_name=loss_name)
        from m2po_megatron.algo.rollout_correction import CorrectionSpec

        self.correction = CorrectionSpec(**(rollout_correction or {}))  # ValueError naming the field
        self.attention_backend, self.precision = resolve_machine(attention_backend, params_dtype, fp8, fp8_recipe)
        from m2po_megatron.models.builder import validate_layout
        from m2po_megatron.models.hf_config import read_hf_config

        self.hf_source = hf_path if hf_path is not None else hf_config
        self.spec = read_hf_config(self.hf_source)
        validate_layout(self.spec, tensor_model_parallel_size, pipeline_model_parallel_size,
                        ep=expert_model_parallel_size, etp=expert_tensor_parallel_size)
        self.moe = dict(expert_model_parallel_size=expert_model_parallel_size, moe_aux_loss_coeff=moe_aux_loss_coeff,
                        moe_grouped_gemm=bool(moe_grouped_gemm),
                        expert_tensor_parallel_size=expert_tensor_parallel_size)
        check_routing_replay(self.spec, routing_replay, context_parallel_size)

        self.loss_name = loss_name
        self.loss_kwargs = dict(loss_kwargs or {})
        self.kl = None
        if reference is not None:
            from m2po_megatron.algo.kl import check_kl_type

            ref = dict(reference)
            unknown = set(ref) - {"kl_loss_coef", "kl_loss_type", "param_offload"}
            if unknown:
                raise ValueError(f"reference has unknown keys {sorted(unknown)}")
            if "kl_loss_coef" in ref:  # else the reference serves the KL in the reward only (the loop's)
                self.kl = dict(kl_coef=float(ref["kl_loss_coef"]),
                               kl_type=check_kl_type(ref.get("kl_loss_type", "low_var_kl")))
        self.entropy_coeff = float(entropy_coeff)
        self.m2po_tau, self.m2po_rule, self.m2po_scope = float(m2po_tau), m2po_rule, m2po_scope
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.updates_applied = 0
        self.last_spans: list = []  # (phase, perf_counter start, end) of the last train_step
        self.use_distributed_optimizer = bool(use_distributed_optimizer)

        self._init_parallel(tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size, seed)
        chunks = self._build_model(sequence_parallel, recompute_overrides(
            recompute_granularity, recompute_method, recompute_num_layers))
        self.replay = RoutingReplay(chunks, mode=routing_replay, num_experts=self.spec.num_experts,
                                    topk=self.spec.num_experts_per_tok,
                                    recompute=recompute_granularity == "full") if self.spec.is_moe else None
        # Initial weights go into the bare chunks, before DDP / the optimizer copy them into their buffers.
        src = load_from
        if src is None and hf_path is not None and checkpoint.has_hf_weights(hf_path):
            src = hf_path
        if src is not None:
            checkpoint.load_initial_weights(chunks, src, self.spec)
        self.reference = None  # the initial weights, copied before any update (on resume too: the same load)
        if reference is not None:
            self.reference = ReferenceModel(self.spec, self.config, chunks, attention_backend=self.attention_backend,
                                            offload=bool(dict(reference).get("param_offload", True)))
        self.model = wrap_ddp(chunks, self.config, self.use_distributed_optimizer)
        self.opt_config, self.optimizer, self.scheduler = build_optimizer(
            self.model, self.config, self.precision.params_dtype,
            dict(optimizer=optimizer, lr=lr, min_lr=min_lr, weight_decay=weight_decay, adam_beta1=adam_beta1,
                 adam_beta2=adam_beta2, adam_eps=adam_eps, clip_grad=clip_grad),
            use_distributed_optimizer=self.use_distributed_optimizer, warmup_updates=warmup_updates,
            lr_decay_steps=lr_decay_steps, lr_schedule=lr_schedule)

    # ------------------------------------------------------------------ construction
    def _init_parallel(self, tp: int, pp: int, cp: int, seed: int) -> None:
        """torch.distributed and Megatron's parallel state; the groups and ranks this actor talks to."""
        from megatron.core import parallel_state as ps

        from .parallel import init_distributed

        self.dp_size = init_distributed(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                        context_parallel_size=cp, seed=seed,
                                        expert_model_parallel_size=self.moe["expert_model_parallel_size"],
                                        expert_tensor_parallel_size=self.moe["expert_tensor_parallel_size"])
        self.ps = ps
        self.tp_size = tp
        self.pp_size = pp
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.is_last_stage = ps.is_pipeline_last_stage()
        # the expert-parallel group spans DP ranks: they must run as many micro-batches (dp_share)
        self.even = self.spec.is_moe and self.moe["expert_model_parallel_size"] > 1

    def _build_model(self, sequence_parallel: bool, recompute: dict) -> list:
        """This rank's bare GPTModel chunks (the TransformerConfig kept as self.config)."""
        from m2po_megatron.models.builder import build_model_chunks, transformer_config_from_hf

        pr = self.precision
        self.config = transformer_config_from_hf(
            self.spec, params_dtype=pr.transformer_overrides()["params_dtype"],
            tensor_model_parallel_size=self.tp_size, pipeline_model_parallel_size=self.pp_size,
            sequence_parallel=sequence_parallel, fp8=pr.fp8, fp8_recipe=pr.fp8_recipe, **self.moe, **recompute)
        chunks = build_model_chunks(self.spec, self.config, attention_backend=self.attention_backend)
        self.device = next(chunks[0].parameters()).device  # where every micro-batch input goes
        # Row lengths divide by TP for sequence parallelism, and by TE's FP8 GEMM rule (packing.row_multiple).
        self.pad_multiple = row_multiple(self.tp_size, self.config.sequence_parallel, bool(pr.fp8), pr.fp8_recipe)
        # Pipeline stages exchange activations of a fixed shape: every micro-batch of a call is padded to
        # the longest row (megatron's variable_seq_lengths shape exchange mismatched micro-batches over
        # gloo in 0.19.2 here; fixed shapes also avoid one extra p2p per micro-batch).
        if self.pp_size > 1:
            self.config.variable_seq_lengths = False
        return chunks

    # ------------------------------------------------------------------ weights
    def _unwrapped(self) -> list:
        return [m.module for m in self.model]

    def model_chunks(self) -> list:
        """The bare GPTModel chunks of this rank (for the export iterator / weight sync)."""
        return self._unwrapped()

    # ------------------------------------------------------------------ forward plumbing
    def _run(self, mbs: list[MicroBatch], loss_fn, forward_only: bool, targets=lambda mb: None, model=None):
        """Run megatron's schedule over this rank's micro-batches; loss_fn(mb, (log-probs, entropy)) on the
        last stage, where GPTModel's output_processor hook hands the final hidden states to the fused
        output-layer log-probs instead of building [S, V/tp] logits (earlier stages return hidden states).
        targets(mb): MoE routing replay's [S, layers, k] for the micro-batch, or None (routing_replay.py).
        model: other chunks of the same layout (the reference model's; no routing replay), else the actor's."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        replay = self.replay if model is None else None

        def forward_step(data_iterator: Iterator, model):
            mb = next(data_iterator)
            if replay is not None:
                replay.before_forward(targets(mb))
            out = model(**model_inputs(mb, self.device, self.attention_backend),
                        output_processor=self._response_logps, output_processor_context=mb)
            return out, partial(loss_fn, mb)

        fb = get_forward_backward_func()
        seq_len = max(m.seq_len for m in mbs)
        return fb(forward_step_func=forward_step, data_iterator=iter(mbs), model=model or self.model,
                  num_microbatches=len(mbs), seq_length=seq_len, micro_batch_size=1,
                  forward_only=forward_only)

    def _plan(self, batch: TrainBatch, indices: list[int]) -> list[MicroBatch]:
        mbs = plan_microbatches(batch, indices, self.micro_batch_tokens, self.pad_multiple)
        if self.pp_size > 1:
            s = max(m.seq_len for m in mbs)
            mbs = [m.padded_to(s) for m in mbs]
        return mbs

    def _response_logps(self, *, hidden_states, output_layer, output_weight, context, config, **_):
        """GPTModel's output_processor (last stage): the micro-batch `context`'s response-token log-probs [R]
        (with grad to the hidden states and the output weight) and entropy [R] (no grad), from the decoder's
        final hidden states and the output layer's weight, chunk by chunk (actor.fused_logprobs)."""
        if getattr(config, "use_mup", False):
            raise NotImplementedError("use_mup scales the logits; the fused output-layer log-probs do not")
        pos = context.logprob_positions
        return output_layer_log_probs(hidden_states, output_layer, output_weight, pos,
                                      context.labels[0].index_select(0, pos), self.tp_group)

    def _token_logps(self, mb: MicroBatch, out: tuple, with_entropy: bool):
        """The (log-probs [R], entropy [R]) the model returned for `mb` (entropy None unless with_entropy)."""
        lp, ent = out
        return lp, (ent if with_entropy else None)

    def _eval_mode(self):
        for m in self.model:
            m.eval()

    def _train_mode(self):
        for m in self.model:
            m.train()

    # ------------------------------------------------------------------ training
    def train_step(self, batch: TrainBatch, num_minibatches: int = 1) -> dict:
        """Split `batch` into num_minibatches contiguous optimizer mini-batches and apply one update per
        mini-batch. Returns metrics identical on every rank (see docs/actor.md for the keys), except the
        rank's own seconds under time/actor/* (STEP_TIMES, summed over the updates, and the whole call)."""
        t_start = time.perf_counter()
        minis = split_minibatches(len(batch), num_minibatches)  # an empty one is skipped (dp_share)
        if len(batch):
            batch.validate(for_training=True, vocab_size=self.spec.vocab_size, max_tokens=self.micro_batch_tokens)
        times = StepTimes(STEP_TIMES)
        corr_metrics: dict = {}
        engine = None  # three-policy steps: the engine's behaviour log-probs, for ratio_parts/*
        if self.reference is not None and len(batch) and batch.ref_log_probs is None:
            t = time.perf_counter()
            batch = dataclasses.replace(batch, ref_log_probs=self.reference_log_probs(batch))
            times.add("ref_pass", t)
        if self.correction.mode != "bypass" and len(batch):
            t = time.perf_counter()
            engine = batch
            proximal, _ = self.compute_log_probs(batch, with_entropy=False)  # the step's starting weights
            batch, corr_metrics = three_policy_batch(batch, proximal, self.correction)
            times.add("logprob_pass", t)
        replay_metrics = {}
        if self.replay is not None and len(batch):
            t = time.perf_counter()
            batch, replay_metrics = self.replay.prepare_step(self, batch, minis)
            times.add("logprob_pass", t)
        per_update = [self._train_minibatch(batch.select(mi), times, None if engine is None else engine.select(mi))
                      if mi else skipped_update(float(self.optimizer.param_groups[0]["lr"])) for mi in minis]
        out = combine_updates(per_update, self.updates_applied)
        out.update(corr_metrics)
        out.update(replay_metrics)
        if self.replay is not None:
            out.update(self.replay.step_metrics(self))
        out.update({f"time/actor/{k}": v for k, v in times.items()})
        self.last_spans = times.spans  # the run timeline's per-update spans (run/worker.py)
        out["time/actor/train_step"] = time.perf_counter() - t_start
        return out

    def _train_minibatch(self, mb_batch: TrainBatch, times: dict, engine_batch: Optional[TrainBatch] = None) -> dict:
        """One update. engine_batch (three-policy steps): mb_batch with the engine's behaviour log-probs, whose
        ratio to proximal (mb_batch's behaviour) and theta's drift from proximal go to ratio_parts/*."""
        from m2po_megatron.algo import losses as algo_losses
        from m2po_megatron.algo.rollout_correction import ratio_parts

        global_tokens, global_seqs = mb_batch.loss_counts()  # the denominators, over every DP rank
        mb_batch, engine_batch, shard, filler = rank_share(mb_batch, self.dp_size, self.dp_rank, engine_batch)
        mbs = self._plan(mb_batch, shard)
        first_fill = len(mb_batch) - 1 if filler else len(mb_batch)
        if self.even:
            mb_batch, engine_batch, mbs, n_fill = self._even(mb_batch, engine_batch, mbs)
            first_fill = len(mb_batch) - 1 if (filler or n_fill) else first_fill
        n_local = len(mbs)
        fillers = sum(mb.seq_index[0] >= first_fill for mb in mbs)

        keep_masks: dict[int, torch.Tensor] = {}
        mask_stats: dict[str, float] = {}
        use_global_mask = self.loss_name == "m2po" and self.m2po_scope == "global"
        if use_global_mask:
            t = time.perf_counter()
            keep_masks, mask_stats = global_keep_masks(self, mb_batch, mbs)  # ends in a host read
            times.add("logprob_pass", t)

        # Per micro-batch everything stays on the device (loss stats with their NaN/inf counts, the entropy
        # sum); it is read once after the schedule, and a non-finite input raises there, before
        # optimizer.step (its tokens were left out of the loss, so the gradients stay finite until then).
        stats: list = []
        parts: list = []
        ent_sums: list[torch.Tensor] = []

        def loss_fn(mb: MicroBatch, model_out):
            logp, ent = self._token_logps(mb, model_out, with_entropy=True)
            dev = logp.device
            behav, adv, weights, policy, mask = behav_and_advantages(mb_batch, mb, dev)  # mask: policy & weight > 0
            seq_ids = to_device(mb.response_seq_ids(), dev)
            kw = dict(self.loss_kwargs)
            if self.kl is not None:
                kw.update(self.kl, ref_log_prob=to_device(
                    torch.cat([mb_batch.ref_log_probs[i].float() for i in mb.seq_index]), dev))
            if self.entropy_coeff:
                kw.update(entropy=ent, entropy_coeff=self.entropy_coeff)
            if self.loss_name == "m2po":
                if use_global_mask:
                    kw["keep_mask"] = to_device(keep_masks[id(mb)], dev)
                else:
                    kw.setdefault("tau", self.m2po_tau)
                    kw.setdefault("rule", self.m2po_rule)
            loss, st = algo_losses.policy_loss_on_device(
                self.loss_name, logp, behav, adv, mask, seq_ids=seq_ids, num_seq_ids=len(mb.seq_index),
                num_tokens=global_tokens, num_seqs=global_seqs, weights=weights, **kw)
            stats.append(st)
            if engine_batch is not None:  # log(theta/engine) = drift log(theta/proximal) + mismatch log(proximal/engine)
                eng = to_device(torch.cat([engine_batch.behav_log_probs[i].float() for i in mb.seq_index]), dev)
                # every policy token, the correction's dropped ones included; a filler's and the environment's out
                if mb.seq_index[0] >= first_fill:
                    counted = mask  # a filler micro-batch: weight 0 throughout
                else:
                    counted = torch.ones_like(mask) if policy is None else policy
                parts.append(ratio_parts(logp, behav, eng, counted))
            ent_sums.append(torch.where(mask, ent.detach(), 0.0).sum().float())  # a filler's or dropped token's: 0
            return loss * (n_local * self.dp_size), {}

        self._train_mode()
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        t = time.perf_counter()
        try:
            self._run(mbs, loss_fn, forward_only=False, targets=self._targets(mb_batch, True, count=True))
        except Exception:
            read_step_values(stats, ent_sums)  # a NaN/inf input that broke the step: name it
            raise
        mb_metrics, entropy_sum = read_step_values(stats, ent_sums)  # raises on NaN/inf inputs
        t_opt = time.perf_counter()
        times.add("forward_backward", t, t_opt)
        lr_used = float(self.optimizer.param_groups[0]["lr"])
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
            self.updates_applied += 1
        times.add("optimizer", t_opt)

        reduced = (reduce_minibatch(mb_metrics, entropy_sum, mask_stats, dp_group=self.dp_group, parts=parts,
                                    fillers=fillers) if self.is_last_stage else None)
        out = self._on_all_stages(reduced)
        out.update({
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "lr": lr_used,
            "update_successful": bool(ok),
            "num_seqs": global_seqs,
            "num_tokens": global_tokens,
        })
        return out

    def _on_all_stages(self, obj):
        """`obj` of the last pipeline stage, on every stage."""
        if self.pp_size > 1:
            box = [obj]
            dist.broadcast_object_list(box, src=self.ps.get_pipeline_model_parallel_last_rank(),
                                       group=self.pp_group)
            obj = box[0]
        return obj

    def _even(self, batch: TrainBatch, engine: Optional[TrainBatch], mbs: list):
        return even_microbatches(batch, engine, mbs, dp_size=self.dp_size, max_tokens=self.micro_batch_tokens,
                                 plan=self._plan)

    def _targets(self, batch: TrainBatch, replay: bool, count: bool = False):
        """targets(mb) for _run: the batch's routing replayed (MoE with a replay mode), else None."""
        if self.replay is None:
            return lambda mb: None
        return self.replay.targets_for(batch, replay, count)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str) -> None:
        """Write a Megatron dist checkpoint (model, optimizer, scheduler, RNG, update count) to `path`.
        Loadable at another TP/PP/DP layout (RNG is then re-seeded instead of restored)."""
        checkpoint.save(self, path)

    def load(self, path: str) -> None:
        """Resume from save(): model, optimizer, scheduler, update count (and RNG at the same TP/PP)."""
        checkpoint.load(self, path)

    def close(self) -> None:
        """Drop Megatron's parallel state (the process group stays, so another actor can be built)."""
        if self.ps.model_parallel_is_initialized():
            self.ps.destroy_model_parallel()
