"""OAR-G: token importance from one gradient x input pass on noised embeddings (SPEC §4).

Legend: B rollouts, L sequence positions, H embedding width, V vocabulary.

  1. P_0 (or phi_0): the clean outcome, detached. Pass `clean` to reuse a forward the training
     step already ran (its logits at the answer positions); otherwise one no-grad forward here.
  2. e = embed(x), detached;  e~ = e + delta,  delta ~ N(0, sigma^2 I) on reasoning positions only.
  3. J = KL(P_0 || P(e~))   (phi_0 - phi(e~) for answer_joint), summed over rollouts: rollouts are
     independent, so d(sum J)/d e~_i = dJ_i/d e~_i.
  4. g = dJ/de~ by `torch.autograd.grad` with respect to e~ alone: autograd then skips every
     weight-gradient product, writes nothing to any `.grad`, and no `requires_grad` flag is touched.
  5. s_t = |<g_t, e_t>| on reasoning positions, 0 elsewhere.
Why the noise: at delta = 0 the KL sits at its minimum (0) and its gradient is exactly 0; the noise
makes the first-order signal non-zero. answer_joint needs none (noise_std = 0 is allowed).

Deviations: the noise is drawn in float32 and added in the model's dtype; only positions from the
earliest answer-predicting position on get logits (`logits_to_keep`), which changes nothing.
Rows without an answer token score 0.
"""

from __future__ import annotations

import torch

from oar.models import forward_logits
from oar.probes import answer_positions, check_probe, divergence, outcome


def gradient_scores(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    reasoning_mask: torch.Tensor,
    answer_mask: torch.Tensor,
    *,
    probe: str = "answer_mean",
    noise_std: float = 1e-3,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    clean: torch.Tensor | None = None,
) -> torch.Tensor:
    """OAR-G scores (B, L) float32, 0 outside `reasoning_mask`. Inputs (B, L).

    noise: optional standard-normal draws (B, L, H) used instead of the generator's (so a caller
    can make each rollout's noise independent of how rollouts are batched); scaled by noise_std.
    clean: optional precomputed clean outcome, as `probes.outcome` returns it for these rows.
    """
    check_probe(probe)
    assert noise_std >= 0.0, f"noise_std must be >= 0, got {noise_std}"
    assert input_ids.shape == attention_mask.shape == reasoning_mask.shape == answer_mask.shape
    has_answer = answer_mask.any(dim=1)
    if not has_answer.any():
        return torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)

    pos, valid = answer_positions(answer_mask)  # (B, K)
    targets = input_ids.gather(1, (pos + 1).clamp(max=input_ids.shape[1] - 1))
    first = int(pos[has_answer, 0].min())
    keep = input_ids.shape[1] - first  # logits from the earliest answer-predicting position on
    rows = torch.arange(input_ids.shape[0], device=input_ids.device).unsqueeze(1)

    def probe_of(embeds: torch.Tensor) -> torch.Tensor:
        logits = forward_logits(model, attention_mask=attention_mask, inputs_embeds=embeds, logits_to_keep=keep)
        return outcome(logits[rows, (pos - first).clamp(min=0)], targets, valid, probe)

    with torch.no_grad():
        e = model.get_input_embeddings()(input_ids)  # (B, L, H)
        if clean is None:
            clean = probe_of(e)
    if noise is None:
        noise = torch.randn(e.shape, generator=generator, device=e.device if generator is None else generator.device)
    assert noise.shape == e.shape, (noise.shape, e.shape)
    delta = noise_std * noise.to(e.device, torch.float32) * reasoning_mask.unsqueeze(-1)
    noised = (e.float() + delta).to(e.dtype).requires_grad_(True)

    with torch.enable_grad():
        objective = divergence(clean.detach(), probe_of(noised), probe)  # (B,)
        (grad,) = torch.autograd.grad(objective[has_answer].sum(), noised)

    scores = (grad.float() * e.float()).sum(dim=-1).abs()
    return scores * (reasoning_mask & has_answer.unsqueeze(1))
