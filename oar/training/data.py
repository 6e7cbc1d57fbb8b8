"""Problems for training and evaluation: JSON Lines files, the built-in `arith` task, HF datasets.

A problem is a statement and its raw gold answer string; normalising or checking answers is the
rewards' job, not this module's. Every loader validates its whole input before returning, and a
bad input stops with a `DataError` that names the file, the line and the fix, so a long run never
starts on data it will choke on later.

One schema for JSON Lines files and hub data sets alike (the columns GSM8K, MATH and their copies
use, and TRL's): a row's problem is its key `problem`, else `question`, else TRL's `prompt` (a string, or a
conversation: an optional system turn, then one user turn), else `messages` (a conversation: an optional
system turn, one user turn, an optional assistant turn); its gold answer is `answer` (a GSM8K answer,
"... #### 18", cut to what follows `####`), else `solution` cut to its final answer (`reference_answer`:
the last `\\boxed{..}`, else what follows `####` or "the answer is"), else the final answer of a `messages`
row's assistant turn. A system turn is kept (`Problem.system`, the prompt's first turn: `problem_prompt`);
the row itself too (`Problem.row`: a TRL-style reward function is passed its columns). In a file, blank
lines are skipped. A step's prompts and rollout seeds (`step_prompts`:
`prompt_order`, `rollout_seeds`) are functions of the run's seed and the step alone, so a resumed run
and any process count see the same data.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from oar.answers import boxed_answer, extract_answer
from oar.sampler import format_prompt
from oar.tasks.arith import DEFAULT_ARITH, ArithConfig, arith_problems
from oar.tasks.problem import Problem

PROBLEM_KEYS = ("problem", "question", "prompt", "messages")  # a row's problem: the first of these it has
ANSWER_KEYS = ("answer", "solution")  # its gold answer: the first of these it has (a solution: its final answer)
CONVERSATIONAL = ("prompt", "messages")  # keys that may hold a conversation (a list of {role, content} turns)
_FIX = (
    "each line must be a JSON object with a string key 'problem' (or 'question', or TRL's 'prompt': a string or a "
    "conversation; or 'messages') and 'answer' (or 'solution')"
)


class DataError(ValueError):
    """A dataset input that cannot be used; the message names the input, the place and the fix."""


def _problem_from_record(record: Any, where: str) -> Problem:
    """Validate one row (already parsed from JSON or a dataset) and build its Problem.

    `where` names the row for error messages, e.g. 'data/train.jsonl:12'.
    """
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}; {_FIX}.")
    texts, system, reply = [], "", None
    for keys in (PROBLEM_KEYS, ANSWER_KEYS):
        present = [k for k in keys if k in record]  # a hub table gives every row every column, None where absent
        key = next((k for k in present if record[k] is not None), present[0] if present else None)
        if key is None and keys is ANSWER_KEYS and reply is not None:  # a messages row: its assistant turn's answer
            if not (gold := reference_answer(reply)):
                raise DataError(
                    f"{where}: no 'answer' key, and the assistant turn of 'messages' holds no final answer (no "
                    f"\\boxed{{..}}, '####' or 'the answer is'); add an 'answer' key or remove the row."
                )
            texts.append(gold)
            continue
        if key is None:
            others = "', '".join(keys[1:])
            raise DataError(
                f"{where}: missing key '{keys[0]}' (or '{others}'; keys present: {sorted(record)}); "
                f"{_FIX}. Add '{keys[0]}' or remove the row."
            )
        value = record[key]
        if key == "messages" or (key in CONVERSATIONAL and not isinstance(value, str)):
            system, value, reply = conversation(value, key, where)
        if not isinstance(value, str):
            raise DataError(
                f"{where}: key '{key}' must be a string, got {type(value).__name__} "
                f'({value!r:.40}); quote it, e.g. "{key}": "{value}".'
            )
        if key == "solution":
            value = reference_answer(value)
            if not value:
                raise DataError(
                    f"{where}: key 'solution' holds no final answer (no \\boxed{{..}}, '####' or 'the answer is'); "
                    f"add an 'answer' key or remove the row."
                )
        elif key == "answer":
            value = gsm8k_final_answer(value)
            if _worked_solution(value):  # in the answer field: its final answer
                value = reference_answer(value)
                if not value:
                    raise DataError(
                        f"{where}: key 'answer' holds a worked solution with no final answer (no \\boxed{{..}}, "
                        f"'####' or 'the answer is'); give the answer alone, or remove the row."
                    )
        if not value.strip():
            raise DataError(f"{where}: key '{key}' is empty; give it a value or remove the row.")
        texts.append(value)
    return Problem(problem=texts[0], answer=texts[1], system=system, row=dict(record))


def conversation(turns: Any, key: str, where: str) -> tuple[str, str, str | None]:
    """(system turn or '', user turn, assistant turn or None) of a conversational `prompt` or `messages` value:
    a list of {"role", "content"} turns, an optional system turn first, then one user turn, then (`messages`
    only: a reference reply) an optional assistant turn. Anything else is a DataError that says what is read."""
    shape = (
        f"key '{key}' must be {'a string or ' if key == 'prompt' else ''}a list of turns "
        f'{{"role": ..., "content": "..."}}: an optional system turn, one user turn'
        f"{', an optional assistant turn' if key == 'messages' else ''}"
    )
    if not isinstance(turns, list) or not all(
        isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str) for t in turns
    ):
        raise DataError(f"{where}: {shape} (string contents); got {turns!r:.80}.")
    roles = [t["role"] for t in turns]
    allowed = [["user"], ["system", "user"]]
    if key == "messages":
        allowed += [r + ["assistant"] for r in allowed]
    if roles not in allowed:
        raise DataError(
            f"{where}: {shape}; got the roles {roles}. Several user turns (few-shot examples) go into the one "
            f"user turn's text."
        )
    text = {t["role"]: t["content"] for t in turns}
    return text.get("system", ""), text["user"], text.get("assistant")


def problem_prompt(tokenizer, problem: Problem, instruction: str = "") -> str:
    """The prompt text of `problem`: oar.sampler.format_prompt's (the chat template when the tokenizer has one),
    with a conversational row's system turn first (in the template, else as a line above the problem)."""
    if not problem.system:
        return format_prompt(tokenizer, problem.problem, instruction)  # every problem without one: as before
    content = f"{problem.problem}\n{instruction}".strip() if instruction else problem.problem
    if getattr(tokenizer, "chat_template", None):
        if not takes_system_turn(tokenizer):  # its template refuses one (tiny-arith's, some Gemma's): run.py says so
            return format_prompt(tokenizer, f"{problem.system}\n\n{problem.problem}", instruction)
        turns = [{"role": "system", "content": problem.system}, {"role": "user", "content": content}]
        return tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    return f"{problem.system}\n{content}\n"


def takes_system_turn(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a system turn (some raise on one); True without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return True
    try:
        turns = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    except Exception:  # jinja2's TemplateError, or what the template raises itself
        return False
    return True


def reference_answer(solution: str) -> str:
    """A worked reference solution's final answer: its last `\\boxed{..}` (MATH's convention, whatever remark
    follows it), else what `oar.answers` finds ('####', "the answer is"); '' when there is none."""
    return boxed_answer(solution) or extract_answer(solution) or ""


def _worked_solution(answer: str) -> bool:
    """Whether an `answer` field holds a worked solution rather than the answer: a box, or a line break
    outside every brace group (`90\\text{ square\\nunits}` is one answer, its break LaTeX whitespace)."""
    if "\\boxed" in answer:
        return True
    depth = 0
    for ch in answer.strip():
        depth += (ch == "{") - (ch == "}")
        if ch == "\n" and depth <= 0:
            return True
    return False


def problems_digest(problems: list[Problem]) -> str:
    """A hash of the problems and their answers, in order: a resume checks that its training data is the
    checkpoint's (the data order is a permutation of their count)."""
    digest = hashlib.sha1()
    for p in problems:
        digest.update(p.problem.encode() + b"\0" + p.answer.encode() + b"\n")
        if p.system:  # a conversational row's system turn changes the prompt (none: the digest as before)
            digest.update(b"system\0" + p.system.encode() + b"\n")
    return digest.hexdigest()[:16]


def load_jsonl(path: str | Path) -> list[Problem]:
    """Every problem of a JSON Lines file, in file order. Raises DataError on any bad line."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise DataError(f"{path}: {what}; pass the path of a .jsonl file of problems.")
    problems: list[Problem] = []
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(
                        f"{path}:{lineno}: invalid JSON ({err.msg} at column "
                        f"{err.colno}); {_FIX}. Fix or remove the line."
                    ) from None
                problems.append(_problem_from_record(record, f"{path}:{lineno}"))
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); re-save the file as UTF-8."
        ) from None
    if not problems:
        raise DataError(f"{path}: no problems (the file is empty or only blank lines); {_FIX}.")
    return problems


def gsm8k_final_answer(answer: str) -> str:
    """The part after GSM8K's '#### ' marker ('... #### 18' -> '18'); other answers unchanged."""
    return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer


def problems_from_records(records: Iterable[dict], source: str) -> list[Problem]:
    """Problems from dataset rows (a Hugging Face dataset's), mapped as a file's lines are (module docstring)."""
    problems = [_problem_from_record(record, f"{source} row {index}") for index, record in enumerate(records)]
    if not problems:
        raise DataError(f"{source}: the dataset has no rows; check the name and the split.")
    return problems


def _load_hf(name: str, split: str) -> list[Problem]:
    """Problems of a Hugging Face dataset; 'owner/name:config' picks a config (e.g. gsm8k:main)."""
    import datasets  # optional dependency, only needed for hub datasets

    path, _, config = name.partition(":")
    _check_hub_dataset(name, path)
    try:
        rows = datasets.load_dataset(path, config or None, split=split)
    except Exception as err:  # the hub raises many types; all mean "cannot load this name"
        raise DataError(
            f"{name!r}: could not load it as a Hugging Face dataset (split {split!r}): "
            f"{type(err).__name__}: {err}. Check the name, config and split, or pass "
            f"a .jsonl path or 'arith'."
        ) from None
    return problems_from_records(rows, f"{name}[{split}]")


HUB_TIMEOUT_S = 5.0  # the one request that asks the hub whether an uncached data set exists


@functools.cache
def _check_hub_dataset(name: str, repo_id: str) -> None:
    """Stop in seconds on a data set name that is neither in the local Hugging Face cache nor on a reachable hub,
    as oar.training.models._check_hub does for a model: left to `datasets`, huggingface_hub retries every request
    with back-off (35-40 s measured without a network) before its error. A name in the cache is left to
    `datasets`, online or not; a hub that answers otherwise than "no such data set" too."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HFValidationError, HfHubHTTPError, RepositoryNotFoundError

    use = "check the name, or pass a .jsonl file, a folder with train.jsonl and test.jsonl, or 'arith'"
    import datasets

    cached = [  # the hub's download cache, and `datasets`' own of prepared tables
        Path(constants.HF_HUB_CACHE) / f"datasets--{repo_id.replace('/', '--')}",
        Path(datasets.config.HF_DATASETS_CACHE) / repo_id.replace("/", "___"),
    ]
    if any(c.is_dir() for c in cached) or constants.HF_HUB_OFFLINE:  # offline: `datasets` answers at once
        return
    try:
        HfApi().dataset_info(repo_id, timeout=HUB_TIMEOUT_S)
    except HFValidationError as err:
        raise DataError(f"{name!r}: not a data set name ({str(err).splitlines()[0][:200]}); {use}.") from None
    except (RepositoryNotFoundError, HfHubHTTPError) as err:
        if isinstance(err, RepositoryNotFoundError) or getattr(err.response, "status_code", None) == 404:
            raise DataError(
                f"{name!r}: no such data set on {constants.ENDPOINT} (or it is private: log in with "
                f"`hf auth login`); {use}."
            ) from None
    except Exception as err:  # no answer: a connection refused, a name not resolved, a timeout
        raise DataError(
            f"{name!r}: not in the local Hugging Face cache and {constants.ENDPOINT} is not reachable "
            f"({type(err).__name__}: {str(err)[:120]}); connect, set HF_ENDPOINT to a mirror, or {use}."
        ) from None


def load_problems(
    name: str, *, split: str = "train", limit: int | None = None, seed: int = 0, arith: ArithConfig | None = None
) -> list[Problem]:
    """Problems from `name`: 'arith', a .jsonl file, a folder holding `<split>.jsonl`, or a HF dataset.

    - 'arith': the built-in task (oar/tasks/arith.py) at difficulty `arith` (default DEFAULT_ARITH);
      `split` is 'train' or 'test'; `limit` problems (default 10,000 train / 500 test) drawn
      with `seed`.
    - a file or folder: `split` picks `<folder>/<split>.jsonl`; `limit` keeps the first rows, so an
      evaluation on a prefix is the same prefix everywhere. `seed` is not used.
    - otherwise, when the `datasets` package is installed, a hub dataset ('openai/gsm8k:main').
    """
    if limit is not None and limit < 1:
        raise DataError(f"load_problems({name!r}): limit must be >= 1 or None, got {limit}.")
    if name == "arith":
        if split not in ("train", "test"):
            raise DataError(f"arith: split must be 'train' or 'test', got {split!r}.")
        n = limit if limit is not None else (10_000 if split == "train" else 500)
        try:
            return arith_problems(n, split=split, seed=seed, config=arith or DEFAULT_ARITH)
        except ValueError as err:
            raise DataError(str(err)) from None
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / f"{split}.jsonl"
    if path.suffix == ".jsonl" or path.exists():
        return load_jsonl(path)[:limit]
    if importlib.util.find_spec("datasets") is None:
        raise DataError(
            f"{name!r}: not 'arith', not an existing .jsonl file or folder, and the `datasets` package "
            f"that hub names need is not installed (pip install -r requirements.txt); pass 'arith' or "
            f"a path to a .jsonl file, or install it."
        )
    return _load_hf(name, split)[:limit]


def run_problems(dataset: str, eval_dataset: str, *, train_size: int, eval_size: int, seed: int):
    """A run's (training problems, held-out problems): `dataset`'s train split (arith: `train_size` of
    them, drawn with `seed`), and `eval_dataset`'s test split (its first `eval_size`, 0: all), by default
    `dataset`'s own test split when it has one (arith's; a folder's test.jsonl), else none."""
    train = load_problems(dataset, split="train", limit=train_size if dataset == "arith" else None, seed=seed)
    folder = Path(dataset).expanduser()
    own = dataset == "arith" or (folder.is_dir() and (folder / "test.jsonl").is_file())  # its own test split
    eval_name = eval_dataset or (dataset if own else "")
    return train, load_problems(eval_name, split="test", limit=eval_size or None) if eval_name else []


def seen_in_training(train: list[Problem], held_out: list[Problem]) -> int:
    """How many held-out problems are also training problems (the same statement): a .jsonl file has no
    splits, so `--dataset f --eval_dataset f` holds out the training problems themselves, and a held-out
    accuracy on them measures memory, not generalisation. train.py says the count and records it."""
    seen = {p.problem.strip() for p in train}
    return sum(p.problem.strip() in seen for p in held_out)


def step_prompts(
    step: int, rank: int, local: int, n_problems: int, prompts_per_step: int, group_size: int, seed: int
) -> tuple[list[int], list[int]]:
    """This process's `local` prompts at `step` (indices into the problems, `prompt_order`) and one seed
    per rollout, G of them per prompt (`rollout_seeds`, from the prompts' global slots)."""
    slots = [step * prompts_per_step + rank * local + k for k in range(local)]
    idx = prompt_order(step, local, rank, n_problems, prompts_per_step, seed)
    return idx, rollout_seeds(seed, step, slots, group_size)


def prompt_order(step: int, local: int, rank: int, n_problems: int, prompts_per_step: int, seed: int) -> list[int]:
    """Indices of this process's prompts at `step`: epochs of seeded permutations, a function of the
    step alone (so a resumed run sees the same data), the global batch split in contiguous slices."""
    first = step * prompts_per_step + rank * local
    out = []
    for k in range(first, first + local):
        epoch, i = divmod(k, n_problems)
        out.append(int(np.random.default_rng([seed, epoch]).permutation(n_problems)[i]))
    return out


def rollout_seeds(seed: int, step: int, global_prompts: list[int], group_size: int) -> list[int]:
    """One seed per rollout, from (run seed, step, global prompt slot, sample): independent of
    which process or micro-batch the rollout lands in."""
    return [
        (seed * 1_000_003 + step) * 10_007 * group_size + p * group_size + g
        for p in global_prompts
        for g in range(group_size)
    ]
