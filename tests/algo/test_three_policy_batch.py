"""actor.correction.three_policy_batch: the losses' batch in a three-policy step (pure, no model)."""
import math

import torch

from m2po_megatron.actor.batch import TrainBatch
from m2po_megatron.actor.correction import three_policy_batch
from m2po_megatron.algo.rollout_correction import CorrectionSpec


def test_behaviour_becomes_proximal_and_weights_follow_the_ratio_per_sequence():
    ids = [torch.arange(6), torch.arange(5)]
    prox = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0, -1.0])]
    shift = [0.0, math.log(3.0), -math.log(3.0)]  # p/b = 1, 3, 1/3 on sequence 0's tokens
    behav = [prox[0] - torch.tensor(shift), prox[1].clone()]
    batch = TrainBatch(ids, [3, 3], behav, advantages=torch.tensor([1.0, -1.0]))
    for spec, want in ((CorrectionSpec("tis", threshold=2.0), [1.0, 2.0, 1 / 3]),
                       (CorrectionSpec("mis", threshold=2.0), [1.0, 0.0, 0.0])):
        out, m = three_policy_batch(batch, prox, spec)
        assert [t.tolist() for t in out.behav_log_probs] == [t.tolist() for t in prox]
        assert torch.allclose(out.loss_weights[0], torch.tensor(want)) and out.loss_weights[1].tolist() == [1.0, 1.0]
        assert out.advantages is batch.advantages and out.input_ids is batch.input_ids
        assert m["rollout_corr/count_tokens"] == 5
    assert m["rollout_corr/masked_frac"] == 2 / 5 and m["rollout_corr/seq_masked_frac"] == 1 / 2
    sel = out.select([1])  # the weights travel with the mini-batch split
    assert sel.loss_weights[0].tolist() == [1.0, 1.0]
    assert behav[0].tolist() != prox[0].tolist()  # the input batch is left as it was
