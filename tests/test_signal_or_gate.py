"""The signal-or-gate study's inverted-score control (research/signal-or-gate/inverted.py): it is OAR-G with
the ranking turned over, and nothing else."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from oar.grpo import group_advantages

ROOT = Path(__file__).resolve().parents[1]
MODULE = str(ROOT / "research" / "signal-or-gate" / "inverted.py")


def _module():
    from oar.credit_modules import module_methods

    return module_methods(MODULE)[0]


def test_invert_by_hand():
    """u = log(1 + s) = 0, 1, 2 on the reasoning tokens becomes 2, 1, 0: s' = e^2 - 1, e - 1, 0; other columns kept."""
    import sys

    inverted = sys.modules[_module().weigh.__module__]
    s = torch.tensor([[5.0, 0.0, math.e - 1, math.e ** 2 - 1, 7.0]])
    r = torch.tensor([[False, True, True, True, False]])
    got = inverted.invert(s, r)
    torch.testing.assert_close(got, torch.tensor([[5.0, math.e ** 2 - 1, math.e - 1, 0.0, 7.0]]))
    s_nan = s.clone()
    s_nan[0, 2] = float("nan")
    assert torch.equal(inverted.invert(s_nan, r).isnan(), s_nan.isnan())  # a non-finite row passes through to the gate's all-ones


def test_inverted_is_oar_g_turned_over(tiny_model):
    """On a real step of the tiny model: with the inversion off the module's weights are the built-in
    oar-g's (the same noise, probe and gate); with it on they are the gate of 1 - n, so the token OAR-G
    boosts most is suppressed most, and the rollout's mass is kept."""
    import sys

    from oar.credit import CreditSettings, MicroBatch, Step, step_credit
    from oar.gating import bilevel_weights
    from oar.rewards import reward
    from oar.sampler import format_prompt, sample
    from oar.training.models import load_model

    method = _module()
    inverted = sys.modules[method.weigh.__module__]
    model, tok = load_model(str(tiny_model))
    problems = [("Compute 3 + 4.", "7"), ("Compute 5 * 2.", "10")]
    ro = sample(model, tok, [format_prompt(tok, q) for q, _ in problems], group_size=4, seeds=list(range(8)), max_new_tokens=20)
    golds = [a for _, a in problems for _ in range(4)]
    rewards = torch.tensor([reward(t, g) for t, g in zip(ro.texts, golds)])
    adv = group_advantages(rewards, 4)
    scored = (adv != 0) & ro.completion_mask.any(1)
    seeds = [21, 22, 23, 24, 25, 26, 27, 28]
    logits = torch.zeros(8, ro.input_ids.shape[1] - ro.prompt_width + 1, 1)  # unread by both methods
    q, beta = 0.25, 1.0  # the study's gate

    def weights(name, module=""):
        s = CreditSettings(method=name, credit_module=module, group_size=4, gate_quantile=q, gate_boost=beta)
        return step_credit(s, model, tok, ro, rewards, adv, scored, seeds, golds, "answer_mean")(slice(0, 8), ro, logits)[0]

    oar_g, inv = weights("oar-g"), weights("oar-g-inverted", MODULE)
    settings = CreditSettings(method="oar-g-inverted", credit_module=MODULE, group_size=4, gate_quantile=q, gate_boost=beta)
    step = Step(settings, model, tok, ro, rewards, adv, scored, seeds, golds, "answer_mean", lambda x: x)
    plain, _ = inverted.weigh(step, None, MicroBatch(slice(0, 8), ro, logits), inverted=False)
    torch.testing.assert_close(plain, oar_g)  # the scores are OAR-G's own

    reasoning = ro.reasoning_mask & scored[:, None]
    scores, _ = inverted.oar_g_scores(step, MicroBatch(slice(0, 8), ro, logits))
    u = torch.log1p(scores.double().abs())
    lo = u.masked_fill(~reasoning, math.inf).amin(1, keepdim=True)
    hi = u.masked_fill(~reasoning, -math.inf).amax(1, keepdim=True)
    n = ((u - lo) / (hi - lo)).where(reasoning, 0.0)
    gate_of_flipped = bilevel_weights(torch.expm1(1 - n).where(reasoning, 0.0).float(), reasoning, quantile=q, boost=beta)
    torch.testing.assert_close(inv, gate_of_flipped, atol=1e-5, rtol=1e-5)  # the gate normalises log(1 + s) = 1 - n to 1 - n
    rows = [i for i in range(8) if reasoning[i].sum() >= 3]
    assert rows, "no scored rollout with 3 reasoning tokens: the check below would not run"
    for i in rows:
        top, low = scores[i].masked_fill(~reasoning[i], -1).argmax(), scores[i].masked_fill(~reasoning[i], math.inf).argmin()
        assert oar_g[i, top] > oar_g[i, low] and inv[i, top] < inv[i, low]  # the order is turned over
        torch.testing.assert_close(inv[i][reasoning[i]].sum(), reasoning[i].sum().float())  # mass preserved
    assert torch.equal(inv[~reasoning], torch.ones_like(inv[~reasoning]))
