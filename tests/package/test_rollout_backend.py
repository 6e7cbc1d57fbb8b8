"""--rollout_backend and the truncated importance-sampling correction, without vLLM (tests/package/test_vllm.py needs
it).

What must hold wherever the project runs: the weights are exactly 1 where the sampler's log-probs
are the trainer's, the cap holds, padding never leaks into the product; the loss without weights
is the same floats as before and GRPO on the own backend ignores the vLLM settings; asking for vLLM
where it is not installed (or with top-p it cannot score) stops with one line saying what to do.
"""

import json
import math
import re

import pytest

from oar.training.config import parse_args
import torch
from tinyrun import TINY, final_params, metrics, run_inprocess

from oar import vllm_rollouts, vllm_settings
from oar.grpo import policy_loss, truncated_is_weights


def test_weights_are_one_where_the_logprobs_agree_and_capped_elsewhere():
    trainer = torch.tensor([[-0.5, -1.0, -0.5, 0.0], [-0.1, -3.0, -0.2, -0.3]])
    sampler = torch.tensor([[-0.5, -1.5, -2.0, 7.0], [-0.1, -3.0, -0.2, -0.3]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    w = truncated_is_weights(trainer, sampler, mask, cap=2.0)
    # row 0: exp(0) = 1; exp(0.5) = 1.6487 (under the cap); exp(1.5) = 4.48 -> 2 (capped);
    # padding -> 1 (its 7.0 ignored)
    assert torch.equal(w[1], torch.ones(4))
    assert w[0, 0] == 1.0 and w[0, 3] == 1.0
    assert math.isclose(float(w[0, 1]), math.exp(0.5), rel_tol=1e-6)
    assert math.isclose(float(w[0, 2]), 2.0, rel_tol=1e-6)
    assert not w.requires_grad


def test_the_cap_holds_for_any_gap():
    g = torch.Generator().manual_seed(0)
    trainer, sampler = torch.randn(16, 32, generator=g) * 5, torch.randn(16, 32, generator=g) * 5
    trainer[0, 0] = float("inf")  # an overflow the clamp must absorb
    for cap in (0.5, 1.0, 2.0, 10.0):
        w = truncated_is_weights(trainer, sampler, torch.ones(16, 32, dtype=torch.bool), cap=cap)
        assert bool(torch.isfinite(w).all()) and float(w.max()) <= cap * (1 + 1e-6) and float(w.min()) > 0


def test_loss_without_weights_is_unchanged_and_weights_scale_the_surrogate():
    g = torch.Generator().manual_seed(1)
    old = torch.randn(3, 5, generator=g) - 1
    new = (old + 0.1 * torch.randn(3, 5, generator=g)).requires_grad_()
    adv = torch.randn(3, 5, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.2
    ref = old - 0.05
    base, stats = policy_loss(new, old, adv, mask, kl_beta=0.1, ref_logprobs=ref)
    (grad_base,) = torch.autograd.grad(base, new)
    ones, _ = policy_loss(new, old, adv, mask, kl_beta=0.1, ref_logprobs=ref, is_weights=torch.ones(3, 5))
    (grad_ones,) = torch.autograd.grad(ones, new)
    assert torch.equal(base, ones) and torch.equal(grad_base, grad_ones)  # x 1.0 is exact: the same floats
    assert "is_weight_mean" not in stats
    # with weights w: l = -w min(rho A, clip(rho) A) + beta k3, mean over each row's valid tokens, then over rows
    w = torch.rand(3, 5, generator=g) + 0.5
    got, s = policy_loss(new, old, adv, mask, kl_beta=0.1, ref_logprobs=ref, is_weights=w)
    rho = torch.exp(new - old)
    surrogate = -torch.minimum(rho * adv, rho.clamp(0.8, 1.2) * adv)
    x = ref - new
    per_token = torch.where(mask, w * surrogate + 0.1 * (torch.exp(x) - x - 1), 0.0)
    want = (per_token.sum(1) / mask.sum(1).clamp(min=1)).sum() / (mask.sum(1) > 0).sum()
    assert torch.allclose(got, want, rtol=1e-6)
    assert math.isclose(s["is_weight_mean"], float((w * mask).sum() / mask.sum()), rel_tol=1e-6)


def test_own_backend_ignores_the_vllm_settings(tiny_model, tmp_path):
    """GRPO on the own sampler: a run with every vllm_* setting moved is the default run, to the bit."""
    common = [
        "--model",
        str(tiny_model),
        "--dataset",
        str(tiny_model / "data.jsonl"),
        "--steps",
        "2",
        "--save_every",
        "0",
        "--method",
        "grpo",
        *TINY,
    ]
    run_inprocess([*common, "--output_dir", str(tmp_path / "default")])
    run_inprocess(
        [
            *common,
            "--output_dir",
            str(tmp_path / "moved"),
            "--rollout_backend",
            "own",
            "--vllm_gpu_memory_utilization",
            "0.9",
        ]
    )
    a, b = final_params(tmp_path / "default"), final_params(tmp_path / "moved")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert metrics(tmp_path / "default") == metrics(tmp_path / "moved")
    assert "sampler/is_weight_mean" not in metrics(tmp_path / "default")[0]


@pytest.mark.parametrize("script", ["train", "eval"])
def test_vllm_backend_without_vllm_stops_with_the_install_command(tiny_model, tmp_path, monkeypatch, script):
    monkeypatch.setattr(
        vllm_rollouts, "installed", lambda: False
    )  # as on a machine without it (here or in CI's vLLM env)
    args = [
        "--model",
        str(tiny_model),
        "--dataset",
        str(tiny_model / "data.jsonl"),
        "--output_dir",
        str(tmp_path / "run"),
        "--rollout_backend",
        "vllm",
    ]
    with pytest.raises(SystemExit) as stop:
        _main(script, args)
    message = str(stop.value)
    assert (
        "vLLM is not installed" in message
        and "pip install -r requirements-vllm.txt" in message
        and "\n" not in message
    )
    assert not (tmp_path / "run").exists()  # refused before anything was loaded or written


@pytest.mark.parametrize(
    "script, flag", [("train", "--temperature"), ("train", "--eval_temperature"), ("eval", "--eval_temperature")]
)
def test_vllm_backend_refuses_a_temperature_it_would_raise_to_001(tiny_model, tmp_path, script, flag):
    """vLLM samples (and scores) any temperature in (0, 0.01) at 0.01 and says so only at a log level the backend
    silences: such a run is refused before anything loads; 0.01 itself and 0 (greedy evaluation) pass the check."""
    args = [
        "--model",
        str(tiny_model),
        "--dataset",
        str(tiny_model / "data.jsonl"),
        "--output_dir",
        str(tmp_path / "run"),
        "--rollout_backend",
        "vllm",
    ]
    with pytest.raises(SystemExit, match=f"{flag} 0.005 with --rollout_backend vllm: vLLM samples any temperature in"):
        _main(script, [*args, flag, "0.005"])
    from oar.training.checks import check_backend_settings
    from oar.training.config import Config

    for ok in (0.01, 0.0) if flag == "--eval_temperature" else (0.01,):
        assert check_backend_settings(Config(rollout_backend="vllm", **{flag[2:]: ok})) == []


def test_unknown_backend_is_refused(tiny_model, tmp_path):
    with pytest.raises(SystemExit, match="--rollout_backend sglang: own or vllm"):
        _main(
            "train", ["--model", str(tiny_model), "--output_dir", str(tmp_path / "run"), "--rollout_backend", "sglang"]
        )


def _main(script: str, args: list[str]):
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    if script == "train":
        import train

        return train.main(parse_args(args))
    import eval as evaluation

    return evaluation.main(evaluation.parser().parse(args))


def test_a_gguf_conversion_is_reused_only_for_the_same_file(tiny_model, tmp_path, monkeypatch):
    """<output_dir>/vllm-model is made once per .gguf file: the same file (path, size, modification time) reuses
    it, another file or a changed one makes it again (a new run in an old --output_dir must not serve the old
    weights), and so does a folder from before the source was recorded."""
    import os

    from oar.training import rollout_backend
    from oar.training.models import load_model

    made = []
    monkeypatch.setattr(rollout_backend, "load_model", lambda name: made.append(name) or load_model(str(tiny_model)))
    a, b, folder = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "run" / "vllm-model"
    a.write_bytes(b"a"), b.write_bytes(b"bb")
    folder.parent.mkdir()
    for model, want in ((a, 1), (a, 1), (b, 2), (a, 3)):
        rollout_backend.convert_gguf(str(model), folder)
        assert len(made) == want and (folder / "config.json").is_file()
        assert json.loads((folder / rollout_backend.SOURCE).read_text())["path"] == str(model.resolve())
    os.utime(a, ns=(1, 1))  # the same path, rewritten
    rollout_backend.convert_gguf(str(a), folder)
    (folder / rollout_backend.SOURCE).unlink()  # a conversion made before the source was recorded
    rollout_backend.convert_gguf(str(a), folder)
    assert len(made) == 5 and not folder.with_name("vllm-model.tmp").exists()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_engine_gets_the_weights_one_at_a_time(family, monkeypatch):
    """policy_weights streams: drawing a tensor gathers only it (LoRA: only its layer's base and adapters),
    so a sharded process never holds a second full copy beside its engine's; all drawn, they are the plain
    model's weights, LoRA merged as final/ merges them (GPT-2's Conv1D transposed)."""
    from conftest import tiny_llama
    from transformers import GPT2Config, GPT2LMHeadModel

    from oar.training import lora, sharding
    from oar.training.rollout_backend import policy_weights

    torch.manual_seed(0)
    make = (
        (
            lambda: GPT2LMHeadModel(
                GPT2Config(
                    vocab_size=40, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=1
                )
            )
        )
        if family == "gpt2"
        else tiny_llama
    )
    targets = "c_attn,c_proj" if family == "gpt2" else "q_proj,v_proj,down_proj"
    gathered = []
    monkeypatch.setattr(sharding, "full_tensor", lambda t: gathered.append(t) or t)

    plain = make()
    stream = policy_weights(plain)
    name, first = next(stream)
    assert len(gathered) == 1 and first.data_ptr() == dict(plain.named_parameters())[name].data_ptr()  # no copy
    assert [name, *(n for n, _ in stream)] == [n for n, _ in plain.named_parameters()]

    peft = lora.add_adapters(make(), r=4, alpha=8.0, targets=targets)
    with torch.no_grad():  # adapters that change something (B starts at 0)
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    model, gathered[:] = lora.inner(peft), []
    stream, drawn, sources, names = policy_weights(model, peft), {}, 0, {n for n, _ in model.named_parameters()}
    for name, tensor in stream:
        drawn[name] = tensor
        sources += 3 if name.replace(".weight", ".base_layer.weight") in names else 1  # a merged weight is W, A, B
        assert len(gathered) - sources <= 4  # at most one layer ahead (base weight, bias, A, B), not the model
    want, _ = lora.final_weights(peft, None)
    assert set(want) - set(drawn) <= {"lm_head.weight"} and set(drawn) <= set(want)  # a tied head is the embedding's
    assert len(gathered) == len(list(model.parameters()))
    assert all(torch.equal(drawn[k], want[k]) for k in drawn)
    base = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if ".base_layer.weight" in k}
    assert base and all(not torch.equal(drawn[k], v) for k, v in base.items())  # merged, not the base weights


def test_a_mixture_of_experts_is_told_from_a_dense_model_by_its_config():
    """What vllm_rollouts.check refuses for training (its test runs in the vLLM environment): a config naming
    experts, at its top level (Mixtral, Qwen3-MoE) or in DBRX's ffn_config; dense configs name none."""
    import transformers as tf

    assert vllm_rollouts._experts(tf.LlamaConfig()) == 0 == vllm_rollouts._experts(tf.Qwen2Config())
    assert vllm_rollouts._experts(tf.MixtralConfig(num_local_experts=4)) == 4
    assert vllm_rollouts._experts(tf.Qwen3MoeConfig(num_experts=6)) == 6
    assert vllm_rollouts._experts(tf.DbrxConfig(ffn_config={"moe_num_experts": 3})) == 3


CPU = vllm_settings.Platform("cpu", cpu=True, sleep_mode=False)  # vLLM 0.32's CPU build, as here
CUDA = vllm_settings.Platform("cuda", cpu=False, sleep_mode=True)  # what vLLM reports on a GPU (faked: none here)


def test_what_the_engine_is_given_on_a_cpu_and_on_a_gpu():
    """oar/vllm_settings.py engine_args, the one place the engine's settings are decided, on this CPU and on a
    faked CUDA platform: the dtype (the trainer's on a CPU; bfloat16 on a GPU whatever the master weights), a
    request's length (what train.py asks, capped at the model's limit), chunked prefill (off on the CPU build
    only), sleep mode (a training engine where the platform has it), compilation and the KV cache."""
    args = dict(dtype="float32", max_model_length=4096 + 1024, model_limit=131072)
    cpu, gpu = vllm_settings.engine_args(CPU, **args, environ={}), vllm_settings.engine_args(CUDA, **args, environ={})
    assert cpu == {
        "dtype": "float32",
        "max_model_len": 5120,
        "enable_sleep_mode": False,
        "enforce_eager": True,
        "gpu_memory_utilization": 0.3,
        "kv_cache_memory_bytes": 2**30,
        "enable_chunked_prefill": False,
    }
    assert gpu == {  # no chunked prefill key: vLLM's default (on); no KV size: what the GPU share leaves
        "dtype": "bfloat16",
        "max_model_len": 5120,
        "enable_sleep_mode": True,
        "enforce_eager": False,
        "gpu_memory_utilization": 0.3,
        "kv_cache_memory_bytes": None,
    }
    engine = lambda p, **kw: vllm_settings.engine_args(p, **{**args, **kw}, environ={})  # noqa: E731
    # the dtype: the trainer's on a CPU (vLLM has no float64); on a GPU bfloat16, float16 weights kept, unless asked
    assert [engine(CPU, dtype=d)["dtype"] for d in ("bfloat16", "float16", "float64")] == [
        "bfloat16",
        "float16",
        "float32",
    ]
    assert [engine(CUDA, dtype=d)["dtype"] for d in ("bfloat16", "float16", "float64")] == [
        "bfloat16",
        "float16",
        "bfloat16",
    ]
    assert engine(CUDA, engine_dtype="float32")["dtype"] == "float32" == engine(CPU, engine_dtype="float32")["dtype"]
    # the length: capped at the model's own limit (Qwen2.5-Math-1.5B's 4096), and the model's own when none is asked
    assert engine(CUDA, model_limit=4096)["max_model_len"] == 4096
    assert engine(CUDA, max_model_length=0, model_limit=0)["max_model_len"] is None
    # sleep mode: a training engine only, and only where the platform has it
    assert engine(CUDA, training=False)["enable_sleep_mode"] is False
    no_sleep = vllm_settings.Platform("tpu", cpu=False, sleep_mode=False)
    assert engine(no_sleep)["enable_sleep_mode"] is False and "enable_chunked_prefill" not in engine(no_sleep)
    # what a caller asks outranks the platform's defaults; VLLM_CPU_KVCACHE_SPACE is vLLM's to read
    assert engine(CPU, enforce_eager=False, kv_cache_gib=0.5)["enforce_eager"] is False
    assert engine(CPU, kv_cache_gib=0.5)["kv_cache_memory_bytes"] == 2**29
    kv = vllm_settings.engine_args(CPU, **args, environ={"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert kv["kv_cache_memory_bytes"] is None


def test_what_a_run_asks_of_the_engine_and_its_environment_variables(monkeypatch):
    """rollout_backend.engine_settings: the trainer's dtype, PROMPT_TOKENS + --max_new_tokens, the GPU share; the
    environment's OAR_VLLM_DTYPE and OAR_VLLM_PROMPT_TOKENS in their place, checked; nothing for the own backend."""
    from oar.training.config import Config
    from oar.training.rollout_backend import engine_settings

    monkeypatch.delenv("OAR_VLLM_DTYPE", raising=False)
    monkeypatch.delenv("OAR_VLLM_PROMPT_TOKENS", raising=False)
    cfg = Config(rollout_backend="vllm", max_new_tokens=1024, dtype="float32")
    assert engine_settings(cfg) == {
        "dtype": "float32",
        "engine_dtype": None,
        "max_model_length": vllm_settings.PROMPT_TOKENS + 1024,
        "gpu_memory_utilization": 0.3,
    }
    assert engine_settings(Config()) == {}  # the own sampler takes none
    monkeypatch.setenv("OAR_VLLM_DTYPE", "float32")
    monkeypatch.setenv("OAR_VLLM_PROMPT_TOKENS", "8000")
    assert engine_settings(cfg)["engine_dtype"] == "float32" and engine_settings(cfg)["max_model_length"] == 9024
    for name, bad, says in (
        ("OAR_VLLM_DTYPE", "fp8", "OAR_VLLM_DTYPE=fp8: the vLLM engine's dtype, one of float32, bfloat16, float16."),
        ("OAR_VLLM_PROMPT_TOKENS", "0", "OAR_VLLM_PROMPT_TOKENS=0: the prompt tokens the vLLM engine is started for"),
        ("OAR_VLLM_PROMPT_TOKENS", "2k", "OAR_VLLM_PROMPT_TOKENS=2k"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            vllm_settings.overrides({name: bad})


def test_a_bad_engine_variable_stops_the_run_before_anything_loads(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("OAR_VLLM_DTYPE", "fp8")
    args = [
        "--model",
        str(tiny_model),
        "--dataset",
        str(tiny_model / "data.jsonl"),
        "--output_dir",
        str(tmp_path / "r"),
    ]
    with pytest.raises(SystemExit, match="train.py: error: OAR_VLLM_DTYPE=fp8: the vLLM engine's dtype"):
        _main("train", [*args, "--rollout_backend", "vllm"])
    assert not (tmp_path / "r").exists()


class _FakeLLM:
    """The calls VLLMRollouts makes of vllm.LLM, recorded (the weights drawn as vLLM draws them)."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", *tags))

    def collective_rpc(self, method, kwargs=None):
        drawn = len(list(kwargs["weights_iterator"])) if kwargs else None
        self.calls.append(("rpc", method if isinstance(method, str) else method.__name__, drawn))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True


def _engine(*, sleeps: bool, cpu: bool):
    """A VLLMRollouts around the fake engine, as __init__ leaves it (which needs vLLM)."""
    engine = vllm_rollouts.VLLMRollouts.__new__(vllm_rollouts.VLLMRollouts)
    engine.llm, engine.sleeps, engine.asleep, engine.cpu, engine.training = _FakeLLM(), sleeps, False, cpu, True
    engine.dtype = torch.float32
    return engine


def test_a_gpu_engine_sleeps_through_the_update_and_wakes_for_the_weights():
    """The CUDA-only branch, on a fake engine: train.py's rest() after the rollouts puts a sleep-mode engine to
    sleep at level 2 (weights discarded, so sampling is refused until new ones come); follow() maps the weights'
    memory, loads them, then the KV cache's, and resets the prefix cache. Without sleep mode (this CPU) neither
    call touches the engine's memory, and only the CPU build re-processes a tied head."""
    from conftest import tiny_llama

    from oar.training import rollout_backend

    model = tiny_llama()
    n = len(list(model.parameters()))
    gpu = _engine(sleeps=True, cpu=False)
    rollout_backend.follow(gpu, model)  # awake (the engine starts so): a plain reload
    assert gpu.llm.calls == [("rpc", "reload_weights", n), ("reset_prefix_cache",)]
    gpu.llm.calls = []
    rollout_backend.rest(gpu)
    rollout_backend.rest(gpu)  # asleep already: nothing more
    assert gpu.llm.calls == [("sleep", 2)] and gpu.asleep
    with pytest.raises(AssertionError, match="the vLLM engine sleeps"):
        gpu(model, None, ["x"], group_size=1, seeds=[0], max_new_tokens=1)
    rollout_backend.follow(gpu, model)
    assert gpu.llm.calls == [
        ("sleep", 2),
        ("wake_up", "weights"),
        ("rpc", "reload_weights", n),
        ("wake_up", "kv_cache"),
        ("reset_prefix_cache",),
    ]
    assert not gpu.asleep

    cpu = _engine(sleeps=False, cpu=True)
    rollout_backend.rest(cpu)
    rollout_backend.follow(cpu, model)
    assert cpu.llm.calls == [
        ("rpc", "reload_weights", n),
        ("rpc", "_refresh_tied_head", None),
        ("reset_prefix_cache",),
    ]
    rollout_backend.rest(rollout_backend.sample)  # the own sampler: nothing to do


def test_the_weights_are_sent_in_the_engines_dtype(tmp_path, monkeypatch):
    """policy_weights(dtype=bfloat16), as follow() calls it for a bfloat16 engine: every tensor arrives in
    bfloat16, equal to the float32 weight rounded once (LoRA: merged in float32, then rounded, as final/'s merge
    rounded); a float32 engine gets the tensors themselves (no copy). Under FSDP2 (a real sharded model, one gloo
    process) each shard is cast before the gather: what is all-gathered is bfloat16."""
    import torch.distributed as dist
    from conftest import tiny_llama
    from torch.distributed.tensor import DTensor

    from oar.training import lora, sharding
    from oar.training.rollout_backend import policy_weights

    model = tiny_llama()
    plain = dict(model.named_parameters())
    sent = dict(policy_weights(model, dtype=torch.bfloat16))
    assert sent.keys() == plain.keys()
    assert all(
        t.dtype == torch.bfloat16 and torch.equal(t, plain[k].detach().to(torch.bfloat16)) for k, t in sent.items()
    )
    same = dict(policy_weights(model, dtype=torch.float32))
    assert all(same[k].data_ptr() == plain[k].data_ptr() for k in plain)

    peft = lora.add_adapters(tiny_llama(), r=4, alpha=8.0, targets="q_proj,v_proj")
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    merged, _ = lora.final_weights(peft, None)  # float32
    sent = dict(policy_weights(lora.inner(peft), peft, dtype=torch.bfloat16))
    assert set(sent) <= set(merged) and all(t.dtype == torch.bfloat16 for t in sent.values())
    assert all(torch.equal(t, merged[k].to(torch.bfloat16)) for k, t in sent.items())

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        sharded = sharding.shard(tiny_llama())
        gathered, real = [], sharding.full_tensor
        monkeypatch.setattr(sharding, "full_tensor", lambda t: gathered.append(t) or real(t))
        sent = dict(policy_weights(sharded, dtype=torch.bfloat16))
        assert len(gathered) == len(plain) and all(isinstance(t, DTensor) for t in gathered)
        assert all(t.to_local().dtype == torch.bfloat16 for t in gathered)  # the shards, cast before the gather
        assert all(
            not isinstance(t, DTensor) and torch.equal(t, plain[k].detach().to(torch.bfloat16))
            for k, t in sent.items()
        )
    finally:
        dist.destroy_process_group()
