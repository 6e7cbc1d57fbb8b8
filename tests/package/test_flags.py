"""train.py's and eval.py's command lines: help that is true and fast, other libraries' names, one line per
bad value, and one source for every default (oar/training/config.py, oar/credit_settings.py)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys

import pytest

import eval as evaluation
from oar.credit_settings import CreditSettings
from oar.training.config import ALIASES, GONE, REMOVED, SHOWN_IN, TITLES, Config, parse_args, parser
from oar.training.resume import RESUMABLE, check_resume, from_record
from oar.training.flags import field_docs
from tinyrun import ROOT, env

FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _help(script: str) -> str:
    proc = subprocess.run(
        [sys.executable, script, "--help"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_help_loads_neither_torch_nor_transformers():
    """--help and a bad flag answer before the heavy imports: what makes them take a fraction of a second."""
    for script, args in (("train.py", ["--help"]), ("eval.py", ["--help"]), ("train.py", ["--group_size", "x"])):
        code = (
            f"import runpy, sys\nsys.argv = [{script!r}, *{args!r}]\n"
            f"try:\n    runpy.run_path({script!r}, run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'accelerate', 'numpy', 'matplotlib') "
            "if m in sys.modules))"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60
        )
        assert proc.stdout.strip().splitlines()[-1] == "[]", (script, args, proc.stdout, proc.stderr)


def test_every_field_has_a_docstring_and_one_group():
    docs = field_docs(Config)
    assert set(docs) == set(FIELDS), set(FIELDS) - set(docs)
    assert all(len(d) > 10 for d in docs.values())
    groups = parser().groups(TITLES, SHOWN_IN)  # each field under its declaring class's title
    placed = [n for names in groups.values() for n in names]
    assert sorted(placed) == sorted(FIELDS) and list(groups) == list(TITLES)  # every group in --help, in order
    text = _help("train.py")
    assert all(f"\n{title}:\n" in text for title in TITLES)
    assert len(FIELDS) <= 45  # a user sets 45 flags; the knobs no run turned are constants (REMOVED)


def test_every_former_flag_says_where_it_went():
    """A flag that became a constant (or moved to the launch) is refused with one line that says what the run
    does instead, never taken silently; an old run's config.json that holds it still resumes at its value."""
    assert set(REMOVED) <= set(GONE) and not set(GONE) & set(FIELDS)
    for name in ("score_all", "probe", "perturb_mode"):  # still flags
        assert name in FIELDS


def test_the_choices_a_docstring_lists_are_the_code_s():
    from oar.credit import METHODS
    from oar.oar_perturb import MODES
    from oar.probes import PROBES
    from oar.sampler import DECODE_LOOPS

    docs = field_docs(Config)
    eval_docs = field_docs(evaluation.EvalConfig)
    for name, choices, docs_of in (
        ("method", METHODS, docs),
        ("probe", PROBES, docs),
        ("decode_loop", DECODE_LOOPS, eval_docs),
        ("perturb_mode", MODES, docs),
    ):
        for choice in choices:
            assert re.search(rf"(^|[\s:|]){re.escape(choice)}([\s|(,.;]|$)", docs_of[name]), (name, choice)
    assert "built on first use" not in _help("train.py")  # tiny-arith ships (oar/tasks/tiny-arith/)


def _shown(help_text: str) -> dict[str, str]:
    """{flag: the default --help shows for it}."""
    text = " ".join(help_text.split())
    return dict(re.findall(r"--(\w+) [A-Z_]+(?:, --\w+ [A-Z_]+)* .*?\(default: (.*?)\)", text))


def test_help_shows_each_default_of_the_config():
    text = " ".join(_help("train.py").split())
    for name, f in FIELDS.items():
        if f.type in ("bool", bool):
            word = "on" if f.default else "off"
            assert f"--{name} [BOOL]" in text and f"(default: {word}; --no_{name} turns it off)" in text, name
        else:
            m = re.search(rf"--{name} {name.upper()}\b.*?\(default: (.*?)\)", text)
            assert m, name
            assert m.group(1) == (repr(f.default) if f.default == "" else str(f.default)), (
                name,
                m.group(1),
                f.default,
            )


@pytest.mark.parametrize("name", [n for n, f in FIELDS.items() if f.type in ("bool", bool)])
def test_boolean_pairs_do_what_they_say(name):
    assert getattr(parse_args([f"--{name}"]), name) is True
    assert getattr(parse_args([f"--no_{name}"]), name) is False
    assert getattr(parse_args([f"--{name}", "false"]), name) is False
    assert getattr(parse_args([f"--{name}=true"]), name) is True
    assert getattr(parse_args([]), name) is FIELDS[name].default


ALIASED = [  # TRL's (or transformers') spelling -> this project's
    (["--num_generations", "4"], ["--group_size", "4"]),
    (["--max_completion_length", "128"], ["--max_new_tokens", "128"]),
    (["--beta", "0.04"], ["--kl_beta", "0.04"]),
    (["--epsilon", "0.3"], ["--clip_low", "0.3", "--clip_high", "0.3"]),  # TRL: epsilon_high defaults to epsilon
    (["--epsilon", "0.2", "--epsilon_high", "0.28"], ["--clip_low", "0.2", "--clip_high", "0.28"]),
    (["--epsilon_high", "0.28", "--epsilon", "0.2"], ["--clip_low", "0.2", "--clip_high", "0.28"]),
    (["--epsilon", "0.1", "--clip_high", "0.28"], ["--clip_low", "0.1", "--clip_high", "0.28"]),
    (["--loss_type", "grpo"], ["--aggregation", "seq_mean"]),
    (["--loss_type", "dapo"], ["--aggregation", "token_mean"]),
    (["--mask_truncated_completions"], ["--mask_truncated"]),
    (["--report_to", "none"], []),
    (["--report_to", "tensorboard"], ["--log_with", "tensorboard"]),
    (["--model_name_or_path", "m"], ["--model", "m"]),
    (["--dataset_name", "d"], ["--dataset", "d"]),
    (["--torch_dtype", "bfloat16"], ["--dtype", "bfloat16"]),
    (["--save_steps", "7"], ["--save_every", "7"]),
    (["--eval_steps", "9"], ["--eval_every", "9"]),
    (["--scale_rewards", "batch"], ["--advantage_scale", "batch"]),
    (["--scale_rewards", "true"], ["--advantage_scale", "group"]),  # TRL's boolean spellings
    (["--scale_rewards", "false"], ["--advantage_scale", "none"]),
]


@pytest.mark.parametrize("theirs, ours", ALIASED, ids=lambda a: " ".join(a))
def test_other_libraries_names_set_the_same_config(theirs, ours):
    assert parse_args(theirs) == parse_args(ours)


def test_every_alias_is_tested_and_documented():
    tested = {a[0].removeprefix("--") for theirs, _ in ALIASED for a in [theirs]}
    assert {a.name for a in ALIASES} == tested
    page = (ROOT / "docs" / "flags.md").read_text()
    for a in ALIASES:
        assert re.search(rf"`--{a.name}[` ]", page) and re.search(rf"`--{a.target}[` ]", page), a.name
    assert "docs/flags.md" in (ROOT / "README.md").read_text()


def test_eval_py_takes_train_py_s_evaluation_names_and_its_old_ones():
    old = evaluation.parser().parse(
        ["--limit", "8", "--num_samples", "4", "--temperature", "0.7", "--batch_size", "6", "--top_p", "0.9"]
    )
    new = evaluation.parser().parse(
        [
            "--eval_size",
            "8",
            "--eval_samples",
            "4",
            "--eval_temperature",
            "0.7",
            "--eval_batch_size",
            "6",
            "--eval_top_p",
            "0.9",
        ]
    )
    assert old == new
    shared = {f.name for f in dataclasses.fields(evaluation.EvalConfig)} & set(FIELDS)
    assert {"eval_size", "eval_samples", "eval_temperature", "max_new_tokens", "model"} <= shared
    for name in shared - {"output_dir", "dataset"}:  # one declaration: the same default and help
        assert evaluation.EvalConfig.__dataclass_fields__[name].default == FIELDS[name].default, name


BAD = [  # argv -> what the one line must name (as the user typed it); refused while parsing, before torch loads
    (["--group_size", "x"], "--group_size"),
    (["--learning_rate", "fast"], "--learning_rate"),
    (["--resume", "maybe"], "--resume"),
    (["--loss_type", "bnpo"], "--loss_type"),
    (["--per_device_train_batch_size", "4"], "--per_device_train_batch_size"),
    (["--gradient_accumulation_steps", "4"], "--gradient_accumulation_steps"),
    (["--use_vllm"], "--rollout_backend vllm"),  # TRL's switch: the error names ours
    (["--no_such_flag", "1"], "--no_such_flag"),
    (["--gate_floor", "0.2"], "--gate_floor is no longer a flag"),  # a constant now: refused, not ignored
    (["--no_preserve_mass"], "--preserve_mass is no longer a flag: the gate always keeps"),
    (["--fsdp"], "--fsdp is no longer a flag: launch with `accelerate launch --config_file configs/fsdp2.yaml"),
    (["--collective_timeout", "60"], "set OAR_COLLECTIVE_TIMEOUT=<seconds>"),
    (["--deepspeed", "ds.json"], "--deepspeed is not a flag here"),  # not "did you mean --seed?"
    (["--lr_scheduler_type", "cosine"], "--lr_scheduler_type is not a flag here"),  # not --torch_dtype
    # refused by check_config, after the accelerator starts, before anything loads
    (["--num_generations", "1"], "--num_generations 1"),
    (["--dtype", "float33"], "--dtype float33"),
]
CHECKED = [  # the same through check_config in this process (a child each costs torch's import)
    (["--group_size", "1"], "--group_size 1"),
    (["--method", "ppo"], "--method ppo"),
    (["--beta", "-1"], "--beta -1.0"),
    (["--epsilon", "1.5"], "--epsilon 1.5"),
    (["--epsilon", "-0.1"], "--epsilon -0.1"),  # it sets clip_high too: named once, not twice
    (["--max_completion_length", "0"], "--max_completion_length 0"),
    (["--eval_size", "-1"], "--eval_size -1"),
    (["--eval_steps", "-1"], "--eval_steps -1"),
    (["--noise_std", "0"], "--noise_std 0"),  # OAR-G's default probe would score float rounding
    (["--temperature", "inf"], "--temperature inf"),
    (["--learning_rate", "inf"], "--learning_rate inf"),
    (["--eval_temperature", "inf", "--eval_samples", "2"], "--eval_temperature inf"),
    (["--dtype", "int8"], "--dtype int8: the weights' floating-point dtype"),  # a torch dtype, but no weights' dtype
    (["--dtype", "float8_e4m3fn"], "--dtype float8_e4m3fn"),
]


def test_noise_std_0_is_taken_where_nothing_needs_the_noise():
    from oar.training.checks import check_config

    for argv in (["--noise_std", "0", "--probe", "answer_joint"], ["--noise_std", "0", "--method", "oar-p"]):
        check_config(parse_args(argv), num_processes=1)


@pytest.mark.parametrize(
    "argv",
    [
        ["--num_generations", "4", "--group_size", "8"],
        ["--epsilon", "0.2", "--clip_low", "0.3"],
        ["--beta", "0.04", "--kl_beta", "0"],
        ["--loss_type", "dapo", "--aggregation", "token_mean"],
    ],
    ids=" ".join,
)
def test_a_setting_under_two_of_its_names_is_refused(argv, capsys):
    """TRL's name and ours for one setting: which was meant is a guess (`--epsilon 0.2 --clip_low 0.3` made
    both bounds 0.3, `--num_generations 4 --group_size 8` took 8), so neither is taken."""
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "give one of them" in capsys.readouterr().err


def _one_line(proc, script, named):
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode in (1, 2), (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{script}: error: ") and named in lines[0], lines[0]


@pytest.mark.parametrize("argv, named", BAD, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_a_bad_value_stops_with_one_line_that_names_its_flag(argv, named, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "train.py", *argv, "--output_dir", str(out)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    _one_line(proc, "train.py", named)
    assert not out.exists()


@pytest.mark.parametrize("argv, named", CHECKED, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_a_bad_value_is_named_as_typed_by_the_checks(argv, named):
    from oar.training.checks import check_config

    with pytest.raises(ValueError) as err:
        check_config(parse_args(argv), num_processes=1)
    lines = parser().as_typed(str(err.value), argv).splitlines()
    assert len(lines) == 1 and named in lines[0], lines


def test_eval_py_names_a_bad_value_as_typed(tmp_path):
    out = tmp_path / "out"
    for argv, named in (
        (["--num_samples", "4"], "--num_samples 4 / --eval_temperature 0.0"),
        (["--batch_size", "none"], "--batch_size"),
    ):
        proc = subprocess.run(
            [sys.executable, "eval.py", *argv, "--output_dir", str(out)],
            cwd=ROOT,
            env=env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        _one_line(proc, "eval.py", named)
    assert not out.exists()
    for argv, named in (
        (["--limit", "-1"], "--limit -1"),
        (["--eval_top_p", "0"], "--eval_top_p 0.0"),
        (["--temperature", "-1"], "--temperature -1.0"),
    ):
        lines = evaluation.check(evaluation.parser().parse(argv))
        assert len(lines) == 1 and named in evaluation.parser().as_typed(lines[0], argv), lines


# -- one source of settings ----------------------------------------------------------------------


def test_credit_settings_are_the_config_s_own():
    cfg = parse_args(["--method", "oar-p", "--gate_quantile", "0.25", "--perturb_mode", "window", "--group_size", "4"])
    s = cfg.credit()
    assert type(s) is CreditSettings and isinstance(cfg, CreditSettings)
    assert {f.name: getattr(s, f.name) for f in dataclasses.fields(CreditSettings)} == {
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(CreditSettings)
    }
    assert s.gate_floor == Config.gate_floor == REMOVED["gate_floor"]  # constants read as before


def test_the_maths_defaults_are_the_config_s():
    """A library function's keyword default for a setting is the run's default: two copies of one default
    (perturb_window was 64 in the window file's entry point, 32 in the Config) must not drift apart again."""
    from oar.entropy_credit import top_entropy_mask
    from oar.gating import bilevel_weights
    from oar.grpo import group_advantages, policy_loss
    from oar.oar_grad import gradient_scores
    from oar.oar_perturb import perturbation_scores

    c = Config()
    pins = {
        bilevel_weights: dict(
            quantile=c.gate_quantile, boost=c.gate_boost, floor=c.gate_floor, preserve_mass=c.preserve_mass
        ),
        gradient_scores: dict(noise_std=c.noise_std, probe=c.probe),
        perturbation_scores: dict(
            window=c.perturb_window,
            auto_length=c.perturb_auto_length,
            max_chunk_tokens=c.perturb_chunk_tokens,
            span=c.perturb_span,
            probe=c.probe,
        ),
        top_entropy_mask: dict(top=c.entropy_top),
        policy_loss: dict(clip_low=c.clip_low, clip_high=c.clip_high, kl_beta=c.kl_beta, aggregation=c.aggregation),
        group_advantages: dict(scale=c.advantage_scale),
    }
    for fn, want in pins.items():
        got = {k: inspect.signature(fn).parameters[k].default for k in want}
        assert got == want, fn.__name__


def test_resume_refuses_a_checkpoint_that_ran_a_removed_setting_otherwise():
    cfg = Config()
    old = {
        k: v for k, v in dataclasses.asdict(cfg).items()
    } | REMOVED  # a checkpoint written before they were constants
    check_resume(cfg, {"config": old}, "ckpt")
    check_resume(cfg, {"config": old | {"max_bad_steps": 5, "perturb_chunk_tokens": 4096}}, "ckpt")  # resumable ones
    with pytest.raises(ValueError, match=r"ran with gate_floor 0.2 \(now fixed at 0.1\)"):
        check_resume(cfg, {"config": old | {"gate_floor": 0.2}}, "ckpt")
    assert {"max_bad_steps", "perturb_chunk_tokens"} <= RESUMABLE


def test_a_recorded_config_of_an_earlier_version_reruns_unless_it_ran_a_removed_setting_otherwise():
    old = dataclasses.asdict(Config()) | REMOVED | {"max_bad_steps": 5}  # written when these were flags
    assert from_record(old, steps=3) == dataclasses.replace(Config(), steps=3)
    # the vLLM engine's sizes, flags before f6e6ae1, changed no update: a record of them reruns
    engine = {"vllm_kv_cache_gib": 2.0, "vllm_max_model_length": 4096, "vllm_enforce_eager": True}
    assert from_record(old | engine, steps=3) == dataclasses.replace(Config(), steps=3)
    with pytest.raises(ValueError, match=r"ran with gate_floor 0.2 \(now fixed at 0.1\)"):
        from_record(old | {"gate_floor": 0.2})
