"""Outcome probes: the model's own final-answer distribution, read off one forward pass (SPEC §2).

Legend: B rollouts, L sequence positions, K answer tokens (padded to the longest answer), V vocab.
z_p are the logits at position p; they predict token p + 1, so answer token k is read at k - 1.

  last         P = softmax(z_{a0 - 1})                    the distribution of the first answer token
  answer_mean  P = softmax(mean_{k in A} z_{k - 1})       logits averaged over the span, then softmax
  answer_joint phi = mean_{k in A} log p(x_k | x_<k)      a scalar: how likely the whole answer is

`outcome` returns log P (B, V) for the two distribution probes and phi (B,) for answer_joint;
`divergence` turns a clean and a perturbed outcome into an importance score: KL(P_clean || P_pert)
for distributions, phi_clean - phi_pert for answer_joint (SPEC §3/§4). Rows whose answer mask is
empty give a meaningless outcome; the scorers zero their scores.
"""

from __future__ import annotations

import torch

PROBES = ("last", "answer_mean", "answer_joint")


def check_probe(probe: str) -> None:
    if probe not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, got {probe!r}")


def answer_positions(answer_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the logits that predict each answer token. answer_mask (B, L) bool ->
    (positions (B, K) long, valid (B, K) bool), ascending, K = the longest answer (>= 1)."""
    mask = answer_mask.bool()
    k = max(int(mask.sum(dim=1).max()) if mask.numel() else 0, 1)
    # Stable sort puts each row's answer positions first, in order.
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :k]
    valid = mask.gather(1, order)
    return (order - 1).clamp(min=0), valid


def outcome(answer_logits: torch.Tensor, answer_tokens: torch.Tensor, valid: torch.Tensor, probe: str) -> torch.Tensor:
    """The probe from the logits at answer positions. answer_logits (B, K, V), answer_tokens (B, K)
    (the tokens those logits predict), valid (B, K) -> log P (B, V) float32, or phi (B,) float32."""
    check_probe(probe)
    z = answer_logits.float()
    if probe == "last":
        return torch.log_softmax(z[:, 0], dim=-1)
    v = valid.to(z.dtype)
    count = v.sum(dim=1).clamp(min=1.0)  # (B,)
    if probe == "answer_mean":
        mean_z = (z * v.unsqueeze(-1)).sum(dim=1) / count.unsqueeze(-1)
        return torch.log_softmax(mean_z, dim=-1)
    token_logp = z.gather(-1, answer_tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return (token_logp * v).sum(dim=1) / count


def outcome_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, answer_mask: torch.Tensor, probe: str) -> torch.Tensor:
    """`outcome` for full-sequence logits (B, L, V), input_ids (B, L), answer_mask (B, L)."""
    pos, valid = answer_positions(answer_mask)
    rows = torch.arange(logits.shape[0], device=logits.device).unsqueeze(1)
    return outcome(logits[rows, pos], input_ids.gather(1, (pos + 1).clamp(max=input_ids.shape[1] - 1)), valid, probe)


def divergence(clean: torch.Tensor, perturbed: torch.Tensor, probe: str) -> torch.Tensor:
    """Importance of a perturbation: KL(P_clean || P_pert) = sum_v P_clean (log P_clean - log P_pert)
    for distribution probes ((..., V) log-probs -> (...)), phi_clean - phi_pert for answer_joint."""
    check_probe(probe)
    if probe == "answer_joint":
        return clean - perturbed
    p = clean.exp()
    # 0 log 0 = 0: a token the clean model rules out (logit -inf) contributes nothing.
    return torch.where(p > 0, p * (clean - perturbed), torch.zeros_like(p)).sum(dim=-1)
