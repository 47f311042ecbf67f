"""The frozen reference model of the KL term (algo.use_kl_loss): the initial weights, in the actor's layout.

It is a second set of this rank's GPTModel chunks, built from the actor's TransformerConfig (so the same TP, PP,
VPP, EP and parameter dtype; no initialisation, which would draw from the model-parallel RNG) and filled with a
copy of the actor's chunks right after their initial load, before any update. So it holds exactly the weights
the run started from, and a resumed run rebuilds it the same way from the initial checkpoint: a checkpoint
carries no second copy.

With `offload` (algo.ref_param_offload, the default) every parameter and buffer lives on the host (pinned on
CUDA) between passes, as verl's and slime's offloaded reference models do. A pass copies each to the device
(a new storage even on CPU, which is what the rehearsal traces), runs forward-only, and drops the device copies.
Without it the weights stay on the device. The pass itself is the actor's (MegatronActor.compute_log_probs'
structure over the reference chunks), which shards the batch over data-parallel ranks and broadcasts the
result, so every rank gets every sequence's reference log-probs.

MoE: the reference routes tokens with its own routers (routing replay applies to the policy only)."""
from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Iterator

import torch


class ReferenceModel:
    """Frozen copy of `chunks` (an actor's bare GPTModel chunks, already holding the initial weights)."""

    def __init__(self, spec, config, chunks: list, *, attention_backend: str, offload: bool = True):
        from m2po_megatron.models.builder import build_model_chunks

        cfg = copy.copy(config)  # the actor's, less the initialisation (the weights are copied over it)
        cfg.perform_initialization = False
        self.offload = bool(offload)
        self.chunks = build_model_chunks(spec, cfg, attention_backend=attention_backend)
        with torch.no_grad():
            for ref, src in zip(self.chunks, chunks, strict=True):
                mine, theirs = dict(_tensors(ref)), dict(_tensors(src))
                if mine.keys() != theirs.keys():
                    raise RuntimeError(f"reference chunk differs from the actor's: {sorted(mine.keys() ^ theirs.keys())}")
                for name, t in mine.items():
                    t.copy_(theirs[name])
        for c in self.chunks:
            c.requires_grad_(False)
            c.eval()
        self._host: list[torch.Tensor] = []
        if self.offload:
            pin = torch.cuda.is_available()
            for _, t in self._all():
                host = t.detach().to("cpu", copy=True)
                t.data = host.pin_memory() if pin else host
                self._host.append(t.data)

    def _all(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, c in enumerate(self.chunks):
            for name, t in _tensors(c):
                yield f"{i}.{name}", t

    def host_tensors(self) -> list[torch.Tensor]:
        """The host-resident copies (empty without offload): host memory, not the device's."""
        return list(self._host)

    def num_bytes(self) -> int:
        """Bytes of this rank's reference weights and buffers."""
        return sum(t.numel() * t.element_size() for _, t in self._all())

    @contextmanager
    def on_device(self, device: torch.device):
        """The reference's weights on `device` for the duration (offload: copied in, then dropped)."""
        if not self.offload:
            yield self.chunks
            return
        tensors = [t for _, t in self._all()]
        try:
            for t, host in zip(tensors, self._host):
                t.data = host.to(device, copy=True, non_blocking=True)
            yield self.chunks
        finally:
            for t, host in zip(tensors, self._host):
                t.data = host


def _tensors(module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of `module` by name (each storage once: a tied weight appears once)."""
    seen: set[int] = set()
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        yield name, t
