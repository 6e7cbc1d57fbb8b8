"""Tiny random models of every causal-LM family the tests try, built from transformers' own config classes
(hidden 32, 2 layers, vocab 96), and a batch laid out as the sampler lays rollouts out (tests/package/test_families.py,
tests/package/test_dropout.py). Sliding-window families get a window of 6, shorter than every sequence of
`long_batch`, and the families that scale or cap their logits (Granite, Cohere, Gemma 2/3) get scales far
from 1, so a head that skipped them would be far off. Every model runs eager attention (Llama also sdpa)."""

import pytest
import torch

VOCAB, PAD, BOS, EOS, WINDOW = 96, 0, 1, 2, 6
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
)


def family(name: str):
    """(model class, config) of a family, built from transformers' own config classes."""
    import transformers as tf

    c = COMMON
    table = {
        "llama-sdpa": ("LlamaForCausalLM", "LlamaConfig", dict(c, attn_implementation="sdpa")),
        "llama": ("LlamaForCausalLM", "LlamaConfig", c),
        "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(c, tie_word_embeddings=True)),  # q/k/v biases, tied head
        "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(c, head_dim=8)),
        "qwen3-moe": (
            "Qwen3MoeForCausalLM",
            "Qwen3MoeConfig",
            dict(c, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
        ),
        "mistral-window": ("MistralForCausalLM", "MistralConfig", dict(c, sliding_window=WINDOW)),
        "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(c, head_dim=8)),
        "gemma2": (
            "Gemma2ForCausalLM",
            "Gemma2Config",
            dict(c, head_dim=8, sliding_window=WINDOW, final_logit_softcapping=2.0, attn_logit_softcapping=5.0),
        ),
        "gemma3-text": (
            "Gemma3ForCausalLM",
            "Gemma3TextConfig",
            dict(
                c,
                head_dim=8,
                sliding_window=WINDOW,
                final_logit_softcapping=2.0,
                layer_types=["sliding_attention", "full_attention"],
            ),
        ),
        "phi3": ("Phi3ForCausalLM", "Phi3Config", c),
        "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", c),
        "granite": (
            "GraniteForCausalLM",
            "GraniteConfig",
            dict(c, logits_scaling=8.0, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3),
        ),
        "cohere": ("CohereForCausalLM", "CohereConfig", dict(c, logit_scale=0.05)),
        "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", c),
        "gpt-neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(c, num_key_value_heads=None)),
        "gpt2": (
            "GPT2LMHeadModel",
            "GPT2Config",
            dict(
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=128,
                pad_token_id=PAD,
                bos_token_id=BOS,
                eos_token_id=EOS,
            ),
        ),
        # families whose forward reads dropout rates, or router jitter, from the config
        # (only the dropout test builds them)
        "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(c, num_local_experts=4, num_experts_per_tok=2)),
        "phimoe": (
            "PhimoeForCausalLM",
            "PhimoeConfig",
            dict(c, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.5),
        ),  # a routing threshold, eval mode too
        "falcon": (
            "FalconForCausalLM",
            "FalconConfig",
            dict(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                pad_token_id=PAD,
                bos_token_id=BOS,
                eos_token_id=EOS,
            ),
        ),
        "dbrx": (
            "DbrxForCausalLM",
            "DbrxConfig",
            dict(
                vocab_size=VOCAB,
                d_model=32,
                n_heads=4,
                n_layers=2,
                max_seq_len=128,
                attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 2, "moe_top_k": 1},
                pad_token_id=PAD,
                bos_token_id=BOS,
                eos_token_id=EOS,
            ),
        ),
    }
    model_cls, config_cls, kwargs = table[name]
    if not hasattr(tf, model_cls):
        pytest.skip(f"transformers {tf.__version__} has no {model_cls}")
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    kwargs.setdefault("attn_implementation", "eager")
    return getattr(tf, model_cls), getattr(tf, config_cls)(**kwargs)


FAMILIES = [
    "llama-sdpa",
    "llama",
    "qwen2",
    "qwen3",
    "qwen3-moe",
    "mistral-window",
    "gemma",
    "gemma2",
    "gemma3-text",
    "phi3",
    "olmo2",
    "granite",
    "cohere",
    "smollm3",
    "gpt-neox",
    "gpt2",
]


def build(name: str, seed: int = 0):
    model_cls, config = family(name)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():  # random biases and norm weights: zeros and ones would hide a skipped term
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "ln" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


def long_batch(seed: int = 0):
    """Three rows as the sampler lays them out (left pad, prompt, reasoning, answer, EOS, right pad),
    each longer than the window, with different left padding. ids, attention, reasoning, answer (B, L)."""
    g = torch.Generator().manual_seed(seed)
    layouts = [(0, 5, 14, 2, 1), (4, 3, 10, 3, 2), (1, 6, 12, 1, 2)]
    rows, attn, reas, ans = [], [], [], []
    for lp, p, r, a, tail in layouts:
        n = lp + p + r + a + tail
        ids = torch.randint(3, VOCAB, (n,), generator=g)
        ids[:lp] = PAD
        ids[lp + p + r + a] = EOS
        ids[lp + p + r + a + 1 :] = PAD
        mask = torch.zeros(n, dtype=torch.long)
        mask[lp : lp + p + r + a + 1] = 1
        rm, am = torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)
        rm[lp + p : lp + p + r] = True
        am[lp + p + r : lp + p + r + a] = True
        rows.append(ids), attn.append(mask), reas.append(rm), ans.append(am)
    return torch.stack(rows), torch.stack(attn), torch.stack(reas), torch.stack(ans)
