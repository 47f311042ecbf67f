"""The HF transformers peer of MegatronActor.train_step, for benchmarks (not a test).

The same work on the same batch, written the plain way: padded micro-batches of the same token budget
(sorted by length, b x longest <= budget), a no-grad forward of every micro-batch for the M2PO mask over the
whole mini-batch, then forward + backward of each micro-batch with the same policy loss (algo.policy_loss,
global token-mean), log-probs from log_softmax over the response rows (entropy without gradient, as the
actor logs it), gradient clipping at 1.0 and one torch AdamW step (fused on CUDA). Pure torch +
transformers + the algo library: no Megatron, no Ray.
"""
from __future__ import annotations

from typing import Sequence

import torch


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
    def __init__(self, model, batch, micro_batch_tokens: int, lr: float = 1e-6, tau: float = 0.04):
        self.model, self.batch, self.tau = model, batch, tau
        self.dev = next(model.parameters()).device
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01,
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

    def _log_probs(self, ids, am, resp):
        logits = self.model(input_ids=ids, attention_mask=am).logits[:, :-1]
        rows = logits[resp].float()  # [R, V]: the response positions only
        logp_all = torch.log_softmax(rows, -1)
        logp = logp_all.gather(-1, ids[:, 1:][resp].unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
        return logp, ent

    def step(self) -> dict:
        from m2po_megatron.algo import m2po_keep_mask, policy_loss

        self.model.train()
        with torch.no_grad():  # the M2PO mask over the whole mini-batch, at the current weights
            ratios = [self._log_probs(ids, am, resp)[0] - behav for ids, am, resp, behav, _ in self.groups]
        advs = [g[4] for g in self.groups]
        keep = m2po_keep_mask(torch.cat(ratios), torch.cat(advs), torch.ones(self.num_tokens, dtype=torch.bool,
                                                                              device=self.dev), tau=self.tau)
        keeps = torch.split(keep, [r.numel() for r in ratios])
        total, ent_sum = 0.0, 0.0
        for (ids, am, resp, behav, adv), k in zip(self.groups, keeps):
            logp, ent = self._log_probs(ids, am, resp)
            loss, _ = policy_loss("m2po", logp, behav, adv, torch.ones_like(k), keep_mask=k,
                                  num_tokens=self.num_tokens, num_seqs=len(self.batch))
            loss.backward()
            total += float(loss)
            ent_sum += float(ent.sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"loss": total, "grad_norm": float(grad_norm), "entropy": ent_sum / self.num_tokens,
                "num_microbatches": len(self.groups)}
