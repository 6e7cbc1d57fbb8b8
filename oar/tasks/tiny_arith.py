"""The built-in policy `tiny-arith`: a ~1M-parameter Llama warm-started on `arith` in minutes on a CPU.

It exists so that every part of the project (sampling, GRPO, OAR-P, OAR-G, the tests, a real
learning curve) runs offline and fast, through exactly the code paths a hub model takes: the
saved folder loads with `AutoTokenizer` / `AutoModelForCausalLM.from_pretrained(dir)`.

- Tokenizer: one token per character (printable ASCII and newline) plus `<pad>`, `<eos>`,
  `<unk>`, built with `tokenizers` and wrapped in `PreTrainedTokenizerFast`. No BOS, nothing added
  around the text, no clean-up on decode, so `decode(encode(s)) == s` for every ASCII string, and
  every digit of an answer is its own token (the answer span of maths §0 is one token per digit).
  Its padding side is left, as generation needs.
- Chat template: a user turn renders as `Q: <problem>\\n`, the generation prompt is `A:\\n`, an
  assistant turn is its content then `<eos>`. The model is trained to complete
  `Q: Compute (3 + 4) * 2.\\nA:\\n` with `sft_target` (a worked solution) and `<eos>`.
- Warm start: a fixed number of supervised steps (AdamW, loss on completion tokens only) on arith
  TRAIN problems of 1-3 operations (in practice ~5% have one: there are only ~2k distinct
  one-operation expressions). Partly competent on purpose, in two ways:
  * its arithmetic facts are partly learned (the steps fit the build budget, not convergence;
    seed 0 gets 42% of held-out 2-operation problems right, seed 1 94%);
  * it imitates a flawed teacher: on 75% of the 3-operation problems the target stops one line
    early and gives that line's result as the answer (`sft_target`). Greedy decoding inherits the
    habit on every 3-operation problem; sampling at temperature 1 still finishes the work on some
    of them, and only those rollouts are rewarded. That is the gap RL is meant to close: a
    systematic, answer-deciding mistake that reward alone reveals, as premature final answers are
    for real models, so that a CPU-sized run shows RL improving the policy (docs/default-run.md).
- Deterministic from `seed` (torch.manual_seed for the weights, the arith seed for the data
  order) for a given number of threads; the build is CPU-only on purpose for that reason.

The cache folder is named by BUILDER_VERSION: bump it whenever the recipe, the tokenizer or the
task changes, so a stale model is rebuilt rather than silently reused.
"""

from __future__ import annotations

import contextlib
import math
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from oar.tasks.arith import DEFAULT_ARITH, ArithConfig, arith_problems, arith_solution
from oar.tasks.problem import Problem
from oar.tasks.teacher import pad_lines, slip_lines

BUILDER_VERSION = "tiny-arith-v4"
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")  # ids 0, 1, 2
CHARACTERS = tuple(chr(c) for c in range(32, 127)) + ("\n",)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{ 'Q: ' + message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ 'A:\\n' + message['content'] + eos_token }}"
    "{%- else -%}{{ raise_exception('tiny-arith knows only user and assistant turns, got ' "
    "+ message['role'] + '; put the instructions in the user turn.') }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'A:\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class TinyArithRecipe:
    """How tiny-arith is built. The defaults are the published model; tests shrink them."""

    hidden_size: int = 128
    """Width of the residual stream; the MLP is 4x wider."""
    num_layers: int = 3
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads (no grouped-query sharing)."""
    steps: int = 1300
    """Optimizer steps of supervised training (the cosine schedule ends here); sized to fit the
    build budget (~5 min on 2 cores), which leaves the arithmetic facts partly learned."""
    batch_size: int = 64
    """Problems per step; each is seen once (the train problems are distinct)."""
    lr: float = 3e-3
    """Peak AdamW learning rate, reached after `warmup_steps`, then cosine decay to 10%."""
    warmup_steps: int = 50
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    train_arith: ArithConfig = field(default_factory=lambda: ArithConfig(min_ops=1, max_ops=3))
    """Difficulty of the supervised problems: DEFAULT_ARITH plus some 1-operation ones."""
    lazy_ops: int = 3
    """Problems with at least this many operations are sometimes solved lazily (below)."""
    lazy_rate: float = 0.75
    """Share of those supervised problems whose target stops one line early and gives that line's
    result as the answer (almost always wrong): the flaw in the warm start that RL can find and fix."""
    slip_rate: float = 0.0
    """Share of worked lines whose result the teacher writes with its last digit off by one, carried
    forward to the answer (oar/tasks/teacher.py: the `slip` testbed). 0: none (v4)."""
    filler: str = ""
    """Phrase the teacher writes at the start of every worked line, which cannot change the answer
    (oar/tasks/teacher.py: the `filler` testbed). Empty: none (v4)."""
    eval_arith: ArithConfig = DEFAULT_ARITH
    """Difficulty at which the held-out accuracy in build_info.json is measured."""
    eval_problems: int = 500
    """Held-out (test split) problems for the accuracy estimate (binomial sd ~2 points at 500)."""
    num_threads: int = 2
    """torch threads during the build; recorded and fixed because a kernel may split a reduction by thread
    and round otherwise (on the project's 2-core x86 machine 1 and 2 threads gave bitwise the same weights
    over 40 steps of this recipe, checked in Nov. 2026; another CPU need not). Two: 1.65x faster per step
    than one on a quiet 2-core machine (busy cores wait on each other)."""

    def __post_init__(self):
        if not 0.0 <= self.slip_rate <= 1.0 or any(ch.isdigit() or ch in "#=\n" for ch in self.filler):
            raise ValueError(
                f"TinyArithRecipe: need 0 <= slip_rate <= 1 and a filler without digits, '#', '=' or "
                f"newlines (it must not look like a result or an answer), got {self.slip_rate}, {self.filler!r}."
            )
        if self.lazy_ops < 2 or not 0.0 <= self.lazy_rate <= 1.0:
            raise ValueError(
                f"TinyArithRecipe: need lazy_ops >= 2 (a lazy solution keeps at least one line) and "
                f"0 <= lazy_rate <= 1, got lazy_ops={self.lazy_ops}, lazy_rate={self.lazy_rate}."
            )


def make_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer, with pad/eos/unk, the chat template and left padding."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # 1 char = 1 token
    core.decoder = decoders.Fuse()  # join tokens with nothing between them (WordLevel adds spaces)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )  # keep " ." and " *" as is
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_model(tok: PreTrainedTokenizerFast, recipe: TinyArithRecipe) -> LlamaForCausalLM:
    """A freshly initialised small Llama with tied embeddings, sized by `recipe`."""
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=recipe.hidden_size,
        intermediate_size=4 * recipe.hidden_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def prompt_text(tok: PreTrainedTokenizerFast, problem: str) -> str:
    """The prompt the model sees for `problem`: its chat template with the generation prompt."""
    return tok.apply_chat_template([{"role": "user", "content": problem}], add_generation_prompt=True, tokenize=False)


def sft_target(problem: Problem, recipe: TinyArithRecipe) -> str:
    """The supervised completion: the worked solution, or for a fixed share of the longer problems
    (chosen by a hash of the text, so a problem always gets the same) the lazy one that skips the
    last line and answers with the line before: `37 + 8 = 45\\n45 - 5 = 40\\n#### 40`. Then the
    slips and the filler of the other testbeds, if the recipe has them (oar/tasks/teacher.py)."""
    lines = arith_solution(problem).split("\n")  # one line per operation, then `#### N`
    lazy = (
        len(lines) - 1 >= recipe.lazy_ops
        and zlib.crc32(b"lazy:" + problem.problem.encode()) % 10_000 < recipe.lazy_rate * 10_000
    )
    if lazy:
        lines = lines[:-2] + [f"#### {lines[-3].rsplit('= ', 1)[1]}"]
    return "\n".join(pad_lines(slip_lines(lines, problem.problem, recipe.slip_rate), recipe.filler))


def sft_batch(
    tok: PreTrainedTokenizerFast, problems: list[Problem], recipe: TinyArithRecipe
) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask, labels (B, T); labels are -100 off the completion.

    The completion is `sft_target` and `<eos>`: stopping is learned like any token.
    """
    prompts = tok([prompt_text(tok, p.problem) for p in problems]).input_ids
    completions = tok([sft_target(p, recipe) for p in problems]).input_ids
    rows = [(p, c + [tok.eos_token_id]) for p, c in zip(prompts, completions)]
    width = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), width), tok.pad_token_id)  # (B, T)
    labels = torch.full((len(rows), width), -100)  # (B, T)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    for i, (p, c) in enumerate(rows):
        input_ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
        attention_mask[i, : len(p) + len(c)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def final_answer(completion: str) -> str | None:
    """The text after the last '####' up to the end of its line, stripped; None without a marker."""
    if "####" not in completion:
        return None
    return completion.rsplit("####", 1)[1].split("\n", 1)[0].strip()


@torch.no_grad()
def greedy_accuracy(model, tok, problems: list[Problem], *, max_new_tokens: int, batch_size: int = 256) -> float:
    """Fraction of `problems` whose greedy completion's final answer equals the gold exactly."""
    model.eval()
    correct = 0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        enc = tok([prompt_text(tok, p.problem) for p in chunk], return_tensors="pt", padding=True, padding_side="left")
        out = model.generate(
            **enc,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        texts = tok.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
        correct += sum(final_answer(t) == p.answer for t, p in zip(texts, chunk))
    return correct / len(problems)


def max_new_tokens_for(config: ArithConfig, filler: str = "") -> int:
    """A bound on a solution's length: a line per op ("99 - 9 = 90\n" is 12, plus the filler) and "#### N<eos>"."""
    return (20 + len(filler)) * config.max_ops + 16


def train(
    model, tok, problems: list[Problem], recipe: TinyArithRecipe, log: Callable[[str], None] | None = None
) -> list[float]:
    """Supervised training, one step per `batch_size` problems in order (they are distinct, so every
    step sees new ones), for `recipe.steps` steps. Returns the step losses."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=recipe.weight_decay
    )

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine from 1 to 0.1 at `steps`
        if step < recipe.warmup_steps:
            return (step + 1) / recipe.warmup_steps
        progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    losses, started = [], time.perf_counter()
    for step in range(1, recipe.steps + 1):
        batch = sft_batch(tok, problems[(step - 1) * recipe.batch_size : step * recipe.batch_size], recipe)
        loss = model(**batch).loss  # mean over the batch's completion tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log and step % 100 == 0:
            log(
                f"tiny-arith: step {step}/{recipe.steps}, loss {loss.item():.3f}, "
                f"{time.perf_counter() - started:.0f} s"
            )
    return losses


@contextlib.contextmanager
def _torch_threads(n: int):
    """Run with `n` torch threads, then restore the caller's setting (it is process-global)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_tiny_arith(seed: int, recipe: TinyArithRecipe, log: Callable[[str], None] | None):
    """The model, its tokenizer and the build facts (accuracy, steps, times) of one training run."""
    started, cpu_started = time.perf_counter(), time.process_time()
    with _torch_threads(recipe.num_threads):
        torch.manual_seed(seed)
        tok = make_tokenizer()
        model = make_model(tok, recipe)
        problems = arith_problems(
            recipe.steps * recipe.batch_size, split="train", seed=seed, config=recipe.train_arith
        )
        losses = train(model, tok, problems, recipe, log)
        train_s = time.perf_counter() - started
        held_out = arith_problems(recipe.eval_problems, split="test", seed=seed, config=recipe.eval_arith)
        accuracy = greedy_accuracy(
            model, tok, held_out, max_new_tokens=max_new_tokens_for(recipe.eval_arith, recipe.filler)
        )
    if log and not 0.15 <= accuracy <= 0.6:
        log(
            f"tiny-arith: warning: held-out accuracy {accuracy:.1%} is outside the intended 15-60% "
            f"(partly competent, room for RL); this seed or recipe gives a different model than the default."
        )
    info = {
        "builder": BUILDER_VERSION,
        "seed": seed,
        "recipe": asdict(recipe),
        "heldout_accuracy": accuracy,
        "heldout_problems": len(held_out),
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "train_seconds": round(train_s, 1),
        "build_seconds": round(time.perf_counter() - started, 1),
        # CPU time too: on a shared machine the wall time says more about the neighbours.
        "build_cpu_seconds": round(time.process_time() - cpu_started, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tok),
        "torch_threads": recipe.num_threads,
    }
    return model, tok, info
