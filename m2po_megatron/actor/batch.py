"""The batch the trainer ranks receive, and its checks.

Every rank of the trainer group receives the same full step batch; the actor itself decides which
sequences each data-parallel rank works on (see packing.py). Behaviour log-probs always travel with the
batch: the actor never assumes the data is on-policy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch


@dataclass
class TrainBatch:
    """A batch of prompt+response sequences.

    input_ids: one 1-D LongTensor per sequence, prompt tokens followed by response tokens.
    prompt_lens: number of prompt tokens of each sequence (>= 1; the response is the rest, >= 1 token).
    behav_log_probs: per response token log-prob under the behaviour policy (one 1-D float tensor per
        sequence, length = response length). Required by train_step; unused by compute_log_probs.
    advantages: FloatTensor[n] (one value per sequence) or a list of 1-D per-response-token tensors.
        Required by train_step.
    loss_weights: optional per response token factor on the loss (>= 0; 0 drops the token), one 1-D float
        tensor per sequence: the rollout correction's weights, which the actor sets itself.
    routed_experts: MoE models with routing replay R3 only: per sequence None or an integer tensor
        [len(input_ids[i]), layers, top-k] of the experts that routed each token at generation (ids >= 0),
        -1 for a token with no record (the trainer's router chooses). actor.routing_replay replays it.
    loss_mask: multi-turn rollouts: which response tokens the policy generated (True: trained on) and which
        the environment inserted (tool output, chat template; False: context only, never counted anywhere a
        response token counts). One 1-D bool (or 0/1) tensor per sequence, response length, at least one
        True each. None (the default): every response token is the policy's, at no extra cost.
    ref_log_probs: the reference model's log-probs of each response token (KL to the reference), which the
        actor computes itself at the start of its step (actor.reference); None otherwise.
    """

    input_ids: list[torch.Tensor]
    prompt_lens: list[int]
    behav_log_probs: Optional[list[torch.Tensor]] = None
    advantages: Optional[Union[torch.Tensor, list[torch.Tensor]]] = None
    loss_weights: Optional[list[torch.Tensor]] = None
    routed_experts: Optional[list[Optional[torch.Tensor]]] = None
    loss_mask: Optional[list[torch.Tensor]] = None
    ref_log_probs: Optional[list[torch.Tensor]] = None

    def __len__(self) -> int:
        return len(self.input_ids)

    # Pickled (ray.put to every rank) as one flat tensor per field plus the lengths: hundreds of small tensors
    # cost about 0.1 ms each to pickle and again to unpickle. Anything else pickles as is, for validate().
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for name in _FLAT:
            flat = _flatten(state.get(name))
            if flat is not None:
                state[name] = flat
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault("loss_mask", None)  # a batch pickled before the field existed
        state.setdefault("ref_log_probs", None)
        for name in _FLAT:
            if isinstance(state.get(name), _Flat):
                state[name] = state[name].unflatten()
        self.__dict__.update(state)

    @property
    def lengths(self) -> list[int]:
        return [int(t.numel()) for t in self.input_ids]

    @property
    def response_lens(self) -> list[int]:
        return [int(t.numel()) - int(p) for t, p in zip(self.input_ids, self.prompt_lens)]

    def token_advantages(self, i: int) -> torch.Tensor:
        """Advantages of sequence i, one per response token (a per-sequence value is broadcast)."""
        if isinstance(self.advantages, torch.Tensor):
            # one sequence's length only: this runs per sequence of every micro-batch
            return self.advantages[i].float().expand(int(self.input_ids[i].numel()) - int(self.prompt_lens[i]))
        return self.advantages[i].float()

    def policy_mask(self, i: int) -> Optional[torch.Tensor]:
        """Sequence i's loss mask as bool (True: a policy token), or None when every token is the policy's."""
        return None if self.loss_mask is None else self.loss_mask[i].bool()

    def loss_counts(self) -> tuple[int, int]:
        """(tokens, sequences) in the loss's denominators: every policy response token (loss mask 1) and
        sequence, less the tokens a rollout correction dropped (loss weight 0) and the sequences left with
        none, as verl's rejection sampling drops them from the response mask. M2PO's own dropped tokens stay
        (the paper's Eq. 5)."""
        if self.loss_weights is None and self.loss_mask is None:
            return sum(self.response_lens), len(self)
        kept = []
        for i in range(len(self)):
            m = self.policy_mask(i)
            if self.loss_weights is not None:
                w = self.loss_weights[i] > 0
                m = w if m is None else m & w
            kept.append(int(m.sum()))
        return sum(kept), sum(k > 0 for k in kept)

    def select(self, indices: Sequence[int]) -> "TrainBatch":
        idx = list(indices)
        adv = self.advantages
        if isinstance(adv, torch.Tensor):
            adv = adv[torch.as_tensor(idx, dtype=torch.long)] if idx else adv[:0]
        elif adv is not None:
            adv = [adv[i] for i in idx]
        return TrainBatch(
            input_ids=[self.input_ids[i] for i in idx],
            prompt_lens=[int(self.prompt_lens[i]) for i in idx],
            behav_log_probs=None if self.behav_log_probs is None else [self.behav_log_probs[i] for i in idx],
            advantages=adv,
            loss_weights=None if self.loss_weights is None else [self.loss_weights[i] for i in idx],
            loss_mask=None if self.loss_mask is None else [self.loss_mask[i] for i in idx],
            routed_experts=None if self.routed_experts is None else [self.routed_experts[i] for i in idx],
            ref_log_probs=None if self.ref_log_probs is None else [self.ref_log_probs[i] for i in idx],
        )

    def validate(self, *, for_training: bool, vocab_size: Optional[int] = None, max_tokens: Optional[int] = None):
        """Raise ValueError naming the field and the fix; cheap, so it runs before any model work."""
        n = len(self.input_ids)
        if n == 0:
            raise ValueError("TrainBatch.input_ids is empty: pass at least one sequence")
        if len(self.prompt_lens) != n:
            raise ValueError(f"TrainBatch.prompt_lens has {len(self.prompt_lens)} entries for {n} sequences")
        for i, (ids, p) in enumerate(zip(self.input_ids, self.prompt_lens)):
            if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"TrainBatch.input_ids[{i}] must be a 1-D integer tensor (prompt+response)")
            if not 1 <= int(p) < ids.numel():
                raise ValueError(
                    f"TrainBatch.prompt_lens[{i}]={p} must be in [1, len(input_ids[{i}])-1]={ids.numel() - 1}: "
                    "every sequence needs a prompt token and at least one response token")
            if vocab_size is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                raise ValueError(f"TrainBatch.input_ids[{i}] has token ids outside [0, {vocab_size})")
            if max_tokens is not None and ids.numel() > max_tokens:
                raise ValueError(
                    f"TrainBatch.input_ids[{i}] has {ids.numel()} tokens, more than micro_batch_tokens="
                    f"{max_tokens}: raise micro_batch_tokens to at least the longest prompt+response")
        self._validate_routing()
        self._validate_loss_mask()
        if not for_training:
            return
        rl = self.response_lens
        if self.behav_log_probs is None:
            raise ValueError("TrainBatch.behav_log_probs is required for train_step (per response token)")
        if len(self.behav_log_probs) != n:
            raise ValueError(f"TrainBatch.behav_log_probs has {len(self.behav_log_probs)} entries for {n} sequences")
        for i, lp in enumerate(self.behav_log_probs):
            if lp.dim() != 1 or lp.numel() != rl[i]:
                raise ValueError(
                    f"TrainBatch.behav_log_probs[{i}] has shape {tuple(lp.shape)}; expected ({rl[i]},) = "
                    "response length (len(input_ids) - prompt_lens)")
            m = self.policy_mask(i)  # an environment token's value is never read: the engine may leave it unset
            if not torch.isfinite(lp if m is None else lp[m]).all():
                raise ValueError(f"TrainBatch.behav_log_probs[{i}] has non-finite values")
        if self.advantages is None:
            raise ValueError("TrainBatch.advantages is required for train_step")
        if isinstance(self.advantages, torch.Tensor):
            if self.advantages.shape != (n,):
                raise ValueError(
                    f"TrainBatch.advantages has shape {tuple(self.advantages.shape)}; expected ({n},) "
                    "(one per sequence) or a list of per-token tensors")
        else:
            if len(self.advantages) != n:
                raise ValueError(f"TrainBatch.advantages has {len(self.advantages)} entries for {n} sequences")
            for i, a in enumerate(self.advantages):
                if a.dim() != 1 or a.numel() != rl[i]:
                    raise ValueError(
                        f"TrainBatch.advantages[{i}] has shape {tuple(a.shape)}; expected ({rl[i]},)")


    def _validate_loss_mask(self) -> None:
        if self.loss_mask is None:
            return
        n, rl = len(self.input_ids), self.response_lens
        if not isinstance(self.loss_mask, (list, tuple)) or len(self.loss_mask) != n:
            raise ValueError(f"TrainBatch.loss_mask must be a list of {n} tensors (one per sequence) or None")
        for i, m in enumerate(self.loss_mask):
            if not isinstance(m, torch.Tensor) or m.dim() != 1 or m.numel() != rl[i]:
                shape = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
                raise ValueError(f"TrainBatch.loss_mask[{i}] has shape {shape}; expected ({rl[i]},) = response "
                                 "length (len(input_ids) - prompt_lens), one flag per response token")
            if m.dtype != torch.bool and (m.is_complex() or bool(((m != 0) & (m != 1)).any())):
                raise ValueError(f"TrainBatch.loss_mask[{i}] must be bool or 0/1 ({m.dtype} with other values): "
                                 "1 = a policy token, 0 = an environment token")
            if not bool(m.any()):
                raise ValueError(f"TrainBatch.loss_mask[{i}] has no policy token (all 0): a sequence needs at "
                                 "least one token the policy generated; drop the sample before training")

    def _validate_routing(self) -> None:
        if self.routed_experts is None:
            return
        if len(self.routed_experts) != len(self.input_ids):
            raise ValueError(f"TrainBatch.routed_experts has {len(self.routed_experts)} entries for "
                             f"{len(self.input_ids)} sequences")
        for i, r in enumerate(self.routed_experts):
            if r is not None and (r.dim() != 3 or r.shape[0] != self.input_ids[i].numel() or r.is_floating_point()):
                raise ValueError(f"TrainBatch.routed_experts[{i}] has shape {tuple(r.shape)} ({r.dtype}); expected "
                                 f"an integer tensor ({self.input_ids[i].numel()}, layers, top-k), one row per token")


_FLAT = ("input_ids", "behav_log_probs", "advantages", "loss_mask", "ref_log_probs")  # the fields pickled flat


@dataclass
class _Flat:
    """A list of 1-D tensors of one dtype, as their concatenation and lengths (see TrainBatch.__getstate__)."""

    data: torch.Tensor
    lengths: list[int]

    def unflatten(self) -> list[torch.Tensor]:
        # clone: each sequence owns its storage, as before pickling (no view keeps the whole batch alive)
        return [t.clone() for t in self.data.split(self.lengths)] if self.lengths else []


def _flatten(seqs) -> Optional[_Flat]:
    if not isinstance(seqs, list) or not seqs or not all(isinstance(t, torch.Tensor) for t in seqs):
        return None
    dtype, device = seqs[0].dtype, seqs[0].device
    if any(t.dim() != 1 or t.dtype != dtype or t.device != device or t.requires_grad for t in seqs):
        return None
    return _Flat(torch.cat(seqs), [int(t.numel()) for t in seqs])
