"""oar/probes.py against numbers computed by hand (maths §3): the other tests compare fast paths with
references built from these same functions, so a wrong formula here would pass them."""

import torch

from oar.oar_grad import NOISE_SEED_OFFSET, seeded_noise
from oar.probes import divergence, outcome


def test_divergence_is_kl_from_the_clean_to_the_perturbed_distribution():
    clean, pert = torch.log_softmax(torch.tensor([2.0, 0.0, -1.0]), -1), torch.log_softmax(torch.zeros(3), -1)
    p = clean.exp()
    want = float((p * (clean - pert)).sum())  # KL(P_clean || P_pert) = 0.5743; the other direction is 0.7379
    for probe in ("last", "answer_mean"):
        assert abs(float(divergence(clean, pert, probe)) - want) < 1e-6 and abs(want - 0.5743) < 1e-4


def test_answer_joint_is_the_mean_log_probability_of_the_answer_tokens():
    z = torch.randn(2, 2, 5, generator=torch.Generator().manual_seed(0))  # (B, K, V): row 1 has one answer token
    tokens, valid = torch.tensor([[1, 3], [4, 0]]), torch.tensor([[True, True], [True, False]])
    logp = torch.log_softmax(z, -1)
    want = torch.stack([(logp[0, 0, 1] + logp[0, 1, 3]) / 2, logp[1, 0, 4]])
    torch.testing.assert_close(outcome(z, tokens, valid, "answer_joint"), want)
    # its score is phi_clean - phi_pert: positive when masking a token makes the answer less likely
    assert float(divergence(torch.tensor(-1.0), torch.tensor(-2.0), "answer_joint")) == 1.0


def test_answer_mean_and_last_read_the_distributions_they_name():
    z = torch.randn(1, 3, 5, generator=torch.Generator().manual_seed(1))
    valid = torch.tensor([[True, True, False]])
    torch.testing.assert_close(
        outcome(z, torch.zeros(1, 3, dtype=torch.long), valid, "answer_mean"),
        torch.log_softmax((z[:, 0] + z[:, 1]) / 2, -1),
    )
    torch.testing.assert_close(
        outcome(z, torch.zeros(1, 3, dtype=torch.long), valid, "last"), torch.log_softmax(z[:, 0], -1)
    )


def test_oar_g_noise_is_each_rollouts_own_stream_at_seed_plus_the_offset():
    """maths §0: rollout i's noise is the draws of a generator seeded with s_i + 7919 (its sampler
    uses s_i), laid on its reasoning positions in order, whatever the batch."""
    mask = torch.tensor([[False, True, True, False], [True, False, False, True]])
    noise = seeded_noise([5, 9], mask, 2)
    assert NOISE_SEED_OFFSET == 7919
    for i, s in enumerate((5, 9)):
        want = torch.randn(2, 2, generator=torch.Generator().manual_seed(s + 7919))
        torch.testing.assert_close(noise[i, mask[i]], want, rtol=0, atol=0)
        assert (noise[i, ~mask[i]] == 0).all()
