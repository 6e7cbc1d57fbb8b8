"""The fixed-shape decode loop (oar/decode_loops.py) gives the eager loop's rollouts (docs/sampler.md).

Every family of tests/families.py runs in float64 with sdpa attention where the family has it
(eager attention in float64 turns left-padded rows into NaN in this transformers), so the two loops'
logits agree far below any gap between two tokens' cumulative probabilities: the tokens must be equal,
token for token, greedy, sampled and with top-p, with left padding and EOS ids that end rows early.
Families whose cache is not all full attention (sliding windows) must fall back to the eager loop and
say so. The compiled step runs through torch's CPU backend here; on a GPU the same call is a CUDA graph.
"""

import pytest
import torch

import oar.decode_loops as sd
from oar.sampler import decode, sample

from families import EOS, FAMILIES, PAD, VOCAB, build

SLIDING = {"mistral-window", "gemma2", "gemma3-text"}  # a window of 6 (tests/families.py), shorter than every row


def _double(name):
    model = build(name, seed=1).double()
    try:
        model.set_attn_implementation("sdpa")
    except ValueError:  # no sdpa in this family (Gemma 2): it keeps eager
        pass
    if hasattr(model, "set_experts_implementation") and name == "qwen3-moe":
        model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    return model


def _prompts():
    g = torch.Generator().manual_seed(2)
    ids, mask = torch.full((3, 12), PAD), torch.zeros(3, 12, dtype=torch.long)
    for i, n in enumerate([9, 12, 7]):  # left padding
        ids[i, 12 - n :] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, 12 - n :] = 1
    return ids, mask


SETTINGS = [  # (temperature, top_p, EOS ids): greedy, sampled, top-p; the wide EOS set ends every row early
    (0.0, 1.0, {EOS}),
    (1.0, 1.0, {EOS, 5, 7}),
    (0.8, 0.7, {EOS, 5, 7}),
    (1.0, 1.0, set(range(2, 30))),
]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_fixed_shape_loop_gives_the_eager_loop_tokens_on_every_family(name, capsys):
    model = _double(name)
    ids, mask = _prompts()
    sd._SAID.clear()
    widths = []
    for temperature, top_p, eos in SETTINGS:
        kw = dict(
            max_new_tokens=40,
            temperature=temperature,
            top_p=top_p,
            eos_token_ids=eos,
            pad_token_id=PAD,
            seeds=list(range(6)),
            group_size=2,
        )
        eager, static = decode(model, ids, mask, **kw), decode(model, ids, mask, loop="static", **kw)
        assert static[0].tolist() == eager[0].tolist(), (temperature, top_p)
        torch.testing.assert_close(static[1], eager[1], rtol=0, atol=1e-6, equal_nan=True)
        widths.append(eager[0].shape[1])
    assert widths[0] == 40 and widths[-1] < 16, widths  # rows run to the budget; rows all end before the first check
    said = capsys.readouterr().err
    import transformers

    old_release = int(transformers.__version__.split(".")[0]) < 5  # its static cache is refused (oar/decode_loops.py)
    assert ("the eager loop samples instead" in said) == (name in SLIDING or old_release), said


def test_the_output_is_cut_where_the_eager_loop_stops_whatever_the_check_interval():
    model = _double("llama")
    ids, mask = _prompts()
    kw = dict(
        max_new_tokens=40,
        temperature=1.0,
        top_p=1.0,
        eos_token_ids=set(range(2, 8)),
        pad_token_id=PAD,
        seeds=list(range(6)),
        group_size=2,
    )
    eager = decode(model, ids, mask, **kw)
    assert 16 < eager[0].shape[1] < 40  # past the first check at 16, before the next
    for every in (1, 3, 16, 64):
        tokens, logprobs = sd.decode_static(model, ids, mask, check_every=every, **kw)
        assert tokens.tolist() == eager[0].tolist(), every
        assert logprobs.shape == eager[1].shape


def test_a_row_does_not_depend_on_when_its_batch_mates_stop():
    # Row 0 sampled alone (no padding) and beside two rows that stop at other steps: the same tokens, and
    # pads after its own EOS only. Finished rows are fed and masked, never dropped from the batch.
    model = _double("qwen2")
    ids, mask = _prompts()
    kw = dict(max_new_tokens=30, temperature=1.0, top_p=1.0, eos_token_ids={EOS, 5}, pad_token_id=PAD)
    together = sd.decode_static(model, ids, mask, seeds=[10, 11, 12], group_size=1, check_every=1, **kw)
    alone = sd.decode_static(model, ids[:1, 3:], mask[:1, 3:], seeds=[10], group_size=1, check_every=1, **kw)
    n = alone[0].shape[1]
    assert together[0][0, :n].tolist() == alone[0][0].tolist()
    assert (together[0][0, n:] == PAD).all()


def test_sample_with_chunks_lays_out_the_same_rollouts_with_either_loop():
    from oar.tasks.tiny_arith import make_tokenizer

    from conftest import tiny_llama

    tok = make_tokenizer()
    model = tiny_llama(vocab_size=len(tok), seed=4).double()
    model.set_attn_implementation("sdpa")
    prompts = ["Q: Compute 1 + 2.\nA:\n", "Q: 9\nA:\n", "Q: Compute 12 * 3 - 5.\nA:\n", "Q: 4 + 4\nA:\n"]
    kw = dict(group_size=2, seeds=list(range(100, 108)), max_new_tokens=12, temperature=1.0, chunk=2)
    eager, static = sample(model, tok, prompts, **kw), sample(model, tok, prompts, loop="static", **kw)
    assert static.texts == eager.texts
    for name in ("input_ids", "attention_mask", "completion_mask", "reasoning_mask", "answer_mask"):
        assert torch.equal(getattr(static, name), getattr(eager, name)), name
    torch.testing.assert_close(static.sample_logprobs, eager.sample_logprobs, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_the_compiled_step_gives_the_same_tokens_on_a_cpu():
    # torch.compile(mode="reduce-overhead") of the same step: inductor's CPU code here, a CUDA graph on a GPU.
    model = _double("llama")
    ids, mask = _prompts()
    for temperature, top_p, eos in SETTINGS[1:3]:
        kw = dict(
            max_new_tokens=40,
            temperature=temperature,
            top_p=top_p,
            eos_token_ids=eos,
            pad_token_id=PAD,
            seeds=list(range(6)),
            group_size=2,
        )
        eager, compiled = decode(model, ids, mask, **kw), decode(model, ids, mask, loop="compiled", **kw)
        assert compiled[0].tolist() == eager[0].tolist(), (temperature, top_p)
        torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=1e-5)


SHORT = dict(
    max_new_tokens=12,
    temperature=1.0,
    top_p=1.0,
    eos_token_ids={EOS},
    pad_token_id=PAD,
    seeds=list(range(6)),
    group_size=2,
)


def test_the_compiled_step_takes_and_returns_no_tensor(monkeypatch):
    # A CUDA graph's replay overwrites its outputs in place: on an H200 (2026-11-27) the step that took the
    # last token and returned the next stopped at its first replay ("accessing tensor output of CUDAGraphs
    # that has been overwritten by a subsequent run"). The step now reads and writes only the loop's state.
    steps = []

    def compile_spy(fn, **kwargs):
        assert kwargs.get("mode") == "reduce-overhead"

        def run(*args):
            assert not args
            out = fn()
            assert out is None
            steps.append(1)

        return run

    monkeypatch.setattr(torch, "compile", compile_spy)
    model = build("llama", seed=1)
    ids, mask = _prompts()
    eager, compiled = decode(model, ids, mask, **SHORT), decode(model, ids, mask, loop="compiled", **SHORT)
    assert compiled[0].tolist() == eager[0].tolist() and len(steps) == compiled[0].shape[1] - 1


def _one_dtype_caches(monkeypatch):
    """transformers before 5.24: a cache layer allocates its values in its keys' dtype."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    for layer in (StaticLayer, DynamicLayer):
        init = layer.lazy_initialization
        monkeypatch.setattr(layer, "lazy_initialization", lambda self, k, v, init=init: init(self, k, v.to(k.dtype)))


@pytest.mark.vllm  # also in the vLLM environment, whose transformers (< 5.20) has the one-dtype cache for real
@pytest.mark.parametrize("one_dtype", [False, True])
def test_under_accelerate_bf16_the_static_loop_gives_the_eager_tokens_or_hands_over(one_dtype, monkeypatch, capsys):
    # accelerate's mixed precision runs the forward under autocast: RoPE leaves the keys float32 and the values
    # bfloat16. On an H200 with transformers 5.17 the static loop stopped at its first step (values copied into
    # a float32 cache); it must now hand over to the eager loop there, and run where the cache keeps both dtypes.
    import transformers
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4.x: the static cache is refused anyway")
    if one_dtype:
        _one_dtype_caches(monkeypatch)
    AcceleratorState._reset_state(reset_partial_state=True)  # this process's state may be another test's
    GradientState._reset_state()
    try:
        model = Accelerator(mixed_precision="bf16", cpu=True).prepare(build("llama", seed=1))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the wrapped forward keeps its autocast
        GradientState._reset_state()
    ids, mask = _prompts()
    sd._SAID.clear()
    eager, static = decode(model, ids, mask, **SHORT), decode(model, ids, mask, loop="static", **SHORT)
    assert static[0].tolist() == eager[0].tolist()
    said = capsys.readouterr().err
    keeps_each = sd.keeps_each_dtype(
        type(sd.static_cache_or_reason(model, 8)[0].layers[0]), torch.float32, torch.bfloat16
    )
    assert not (one_dtype and keeps_each)  # the emulation of the older cache holds
    assert ("under autocast to torch.bfloat16" in said) == (not keeps_each), said


def test_a_model_without_an_embedding_module_to_watch_still_samples_with_the_static_loop(monkeypatch):
    model = build("llama", seed=1)

    def no_embeddings():
        raise NotImplementedError

    monkeypatch.setattr(model, "get_input_embeddings", no_embeddings)
    ids, mask = _prompts()
    assert (
        decode(model, ids, mask, loop="static", **SHORT)[0].tolist() == decode(model, ids, mask, **SHORT)[0].tolist()
    )


def test_cache_widths_waste_at_most_an_eighth_and_come_eight_per_doubling():
    for n in range(1, 5000):
        w = sd.cache_width(n)
        assert n <= w <= max(n + 7, n * 9 // 8), n
    assert len({sd.cache_width(n) for n in range(1025, 2049)}) == 8


@pytest.mark.slow  # an end-to-end run of 10-35 s
def test_eval_py_with_the_static_loop_writes_the_eager_loop_records(tiny_model, tmp_path):
    import json

    from tinyrun import EVAL, check_ok, run_script

    got = {}
    for loop in ("eager", "static"):
        out = tmp_path / loop
        check_ok(
            run_script(
                EVAL,
                [
                    "--model",
                    str(tiny_model),
                    "--dataset",
                    str(tiny_model / "data.jsonl"),
                    "--output_dir",
                    str(out),
                    "--instruction",
                    "",
                    "--max_new_tokens",
                    "20",
                    "--limit",
                    "12",
                    "--num_samples",
                    "2",
                    "--temperature",
                    "1.0",
                    "--decode_loop",
                    loop,
                ],
            )
        )
        got[loop] = [json.loads(line)["completion"] for line in (out / "eval.jsonl").read_text().splitlines()]
    assert got["static"] == got["eager"]
    bad = run_script(EVAL, ["--model", str(tiny_model), "--decode_loop", "graph", "--output_dir", str(tmp_path / "x")])
    assert bad.returncode != 0 and "--decode_loop graph: one of eager, static, compiled" in bad.stderr


def test_the_static_loop_samples_through_lora_adapters():
    from peft import LoraConfig, get_peft_model

    from conftest import tiny_llama

    model = tiny_llama(seed=1).double()
    model.set_attn_implementation("sdpa")
    model = get_peft_model(
        model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    ).eval()
    ids = torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(
        max_new_tokens=12,
        temperature=1.0,
        top_p=1.0,
        eos_token_ids={2},
        pad_token_id=0,
        seeds=list(range(4)),
        group_size=2,
    )
    eager, static = (
        decode(model, ids, torch.ones_like(ids), **kw),
        decode(model, ids, torch.ones_like(ids), loop="static", **kw),
    )
    assert static[0].tolist() == eager[0].tolist()
    torch.testing.assert_close(static[1], eager[1], rtol=0, atol=1e-6)
