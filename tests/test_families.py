"""Every decoder-only family a maths-RL user plausibly brings: OAR's fast paths give the definition's
numbers on each, built here as a tiny random model from its config class (no download).

Per family, on a left-padded batch whose rows are longer than a small sliding window (6 positions,
where the family has one): OAR-P's fast path equals `perturbation_scores_naive` (one full forward of
the model per masked copy); OAR-G equals a plain autograd pass through the model's own forward; both
equal themselves fed the clean outcome and keys/values of the update's forward (`clean_forward`); the
sampler's greedy rollouts equal `generate`'s. The families whose heads transform the logits (Granite's
logits_scaling, Cohere's logit_scale, Gemma 2/3's soft-cap) and those with sliding windows are the
ones that once gave other numbers or crashed (issue 11).
"""

import pytest
import torch
import transformers as T

from oar.grpo import token_logprobs
from oar.models import position_ids
from oar.oar_grad import gradient_scores
from oar.oar_perturb import perturbation_scores, perturbation_scores_naive
from oar.probes import clean_forward, divergence, outcome_from_logits
from oar.sampler import generate

from families import COMMON, FAMILIES, V, build


def batch(seed: int = 1):
    """Three left-padded rows of 22 positions (longer than the window): prompt, reasoning, answer, EOS, pads."""
    g = torch.Generator().manual_seed(seed)
    layouts = [(0, 5, 11, 2, 4), (3, 3, 9, 3, 4), (1, 4, 12, 1, 4)]  # (left pad, prompt, reasoning, answer, eos + right pad)
    ids, attn, reas, ans = (torch.zeros(3, 22, dtype=d) for d in (torch.long, torch.long, torch.bool, torch.bool))
    for i, (lp, p, r, a, tail) in enumerate(layouts):
        end = lp + p + r + a
        ids[i, lp:end] = torch.randint(3, V, (end - lp,), generator=g)
        ids[i, end] = 2
        attn[i, lp:end + 1] = 1
        reas[i, lp + p:lp + p + r] = True
        ans[i, lp + p + r:end] = True
    return ids, attn, reas, ans


@pytest.mark.parametrize("name", FAMILIES)
def test_oar_p_fast_is_the_definition(name):
    model = build(name)
    ids, attn, reas, ans = batch()
    for probe in ("answer_mean", "answer_joint"):
        naive = perturbation_scores_naive(model, ids, attn, reas, ans, probe=probe, pad_token_id=0)
        fast = perturbation_scores(model, ids, attn, reas, ans, probe=probe, pad_token_id=0, max_chunk_tokens=200)
        logits, kv = clean_forward(model, ids, attn, keep_cache=True)
        clean = outcome_from_logits(logits, ids, ans, probe)
        reused = perturbation_scores(model, ids, attn, reas, ans, probe=probe, pad_token_id=0, clean=clean, clean_kv=kv)
        top = naive.abs().max().item()
        assert top > 0
        torch.testing.assert_close(fast, naive, rtol=0, atol=1e-5 * top)
        torch.testing.assert_close(reused, naive, rtol=0, atol=1e-5 * top)


@pytest.mark.parametrize("name", FAMILIES)
def test_oar_g_is_an_autograd_pass_through_the_models_own_forward(name):
    model = build(name)
    ids, attn, reas, ans = batch()
    noise = torch.randn(*ids.shape, model.get_input_embeddings().embedding_dim, generator=torch.Generator().manual_seed(2))
    fast = gradient_scores(model, ids, attn, reas, ans, noise=noise, noise_std=1e-3)
    logits, kv = clean_forward(model, ids, attn, keep_cache=True)
    clean = outcome_from_logits(logits, ids, ans, "answer_mean")
    reused = gradient_scores(model, ids, attn, reas, ans, noise=noise, noise_std=1e-3, clean=clean, clean_kv=kv)
    # The definition: the model's own forward on noised input embeddings, one autograd pass.
    e = model.get_input_embeddings()(ids).detach()
    noised = (e + 1e-3 * noise * reas[..., None]).requires_grad_(True)
    pert = model(inputs_embeds=noised, attention_mask=attn, position_ids=position_ids(attn)).logits
    objective = divergence(clean.detach(), outcome_from_logits(pert, ids, ans, "answer_mean"), "answer_mean").sum()
    (grad,) = torch.autograd.grad(objective, noised)
    want = (grad * e).sum(-1).abs() * reas
    assert all(p.grad is None for p in model.parameters())
    top = want.abs().max().item()
    assert top > 0
    # A KL at its minimum magnifies last-bit differences of the two forwards ~1/noise_std-fold.
    torch.testing.assert_close(fast, want, rtol=0, atol=1e-3 * top)
    torch.testing.assert_close(reused, want, rtol=0, atol=1e-3 * top)


@pytest.mark.parametrize("name", FAMILIES)
def test_sampler_greedy_equals_generate_and_logprobs_equal_the_forward(name):
    model = build(name)
    ids, attn, _, _ = batch()
    prompt_ids, prompt_mask = ids[:, :8].clone(), attn[:, :8].clone()  # left-padded prompts
    prompt_mask[:, :] = (torch.arange(8)[None] >= torch.tensor([[0], [3], [1]])).long()
    prompt_ids[prompt_mask == 0] = 0
    ours = generate(model, prompt_ids, prompt_mask, max_new_tokens=16, temperature=0.0, top_p=1.0, eos_token_ids={2},
                    pad_token_id=0, seeds=list(range(6)), group_size=2)  # G = 2 rollouts share each prefill
    theirs = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=False, max_new_tokens=16,
                            pad_token_id=0, eos_token_id=2)[:, 8:]
    assert torch.equal(ours, theirs.repeat_interleave(2, dim=0)[:, : ours.shape[1]])
    # Log-probs of the completion from one forward equal the model's own log-softmax.
    full = torch.cat([prompt_ids, theirs], 1)
    mask = torch.cat([prompt_mask, torch.ones_like(theirs)], 1)
    logits = model(input_ids=full, attention_mask=mask, position_ids=position_ids(mask)).logits
    got = token_logprobs(logits[:, 7:-1], full[:, 8:])
    want = torch.log_softmax(logits[:, 7:-1].float(), -1).gather(-1, full[:, 8:, None]).squeeze(-1)
    torch.testing.assert_close(got, want)


def test_a_head_oar_cannot_reproduce_is_refused_by_name():
    # A family whose forward transforms the logits in a way no config field declares: OAR refuses it
    # (naming the family and the fix) instead of scoring other numbers than the model's.
    from oar.models import ModelError

    class Scaled(T.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3.0
            return out

    config = T.LlamaConfig(**COMMON)
    model = Scaled(config).eval()
    ids, attn, reas, ans = batch()
    with pytest.raises(ModelError, match="Scaled.*--method grpo"):
        perturbation_scores(model, ids, attn, reas, ans, pad_token_id=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["granite", "gemma2"])
def test_one_train_step_per_method_on_another_family(tmp_path_factory, family):
    # Briefly trained so that rewards vary and OAR has rollouts to score (a random model never
    # writes an answer). Granite scales its logits; Gemma 2's window (6) is shorter than every
    # rollout and it soft-caps. (A Qwen2 of this size earned no reward after the same training.)
    from tinyrun import TINY, build_model, metrics, run_inprocess

    model = build_model(tmp_path_factory.getbasetemp() / f"oar-tiny-{family}", family=family)
    for method in ("grpo", "oar-g", "oar-p"):
        out = tmp_path_factory.mktemp(f"{family}-{method}")
        run_inprocess(["--model", str(model), "--dataset", str(model / "data.jsonl"), "--output_dir", str(out), "--steps", "1",
                       "--save_every", "0", "--micro_batch_size", "8", *TINY, "--method", method, "--score_all"])
        (row,) = metrics(out)
        assert row["optim/grad_norm"] > 0 and row["reward/frac_zero_std_groups"] < 1, row
        if method != "grpo":  # every rollout with an answer was scored, and its weights are not all ones
            assert row["oar/frac_scored"] > 0 and row["oar/weight_max"] > 1, row
