"""The decode loops without per-token waste (docs/sampler.md) give the numbers of the loop they replace, bit for bit.

`_loop_before` is the eager loop as it was at c0ec13d: a DynamicCache and an attention mask grown by
`torch.cat` every step, a host check every step, and under autocast every linear weight cast at every step.
Today's loop fills a preallocated cache and mask in place (`lm.in_place_cache`), checks for finished rows every
`check_interval` steps, and under autocast runs its steps with the linear weights cast once
(`lm.linear_weights_in`). Each must leave the tokens and the log-probs exactly as they were: in float32 on every
family of tests/families.py (eager and sdpa attention), under accelerate's bf16 autocast, through LoRA adapters,
and on SmolLM2-135M.
"""

import pytest
import torch

import oar.decode_loops as dl
from oar.lm import cache_kwargs, in_place_cache, linear_weights_in
from oar.sampler import decode

from families import EOS, FAMILIES, PAD, VOCAB, build


@torch.no_grad()
def _loop_before(
    model,
    prompt_ids,
    prompt_mask,
    *,
    max_new_tokens,
    temperature,
    top_p,
    eos_token_ids,
    pad_token_id,
    seeds,
    group_size,
):
    """The eager loop of c0ec13d, verbatim but for its name (oar/eager_decode.py's decode_eager)."""
    b = prompt_ids.shape[0] * group_size
    uniforms = dl.draw_uniforms(seeds, max_new_tokens, prompt_ids.device)
    eos = torch.tensor(sorted(eos_token_ids), device=prompt_ids.device)
    logits, cache, pos = dl.prefill(model, prompt_ids, prompt_mask)
    if group_size > 1:
        cache.batch_repeat_interleave(group_size)
    logits, mask, pos = (x.repeat_interleave(group_size, dim=0) for x in (logits, prompt_mask, pos))
    next_pos = pos[:, -1:] + 1
    done = torch.zeros(b, dtype=torch.bool, device=prompt_ids.device)
    tokens, logprobs = [], []
    for t in range(max_new_tokens):
        token, logp = dl.choose(logits, temperature, top_p, uniforms[:, t], done, pad_token_id)
        tokens.append(token)
        logprobs.append(logp)
        done = done | torch.isin(token, eos)
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits = model(
            input_ids=token[:, None], attention_mask=mask, position_ids=next_pos, **cache_kwargs(cache), use_cache=True
        ).logits[:, -1]
        next_pos = next_pos + 1
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)


def _prompts():
    g = torch.Generator().manual_seed(2)
    ids, mask = torch.full((3, 12), PAD), torch.zeros(3, 12, dtype=torch.long)
    for i, n in enumerate([9, 12, 7]):  # left padding
        ids[i, 12 - n :] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, 12 - n :] = 1
    return ids, mask


SETTINGS = [  # (temperature, top_p, EOS ids): greedy, sampled, top-p, and EOS ids that end every row early
    (0.0, 1.0, {EOS}),
    (1.0, 1.0, {EOS, 5, 7}),
    (0.8, 0.7, {EOS, 5, 7}),
    (1.0, 1.0, set(range(2, 30))),
]


def _kw(temperature, top_p, eos, tokens=40):
    return dict(
        max_new_tokens=tokens,
        temperature=temperature,
        top_p=top_p,
        eos_token_ids=eos,
        pad_token_id=PAD,
        seeds=list(range(6)),
        group_size=2,
    )


def _same(got, want):
    assert got[0].tolist() == want[0].tolist()
    assert torch.equal(got[1], want[1])  # the log-probs bit for bit, not to a tolerance


@pytest.mark.parametrize("name", FAMILIES)
def test_the_eager_loop_gives_the_tokens_and_log_probs_of_the_loop_it_replaces_on_every_family(name):
    model = build(name, seed=1)  # float32, as the published runs sample
    ids, mask = _prompts()
    for attention in ("eager", "sdpa"):
        try:
            model.set_attn_implementation(attention)
        except ValueError:  # a family without sdpa (Gemma 2)
            continue
        for setting in SETTINGS:
            _same(decode(model, ids, mask, **_kw(*setting)), _loop_before(model, ids, mask, **_kw(*setting)))


@pytest.mark.parametrize("every", [1, 3, 16, 64])
def test_any_check_interval_gives_the_same_output(every):
    model = build("qwen2", seed=1)
    ids, mask = _prompts()
    for setting in SETTINGS:
        want = _loop_before(model, ids, mask, **_kw(*setting))
        _same(dl.decode_eager(model, ids, mask, check_every=every, **_kw(*setting)), want)
    assert dl.check_interval("cpu") == 1 and dl.check_interval("cuda") == dl.CHECK_EVERY  # no sync a step on a GPU


def test_the_steps_run_past_the_end_until_the_check_and_are_cut():
    # every row ends by step 5 of 40; checked every 16 steps, the loop runs 16 and cuts to the stop of a loop
    # that checks every step
    model = build("llama", seed=1)
    ids, mask = _prompts()
    steps = []
    got = dl.decode_eager(model, ids, mask, check_every=16, on_token=lambda: steps.append(1), **_kw(*SETTINGS[-1]))
    want = _loop_before(model, ids, mask, **_kw(*SETTINGS[-1]))
    assert want[0].shape[1] < 16 and len(steps) == 16
    _same(got, want)


def _under_accelerate_bf16(model):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # this process's state may be another test's
    GradientState._reset_state()
    try:
        return Accelerator(mixed_precision="bf16", cpu=True).prepare(model)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the wrapped forward keeps its autocast
        GradientState._reset_state()


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2", "gpt2"])  # gemma2, gpt2: tied heads; gpt2's Conv1D
def test_under_accelerate_bf16_the_steps_cast_once_and_give_the_same_numbers(name, monkeypatch):
    model = _under_accelerate_bf16(build(name, seed=1))
    before = dict(model.named_parameters())
    ids, mask = _prompts()
    dtypes = []  # a linear weight's dtype at every forward: float32 for the prefill, the copy's for the steps
    linear = next(m for m in model.modules() if type(m) is torch.nn.Linear)
    hook = linear.register_forward_pre_hook(lambda m, a: dtypes.append(m.weight.dtype))
    try:
        for loop in ("eager", "static"):
            for setting in SETTINGS:
                dtypes.clear()
                got = decode(model, ids, mask, loop=loop, **_kw(*setting))
                if got[0].shape[1] > 1:
                    assert dtypes[0] == torch.float32 and set(dtypes[1 : got[0].shape[1]]) == {torch.bfloat16}
                with monkeypatch.context() as m:  # the loop as it was: autocast casts the weights at every step
                    m.setattr(dl, "linear_weights_in", lambda model, dtype: linear_weights_in(model, None))
                    _same(got, decode(model, ids, mask, loop=loop, **_kw(*setting)))
                if loop == "eager":
                    _same(got, _loop_before(model, ids, mask, **_kw(*setting)))
    finally:
        hook.remove()
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)  # the very parameters back
    assert all(p.dtype == torch.float32 for p in after.values())


def test_the_compiled_step_keeps_its_weights(monkeypatch):
    # a CUDA graph records its inputs' addresses: copies made at every call would re-record it at every call
    model = build("llama", seed=1)
    seen = []
    monkeypatch.setattr(dl, "linear_weights_in", lambda m, dtype: seen.append(dtype) or linear_weights_in(m, dtype))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # what is cast, not how inductor runs it
    ids, mask = _prompts()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for compiled in (False, True):
            dl.decode_static(model, ids, mask, compiled=compiled, **_kw(1.0, 1.0, {EOS}, tokens=4))
    assert seen == [torch.bfloat16, None]


def test_the_weights_cast_once_only_where_nothing_else_swaps_them():
    model = build("llama", seed=1)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    with linear_weights_in(model, torch.bfloat16):
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert all(m.weight.dtype == torch.bfloat16 and not m.weight.requires_grad for m in linears)
        assert model.get_input_embeddings().weight.dtype == torch.float32  # autocast does not cast an embedding
    assert all(m.weight.dtype == torch.float32 for m in linears)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    for dtype in (None, torch.float32):
        with linear_weights_in(model, dtype):
            assert all(m.weight.dtype == torch.float32 for m in linears)
    model.model.layers[0]._hf_hook = object()  # accelerate's offloading hooks swap weights themselves
    with linear_weights_in(model, torch.bfloat16):
        assert all(m.weight.dtype == torch.float32 for m in linears)


def test_the_in_place_cache_holds_a_dynamic_caches_tensors_and_grows_as_one_past_its_width():
    from transformers import DynamicCache

    k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4).to(torch.bfloat16)  # autocast: each its own dtype
    grown, placed = DynamicCache(), DynamicCache()
    grown.update(k, v, 0), placed.update(k, v, 0)
    grown.batch_repeat_interleave(2)
    placed = in_place_cache(placed, 7, repeats=2)
    for step in range(4):  # two steps in the buffer, then past its width: concatenation from there on
        nk, nv = torch.randn(4, 3, 1, 4), torch.randn(4, 3, 1, 4).to(torch.bfloat16)
        want, got = grown.update(nk, nv, 0), placed.update(nk, nv, 0)
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(want, got)), step
        assert placed.get_seq_length() == grown.get_seq_length() == 6 + step
    assert placed.layers[0].buffers == []  # it left its buffers at the step that did not fit


def test_the_eager_loop_samples_through_lora_adapters_under_bf16_as_before():
    from peft import LoraConfig, get_peft_model

    from conftest import tiny_llama

    model = get_peft_model(
        tiny_llama(seed=1), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    model = _under_accelerate_bf16(model.eval())
    ids = torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=12, temperature=1.0, top_p=1.0, eos_token_ids={2}, pad_token_id=0, group_size=2)
    kw["seeds"] = list(range(4))
    _same(decode(model, ids, torch.ones_like(ids), **kw), _loop_before(model, ids, torch.ones_like(ids), **kw))


@pytest.mark.slow
def test_smollm2_samples_the_rollouts_of_the_loop_it_replaces(smollm2):
    from oar.sampler import encode_prompts, format_prompt, stop_token_ids

    model, tok = smollm2
    prompts = [format_prompt(tok, p) for p in ("What is 17 + 25?", "Name a prime above 50.")]
    ids, mask = encode_prompts(tok, prompts, "cpu")  # two prompt widths: left padding
    kw = dict(max_new_tokens=24, temperature=1.0, top_p=1.0, eos_token_ids=stop_token_ids(model, tok), group_size=2)
    kw |= dict(pad_token_id=tok.pad_token_id, seeds=[3, 4, 5, 6])
    _same(decode(model.eval(), ids, mask, **kw), _loop_before(model, ids, mask, **kw))
