"""Calling Hugging Face causal LMs the one way this project does, and loading them.

Legend: B rows, L positions, V vocabulary. Sequences are left-padded prompts followed by
right-padded completions, so a row's real tokens need not start at position 0: every forward pass
here passes position ids counted over the attention mask, exactly as `generate` does, so the
log-probs of training equal those of sampling.
"""

from __future__ import annotations

import torch


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) 0/1 mask -> (B, L) positions counted over real tokens (padding gets 0)."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def forward_logits(model, input_ids=None, attention_mask=None, *, inputs_embeds=None, logits_to_keep: int = 0) -> torch.Tensor:
    """Logits (B, L, V) of a causal LM (the last `logits_to_keep` positions when > 0), no cache."""
    out = model(
        input_ids=input_ids,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        use_cache=False,
        logits_to_keep=logits_to_keep,
    )
    return out.logits
