"""A recipe's settings as MegatronActor's keyword arguments: the actor's parameters carry the recipe's key
names (optim.warmup_updates -> warmup_updates, algo.m2po.scope -> m2po_scope, ...); only derived values are
computed here (the dtype for "auto", the loss options of the chosen algorithm, the decay length). Three keep
names of their own: `load_from` (model.megatron_ckpt, but it also takes an HF directory or, in tests, a model),
`loss_name` (algo.name; a bare `name` would be ambiguous on the actor) and `loss_kwargs` (the loss library's
own keywords, shared by all its callers: eps_low/eps_high from algo.*.eps_clip_low/high, dual_clip from
algo.dual_clip_c)."""
from __future__ import annotations

from omegaconf import DictConfig

from m2po_megatron.infra import device


def actor_kwargs(cfg: DictConfig) -> dict:
    p, o, a = cfg.parallel, cfg.optim, cfg.algo
    dtype = cfg.model.params_dtype
    if dtype == "auto":
        dtype = "bf16" if device.has_cuda() else "fp32"
    loss_kwargs = {"loss_agg_mode": a.gspo.loss_agg_mode if a.name == "gspo" else a.loss_agg_mode}
    if a.dual_clip_c is not None:
        loss_kwargs["dual_clip"] = a.dual_clip_c
    if a.name == "m2po":  # the global mask reads it here too
        loss_kwargs["m2_tokens"] = a.m2po.m2_tokens
    if a.name == "grpo":
        loss_kwargs.update(eps_low=a.grpo.eps_clip_low, eps_high=a.grpo.eps_clip_high)
    elif a.name == "gspo":
        loss_kwargs.update(eps_low=a.gspo.eps_clip_low, eps_high=a.gspo.eps_clip_high)
    elif a.name == "cispo":
        loss_kwargs.update(eps_low=a.cispo.eps_clip_low, eps_high=a.cispo.eps_clip_high)
    if a.use_opsm:
        loss_kwargs["opsm_delta"] = a.opsm_delta
    if loss_kwargs["loss_agg_mode"] == "seq-mean-token-sum-norm":  # Dr.GRPO's constant: the longest response
        loss_kwargs["loss_scale_factor"] = a.loss_scale_factor or cfg.rollout.max_new_tokens
    total_updates = cfg.train.steps * cfg.train.updates_per_step
    return dict(
        hf_path=cfg.model.hf_path, hf_config=cfg.model.hf_config, load_from=cfg.model.megatron_ckpt,
        micro_batch_tokens=cfg.train.micro_batch_tokens,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size, sequence_parallel=p.sequence_parallel,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size, moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff,
        moe_grouped_gemm=cfg.model.moe_grouped_gemm,
        routing_replay=a.routing_replay,
        use_distributed_optimizer=p.use_distributed_optimizer, recompute_granularity=p.recompute_granularity,
        recompute_method=p.recompute_method, recompute_num_layers=p.recompute_num_layers,
        params_dtype=dtype, fp8=cfg.model.fp8, fp8_recipe=cfg.model.fp8_recipe if cfg.model.fp8 else None,
        lr=o.lr, min_lr=o.min_lr, warmup_updates=o.warmup_updates, lr_decay_steps=max(total_updates, 1),
        lr_schedule=o.lr_schedule, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps, clip_grad=o.clip_grad, attention_backend=cfg.model.attention_backend,
        loss_name=a.name, loss_kwargs=loss_kwargs, m2po_tau=a.m2po.tau, m2po_rule=a.m2po.rule,
        m2po_scope=a.m2po.scope, rollout_correction=dict(a.rollout_correction), seed=cfg.run.seed,
        reference=(dict(param_offload=a.ref_param_offload,
                        **(dict(kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type) if a.use_kl_loss else {}))
                   if a.use_kl_loss or a.use_kl_in_reward else None),
        entropy_coeff=a.entropy_coeff)
