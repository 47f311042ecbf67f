"""The HF transformers peer of MegatronActor.train_step, for benchmarks (not a test).

The same work on the same batch, written the plain way: padded micro-batches of the same token budget
(sorted by length, b x longest <= budget), a no-grad forward of every micro-batch for the M2PO mask over the
whole mini-batch, then forward + backward of each micro-batch with the same policy loss (algo.policy_loss,
global token-mean), log-probs from log_softmax over the response rows (entropy without gradient, in chunks
of rows, as the actor logs it), gradient clipping at 1.0 and one AdamW step (fused on CUDA). Optional
full activation recompute (HF's gradient checkpointing, one checkpoint per decoder layer), for configs where
the actor recomputes too.

Optimizer precision is the actor's (Megatron's mixed precision): the model holds the compute dtype (bf16 on
a GPU), each micro-batch's gradients are added into fp32 master gradients, clipping and AdamW run on fp32
master weights with fp32 moments, and the bf16 weights are copied back from them. On CPU (fp32 models) the
same code runs with fp32 on both sides. Pure torch + transformers + the algo library: no Megatron, no Ray.
"""
from __future__ import annotations

from typing import Sequence

import torch

PRECISION = ("model weights in the compute dtype; fp32 master weights, fp32 gradient accumulation, fp32 AdamW "
             "moments (the actor's: bf16 params, fp32 main grads, fp32 distributed-optimizer state)")
ENTROPY_CHUNK_ROWS = 2048


def padded_microbatches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Sequences sorted by length (longest first) in groups with len(group) x longest <= budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups, i = [], 0
    while i < len(order):
        b = max(1, budget // lengths[order[i]])
        groups.append(order[i:i + b])
        i += b
    return groups


class HFPeer:
    def __init__(self, model, batch, micro_batch_tokens: int, lr: float = 1e-6, tau: float = 0.04,
                 recompute: bool = False):
        self.model, self.batch, self.tau = model, batch, tau
        self.dev = next(model.parameters()).device
        if recompute:
            model.config.use_cache = False
            kw = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the older name warns
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, weight_decay=0.01,
                                     fused=True if self.dev.type == "cuda" else None)
        self.groups = []
        for g in padded_microbatches(batch.lengths, micro_batch_tokens):
            ids = torch.nn.utils.rnn.pad_sequence([batch.input_ids[i] for i in g], batch_first=True)
            am = torch.zeros_like(ids)
            resp = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)  # logits j predict token j+1
            for k, i in enumerate(g):
                n, p = batch.lengths[i], batch.prompt_lens[i]
                am[k, :n] = 1
                resp[k, p - 1:n - 1] = True
            behav = torch.cat([batch.behav_log_probs[i] for i in g]).float()
            adv = torch.cat([batch.token_advantages(i) for i in g]).float()
            self.groups.append(tuple(t.to(self.dev) for t in (ids, am, resp, behav, adv)))
        self.num_tokens = sum(int(g[2].sum()) for g in self.groups)
        self.padded_tokens = sum(int(g[0].numel()) for g in self.groups)

    def _log_probs(self, ids, am, resp, with_entropy: bool):
        logits = self.model(input_ids=ids, attention_mask=am).logits[:, :-1]
        rows = logits[resp]  # [R, V]: the response positions only
        del logits
        logp_all = torch.log_softmax(rows.float(), -1)
        logp = logp_all.gather(-1, ids[:, 1:][resp].unsqueeze(-1)).squeeze(-1)
        ent = None
        if with_entropy:
            with torch.no_grad():
                ent = torch.cat([-(c.exp() * c).sum(-1) for c in logp_all.detach().split(ENTROPY_CHUNK_ROWS)])
        return logp, ent

    def step(self) -> dict:
        from m2po_megatron.algo import m2po_keep_mask, policy_loss

        self.model.train()
        with torch.no_grad():  # the M2PO mask over the whole mini-batch, at the current weights
            ratios = [self._log_probs(ids, am, resp, False)[0] - behav for ids, am, resp, behav, _ in self.groups]
        advs = [g[4] for g in self.groups]
        keep = m2po_keep_mask(torch.cat(ratios), torch.cat(advs), torch.ones(self.num_tokens, dtype=torch.bool,
                                                                              device=self.dev), tau=self.tau)
        keeps = torch.split(keep, [r.numel() for r in ratios])
        total, ent_sum = 0.0, 0.0
        for m in self.master:
            m.grad = torch.zeros_like(m)
        for (ids, am, resp, behav, adv), k in zip(self.groups, keeps):
            logp, ent = self._log_probs(ids, am, resp, True)
            loss, _ = policy_loss("m2po", logp, behav, adv, torch.ones_like(k), keep_mask=k,
                                  num_tokens=self.num_tokens, num_seqs=len(self.batch))
            loss.backward()
            with torch.no_grad():  # accumulate in fp32, as Megatron's main_grad
                for m, p in zip(self.master, self.params):
                    if p.grad is not None:
                        m.grad.add_(p.grad)
                        p.grad = None
            total += float(loss)
            ent_sum += float(ent.sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.master, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.master):  # master -> compute dtype (a cast for bf16 models)
                p.copy_(m)
        return {"loss": total, "grad_norm": float(grad_norm), "entropy": ent_sum / self.num_tokens,
                "num_microbatches": len(self.groups)}
