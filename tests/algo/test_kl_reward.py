"""The KL in the reward (algo.use_kl_in_reward): each sequence's reward less coef x its summed per-token KL of
the behaviour policy against the reference (verl's own kl_penalty as the oracle), before GRPO's group
normalisation; environment tokens carry no penalty; the recipe's checks."""
import pytest
import torch

from _verl_kl import kl_penalty as verl_kl_penalty
from m2po_megatron.algo.advantages import grpo_advantages
from m2po_megatron.algo.kl_reward import penalised_advantages


def _seqs(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 9, (n,), generator=g).tolist()
    behav = [-3 * torch.rand(k, generator=g) for k in lens]
    ref = [b + 0.3 * torch.randn(k, generator=g) for b, k in zip(behav, lens)]
    masks = [torch.rand(k, generator=g) > 0.3 for k in lens]
    return behav, ref, masks, torch.rand(n, generator=g), torch.tensor([0, 0, 0, 1, 1, 1])[:n]


@pytest.mark.parametrize("kl_type", ["kl", "abs", "mse", "low_var_kl"])
@pytest.mark.parametrize("masked", [False, True])
def test_penalty_is_the_summed_verl_kl_before_group_normalisation(kl_type, masked):
    behav, ref, masks, rewards, gids = _seqs()
    coef = 0.05
    adv, m = penalised_advantages(rewards, gids, behav, ref, coef=coef, kl_type=kl_type,
                                  loss_mask=masks if masked else None)
    kl = [verl_kl_penalty(b[None].double(), r[None].double(), kl_type)[0] for b, r in zip(behav, ref)]
    if masked:
        kl = [k * mk for k, mk in zip(kl, masks)]
    shaped = rewards.double() - coef * torch.stack([k.sum() for k in kl])
    assert torch.allclose(adv.double(), grpo_advantages(shaped, group_ids=gids), atol=1e-6)
    means = [k.sum() / (mk.sum() if masked else len(k)) for k, mk in zip(kl, masks)]
    assert m["kl_in_reward/kl"] == pytest.approx(float(torch.stack(means).mean()), rel=1e-9)
    assert m["kl_in_reward/reward_mean"] == pytest.approx(float(shaped.mean()), rel=1e-9)
    assert m["kl_in_reward/coef"] == coef
    same = penalised_advantages(rewards, gids, behav, ref, coef=0.0, kl_type=kl_type)[0]
    assert torch.allclose(same, grpo_advantages(rewards, group_ids=gids))  # coefficient 0: GRPO's own
    assert not torch.allclose(adv, same)


def test_a_sample_that_strayed_further_loses_advantage():
    behav = [torch.full((4,), -1.0), torch.full((4,), -1.0)]
    ref = [torch.full((4,), -1.0), torch.full((4,), -2.0)]  # sample 1 is further from the reference
    adv, _ = penalised_advantages(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), behav, ref, coef=0.1,
                                  kl_type="low_var_kl")
    assert adv[0] > 0 > adv[1]


def test_bad_inputs_are_named():
    behav, ref, _, rewards, gids = _seqs()
    with pytest.raises(ValueError, match="kl_coef"):
        penalised_advantages(rewards, gids, behav, ref, coef=float("nan"), kl_type="kl")
    with pytest.raises(ValueError, match="sequence 2"):
        penalised_advantages(rewards, gids, behav, [*ref[:2], ref[2][:1], *ref[3:]], coef=0.1, kl_type="kl")
    with pytest.raises(ValueError, match="kl_loss_type 'nope'"):
        penalised_advantages(rewards, gids, behav, ref, coef=0.1, kl_type="nope")


def test_the_recipe_checks():
    from m2po_megatron.config.loading import load_config
    from m2po_megatron.config.schema import ConfigError

    load_config(None, ["algo.use_kl_in_reward=true", "algo.kl_penalty=low_var_kl", "algo.kl_ctrl.kl_coef=0.01"])
    for bad, field in ((["algo.kl_ctrl.type=adaptive"], "algo.kl_ctrl.type = 'adaptive'"),
                       (["algo.kl_penalty=full"], "algo.kl_penalty"),
                       (["algo.kl_ctrl.kl_coef=-1"], "algo.kl_ctrl.kl_coef"),
                       (["algo.overlong_filtering=true"], "overlong_filtering")):
        with pytest.raises(ConfigError, match=field):
            load_config(None, ["algo.use_kl_in_reward=true", *bad])
        load_config(None, bad if "overlong" in bad[0] else [])  # checked only with the KL in the reward
