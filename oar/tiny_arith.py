"""The built-in policy `tiny-arith`: a ~1M-parameter Llama warm-started on `arith` in minutes on a CPU.

It exists so that every part of the project (sampling, GRPO, OAR-P, OAR-G, the tests, a real
learning curve) runs offline and fast, through exactly the code paths a hub model takes: the
saved folder loads with `AutoTokenizer` / `AutoModelForCausalLM.from_pretrained(dir)`.

- Tokenizer: one token per character (printable ASCII and newline) plus `<pad>`, `<eos>`,
  `<unk>`, built with `tokenizers` and wrapped in `PreTrainedTokenizerFast`. No BOS, nothing added
  around the text, no clean-up on decode, so `decode(encode(s)) == s` for every ASCII string, and
  every digit of an answer is its own token (the answer span of SPEC §2 is one token per digit).
  Its padding side is left, as generation needs.
- Chat template: a user turn renders as `Q: <problem>\\n`, the generation prompt is `A:\\n`, an
  assistant turn is its content then `<eos>`. The model is trained to complete
  `Q: Compute (3 + 4) * 2.\\nA:\\n` with the worked solution of `arith_solution` and `<eos>`.
- Warm start: supervised training (AdamW, loss on completion tokens only) on arith TRAIN problems
  of 1-3 operations (in practice ~5% have one: there are only ~2k distinct one-operation
  expressions), until greedy accuracy on held-apart validation problems of the default RL/eval
  difficulty (DEFAULT_ARITH, 2-3 operations) reaches 30%, or at most `steps`. Partly competent on
  purpose: most groups of rollouts then have mixed rewards, and RL has room to improve.
- Deterministic from `seed` (torch.manual_seed for the weights, the arith seed for the data
  order) for a given number of threads; the build is CPU-only on purpose for that reason.

The cache folder is named by BUILDER_VERSION: bump it whenever the recipe, the tokenizer or the
task changes, so a stale model is rebuilt rather than silently reused.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from oar.arith import DEFAULT_ARITH, ArithConfig, arith_problems, arith_solution, unseen_problems
from oar.data import Problem

BUILDER_VERSION = "tiny-arith-v3"
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
    steps: int = 900
    """Most optimizer steps of supervised training (the cosine schedule ends here); sized so the
    worst case fits the build budget. Training usually stops earlier, at `target_accuracy`."""
    target_accuracy: float = 0.3
    """Stop at the first check whose greedy validation accuracy reaches this: partly competent."""
    first_check: int = 400
    """No check before this step: each costs ~2 s, and our runs were under 10% before step 500."""
    check_every: int = 50
    """Steps between accuracy checks."""
    validation_problems: int = 200
    """Problems per check (train split, eval difficulty, none trained on)."""
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
    eval_arith: ArithConfig = DEFAULT_ARITH
    """Difficulty at which the held-out accuracy in build_info.json is measured."""
    eval_problems: int = 500
    """Held-out (test split) problems for the accuracy estimate (binomial sd ~2 points at 500)."""
    num_threads: int = 1
    """torch threads during the build; fixed because the float results depend on it. One, because
    on shared cores two threads ran up to 10x slower per step (they wait on each other)."""


def make_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer, with pad/eos/unk, the chat template and left padding."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # 1 char = 1 token
    core.decoder = decoders.Fuse()  # join tokens with nothing between them (WordLevel adds spaces)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>", padding_side="left",
                                  clean_up_tokenization_spaces=False)  # keep " ." and " *" as is
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_model(tok: PreTrainedTokenizerFast, recipe: TinyArithRecipe) -> LlamaForCausalLM:
    """A freshly initialised small Llama with tied embeddings, sized by `recipe`."""
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=recipe.hidden_size,
        intermediate_size=4 * recipe.hidden_size, num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_heads,
        max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def prompt_text(tok: PreTrainedTokenizerFast, problem: str) -> str:
    """The prompt the model sees for `problem`: its chat template with the generation prompt."""
    return tok.apply_chat_template([{"role": "user", "content": problem}],
                                   add_generation_prompt=True, tokenize=False)


def sft_batch(tok: PreTrainedTokenizerFast, problems: list[Problem]) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask, labels (B, T); labels are -100 off the completion.

    The completion is the worked solution and `<eos>`: stopping is learned like any token.
    """
    prompts = tok([prompt_text(tok, p.problem) for p in problems]).input_ids
    completions = tok([arith_solution(p) for p in problems]).input_ids
    rows = [(p, c + [tok.eos_token_id]) for p, c in zip(prompts, completions)]
    width = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), width), tok.pad_token_id)  # (B, T)
    labels = torch.full((len(rows), width), -100)  # (B, T)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    for i, (p, c) in enumerate(rows):
        input_ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
        attention_mask[i, :len(p) + len(c)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def final_answer(completion: str) -> str | None:
    """The text after the last '####' up to the end of its line, stripped; None without a marker."""
    if "####" not in completion:
        return None
    return completion.rsplit("####", 1)[1].split("\n", 1)[0].strip()


@torch.no_grad()
def greedy_accuracy(model, tok, problems: list[Problem], *, max_new_tokens: int,
                    batch_size: int = 256) -> float:
    """Fraction of `problems` whose greedy completion's final answer equals the gold exactly."""
    model.eval()
    correct = 0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        enc = tok([prompt_text(tok, p.problem) for p in chunk], return_tensors="pt",
                  padding=True, padding_side="left")
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        texts = tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        correct += sum(final_answer(t) == p.answer for t, p in zip(texts, chunk))
    return correct / len(problems)


def max_new_tokens_for(config: ArithConfig) -> int:
    """A bound on a solution's length: a line per op ("99 - 9 = 90\n" is 12) and "#### N<eos>"."""
    return 20 * config.max_ops + 16


def train(model, tok, problems: list[Problem], validation: list[Problem], recipe: TinyArithRecipe,
          log: Callable[[str], None] | None = None) -> tuple[list[float], dict[int, float]]:
    """Supervised training until `validation` accuracy reaches the target or `steps` run out.

    One step per `batch_size` problems in order: they are distinct, so every step sees new ones.
    Every `check_every` steps from `first_check` on, greedy accuracy on `validation` is measured
    and training stops at the first check that reaches `target_accuracy`. Why a target and not a
    fixed step count: this model's accuracy rises steeply and at a step that varies a lot with the
    seed and even the thread count (19% to 71% at 800-900 steps in our runs); stopping on a target
    makes "partly competent" hold for every seed. Returns the step losses and {step: accuracy}.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98),
                                  weight_decay=recipe.weight_decay)

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine from 1 to 0.1 at `steps`
        if step < recipe.warmup_steps:
            return (step + 1) / recipe.warmup_steps
        progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    losses, checks, started = [], {}, time.perf_counter()
    for step in range(1, recipe.steps + 1):
        model.train()
        batch = sft_batch(tok, problems[(step - 1) * recipe.batch_size:step * recipe.batch_size])
        loss = model(**batch).loss  # mean over the batch's completion tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step >= recipe.first_check and step % recipe.check_every == 0:
            checks[step] = greedy_accuracy(model, tok, validation,
                                           max_new_tokens=max_new_tokens_for(recipe.eval_arith))
        if log and (step % 100 == 0 or step in checks):
            accuracy = f", validation accuracy {checks[step]:.1%}" if step in checks else ""
            log(f"tiny-arith: step {step}/{recipe.steps}, loss {loss.item():.3f}{accuracy}, "
                f"{time.perf_counter() - started:.0f} s")
        if step in checks and checks[step] >= recipe.target_accuracy:
            break
    return losses, checks


@contextlib.contextmanager
def _torch_threads(n: int):
    """Run with `n` torch threads, then restore the caller's setting (it is process-global)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def validation_problems(train_problems: list[Problem], recipe: TinyArithRecipe,
                        seed: int) -> list[Problem]:
    """Problems of the stopping check: eval difficulty, TRAIN split, none that training sees.

    From the train split so the test split stays untouched by model selection; drawn with another
    seed and filtered, because the supervised problems cover much of the 2-operation space.
    """
    return unseen_problems(recipe.validation_problems, {p.problem for p in train_problems},
                           pool=3 * recipe.validation_problems, seed=seed + 10_000, config=recipe.eval_arith)


def train_tiny_arith(seed: int, recipe: TinyArithRecipe, log: Callable[[str], None] | None):
    """The model, its tokenizer and the build facts (accuracy, steps, times) of one training run."""
    started, cpu_started = time.perf_counter(), time.process_time()
    with _torch_threads(recipe.num_threads):
        torch.manual_seed(seed)
        tok = make_tokenizer()
        model = make_model(tok, recipe)
        problems = arith_problems(recipe.steps * recipe.batch_size, split="train", seed=seed,
                                  config=recipe.train_arith)
        validation = validation_problems(problems, recipe, seed)
        losses, checks = train(model, tok, problems, validation, recipe, log)
        train_s = time.perf_counter() - started
        held_out = arith_problems(recipe.eval_problems, split="test", seed=seed,
                                  config=recipe.eval_arith)
        accuracy = greedy_accuracy(model, tok, held_out,
                                   max_new_tokens=max_new_tokens_for(recipe.eval_arith))
    if log and max(checks.values(), default=0.0) < recipe.target_accuracy:
        log(f"tiny-arith: warning: validation accuracy never reached {recipe.target_accuracy:.0%} "
            f"in {recipe.steps} steps; the model is weaker than intended.")
    info = {
        "builder": BUILDER_VERSION, "seed": seed, "recipe": asdict(recipe),
        "heldout_accuracy": accuracy, "heldout_problems": len(held_out),
        "steps_run": len(losses), "validation_accuracy": checks,
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "train_seconds": round(train_s, 1),
        "build_seconds": round(time.perf_counter() - started, 1),
        # CPU time too: on a shared machine the wall time says more about the neighbours.
        "build_cpu_seconds": round(time.process_time() - cpu_started, 1),
        "parameters": sum(p.numel() for p in model.parameters()), "vocab_size": len(tok),
        "torch_threads": recipe.num_threads,
    }
    return model, tok, info
