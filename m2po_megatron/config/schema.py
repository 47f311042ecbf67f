"""The typed schema of a run: one dataclass per recipe section, `RunConfig` holding them all.

A recipe is YAML matching `RunConfig`; comments give each field's choices and units. Loading (loading.py)
and the checks (validation.py) read these dataclasses; nothing here touches files.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional


class ConfigError(ValueError):
    """A recipe or override is wrong; the message names the field and the fix."""


@dataclass
class RunSection:
    name: str = "run"
    output_dir: str = "runs"  # the run directory is output_dir/name
    seed: int = 1234
    resume: str = "none"  # none | auto | PATH of a checkpoint
    overwrite: bool = False  # start over in a run directory that holds another run (it is moved aside)


@dataclass
class ModelSection:
    hf_path: Optional[str] = None  # HF checkpoint dir (config.json + weights); initial weights
    hf_id: Optional[str] = None  # Hugging Face hub repo id of hf_path's weights (`m2po download` fetches it)
    hf_config: Optional[str] = None  # dir or config.json used for validation when hf_path is absent
    tokenizer: Optional[str] = None  # defaults to hf_path
    megatron_ckpt: Optional[str] = None  # initial weights from `m2po convert hf-to-megatron`
    params_dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 | fp16
    fp8: Optional[str] = None  # null | e4m3 | hybrid (Transformer Engine only)
    fp8_recipe: str = "delayed"  # delayed | tensorwise | blockwise | mxfp8
    # MoE models only: the weight of megatron-core's load-balancing (aux) loss. 0 (the default) trains the RL
    # objective alone; the HF config's router_aux_loss_coef (0.001 for Qwen3-MoE) keeps pre-training's term.
    moe_aux_loss_coeff: float = 0.0
    # MoE models only: run each layer's local experts as one grouped GEMM (models/grouped_experts.py) on megatron's
    # local layers (sdpa, local) instead of a SequentialMLP loop. Where Transformer Engine is usable, its grouped
    # experts (TEGroupedMLP) are the grouped path. Off by default: not yet measured on a GPU (docs/moe.md).
    moe_grouped_gemm: bool = False
    # auto (te where Transformer Engine is usable, else sdpa) | te | sdpa (FlexAttention per packed row on
    # CUDA, fused SDPA per sequence elsewhere) | local (megatron's dense-mask attention: S x S scores per layer)
    attention_backend: str = "auto"


@dataclass
class ParallelSection:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    data_parallel_size: int = 1
    # MoE models only: experts split over this many ranks (megatron-core's EP; it divides num_experts and the
    # ranks of a pipeline stage), and each expert's matrices over expert_tensor_parallel_size ranks
    # (null: tensor_model_parallel_size, megatron-core's default)
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    # Megatron's activation recompute: null | selective (core attention) | full (whole layers)
    recompute_granularity: Optional[str] = None
    recompute_method: str = "uniform"  # full only: uniform (chunks of recompute_num_layers) | block
    recompute_num_layers: int = 1  # full only: layers per chunk (uniform) or per stage (block)


@dataclass
class M2POSection:
    tau: float = 0.04
    rule: str = "remove"  # remove (paper Algorithm 1) | cap (released code)
    scope: str = "global"  # global (whole optimizer mini-batch across DP) | microbatch (released code)
    m2_tokens: str = "trust_region"  # M2 over: trust_region (paper, released code) | all valid tokens (AReaL)


@dataclass
class ClipSection:
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2


@dataclass
class GSPOSection:
    eps_clip_low: float = 3e-4
    eps_clip_high: float = 4e-4
    loss_agg_mode: str = "seq-mean-token-mean"  # GSPO's own (paper, verl): each sequence weighs the same


@dataclass
class RolloutCorrectionSection:
    """The three-policy objective's correction of proximal/behaviour (algo/rollout_correction.py; docs/algo.md
    gives verl's, slime's, AReaL's and NeMo-RL's names for each). bypass (the default) is the two-policy loss
    on theta/behaviour; any other mode adds a no-grad pass per step for the proximal log-probs."""
    mode: str = "bypass"  # bypass | tis (truncated IS) | mis (masked IS) | icepop (token band) | geometric | clip
    level: Optional[str] = None  # tis, mis, clip: token (default) | sequence; icepop is token, geometric sequence
    threshold: float = 2.0  # C >= 1: tis caps the weight at C; the masking modes keep [1/C, C]; clip clamps to it
    threshold_lower: Optional[float] = None  # the band's lower end in [0, 1), below threshold; default 1/C
    geometric_action: str = "mask"  # geometric only: mask (drop outside the band) | truncate (cap at C) | clip
    batch_normalize: bool = False  # weights to mean 1 over the step's kept tokens (verl's, slime's option)
    veto_threshold: Optional[float] = None  # slime's rs_veto_threshold: drop a sequence with a token p/b below it
    rejection: Optional[str] = None  # verl's rollout_rs k2/k3 criteria: token_k2 ... seq_max_k3, on top of mode
    rejection_threshold: Optional[float] = None  # its upper bound (verl's rollout_rs_threshold)


@dataclass
class KLCtrlSection:
    type: str = "fixed"  # fixed only (verl's adaptive controller would need its state in the checkpoint)
    kl_coef: float = 0.001


@dataclass
class AlgoSection:
    name: str = "m2po"  # m2po | grpo | grpo_notr | gspo | cispo
    # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (Dr.GRPO), for every loss
    # but gspo, which reads algo.gspo.loss_agg_mode, so one recipe can sweep every method with its own aggregation
    loss_agg_mode: str = "token-mean"
    # seq-mean-token-sum-norm's constant (verl's name; Dr.GRPO's MAX_TOKENS); null: rollout.max_new_tokens
    loss_scale_factor: Optional[float] = None
    # off-policy sequence masking (slime's --use-opsm / --opsm-delta): drop A<0 tokens of sequences whose mean
    # log(behaviour / current) exceeds opsm_delta; any loss
    use_opsm: bool = False
    opsm_delta: float = 1e-4
    # KL to a frozen reference model (the initial weights) as a loss term (verl's actor names and defaults):
    # kl_loss_type kl|k1, abs, mse|k2, low_var_kl|k3, and each with "+" (k2's unbiased gradient, verl's); the
    # reference sits on the host between its passes unless ref_param_offload is false (algo/kl.py, actor/reference.py)
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    ref_param_offload: bool = True
    # the same KL as a per-token penalty in the reward (verl's algorithm.use_kl_in_reward, kl_penalty, kl_ctrl):
    # of the behaviour policy against the reference, summed per sequence before GRPO's group normalisation
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLCtrlSection = field(default_factory=KLCtrlSection)
    # entropy bonus (verl's entropy_coeff): loss -= entropy_coeff x the entropy aggregated as the policy loss is
    entropy_coeff: float = 0.0
    norm_adv_by_std: bool = True
    adv_eps: float = 1e-6
    dual_clip_c: Optional[float] = None  # e.g. 3.0; bounds A<0 tokens with huge ratios, any loss
    # MoE models only (verl's names): none | r2 (replay the experts the trainer chose when it computed the old
    # log-probs) | r3 (replay the experts the rollout engine chose, recorded per response token)
    routing_replay: str = "none"
    # DAPO's over-long filtering (NeMo-RL's overlong_filtering, SkyRL's apply_overlong_filtering): a truncated
    # sample (finish reason `length`) keeps its reward in its group's advantages but is masked from the loss
    overlong_filtering: bool = False
    m2po: M2POSection = field(default_factory=M2POSection)
    grpo: ClipSection = field(default_factory=ClipSection)
    gspo: GSPOSection = field(default_factory=GSPOSection)
    # CISPO's weight clip [1 - low, 1 + high]; low 1.0: no lower bound (the paper's, slime's advice)
    cispo: ClipSection = field(default_factory=lambda: ClipSection(eps_clip_low=1.0, eps_clip_high=0.2))
    rollout_correction: RolloutCorrectionSection = field(default_factory=RolloutCorrectionSection)


@dataclass
class StalenessSection:
    mode: str = "bounded"  # on_policy | fixed_lag | bounded
    lag_steps: int = 0  # fixed_lag: k batches of lag (staleness = k x updates_per_step)
    max_staleness: int = 4  # bounded: in optimizer updates
    sync_interval: int = 1  # bounded: push weights every this many updates
    drop_too_stale: bool = True  # bounded: drop (counted) or keep samples beyond the bound
    behav_logprob_source: str = "engine"  # engine | trainer (recomputed at generation time)


@dataclass
class RolloutSection:
    engine: str = "local"  # local (CPU server speaking SGLang's protocol) | sglang
    urls: list[str] = field(default_factory=list)  # attach to servers started elsewhere
    num_servers: int = 1
    host: Optional[str] = None  # default: this node's address (never 0.0.0.0)
    port: int = 0  # 0: each server gets a free port, bound by the launcher itself (no race); N: server i on N + i
    api_key: Optional[str] = None  # prefer the M2PO_API_KEY environment variable; never logged
    tp_size: int = 1  # SGLang --tp-size
    dp_size: int = 1  # SGLang --dp-size
    mem_fraction_static: Optional[float] = None  # SGLang --mem-fraction-static
    context_length: Optional[int] = None
    dtype: str = "auto"
    quantization: Optional[str] = None  # e.g. fp8
    n_samples_per_prompt: int = 8  # GRPO group size
    # The rollout of one prompt group (docs/agents.md): a registered name (single_turn, calculator, ...),
    # `package.module:name` or `path/to/file.py:name` of an `async def f(ctx) -> list[RolloutResult]`
    function: str = "single_turn"
    function_args: dict[str, Any] = field(default_factory=dict)  # handed to it as ctx.args
    function_timeout_s: Optional[float] = 3600.0  # per group call; past it its samples are dropped (null: none)
    tool_call_parser: Optional[str] = None  # SGLang's --tool-call-parser names (qwen25, llama3, ...) or m2po_tags
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 2560
    max_concurrency: int = 64  # samples in flight per server (a prompt's n samples go as one batch request)
    request_timeout_s: float = 600.0
    max_retries: int = 3
    max_restarts: int = 2
    health_timeout_s: float = 600.0
    pause_mode: str = "retract"  # SGLang /pause_generation mode around each weight update: retract | in_place | abort
    deterministic_inference: bool = False  # SGLang --enable-deterministic-inference: sampling seeds take effect
    bucket_mb: int = 512


@dataclass
class DataSection:
    train_path: Optional[str] = None  # prepared JSONL/parquet (m2po prepare-data)
    eval_paths: list[str] = field(default_factory=list)
    # null = the prepared prompt as is; else a preset (m2po, plain) or a format string rendered from each
    # row's `problem`, for training and evaluation alike
    prompt_template: Optional[str] = None
    apply_chat_template: bool = True  # wrap the prompt in the tokenizer's chat template (once)
    max_prompt_len: int = 1534  # + max_new_tokens + 2 must fit the context (SGLang never fills its last 2)
    shuffle_seed: int = 42
    # Column mapping (slime's --input-key/--label-key/--tool-key/--metadata-key, verl's data.prompt_key). A row
    # keeps all its fields: the rollout function and the reward get the whole row, whatever the names.
    input_key: str = "prompt"  # the prompt: raw text, chat messages [{role, content}] or token ids
    label_key: Optional[str] = "answer"  # the reference a rule-based reward checks (math: the gold answer)
    tools_key: Optional[str] = None  # tool schemas handed to the chat template (tools=...) per row
    metadata_key: Optional[str] = None  # a dict column; must be a JSON object where present
    id_key: str = "id"  # a row without it is named by its position
    prompt_format: str = "auto"  # auto (by the value's type) | text | messages | ids
    # A `datasets` dataset saved with save_to_disk (a DatasetDict): the split to read
    train_split: str = "train"
    eval_split: str = "test"


@dataclass
class RewardTerm:
    """One weighted term of the reward: a registered name (math_verify, code, remote), `package.module:name`
    or `path/to/file.py:name`, called as fn(response, token_ids, row, **args) -> float | {"score": ..., ...}."""
    function: str = "math_verify"
    weight: float = 1.0
    args: dict[str, Any] = field(default_factory=dict)
    name: Optional[str] = None  # its metrics' name (reward/<name>/...); default: the function's name
    timeout_s: Optional[float] = None  # per item in the worker pool; default reward.timeout_s


@dataclass
class OverlongBufferSection:
    """DAPO's soft over-long punishment, named as verl's reward_model.overlong_buffer: the last `len` tokens of
    rollout.max_new_tokens cost up to penalty_factor, linearly, added to the reward."""
    enable: bool = False
    len: int = 4096
    penalty_factor: float = 1.0


@dataclass
class RewardSection:
    format_score: float = 0.0  # math_verify: paper appendix 0.1; released code 0
    num_workers: int = 4
    timeout_s: float = 5.0  # per item, for terms run in the worker pool
    # verl's custom_reward_function.{path,name} / slime's --custom-rm-path: one function (a term of weight 1)
    function: str = "math_verify"
    args: dict[str, Any] = field(default_factory=dict)  # its keyword arguments (verl's reward_kwargs)
    terms: list[RewardTerm] = field(default_factory=list)  # several weighted terms; when given, `function` is unused
    # a term that fails (time limit, exception, a reward service down after its retries): score it
    # error_score, or drop the sample (counted as reward_error)
    on_error: str = "score"  # score | drop
    error_score: float = 0.0
    overlong_buffer: OverlongBufferSection = field(default_factory=OverlongBufferSection)


@dataclass
class FilterGroupsSection:
    """DAPO's dynamic sampling, named as verl's algorithm.filter_groups: drop groups whose rewards are all
    equal (zero advantage) and generate more, so that a step trains prompts_per_step informative groups."""
    enable: bool = False
    # generation budget per step in batches of prompts_per_step groups (verl's max_num_gen_batches; >= 1,
    # 1 = no extra generation). A step that cannot fill its batch within it trains on what it has.
    max_num_gen_batches: int = 4  # 0 = unlimited (verl's meaning): a step waits for a full batch
    metric: str = "acc"  # what must vary within a kept group (verl's names): acc | seq_reward


@dataclass
class TrainSection:
    steps: int = 1000
    prompts_per_step: int = 256
    updates_per_step: int = 4  # optimizer mini-batches per step
    micro_batch_tokens: int = 30000  # token budget of a packed micro-batch
    filter_groups: FilterGroupsSection = field(default_factory=FilterGroupsSection)


@dataclass
class OptimSection:
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_schedule: str = "constant"  # constant | cosine | linear
    warmup_updates: int = 0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass
class EvalSection:
    interval: int = 50  # steps; 0 = only before and after training
    steps: list[int] = field(default_factory=list)  # more steps to evaluate at, beside every `interval`
    n_samples: int = 4
    n_samples_overrides: dict[str, int] = field(default_factory=lambda: {"aime24": 16, "aime25": 16})
    temperature: float = 1.0
    top_p: float = 0.7
    max_new_tokens: Optional[int] = None  # default: rollout.max_new_tokens
    # null: the built-in benchmarks' avg@k for single_turn, else rollout.function's episodes; or another function
    function: Optional[str] = None


@dataclass
class CheckpointSection:
    interval: int = 50  # steps; 0 = only at the end and on SIGTERM
    keep_last: int = 2
    save_on_sigterm: bool = True
    stop_timeout_s: float = 270.0  # after SIGTERM/SIGUSR1: exit without a new checkpoint past this (0 = no limit)


@dataclass
class LoggingSection:
    wandb_mode: str = "disabled"  # online | offline | disabled (WANDB_MODE overrides)
    wandb_project: str = "m2po-megatron"
    wandb_entity: Optional[str] = None
    trace: bool = True  # RUN_DIR/trace.json, the run timeline (Chrome trace events; open it in Perfetto)
    trace_limit: int = 20000  # spans per category kept in full, then sampled (at most twice this many)


@dataclass
class ClusterSection:
    ray_address: str = "local"  # local (private Ray on this machine) | auto | HOST:PORT
    ray_tmpdir: Optional[str] = None
    object_store_memory_mb: int = 512
    trainer_nodes: int = 1
    rollout_nodes: int = 0  # 0 = rollout servers share the trainer's node(s)
    gpus_per_node: int = 0  # 0 = CPU: one trainer process per rank
    # GPUs of each trainer node the trainer ranks take (0: all). Fewer, with rollout_nodes = 0, splits a node:
    # the rollout servers get the rest of its GPUs (Ray hands each process distinct ones)
    trainer_gpus_per_node: int = 0
    gpu_memory_gb: Optional[float] = None  # when set, the per-GPU memory estimate must fit
    # Trainer ranks and rollout engines share the same GPUs (slime's --colocate, verl's hybrid engine): each step
    # the engines generate, release their memory, the trainer reloads, trains, offloads, and the engines take
    # the new weights from the same GPU (docs/colocate.md). Synchronous modes only (on_policy, fixed_lag).
    colocate: bool = False
    timeout_s: float = 3600.0  # longest wait on another process (trainer ranks, servers) before the run stops


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    staleness: StalenessSection = field(default_factory=StalenessSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    data: DataSection = field(default_factory=DataSection)
    reward: RewardSection = field(default_factory=RewardSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)


def _field_paths(node: Any, prefix: str = "") -> list[str]:
    out = []
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            path = f"{prefix}{f.name}"
            out.append(path)
            out.extend(_field_paths(getattr(node, f.name), path + "."))
    return out


ALL_FIELDS = _field_paths(RunConfig())


def field_type(key: str) -> str:
    """The declared type of a dotted field (for error messages)."""
    node: Any = RunConfig()
    fld = None
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            break
        fld = {f.name: f for f in dataclasses.fields(node)}.get(part)
        if fld is None:
            break
        node = getattr(node, part)
    return str(fld.type) if fld is not None else "the schema's type"
