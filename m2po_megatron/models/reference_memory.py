"""The reference model's share of a trainer rank's memory (algo.use_kl_loss or use_kl_in_reward; actor/reference.py).

The reference is a frozen second copy of the rank's model chunks, in the actor's layout and params dtype. Its
log-probs come from one forward-only pass over the step's micro-batches at the start of train_step, before
M2PO's global mask and the training micro-batches. Two settings (algo.ref_param_offload):

- offloaded (the default, as verl and slime offload theirs): its weights are host tensors between uses. The
  pass copies each one to the GPU, runs, and drops the copies. The step then has two phases:
    reference pass = static state + reference weights + a forward-only pass's activations
    training       = static state + max(activations + logits, optimizer_step)          (unchanged)
- resident: its weights stay on the GPU in every phase, so both phases carry them.

static state = the actor's weights, gradient buffers, optimizer states and the fixed overhead. The estimate's
peak is the larger phase. The reference's weights are the actor's weights term (the same parameters, dtype and,
with FP8, TE's cast copies made in its forward).

A no-grad forward keeps no layer's tensors for backward: at any moment one micro-batch's stage input (the
embedding's output, or the activations received from the previous stage) and residual stream live, plus the
tensors of the one operation running. `forward_only_bytes` counts, per token, the residual stream and
the largest of: the attention block (at its output projection: the norm's output, all-gathered with sequence
parallelism, linear_qkv's output, q and k after RoPE, the attention output and the projection's output), the
MLP block (at the SwiGLU: fc1's output and the activation; at fc2: its input and output), and, on the last
stage, the fused log-prob output layer (the final hidden states, the response rows' copy and one chunk of logit
rows in fp32 and its exp: actor.fused_logprobs). A MoE layer's MLP is what its
experts keep in training (moe_memory.moe_saved_elements), an upper bound of its forward. The CPU's composite
RMSNorm (cuda_kernels=False, traced by m2po rehearse) makes fp32 copies of its input in forward, and the eager
SwiGLU silu's output beside the product: counted.
Pure arithmetic on a models.memory.ModelShape (taken as given, so this module imports nothing of memory.py).
"""
from __future__ import annotations

from m2po_megatron.models.moe_memory import moe_saved_elements

GiB = 1024**3
LOGPROB_CHUNK_BYTES = 256 * 1024**2  # actor.fused_logprobs.CHUNK_BYTES (fp32 bytes of a chunk of logit rows)


def forward_only_bytes(s, tokens: float, *, tp: int = 1, sequence_parallel: bool = False, act_bytes: int = 2,
                       attention_backend: str = "sdpa", cuda_kernels: bool = True, first: bool = True,
                       last: bool = True, etp: int = 1, chunk_bytes: int = LOGPROB_CHUNK_BYTES) -> float:
    """Peak bytes of one no-grad forward of a micro-batch of `tokens` tokens (per context-parallel rank) on one
    tensor-parallel rank of a pipeline stage (`first`: the embedding; `last`: the output layer and log-probs
    too). Module docstring."""
    a, t = act_bytes, float(tokens)
    hid = s.hidden / (tp if sequence_parallel else 1)  # the residual stream's sequence-parallel shard
    gathered = s.hidden if sequence_parallel else 0.0  # the norm's output all-gathered for a column-parallel input
    q, kv, f = s.q_dim / tp, s.kv_dim / tp, s.ffn / tp
    norm = 0.0 if cuda_kernels else 12 * hid  # the composite RMSNorm's fp32 input, square and product
    ln = a * (hid + gathered)
    attn = ln + a * ((q + 2 * kv) + (q + kv) + q + s.hidden)
    if attention_backend == "local":  # megatron's DotProductAttention: the scores, in fp32 and in bf16
        attn += (s.heads / tp) * t * (4 + a)
    if s.experts:
        act, _, f32 = moe_saved_elements(s, tp, sequence_parallel, etp, False, False)
        mlp = ln + act * a + 4 * f32
    else:
        # fc1's output and SwiGLU's (eager, as the CPU runs it: silu's output too); then fc2's input and output
        mlp = ln + a * max((3 if cuda_kernels else 4) * f, f + s.hidden)
    block = max(attn, mlp, a * hid + norm)
    if last:
        vp = s.vocab / tp
        rows = min(t, max(1, chunk_bytes // (4 * max(1, int(vp)))))
        # the final norm's output (and its gather), the response rows' copy, the per-row partials (max and
        # three sums in fp32); one chunk of logits: the fp32 copy of the product and its exp (the product in the
        # activation dtype is gone by then)
        head = a * (hid + gathered + s.hidden) + 16
        block = max(block, head + rows * vp * 8 / t)
    # the stage's input stays referenced through the pass: the embedding's output and its [S, 1, H] copy on the
    # first stage, the received activations on the others
    stage_input = a * hid * (2 if first else 1)
    return t * (stage_input + a * hid + block)


def uses_reference(cfg) -> bool:
    """Whether a run config's trainer builds a reference model: a KL loss (algo.use_kl_loss) or a KL penalty in
    the reward (algo.use_kl_in_reward), as actor.options.actor_kwargs decides."""
    algo = cfg.algo
    return bool(getattr(algo, "use_kl_loss", False) or getattr(algo, "use_kl_in_reward", False))


def recipe_reference(cfg) -> dict:
    """estimate_gpu_memory's reference arguments for a run config (its algo section)."""
    return dict(reference_model=uses_reference(cfg), ref_param_offload=bool(getattr(cfg.algo, "ref_param_offload", True)))


def reference_place(cfg) -> str | None:
    """plan/costs.from_hardware's `reference` for a run config: "offloaded", "resident" or None."""
    if not uses_reference(cfg):
        return None
    return "offloaded" if getattr(cfg.algo, "ref_param_offload", True) else "resident"


def add_reference(out: dict, *, offload: bool, activations_bytes: float) -> dict:
    """estimate_gpu_memory's result (GiB) with the reference's terms added, in place: "reference" (its
    weights), "reference_activations" (its forward-only pass), "reference_on_gpu" (what of it the training phase
    holds: 0 when offloaded), "training" and "reference_pass" (each phase's total) and "total" (the larger)."""
    ref = out["weights"]
    static = out["weights"] + out["grads"] + out["optimizer"] + out["overhead"]
    resident = 0.0 if offload else ref
    out["reference"] = ref
    out["reference_activations"] = activations_bytes / GiB
    out["reference_on_gpu"] = resident
    out["training"] = static + resident + max(out["activations"] + out["logits"], out["optimizer_step"])
    out["reference_pass"] = static + ref + out["reference_activations"]
    out["total"] = max(out["training"], out["reference_pass"])
    return out


def format_reference(est: dict) -> str:
    """The reference's named part of `m2po config`'s breakdown ("" without a reference model)."""
    if "reference" not in est:
        return ""
    where = "resident" if est["reference_on_gpu"] else "on the host outside its pass"
    phase = "reference pass" if est["reference_pass"] > est["training"] else "training"
    return (f"; reference model: weights {est['reference']:.1f} ({where}), its pass's activations "
            f"{est['reference_activations']:.1f} -> reference pass {est['reference_pass']:.1f}, training "
            f"{est['training']:.1f} (peak: {phase})")
