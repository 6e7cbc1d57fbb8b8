r"""What scripts/analysis/grail_compare.py runs: GRAIL's trainer methods in a harness, the rollouts they run on,
and oar's weights on those rollouts, as oar computes them and as oar computes them fed GRAIL's choices.

Legend: B rollouts, Lp prompt width, T completion width (GRAIL's C), L = Lp + T, H embedding width. GRAIL's
weights are (B, T) over the completion columns; oar's layout is (B, L), the same as TRL's:
[left-padded prompt | completion through EOS | right padding], so GRAIL's inputs are oar's tensors sliced.

No GRAIL code is here: its file is loaded by path at run time (`load_grail`), and what it computes is
rebuilt in oar's terms from its definition (docs/differences.md, "GRAIL and its OAR-G baseline").
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import tempfile
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

from oar.answers import group_end
from oar.credit import CreditSettings, credit_methods, step_credit
from oar.credit_methods import gate
from oar.grail import grail_scores, grail_weights, reweighted_rows
from oar.grpo import group_advantages
from oar.oar_grad import gradient_scores
from oar.probes import clean_forward, outcome_from_logits
from oar.rewards import correctness_reward
from oar.rollout import char_offsets
from oar.sampler import format_prompt, sample
from oar.tasks.arith import ArithConfig, arith_problems
from oar.tasks.tiny_arith import TinyArithRecipe, prompt_text, sft_target
from oar.training.data import rollout_seeds
from oar.training.models import load_model

TINY_ARITH = Path(__file__).resolve().parents[2] / "oar" / "tasks" / "tiny-arith"
GRAIL_FILE = Path("src/train/grail_trainer.py")
GRAIL_CLASS = "GrailTrainerV2"
# What the two methods read of the trainer: GRAIL's run configs (qwen3_grail.yaml, qwen3_oar_g.yaml).
GRAIL_RUN = {
    "temperature": 1.0,
    "grail_std": 0.5,
    "grail_mean": 1.0,
    "grail_w_min": 0.5,
    "grail_w_max": 5.0,
    "grail_leaf_source": "embeddings",
    "grail_rollout_symmetry": "wrong",
    "oar_g_tau": 0.4,
    "oar_g_beta": 2.0,
    "oar_g_eps": 1e-12,
    "oar_g_noise_std": 1e-3,
}
BOX = "\\boxed{"


# -- GRAIL's side ----------------------------------------------------------------------------------


def load_grail(path: str):
    """GRAIL's trainer class from a checkout (its src/train/grail_trainer.py) or the file itself -> (class, file)."""
    where = Path(path).expanduser()
    file = where / GRAIL_FILE if where.is_dir() else where
    if not file.is_file():
        raise SystemExit(
            f"grail_compare.py: --grail {path}: no {GRAIL_FILE} there; pass a GRAIL checkout or the file."
        )
    spec = importlib.util.spec_from_file_location("grail_trainer", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise SystemExit(
            f"grail_compare.py: {file} does not import ({e}): it needs TRL, "
            f"`pip install --no-deps --target DIR trl==1.16.0` and --trl DIR."
        ) from None
    if not hasattr(module, GRAIL_CLASS):
        raise SystemExit(f"grail_compare.py: {file} defines no class {GRAIL_CLASS}.")
    return getattr(module, GRAIL_CLASS), file


def harness(cls, model, tokenizer):
    """An object of GRAIL's trainer class made without __init__ (which wants datasets, reward functions and a
    Trainer's setup), holding what its two methods read. On one process the accelerator's gather and padding
    across processes are the identity."""
    t = object.__new__(cls)
    t.accelerator = SimpleNamespace(
        device=torch.device("cpu"), gather=lambda x: x, pad_across_processes=lambda x, **kwargs: x
    )
    t.model = model  # read for .training: which metrics dict
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.processing_class = tokenizer  # encode, decode, pad_token_id
    for name, value in GRAIL_RUN.items():
        setattr(t, name, value)
    return t


def grail_inputs(ro) -> dict:
    """The arguments of GRAIL's two methods (all but GRAIL's advantages) from oar's rollouts."""
    lp = ro.prompt_width
    return {
        "input_ids": ro.input_ids,
        "attention_mask": ro.attention_mask,
        "logits_to_keep": ro.input_ids.shape[1] - lp,
        "completion_ids": ro.input_ids[:, lp:],  # (B, T)
        "mask": ro.completion_mask[:, lp:].long(),  # (B, T), EOS included, as TRL's completion_mask
    }


def grail_oar_g(t, model, ro, seed: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """GRAIL's OAR-G weights (B, T) after torch.manual_seed(seed); the draws it used, redrawn as one
    randn(B, T, H) from the same seed; and whether the generator's state after GRAIL's call equals the state
    after that one draw (it does only if GRAIL drew exactly that)."""
    torch.manual_seed(seed)
    w = t.compute_oar_g_weights(model, **grail_inputs(ro)).float()
    after = torch.get_rng_state()
    emb = model.get_input_embeddings().weight
    torch.manual_seed(seed)
    draws = torch.randn(len(ro), ro.input_ids.shape[1] - ro.prompt_width, emb.shape[1], dtype=emb.dtype)
    return w, draws, torch.equal(after, torch.get_rng_state())


def ddp_error(t, model, ro) -> str | None:
    """What GRAIL's OAR-G does with the model its call site passes it under DDP, the Trainer's wrapped model:
    one process in a gloo group initialised through a file (no network). None if it ran."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=0, world_size=1)
        try:
            t.compute_oar_g_weights(torch.nn.parallel.DistributedDataParallel(model), **grail_inputs(ro))
            return None
        except AttributeError as e:
            return f"AttributeError: {e}"
        finally:
            dist.destroy_process_group()


# -- the rollouts ----------------------------------------------------------------------------------


def boxed_target(problem, recipe: TinyArithRecipe) -> str:
    r"""tiny-arith's supervised target with its last line `#### N` written `\boxed{N}`."""
    head, marker, answer = sft_target(problem, recipe).rpartition("#### ")
    assert marker, "tiny-arith's targets end in '#### N'"
    return f"{head}{BOX}{answer}}}"


def boxed_model(steps: int, lr: float, batch: int, seed: int, cache: str | None):
    """tiny-arith taught to box its answer: `steps` AdamW steps of `batch` right-padded rows (loss on the
    completion) from the shipped weights, on one thread (deterministic). Kept in `cache` and reused from
    there when it was built alike. -> (model in eval mode, tokenizer, how it was built)."""
    info = {"base": "tiny-arith (oar/tasks/tiny-arith)", "sft_steps": steps, "sft_lr": lr, "sft_batch": batch}
    info["seed"], stamp = seed, Path(cache or ".") / "grail_compare_model.json"
    if cache and stamp.is_file() and json.loads(stamp.read_text()) == info:
        model, tok = load_model(cache)
        return model.eval(), tok, info
    model, tok = load_model(str(TINY_ARITH))
    recipe = TinyArithRecipe()
    problems = arith_problems(steps * batch, split="train", seed=seed + 1, config=recipe.train_arith)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        rows = problems[step * batch : (step + 1) * batch]
        prompts = [tok(prompt_text(tok, p.problem), add_special_tokens=False).input_ids for p in rows]
        targets = [tok(boxed_target(p, recipe), add_special_tokens=False).input_ids + [tok.eos_token_id] for p in rows]
        width = max(len(p) + len(c) for p, c in zip(prompts, targets))
        ids = torch.full((len(rows), width), tok.pad_token_id)  # (b, W)
        labels, attn = torch.full_like(ids, -100), torch.zeros_like(ids)
        for i, (p, c) in enumerate(zip(prompts, targets)):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p) : len(p) + len(c)], attn[i, : len(p) + len(c)] = torch.tensor(c), 1
        model(input_ids=ids, attention_mask=attn, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    if cache:
        model.save_pretrained(cache)
        tok.save_pretrained(cache)
        stamp.write_text(json.dumps(info))
    return model, tok, info


def rollouts(model, tok, prompts: int, group_size: int, ops: int, max_new_tokens: int, seed: int):
    """oar's sampler on held-out arith problems of `ops` operations, at GRAIL's temperature; rewards from the last
    box; A_i = r_i - the group's mean (GRAIL's scale_rewards false) -> (rollouts, rewards, advantages, seeds, golds).
    Stops if a completion does not round-trip through the tokenizer (GRAIL re-encodes decoded text)."""
    problems = arith_problems(prompts, split="test", seed=seed, config=ArithConfig(min_ops=ops, max_ops=ops))
    seeds = rollout_seeds(seed, 0, list(range(prompts)), group_size)
    ro = sample(
        model,
        tok,
        [format_prompt(tok, p.problem) for p in problems],
        group_size=group_size,
        seeds=seeds,
        max_new_tokens=max_new_tokens,
        temperature=GRAIL_RUN["temperature"],
    )
    golds = [p.answer for p in problems for _ in range(group_size)]
    rewards = torch.tensor([correctness_reward(text, gold) for text, gold in zip(ro.texts, golds)])
    lp, special = ro.prompt_width, set(tok.all_special_ids)
    for i in range(len(ro)):
        ids = [t for t in ro.input_ids[i, lp:][ro.completion_mask[i, lp:]].tolist() if t not in special]
        if tok.encode(tok.decode(ids, skip_special_tokens=True), add_special_tokens=False) != ids:
            raise SystemExit(
                f"grail_compare.py: rollout {i} does not round-trip through the tokenizer: {ro.texts[i]!r}"
            )
    return ro, rewards, group_advantages(rewards, group_size, scale="none"), seeds, golds


# -- oar's side ------------------------------------------------------------------------------------


def oar_method(name: str, model, tok, ro, rewards, advantages, seeds, golds, group_size: int) -> torch.Tensor:
    """oar's credit method `name` as train.py's steps 5a-5b compute it, the step one micro-batch: the update
    forward (its logits and, for OAR, its clean outcome and keys/values), step_credit, weigh -> (B, T). Every
    rollout is scored, as --score_all (GRAIL scores tied groups too)."""
    settings = CreditSettings(method=name, group_size=group_size, temperature=GRAIL_RUN["temperature"])
    uses_clean, lp = credit_methods()[name].uses_clean, ro.prompt_width
    with torch.no_grad():
        logits, kv = clean_forward(
            model,
            ro.input_ids,
            ro.attention_mask,
            logits_to_keep=ro.input_ids.shape[1] - lp + 1,
            keep_cache=uses_clean,
        )
    clean = None
    if uses_clean:
        clean = outcome_from_logits(logits, ro.input_ids[:, lp - 1 :], ro.answer_mask[:, lp - 1 :], settings.probe)
    scored = ro.completion_mask.any(1)
    weigh = step_credit(settings, model, tok, ro, rewards, advantages, scored, seeds, golds, settings.probe)
    return weigh(slice(0, len(ro)), ro, logits, clean, kv)[0][:, lp:]


def first_box(text: str) -> tuple[int, int] | None:
    r"""The character span of the first `\boxed{...}` whose braces close (GRAIL's span), or None."""
    for m in re.finditer(re.escape(BOX), text):
        end = group_end(text, m.end() - 1)
        if end is not None:
            return m.start(), end
    return None


def grail_span(tok, ro) -> dict[str, torch.Tensor]:
    r"""GRAIL's answer span rebuilt from its definition: the first closed `\boxed{...}` as its marker tokens,
    its content and its closing brace, and the completion's tokens after it (EOS). (B, T) bool each."""
    lp, (b, width) = ro.prompt_width, ro.input_ids.shape
    out = {k: torch.zeros(b, width - lp, dtype=torch.bool) for k in ("marker", "content", "closing", "after")}
    for i in range(b):
        valid = ro.completion_mask[i, lp:]
        text, offsets = char_offsets(tok, ro.input_ids[i, lp:][valid].tolist())
        span = first_box(text)
        if span is None:
            continue
        start, end = span
        for t, (a, z) in enumerate(offsets):
            if a < start + len(BOX) and z > start:
                out["marker"][i, t] = True
            elif a < end <= z:
                out["closing"][i, t] = True
            elif a >= end:  # EOS too: a special token holds no text
                out["after"][i, t] = True
            elif start <= a:
                out["content"][i, t] = True
    return out


def grail_replica(model, ro, span: dict, advantages, *, shift=True, box_span=True, whole=True) -> torch.Tensor:
    """oar.grail fed GRAIL's choices -> (B, T) weights laid out as GRAIL's, padding 0. Each choice can be turned
    back to oar's: `shift` column j holds the saliency of position Lp - 1 + j (GRAIL's slice), else of its own
    token Lp + j; `box_span` J reads the whole first box, else oar's answer span A_i; `whole` the statistics run
    over every valid completion token and then the box's content gets w_max, its marker, its closing brace and
    the tokens after it the centre (in every row with a box), else they run over R_i and the rest keeps 1.
    With all three turned back this is oar's grail method on the rows where both codes find an answer."""
    lp, (b, width) = ro.prompt_width, ro.input_ids.shape
    valid = ro.completion_mask[:, lp:]  # (B, T)
    box = span["marker"] | span["content"] | span["closing"]
    has_box = box.any(1)
    cols = torch.arange(width - lp) + (lp - 1 if shift else lp)  # the position each column scores
    scored = valid if whole else ro.reasoning_mask[:, lp:]
    score_mask = torch.zeros(b, width, dtype=torch.bool)
    score_mask[:, cols] = scored & has_box[:, None]
    answer = ro.answer_mask.clone()
    if box_span:
        answer[:, lp:] = box
    score_mask &= answer.any(1, keepdim=True)
    s = grail_scores(model, ro.input_ids, ro.attention_mask, score_mask, answer, temperature=GRAIL_RUN["temperature"])
    rows = has_box & answer.any(1) & reweighted_rows(advantages, GRAIL_RUN["grail_rollout_symmetry"])
    run = {"spread": "grail_std", "center": "grail_mean", "w_min": "grail_w_min", "w_max": "grail_w_max"}
    w = grail_weights(s[:, cols], scored, rows, **{k: GRAIL_RUN[v] for k, v in run.items()}).weights * valid
    if not whole:
        return w
    w = w.masked_fill(span["content"], GRAIL_RUN["grail_w_max"])
    return w.masked_fill(span["marker"] | span["closing"] | (span["after"] & valid), GRAIL_RUN["grail_mean"])


def oar_g_matched(model, ro, draws: torch.Tensor) -> torch.Tensor:
    """oar's OAR-G (gradient_scores through the gate, as the oar-g method) given GRAIL's standard-normal draws
    (B, T, H) at GRAIL's positions, Lp - 1 + j for column j; oar noises only its reasoning positions of them.
    -> (B, T)."""
    s, lp, (b, width) = CreditSettings(), ro.prompt_width, ro.input_ids.shape
    noise = torch.zeros(b, width, draws.shape[-1])
    noise[:, lp - 1 : width - 1] = draws.float()
    scores = gradient_scores(
        model,
        ro.input_ids,
        ro.attention_mask,
        ro.reasoning_mask,
        ro.answer_mask,
        probe=s.probe,
        noise_std=s.noise_std,
        noise=noise,
    )
    return gate(s, scores, ro.reasoning_mask)[:, lp:]
