"""A run that cannot learn says so: own data the model cannot answer gave reward 0 at every step,
|g| 0.00 and every group tied, without a word; a --dataset folder with only train.jsonl trained with no
held-out evaluation, silently."""

import json

from tinyrun import TINY, run_inprocess

NO_SIGNAL = "every group's rollouts got one reward (reward/frac_zero_std_groups 1.0, mean reward 0.000)"


def _args(model, data, out, *extra):
    return ["--model", str(model), "--dataset", str(data), "--output_dir", str(out), "--micro_batch_size", "8"] + [
        *TINY,
        *extra,
    ]


def test_a_run_whose_groups_all_tie_says_it_cannot_learn(tiny_model, tmp_path, capsys):
    data = tmp_path / "capitals.jsonl"  # nothing the tiny arithmetic model can answer: reward 0 everywhere
    rows = [{"problem": f"Name the capital of country {i}.", "answer": f"City{i}"} for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_inprocess(_args(tiny_model, data, tmp_path / "out", "--steps", "3", "--save_every", "0"))
    said = capsys.readouterr().out
    assert said.count(NO_SIGNAL) == 1, said[-3000:]
    line = next(ln for ln in said.splitlines() if NO_SIGNAL in ln)
    assert line.startswith("warning: steps 1-3: ") and "too hard for the model" in line and "answer column" in line


def test_a_run_that_learns_says_nothing_of_the_kind(tiny_model, tmp_path, capsys):
    run_inprocess(_args(tiny_model, tiny_model / "data.jsonl", tmp_path / "out", "--steps", "3", "--save_every", "0"))
    assert "got one reward" not in capsys.readouterr().out


def test_a_run_without_a_held_out_set_says_so_at_the_start(tiny_model, tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text((tiny_model / "data.jsonl").read_text())
    run_inprocess(_args(tiny_model, folder, tmp_path / "out", "--steps", "1", "--save_every", "0"))
    said = capsys.readouterr().out
    assert f"no held-out set: --dataset {folder} has none by default" in said, said[-2000:]
    assert "accuracy_after" not in json.loads((tmp_path / "out" / "summary.json").read_text())


def test_a_folder_with_test_jsonl_is_held_out_by_default(tiny_model, tmp_path, capsys):
    """What --eval_dataset's help always said (a --dataset folder's test.jsonl is the default held-out set),
    and the code did not do."""
    folder = tmp_path / "data"
    folder.mkdir()
    lines = (tiny_model / "data.jsonl").read_text().splitlines(keepends=True)
    (folder / "train.jsonl").write_text("".join(lines[:20]))
    (folder / "test.jsonl").write_text("".join(lines[20:]))
    run_inprocess(_args(tiny_model, folder, tmp_path / "out", "--steps", "1", "--save_every", "0"))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["eval_problems"] == 10 and summary["eval_problems_seen_in_training"] == 0
    assert "no held-out set" not in capsys.readouterr().out
