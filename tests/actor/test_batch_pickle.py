"""TrainBatch travels to every rank by pickle (ray.put): as flat tensors, and back exactly as it was."""
import pickle

import pytest
import torch

from m2po_megatron.actor.batch import TrainBatch


def _batch(per_token: bool):
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 50, (int(n),), generator=g) for n in torch.randint(3, 30, (40,), generator=g)]
    lp = [-torch.rand(len(x) - 2, generator=g) for x in ids]
    adv = [torch.randn(len(x) - 2, generator=g) for x in ids] if per_token else torch.randn(40, generator=g)
    return TrainBatch(ids, [2] * 40, lp, adv)


@pytest.mark.parametrize("per_token", [False, True])
def test_round_trip_is_exact_and_each_sequence_owns_its_storage(per_token):
    b = _batch(per_token)
    c = pickle.loads(pickle.dumps(b, protocol=5))
    for name in ("input_ids", "behav_log_probs") + (("advantages",) if per_token else ()):
        for x, y in zip(getattr(b, name), getattr(c, name), strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y)
    if not per_token:
        assert torch.equal(b.advantages, c.advantages)
    assert c.prompt_lens == b.prompt_lens
    c.input_ids[0][0] = 49 - c.input_ids[0][0]  # writing one sequence leaves its neighbours alone
    assert torch.equal(c.input_ids[1], b.input_ids[1])
    assert c.input_ids[0].untyped_storage().nbytes() == c.input_ids[0].numel() * 8
    c.validate(for_training=True, vocab_size=50)


def test_pickled_flat_is_smaller_than_per_tensor():
    b = _batch(False)
    flat = len(pickle.dumps(b, protocol=5))
    per_tensor = len(pickle.dumps(b.__dict__, protocol=5))
    assert flat < per_tensor / 2


def test_malformed_content_survives_so_validate_names_it():
    b = _batch(False)
    b.input_ids[3] = b.input_ids[3][None]  # 2-D: not flattened, so the rank's validate still reports it
    b.behav_log_probs = [x.tolist() for x in b.behav_log_probs]
    c = pickle.loads(pickle.dumps(b))
    assert c.input_ids[3].shape == b.input_ids[3].shape and isinstance(c.behav_log_probs[0], list)
    with pytest.raises(ValueError, match=r"input_ids\[3\] must be a 1-D integer tensor"):
        c.validate(for_training=True)
