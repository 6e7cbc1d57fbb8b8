"""Every causal-LM family a user plausibly brings: OAR-P, OAR-G, the update forward, the sampler and the
log-probs against each model's own definition (docs/model-families.md).

Each family's tiny random model is built in tests/families.py from its transformers config class, and every
definition runs through the same model, so the attention implementation is the same on both sides. Their
dropout: tests/package/test_dropout.py.
"""

import copy

import pytest
import torch

from oar.grpo import token_logprobs
from oar.lm import forward_logits
from oar.training.models import enable_checkpointing
from oar.oar_grad import gradient_scores
from oar.oar_perturb import perturbation_scores, perturbation_scores_naive
from oar.probes import clean_forward, divergence, outcome_from_logits
from oar.sampler import generate

from families import EOS, FAMILIES, PAD, VOCAB, build, long_batch


def oar_g_definition(model, ids, attn, reas, ans, probe, noise, noise_std):
    """OAR-G the plain way: the model's own full forward on noised input embeddings, backward into
    them (a copy of the model, so its parameters' gradients go nowhere), s = |<dJ/de~, e>|."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        e = ref.get_input_embeddings()(ids)
        clean = outcome_from_logits(forward_logits(ref, ids, attn), ids, ans, probe)
    noised = (e + noise_std * noise * reas.unsqueeze(-1)).requires_grad_(True)
    j = divergence(
        clean,
        outcome_from_logits(forward_logits(ref, inputs_embeds=noised, attention_mask=attn), ids, ans, probe),
        probe,
    )
    (grad,) = torch.autograd.grad(j.sum(), noised)
    return (grad * e).sum(-1).abs() * reas


@pytest.mark.parametrize("name", FAMILIES)
def test_oar_scores_equal_the_definitions_on_everyfamily(name):
    model = build(name)
    ids, attn, reas, ans = long_batch()
    if getattr(model.config, "sliding_window", None):
        assert attn.sum(1).min() > model.config.sliding_window  # the window really cuts every row
    logits, kv = clean_forward(model, ids, attn, keep_cache=True)
    assert all(k.shape[2] == v.shape[2] == ids.shape[1] for k, v in kv)  # every position kept, windows or not
    for probe in ("answer_mean", "answer_joint"):
        naive = perturbation_scores_naive(model, ids, attn, reas, ans, probe=probe, pad_token_id=PAD)
        assert naive[reas].abs().max() > 0  # the comparison is not between two zeros
        tol = dict(
            rtol=0, atol=1e-4 * naive.abs().max().item()
        )  # as tests/package/test_oar_scores.py: float rounding of other shapes
        torch.testing.assert_close(
            perturbation_scores(model, ids, attn, reas, ans, probe=probe, pad_token_id=PAD, max_chunk_tokens=60),
            naive,
            **tol,
        )
        clean = outcome_from_logits(logits, ids, ans, probe)
        torch.testing.assert_close(
            perturbation_scores(model, ids, attn, reas, ans, probe=probe, pad_token_id=PAD, clean=clean, clean_kv=kv),
            naive,
            **tol,
        )

        noise = torch.randn(
            *ids.shape, model.get_input_embeddings().embedding_dim, generator=torch.Generator().manual_seed(1)
        )
        ref = oar_g_definition(model, ids, attn, reas, ans, probe, noise, 1e-2)
        assert ref.abs().max() > 0
        # Gradients of a KL near its minimum magnify last-bit differences between shapes (cached prefix,
        # columns cut after the answer): relative 1e-4 of the largest score, as tests/package/test_oar_scores.py.
        tol = dict(rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        torch.testing.assert_close(
            gradient_scores(model, ids, attn, reas, ans, probe=probe, noise=noise, noise_std=1e-2), ref, **tol
        )
        torch.testing.assert_close(
            gradient_scores(
                model, ids, attn, reas, ans, probe=probe, noise=noise, noise_std=1e-2, clean=clean, clean_kv=kv
            ),
            ref,
            **tol,
        )


@pytest.mark.parametrize("name", FAMILIES)
def test_sampler_and_logprobs_equal_the_model_own_generate(name):
    # Greedy rollouts of left-padded prompts longer than the window, 2 per prompt from one prefill,
    # equal model.generate's (its own cache, sliding layers included); the update forward's token
    # log-probs equal the log-softmax of the logits generate computed while sampling them.
    model = build(name, seed=1)
    g = torch.Generator().manual_seed(2)
    lengths = [9, 12, 7]
    prompt_ids = torch.full((3, 12), PAD)
    prompt_mask = torch.zeros(3, 12, dtype=torch.long)
    for i, n in enumerate(lengths):
        prompt_ids[i, 12 - n :] = torch.randint(3, VOCAB, (n,), generator=g)
        prompt_mask[i, 12 - n :] = 1
    new = 10
    ours = generate(
        model,
        prompt_ids,
        prompt_mask,
        max_new_tokens=new,
        temperature=0.0,
        top_p=1.0,
        eos_token_ids={EOS},
        pad_token_id=PAD,
        seeds=list(range(6)),
        group_size=2,
    )  # (6, T)
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        do_sample=False,
        max_new_tokens=new,
        pad_token_id=PAD,
        eos_token_id=EOS,
        output_logits=True,
        return_dict_in_generate=True,
    )
    theirs = out.sequences[:, 12:]  # (3, T), PAD after a row's EOS, as ours
    assert ours.tolist() == theirs.repeat_interleave(2, dim=0).tolist()
    # Log-probs: the sequences generate made, through the update's forward (clean_forward), on the
    # completion tokens through EOS.
    is_eos = theirs == EOS
    valid = (is_eos.long().cumsum(1) - is_eos.long()) == 0  # (3, T) through the first EOS
    seq, mask = torch.cat([prompt_ids, theirs], 1), torch.cat([prompt_mask, valid.long()], 1)
    logits, _ = clean_forward(model, seq, mask, logits_to_keep=theirs.shape[1] + 1)
    ours_lp = token_logprobs(logits[:, :-1], theirs)
    gen_lp = torch.stack(
        [torch.log_softmax(z.float(), -1).gather(1, theirs[:, t, None]).squeeze(1) for t, z in enumerate(out.logits)],
        1,
    )
    # One forward over the sequence vs cached one-token steps: other shapes, float rounding.
    torch.testing.assert_close(ours_lp[valid], gen_lp[valid], rtol=1e-4, atol=1e-5)


def _as_family(trained, out, family: str):
    """The trained tiny Llama (tied head) as another family with the same weights: Qwen2 (q/k/v
    biases, here 0: the same function, so it earns rewards), or Mistral with a window of 32, shorter
    than every rollout (a different function that still writes `#### N` answers). Saved with the
    Llama's tokenizer and data into `out`."""
    import shutil

    import transformers as tf

    if (out / "data.jsonl").is_file():
        return out
    llama = tf.AutoModelForCausalLM.from_pretrained(trained)
    c = llama.config
    common = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=c.rope_parameters,
        tie_word_embeddings=True,
        pad_token_id=c.pad_token_id,
        eos_token_id=c.eos_token_id,
        bos_token_id=c.bos_token_id,
    )
    if family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    else:
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=32))
    missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected and all(k.endswith("bias") for k in missing), (missing, unexpected)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
    model.generation_config = llama.generation_config
    model.save_pretrained(out)
    for f in trained.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) or f.name == "data.jsonl":
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "mistral-window"])
def test_one_train_step_per_method_on_other_families(tiny_model, tmp_path_factory, family):
    from tinyrun import TINY, metrics, run_inprocess

    folder = _as_family(tiny_model, tmp_path_factory.getbasetemp() / f"oar-tiny-{family}", family)
    for method in ("grpo", "oar-g", "oar-p"):
        out = tmp_path_factory.mktemp(f"{family}-{method}")
        run_inprocess(
            [
                "--model",
                str(folder),
                "--dataset",
                str(folder / "data.jsonl"),
                "--output_dir",
                str(out),
                "--steps",
                "1",
                "--save_every",
                "0",
                "--micro_batch_size",
                "4",
                "--score_all",
                "--method",
                method,
                *TINY,
            ]
        )
        (m,) = metrics(out)
        assert all(v == v for v in m.values()), m  # no NaN anywhere
        # Prompts are >= 21 tokens ("Q: Compute a op b.\nA:\n", one per character): rows exceed the window.
        assert 21 + m["completion/length"] > 32
        if method != "grpo":  # OAR scored rollouts that have an answer: its weights moved off 1
            assert m["oar/frac_scored"] > 0 and m["oar/frac_boosted"] > 0, m


@pytest.mark.parametrize("name", ["mistral-window", "gemma2"])
def test_oar_g_with_gradient_checkpointing_on_a_sliding_windowfamily(name):
    # Training mode with checkpointed layers drops caches: OAR-G then puts whole rows in the graph.
    model = build(name)
    ids, attn, reas, ans = long_batch()
    noise = torch.randn(
        *ids.shape, model.get_input_embeddings().embedding_dim, generator=torch.Generator().manual_seed(1)
    )
    ref = oar_g_definition(model, ids, attn, reas, ans, "answer_mean", noise, 1e-2)
    enable_checkpointing(model)  # non-reentrant, as train.py's
    model.train()
    for p in model.parameters():  # dropout is 0 in these configs; the scores must still leave no .grad
        p.grad = None
    got = gradient_scores(model, ids, attn, reas, ans, noise=noise, noise_std=1e-2)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())  # as above
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
def test_smollm2_byte_level_bpe_and_chat_template_through_sample_and_masks(smollm2):
    # The real tokenizer (byte-level BPE, chat template) from the SmolLM2 GGUF: format_prompt ->
    # sample -> masks, then a completion with a \boxed{} answer built by hand (a 135M model rarely
    # writes one in 12 tokens), whose masks OAR-P scores exactly as the definition does.
    from oar.sampler import BOXED_INSTRUCTION, encode_prompts, format_prompt, sample, stop_token_ids
    from oar.rollout import build_rollout

    model, tok = smollm2
    prompt = format_prompt(tok, "What is 12 + 30?", BOXED_INSTRUCTION)
    assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n")  # the chat template
    ro = sample(model, tok, [prompt], group_size=2, seeds=[0, 1], max_new_tokens=12, temperature=1.0)
    lp = ro.prompt_width
    assert tok.decode(ro.input_ids[0, :lp][ro.attention_mask[0, :lp].bool()]) == prompt  # no special token added twice
    for i, text in enumerate(ro.texts):  # the masks cover the completion, and its text is its tokens'
        assert (ro.completion_mask[i, :lp] == 0).all() and ro.completion_mask[i, lp:].any()
        assert tok.decode(ro.input_ids[i][ro.completion_mask[i]], skip_special_tokens=True) == text

    ids, mask = encode_prompts(tok, [prompt], "cpu")
    text = "12 + 30 = 42 (ça fait 42),\nso $\\boxed{42}$."  # a non-ASCII character: byte-level tokens split it
    completion = tok(text, add_special_tokens=False)["input_ids"]
    completion = torch.tensor([completion + [tok.eos_token_id]])
    ro = build_rollout(tok, ids, mask, completion, stop_token_ids(model, tok))
    assert tok.decode(ro.input_ids[ro.answer_mask]).strip() == "42"
    reasoning = tok.decode(ro.input_ids[ro.reasoning_mask])  # every token that ends before the marker
    assert text.startswith(reasoning) and reasoning.startswith("12 + 30 = 42 (ça fait 42),\nso"), reasoning
    kw = dict(probe="answer_mean", pad_token_id=tok.pad_token_id)
    args = (ro.input_ids, ro.attention_mask, ro.reasoning_mask, ro.answer_mask)
    naive = perturbation_scores_naive(model, *args, **kw)
    torch.testing.assert_close(
        perturbation_scores(model, *args, **kw), naive, rtol=0, atol=1e-4 * naive.abs().max().item()
    )


@pytest.mark.slow
@pytest.mark.parametrize("method", ["oar-g", "oar-p"])
def test_a_bfloat16_model_trains_with_oar(tiny_model, tmp_path, method):
    # --dtype bfloat16: the scorers run the bf16 model (noise drawn in float32), the loss's log-probs
    # are float32 (grpo.token_logprobs); the step must score rollouts and stay finite.
    from tinyrun import TINY, metrics, run_inprocess

    run_inprocess(
        [
            "--model",
            str(tiny_model),
            "--dataset",
            str(tiny_model / "data.jsonl"),
            "--output_dir",
            str(tmp_path / "run"),
            "--steps",
            "1",
            "--save_every",
            "0",
            "--micro_batch_size",
            "4",
            "--score_all",
            "--method",
            method,
            "--dtype",
            "bfloat16",
            *TINY,
        ]
    )
    (m,) = metrics(tmp_path / "run")
    assert all(v == v and abs(v) != float("inf") for v in m.values()), m
    assert m["oar/frac_scored"] > 0 and m["oar/frac_boosted"] > 0 and m["oar/frac_nonfinite_scores"] == 0, m
