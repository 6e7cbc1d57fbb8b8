"""Hostile completion text is harmless and fast: characters split across byte-level tokens,
huge completions, a megabyte of unicode noise. What the sampler's span mapping and the reward do
with them; the spans must stay contiguous and the costs linear."""

import time

import torch


def _byte_level_tokenizer(corpus: str = "3 + 4 = 7 so the answer is 7 #### 7 ≥ π 日本語 😀 é", normalizer=None):
    """A small byte-level BPE tokenizer (the kind Qwen and Llama 3 use) trained on `corpus`: a character of several
    UTF-8 bytes can be split over tokens, and a lone token then decodes to U+FFFD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    if normalizer is not None:
        core.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator([corpus] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _rollouts(tok, completions: list[list[int]]):
    """Rollouts of the prompt "Q" whose completions are these token ids (of one length), each ended by EOS."""
    from oar.rollout import build_rollout

    prompt = torch.tensor([_ids(tok, "Q")] * len(completions))
    written = torch.tensor([c + [tok.eos_token_id] for c in completions])
    return build_rollout(tok, prompt, torch.ones_like(prompt), written, {tok.eos_token_id})


def _check_offsets(text, offsets, n):
    assert len(offsets) == n and offsets[-1][1] == len(text)
    assert all(0 <= s <= e <= len(text) for s, e in offsets)
    assert all(a[1] == b[0] for a, b in zip(offsets, offsets[1:]))  # contiguous, in order


def test_char_offsets_on_broken_utf8_are_contiguous_and_fast():
    from oar.rollout import char_offsets

    tok = _byte_level_tokenizer()
    ids = tok("≥ π 日本語 😀 é", add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # the case under test: characters split over tokens
    broken = ids[1:] + ids[:-1]  # starts and ends inside a character
    text, offsets = char_offsets(tok, broken)
    _check_offsets(text, offsets, len(broken))
    long = (broken * 1000)[:8000]
    start = time.perf_counter()
    text, offsets = char_offsets(tok, long)
    assert time.perf_counter() - start < 2.0  # 8,000 tokens: linear (growing prefixes took ~16 s)
    _check_offsets(text, offsets, len(long))


def test_build_rollout_on_broken_utf8_finds_the_answer():
    from oar.rollout import build_rollout, char_offsets

    tok = _byte_level_tokenizer()
    junk = tok("日本語 😀", add_special_tokens=False)["input_ids"][1:]  # begins mid-character
    answer = tok(" #### 7", add_special_tokens=False)["input_ids"]
    completion = torch.tensor([junk + answer + [tok.eos_token_id]])
    prompt = torch.tensor([tok("3 + 4 =", add_special_tokens=False)["input_ids"]])
    ro = build_rollout(tok, prompt, torch.ones_like(prompt), completion, {tok.eos_token_id})
    lp = ro.prompt_width
    answer_ids = ro.input_ids[0][ro.answer_mask[0]].tolist()
    assert tok.decode(answer_ids).strip() == "7" and ro.texts[0].endswith("#### 7")
    # Reasoning is the junk before the marker, every token of it: a byte token that only starts a
    # character spans no character of the text (its successor completes it) and counts as holding it.
    _, offsets = char_offsets(tok, junk + answer)
    assert any(e == s for s, e in offsets[: len(junk)])  # the case under test
    assert ro.reasoning_mask[0, lp : lp + len(junk)].all()
    assert not ro.reasoning_mask[0, lp + len(junk) :].any() and not ro.truncated.any()


def test_an_answer_that_starts_inside_a_split_character_starts_at_its_first_byte_token():
    """ "#### √3" with √'s three bytes in three tokens: the answer's first token is the first of them, so
    the `last` probe reads the logits that choose it, not the ones that finish a character."""
    from oar.rollout import build_rollout, char_offsets

    tok = _byte_level_tokenizer()
    ids = tok("2 + 2 = 4 #### √3", add_special_tokens=False)["input_ids"]
    text, offsets = char_offsets(tok, ids)
    root = text.index("√")
    first = next(t for t, (s, e) in enumerate(offsets) if s <= root < max(e, s + 1))
    assert offsets[first][0] == offsets[first][1]  # √ is split: its first token alone decodes to nothing
    prompt = torch.tensor([tok("Q", add_special_tokens=False)["input_ids"]])
    ro = build_rollout(
        tok, prompt, torch.ones_like(prompt), torch.tensor([ids + [tok.eos_token_id]]), {tok.eos_token_id}
    )
    lp = ro.prompt_width
    answer = ro.answer_mask[0, lp:].nonzero().flatten().tolist()
    assert answer[0] == first and tok.decode([ids[t] for t in answer]) == "√3"
    assert ro.reasoning_mask[0, lp : lp + first - 2].all() and not ro.reasoning_mask[0, lp + first :].any()


def test_a_token_holding_a_space_and_the_first_bytes_of_the_answer_is_in_the_answer():
    """ "... the answer is 日本" where one token holds the space and 日's first two bytes ("ĠæĹ") and decodes to
    nothing alone: it is the answer's first token (the choice of 日 is made there), as are the tokens after it
    that complete the characters; no reasoning token ends inside the answer."""
    from oar.rollout import build_rollout, char_offsets

    tok = _byte_level_tokenizer()
    ids = tok("3 + 4 = 7 so the answer is 日本", add_special_tokens=False)["input_ids"]
    first = tok.convert_ids_to_tokens(ids).index("ĠæĹ")
    assert (
        char_offsets(tok, ids)[1][first][0] == char_offsets(tok, ids)[1][first][1]
    )  # the case under test: empty alone
    prompt = torch.tensor([tok("Q", add_special_tokens=False)["input_ids"]])
    ro = build_rollout(
        tok, prompt, torch.ones_like(prompt), torch.tensor([ids + [tok.eos_token_id]]), {tok.eos_token_id}
    )
    lp = ro.prompt_width
    assert ro.answer_mask[0, lp:].nonzero().flatten().tolist() == list(range(first, len(ids)))
    assert tok.decode(ids[first:]) == " 日本" and not ro.reasoning_mask[0, lp + first :].any()


def test_build_rollout_on_a_huge_completion_is_fast():
    from oar.rollout import build_rollout
    from oar.tasks.tiny_arith import make_tokenizer

    tok = make_tokenizer()
    text = "1 + 1 = 2\n" * 2_000 + "#### 2"  # 20k tokens
    completion = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])  # truncated: no EOS
    prompt = torch.tensor([[tok.convert_tokens_to_ids("Q")]])
    start = time.perf_counter()
    ro = build_rollout(tok, prompt, torch.ones_like(prompt), completion, {tok.eos_token_id})
    assert time.perf_counter() - start < 5.0
    assert ro.truncated.all() and int(ro.answer_mask.sum()) == 1 and int(ro.reasoning_mask.sum()) == len(text) - 6


def test_reward_of_a_megabyte_of_unicode_noise():
    """test_rewards covers 1 MB of ASCII; this is 1 MB of mixed scripts, lone surrogates and NULs."""
    from oar.rewards import reward

    g = torch.Generator().manual_seed(0)
    alphabet = list("0123456789{}\\$#. ") + ["\ud800", "\udfff", "\x00", "日", "😀", "\u202e", "\ufffd"]
    noise = "".join(alphabet[i] for i in torch.randint(len(alphabet), (1_000_000,), generator=g).tolist())
    for completion, gold, want in [
        (noise, "5", None),
        (noise + " #### 5", "5", 1.0),
        (noise + "\\boxed{6}", "5", 0.0),
    ]:
        start = time.perf_counter()
        got = reward(completion, gold)
        assert time.perf_counter() - start < 2.0
        assert got in (0.0, 1.0) and (want is None or got == want)


def test_an_added_special_token_before_the_answer_stays_out_of_it():
    """A token its tokenizer flags special without listing it in all_special_ids decodes to nothing, like the
    first bytes of a character, but it holds no character of the answer: it keeps its empty span."""
    from tokenizers import AddedToken

    tok = _byte_level_tokenizer()
    tok.add_tokens([AddedToken("<|reserved|>", special=True)])
    reserved = tok.convert_tokens_to_ids("<|reserved|>")
    ro = _rollouts(tok, [_ids(tok, "3 + 4 = 7 so the answer is") + [reserved] + _ids(tok, " 7")])
    answer = ro.input_ids[0][ro.answer_mask[0]].tolist()
    assert reserved not in answer and tok.decode(answer).strip() == "7"


def test_a_special_token_inside_the_answer_stays_out_of_it():
    """A special token the model writes between two characters of its answer has an empty span strictly inside
    the answer's: it holds none of it, so it is no answer position for the probes (as none of the reasoning)."""
    tok = _byte_level_tokenizer()
    pad = tok.convert_tokens_to_ids("<pad>")
    ro = _rollouts(tok, [_ids(tok, "3 + 4 = 7 so #### 7") + [pad] + _ids(tok, "7")])
    answer = ro.input_ids[0][ro.answer_mask[0]].tolist()
    assert ro.texts[0].endswith("#### 77") and pad not in answer and tok.decode(answer).strip() == "77"
