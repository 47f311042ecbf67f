"""Checkpoints of megatron's optimizer when it runs PyTorch's Adam/AdamW, on every device.

megatron-core 0.19.2 falls back to `torch.optim.AdamW` when neither Transformer Engine nor Apex is importable (a CPU
machine, and an H200 image without either). Torch's Adam keeps a per-parameter `step` tensor in its state; TE's and
Apex's FusedAdam keep `step` in the param group. Two things then go wrong when a DistributedOptimizer checkpoint
is loaded (`DistributedOptimizer.load_state_dict`):

1. it gives every parameter the *same* `step` tensor, which Adam then increments in place once per parameter
   (single-tensor and foreach kernels alike), so after a resume every update uses a wrong bias correction;
2. it then copies every tensor of the live state from the checkpoint's per-parameter state, which leaves `step`
   out (stored in the param groups): `KeyError: 'step'`.

Both are fixed here, on our side of megatron: `load_state_dict` loads the param groups (and that shared `step`)
through megatron, then the per-parameter tensors through megatron's own loader for the checkpoint's sharding type
with `step` set aside, and gives each parameter its own `step` back. TE/Apex optimizers and the
non-distributed optimizer (which copies `step` per parameter) go through megatron unchanged."""
from __future__ import annotations

import torch

# megatron's DistributedOptimizer.load_state_dict dispatch: param_state_sharding_type -> loader method
_PARAM_STATE_LOADERS = {
    "fully_reshardable": "load_parameter_state_from_fully_reshardable",
    "dp_reshardable": "load_parameter_state_from_dp_reshardable",
    "fully_sharded_model_space": "load_parameter_state_from_fs_model_space",
    "dp_zero_gather_scatter": "load_parameter_state_from_dp_zero",
}


def _parts(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_torch_adam(opt) -> bool:
    """A megatron optimizer (not a chain) whose inner optimizer is PyTorch's Adam or AdamW."""
    return isinstance(getattr(opt, "optimizer", None), (torch.optim.Adam, torch.optim.AdamW))


def ensure_state(optimizer) -> None:
    """Allocate the optimizer state of a fresh optimizer (before its first step there is none), as Megatron-LM
    does before loading: megatron's checkpoint code needs the state tensors to exist. For torch's Adam also the
    `step` megatron's init_state_fn leaves out (DistributedOptimizer.state_dict reads it): a zero tensor, as
    torch's Adam holds before its first step; loading replaces it."""
    for opt in _parts(optimizer):
        fn = getattr(opt, "init_state_fn", None)
        inner = getattr(opt, "optimizer", None)
        if fn is None or inner is None or len(inner.state) != 0:
            continue
        fn(inner, getattr(opt, "config", None))
        if is_torch_adam(opt):
            for st in inner.state.values():
                st.setdefault("step", torch.zeros((), dtype=torch.float32))


def load_state_dict(optimizer, state) -> None:
    """`optimizer.load_state_dict(state)` for a loaded megatron checkpoint, correct for torch's Adam under the
    distributed optimizer (see the module docstring); call ensure_state() before building the sharded dict."""
    parts = _parts(optimizer)
    if not any(_needs_split_load(opt) for opt in parts):
        optimizer.load_state_dict(state)
        return
    if len(parts) == 1:
        states = [state]
    else:  # ChainedOptimizer.load_state_dict's layout: one entry per chained optimizer
        if len(state) != len(parts):
            raise RuntimeError(f"optimizer checkpoint has {len(state)} parts, this optimizer {len(parts)}")
        states = [v for _, v in sorted(state.items())] if isinstance(state, dict) else list(state)
    for opt, st in zip(parts, states):
        if _needs_split_load(opt) and "param_state" in st:
            _load_distributed_torch_adam(opt, st)
        else:
            opt.load_state_dict(st)
    if len(parts) > 1 and hasattr(optimizer, "_synchronize_steps"):
        optimizer._synchronize_steps()  # as ChainedOptimizer.load_state_dict does


def _needs_split_load(opt) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(opt, DistributedOptimizer) and is_torch_adam(opt)


def _load_distributed_torch_adam(opt, st: dict) -> None:
    st = dict(st)
    param_state = st.pop("param_state")
    kind = st.pop("param_state_sharding_type", None)
    if kind not in _PARAM_STATE_LOADERS:
        raise ValueError(f"distributed optimizer checkpoint with param_state_sharding_type={kind!r}: expected one "
                         f"of {sorted(_PARAM_STATE_LOADERS)}")
    # Param groups, grad scaler and the (shared) 'step'; without 'param_state' megatron stops there.
    opt.load_state_dict(st)
    steps = {p: s.pop("step") for p, s in opt.optimizer.state.items() if "step" in s}
    # The checkpoint's per-parameter state has no 'step': megatron's loader copies every tensor state it finds.
    getattr(opt, _PARAM_STATE_LOADERS[kind])(param_state)
    for p, step in steps.items():
        # One tensor per parameter: Adam increments each parameter's 'step' in place.
        opt.optimizer.state[p]["step"] = step.detach().clone()
