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

Cost (all exact, pinned by tests against a plain full-sequence backward): columns before the first
noised or answer-predicting position cannot depend on the noise, so they run once without a graph
and the graph starts there, attending to their cached keys/values (not possible with gradient
checkpointing in training mode, which drops caches: then the whole row is in the graph); columns
after the last answer-predicting position are cut; only the K answer-predicting positions of each
row go through the output head, not every position x V.

Deviations: the noise is drawn in float32 and added in the model's dtype. Rows without an answer
token score 0.
"""

from __future__ import annotations

import torch

from oar.models import position_ids
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
    scores = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    has_answer = answer_mask.any(dim=1)
    if not has_answer.any():
        return scores

    pos, valid = answer_positions(answer_mask)  # (B, K) positions of the logits that predict answers
    targets = input_ids.gather(1, (pos + 1).clamp(max=input_ids.shape[1] - 1))
    end = int(pos[valid].max()) + 1  # inputs 0 .. end-1 are all the probe reads
    noisy = reasoning_mask & has_answer.unsqueeze(1)
    noisy[:, end:] = False  # a token at or after `end` cannot move the probe: its score is 0
    first = min(int(pos[valid].min()), int(noisy.any(0).int().argmax()) if noisy.any() else end)
    if first > 0 and model.training and _checkpointing(model):
        first = 0  # checkpointed layers drop caches in training mode: keep every column in the graph
    decoder, head = model.get_decoder(), _output_head(model)
    pos_ids = position_ids(attention_mask[:, :end])
    rows = torch.arange(input_ids.shape[0], device=input_ids.device).unsqueeze(1)
    at = (pos - first).clamp(min=0)  # (B, K) in the graph's columns

    with torch.no_grad():
        e = model.get_input_embeddings()(input_ids[:, :end])  # (B, end, H)
        prefix = None
        if first > 0:  # the noise-free columns: once, without a graph
            out = decoder(inputs_embeds=e[:, :first], attention_mask=attention_mask[:, :first],
                          position_ids=pos_ids[:, :first], use_cache=True)
            prefix = [(layer.keys, layer.values) for layer in out.past_key_values.layers]

    def probe_of(embeds: torch.Tensor) -> torch.Tensor:  # embeds (B, end - first, H) -> outcome
        hidden = decoder(inputs_embeds=embeds, attention_mask=attention_mask[:, :end], position_ids=pos_ids[:, first:],
                         past_key_values=_cache(prefix), use_cache=prefix is not None).last_hidden_state
        return outcome(head(hidden[rows, at]), targets, valid, probe)

    if clean is None:
        with torch.no_grad():
            clean = probe_of(e[:, first:])
    if noise is None:
        noise = torch.randn((*input_ids.shape, e.shape[-1]), generator=generator,
                            device=e.device if generator is None else generator.device)
    assert noise.shape == (*input_ids.shape, e.shape[-1]), (noise.shape, e.shape)
    e = e[:, first:]
    delta = noise_std * noise[:, first:end].to(e.device, torch.float32) * noisy[:, first:end].unsqueeze(-1)
    noised = (e.float() + delta).to(e.dtype).requires_grad_(True)

    with torch.enable_grad():
        objective = divergence(clean.detach(), probe_of(noised), probe)  # (B,)
        (grad,) = torch.autograd.grad(objective[has_answer].sum(), noised)

    scores[:, first:end] = (grad.float() * e.float()).sum(dim=-1).abs()
    return scores * noisy


def _cache(kv):
    """A fresh transformers cache holding `kv` (each layer's (keys, values)), or None."""
    if kv is None:
        return None
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (k, v) in enumerate(kv):
        cache.update(k, v, layer)
    return cache


def _checkpointing(model) -> bool:
    """Whether activation (gradient) checkpointing is on; transformers 5 renamed the property."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _output_head(model):
    """Final hidden states (B, K, H) -> logits (B, K, V), with the config's logit soft-cap if any."""
    linear = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return linear if not cap else (lambda h: cap * torch.tanh(linear(h) / cap))
