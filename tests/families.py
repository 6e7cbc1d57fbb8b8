"""Tiny random models of every decoder-only family the tests cover, built from their config classes
(no download): a window of 6 positions where the family has sliding-window attention, and the head
transforms that once gave other numbers (Granite's logits_scaling, Cohere's logit_scale)."""

import torch
import transformers as T

V, H, WINDOW = 96, 32, 6
COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GEMMA = dict(head_dim=8, query_pre_attn_scalar=8)


def _families():
    """name -> (config class, model class, config kwargs beyond COMMON)."""
    return {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
        "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(head_dim=8)),
        "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(sliding_window=WINDOW)),
        "gemma": (T.GemmaConfig, T.GemmaForCausalLM, dict(head_dim=8)),
        "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(GEMMA, sliding_window=WINDOW)),
        "gemma3_text": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(GEMMA, sliding_window=WINDOW)),
        "phi3": (T.Phi3Config, T.Phi3ForCausalLM, {}),
        "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, {}),
        "granite": (T.GraniteConfig, T.GraniteForCausalLM, dict(logits_scaling=4.0, embedding_multiplier=3.0,
                                                                 residual_multiplier=0.5, attention_multiplier=0.3)),
        "cohere": (T.CohereConfig, T.CohereForCausalLM, dict(logit_scale=0.0625)),
        "smollm3": (T.SmolLM3Config, T.SmolLM3ForCausalLM, {}),
        "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, dict(rotary_pct=0.5)),
        "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, None),
    }


FAMILIES = _families()


def build(name: str, seed: int = 0, **ids):
    """A tiny random `name` model in float32, eval mode, eager attention. `ids` overrides vocab_size,
    pad_token_id, bos_token_id, eos_token_id (e.g. a tokenizer's)."""
    config_cls, model_cls, extra = FAMILIES[name]
    if extra is None:  # GPT-2 names its sizes its own way
        config = config_cls(**{**dict(vocab_size=V, n_embd=H, n_layer=2, n_head=4, n_positions=256, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2), **ids})
    else:
        config = config_cls(**{**COMMON, **extra, **ids})
    config._attn_implementation = "eager"  # the definition and the fast paths through the same kernels
    torch.manual_seed(seed)
    return model_cls(config).float().eval()
