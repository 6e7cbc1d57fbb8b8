"""The update's two memory changes against the path they replace (docs/speed.md, "The update's memory"): the
update forward read through the model's head in chunks (oar/head.py) against its full logits, and micro-batches
at their own width (Rollout.trimmed) against micro-batches at the step's width. The log-probs, entropies, OAR's
clean outcome, the loss and every parameter's gradient must be today's to float rounding, on every family of
tests/families.py (torch.testing's float32 tolerance unless a comment says why not)."""

import warnings

import pytest
import torch

import oar.head as head_module
from oar.credit import METHODS, CreditSettings, MicroBatch, step_credit
from oar.grpo import policy_loss, token_entropy, token_logprobs
from oar.head import Forward, Head, hidden_forward, reproduces
from oar.probes import PROBES, clean_forward, outcome_from_logits
from oar.rollout import Rollout
from oar.training.learner import Learner, chunked_head

from families import FAMILIES, PAD, VOCAB, build, long_batch
from tinyrun import tiny_step

LP = 3  # long_batch's first completion column for this test: every row's prompt has begun by then


def grads(model, value):
    """Every parameter's gradient of the scalar `value` (zeros where it has none)."""
    params = list(model.parameters())
    got = torch.autograd.grad(value, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, got)]


@pytest.mark.parametrize("positions", [5, 40])  # per chunk: columns of one row; several whole rows
@pytest.mark.parametrize("name", FAMILIES)
def test_the_head_in_chunks_gives_the_full_logits_numbers_on_every_family(name, positions, monkeypatch):
    """log-probs at a temperature, entropies, every logit, the clean outcome of each probe and the gradients of a
    weighted sum of the log-probs: the chunked head's against the model's own logits (the soft-capped, scaled and
    tied heads included), with chunks of a few columns and of several rows."""
    monkeypatch.setattr(head_module, "HEAD_CHUNK_ELEMENTS", VOCAB * positions)
    model = build(name)
    ids, attn, _, ans = long_batch()
    labels, columns = ids[:, LP:], ids.shape[1] - LP + 1
    assert reproduces(model, model.base_model, Head(model), "cpu")

    logits, _ = clean_forward(model, ids, attn, logits_to_keep=columns)  # today's update forward
    want = token_logprobs(logits[:, :-1], labels, temperature=0.7)
    hidden, _ = hidden_forward(model, model.base_model, ids, attn, columns=columns)
    fwd = Forward(hidden, Head(model))
    got, entropy = fwd.logprobs(labels, 0.7)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(entropy, token_entropy(logits[:, :-1].detach()))
    torch.testing.assert_close(fwd.logits(), logits.detach())
    for probe in PROBES:
        torch.testing.assert_close(
            fwd.outcome(ids[:, LP - 1 :], ans[:, LP - 1 :], probe),
            outcome_from_logits(logits.detach(), ids[:, LP - 1 :], ans[:, LP - 1 :], probe),
        )
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(0))
    for g, h in zip(grads(model, (got * w).sum()), grads(model, (want * w).sum())):
        torch.testing.assert_close(g, h)


def mixed_rollouts(lengths=(3, 9, 5, 14, 2, 7), prompt=4, seed=0) -> Rollout:
    """Rollouts in the sampler's layout with mixed completion lengths (each ends in EOS, then right padding):
    micro-batches of 2 rows have widths 9, 14 and 7 of the step's 14 completion columns."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    ids = torch.full((b, prompt + t), PAD)
    attn = torch.zeros(b, prompt + t, dtype=torch.long)
    completion = torch.zeros(b, prompt + t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        start = i % 2  # some prompts left-padded
        ids[i, start:prompt] = torch.randint(3, VOCAB, (prompt - start,), generator=g)
        ids[i, prompt : prompt + n] = torch.randint(3, VOCAB, (n,), generator=g)
        ids[i, prompt + n - 1] = 2  # EOS
        attn[i, start : prompt + n] = 1
        completion[i, prompt : prompt + n] = True
    reasoning = completion & (torch.arange(prompt + t) < prompt + torch.tensor(lengths)[:, None] - 2)
    answer = completion & ~reasoning & (torch.arange(prompt + t) < prompt + torch.tensor(lengths)[:, None] - 1)
    return Rollout(ids, attn, completion, reasoning, answer, torch.zeros(b, dtype=torch.bool), [""] * b, prompt)


def test_a_micro_batch_is_trimmed_to_its_own_rows_width():
    ro = mixed_rollouts()
    widths = [ro.select(slice(k, k + 2)).trimmed().input_ids.shape[1] for k in (0, 2, 4)]
    assert widths == [4 + 9, 4 + 14, 4 + 7]
    mb = ro.select(slice(0, 2))
    cut = mb.trimmed()
    assert cut.prompt_width == mb.prompt_width and cut.texts == mb.texts
    for name in ("input_ids", "attention_mask", "completion_mask", "reasoning_mask", "answer_mask"):
        assert torch.equal(getattr(cut, name), getattr(mb, name)[:, : 4 + 9])
        assert not getattr(mb, name)[:, 4 + 9 :].any() or name == "input_ids"  # only padding was cut
    assert ro.select(slice(2, 4)).trimmed().input_ids.shape == ro.select(slice(2, 4)).input_ids.shape


@pytest.mark.parametrize("name", ["llama", "gemma2", "granite", "qwen2"])  # plain, soft-capped, scaled, tied
def test_an_update_pass_at_each_micro_batchs_width_through_the_chunked_head_is_todays(name, monkeypatch):
    """One pass of train.py's steps 5a-5d over micro-batches of 2 rows with mixed lengths: the summed loss and
    every parameter's gradient, micro-batches trimmed and read through the head in chunks of 3 columns, against
    today's: every micro-batch at the step's width, the model's full logits."""
    monkeypatch.setattr(head_module, "HEAD_CHUNK_ELEMENTS", VOCAB * 3)
    model = build(name).train()
    ro, lp = mixed_rollouts(), 4
    valid = ro.completion_mask[:, lp:]
    g = torch.Generator().manual_seed(1)
    advantages = torch.randn(len(ro), generator=g)
    old = torch.randn(valid.shape, generator=g) * 0.1  # an offset from the policy's log-probs: ratios clip
    norm = {"num_sequences": valid.any(1).sum().float(), "num_tokens": valid.sum().float()}

    def one_pass(trim: bool):
        learner = Learner(model, None, None, model, chunked_head=trim)
        total = 0.0
        for k in range(0, len(ro), 2):
            rows = slice(k, k + 2)
            mb = ro.select(rows).trimmed() if trim else ro.select(rows)
            t = mb.input_ids.shape[1] - lp
            fwd = learner.forward(mb.input_ids, mb.attention_mask, columns=t + 1)
            logprobs, _ = fwd.logprobs(mb.input_ids[:, lp:], 0.9)
            token_adv = advantages[rows, None] * mb.completion_mask[:, lp:].float()
            loss, _ = policy_loss(
                logprobs, logprobs.detach() + old[rows, :t], token_adv, valid[rows, :t], aggregation="seq_mean", **norm
            )
            total = total + loss
        return total, grads(model, total)

    loss, got = one_pass(trim=True)
    want_loss, want = one_pass(trim=False)
    torch.testing.assert_close(loss, want_loss)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_every_builtin_method_weighs_a_trimmed_micro_batch_as_its_untrimmed_columns(tiny_model):
    """The weights of a micro-batch at its own width are the step-width micro-batch's on the columns kept (the
    ones cut are padding, weight 0), for every built-in; prepare's (B, L) states (entropy-mask, tempo) are cut."""
    model, tok, ro, golds, rewards, adv = tiny_step(tiny_model)
    scored = (adv != 0) & ro.completion_mask.any(1)
    lp = ro.prompt_width
    rows = next(
        slice(k, k + 2)
        for k in range(0, 8, 2)
        if ro.select(slice(k, k + 2)).trimmed() is not ro.select(slice(k, k + 2))
    )
    mb = ro.select(rows)
    cut = mb.trimmed()
    assert cut.input_ids.shape[1] < mb.input_ids.shape[1]  # a micro-batch that is cut
    with torch.no_grad():
        logits, _ = clean_forward(
            model, mb.input_ids, mb.attention_mask, logits_to_keep=mb.input_ids.shape[1] - lp + 1
        )
    width = cut.input_ids.shape[1]
    for method in METHODS:
        settings = CreditSettings(method=method, group_size=4, micro_batch_size=2)
        credit = step_credit(settings, model, tok, ro, rewards, adv, scored, list(range(8)), golds, "answer_mean")
        whole = credit.weigh(rows, mb, logits)[0]
        trimmed = credit.weigh(rows, cut, lambda: logits[:, : width - lp + 1])[0]
        assert trimmed.shape == cut.input_ids.shape
        assert not whole[:, width:].any()
        # OAR-G's score is a KL's gradient at its minimum: float rounding of other shapes magnified (test_credit.py)
        torch.testing.assert_close(trimmed, whole[:, :width], atol=1e-3, rtol=1e-3)


def test_micro_batch_logits_are_made_once_and_only_when_read():
    calls = []
    micro = MicroBatch(slice(0, 1), None, lambda: calls.append(1) or torch.ones(1, 2, 3))
    assert not calls
    assert torch.equal(micro.logits, torch.ones(1, 2, 3)) and micro.logits is micro.logits
    assert calls == [1]
    assert torch.equal(MicroBatch(slice(0, 1), None, torch.zeros(1, 2, 3)).logits, torch.zeros(1, 2, 3))


class DoubledLogits(torch.nn.Module):
    """A causal LM whose forward doubles its head's logits, a transform oar.head.Head does not know."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config
        self.base_model_prefix = "inner_model"

    @property
    def base_model(self):
        return self.inner.model

    def get_output_embeddings(self):
        return self.inner.lm_head

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = 2 * out.logits
        return out


def test_a_head_that_is_not_reproduced_falls_back_to_the_full_logits_and_says_so():
    plain = build("llama")
    assert chunked_head(plain, plain, "cpu", None, sharded=False)
    assert not chunked_head(plain, plain, "cpu", None, sharded=True)  # FSDP2: the full logits (oar/head.py)
    odd = DoubledLogits(plain)
    assert not reproduces(odd, odd.base_model, Head(odd), "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not chunked_head(odd, odd, "cpu", None, sharded=False)
    assert any("full logits" in str(w.message) and "DoubledLogits" in str(w.message) for w in caught)
    ids, attn, _, _ = long_batch()
    learner = Learner(odd, None, None, odd, chunked_head=False)
    fwd = learner.forward(ids, attn, columns=5)
    assert fwd.head is None
    want, _ = clean_forward(odd, ids, attn, logits_to_keep=5)
    assert torch.equal(fwd.logits(), 2 * clean_forward(plain, ids, attn, logits_to_keep=5)[0].detach())
    assert torch.equal(fwd.logits(), want.detach())
