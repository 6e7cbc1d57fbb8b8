"""Checkpoint bookkeeping without a model (oar/training/checkpoint.py, oar/training/runlog.py): which folders
count as checkpoints, what saving keeps and cleans, what a resume keeps of metrics.jsonl, that each line is on
disk before its checkpoint, and what a run's code version covers. tests/package/test_resume.py resumes real runs."""

import json
import os
from pathlib import Path

from oar.training import checkpoint as ckpt


class _OneProcess:
    """The part of an Accelerator that oar.training.checkpoint uses, writing a stand-in state file."""

    is_main_process = True

    def wait_for_everyone(self):
        pass

    def save_state(self, path):
        Path(path, "model.safetensors").write_text("weights")

    def load_state(self, path):
        assert Path(path, "model.safetensors").is_file()


def test_latest_checkpoint_ignores_unfinished_ones(tmp_path):
    acc = _OneProcess()
    for step in (1, 2, 10):
        ckpt.save_checkpoint(acc, tmp_path, step, {"history": {}}, keep=5)
    (tmp_path / "checkpoint-11.tmp").mkdir()  # killed mid-save
    (tmp_path / "checkpoint-12.old").mkdir()  # killed while deleting a rotated-out checkpoint
    (tmp_path / "checkpoint-x").mkdir()
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"  # numeric, not text, order
    assert ckpt.load_checkpoint(acc, ckpt.latest_checkpoint(tmp_path))["step"] == 10


def test_saving_keeps_the_newest_and_cleans_leftovers(tmp_path):
    acc = _OneProcess()
    (tmp_path / "checkpoint-3.tmp").mkdir(parents=True)
    (tmp_path / "checkpoint-1.old").mkdir()
    for step in range(1, 6):
        ckpt.save_checkpoint(acc, tmp_path, step, {"history": {"bad_steps": 0}}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-5"]
    state = json.loads((tmp_path / "checkpoint-5" / "trainer_state.json").read_text())
    assert state == {"history": {"bad_steps": 0}, "step": 5}


def test_a_checkpoint_dir_without_trainer_state_is_not_complete(tmp_path):
    """A directory with a checkpoint's name but no trainer_state.json (copied by hand, or an old
    checkpoint half deleted by an earlier version) is not resumed from."""
    acc = _OneProcess()
    ckpt.save_checkpoint(acc, tmp_path, 1, {"history": {}}, keep=5)
    (tmp_path / "checkpoint-2").mkdir()
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"


def test_metrics_of_a_resumed_run_start_at_its_checkpoint(tmp_path):
    """RunLog keeps the lines up to the resumed step, drops later ones and a torn last line."""
    from oar.training.runlog import RunLog

    class Acc:
        is_main_process, log_with = True, None

    lines = [json.dumps({"step": s, "reward/mean": 0.5}) for s in (1, 2, 3)] + ['{"step": 4, "rew']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    RunLog(Acc(), str(tmp_path), {}, resume=True, total_steps=5, start_step=2)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_metrics_line_is_on_disk_before_the_steps_checkpoint(tmp_path, monkeypatch):
    """A checkpoint is fsynced and a resume keeps the lines up to it, so each line is fsynced when it is written:
    after a power loss a kept checkpoint never stands beside a metrics.jsonl missing its steps."""
    from oar.training import runlog

    class Acc:
        is_main_process, log_with = True, None

    synced = []
    monkeypatch.setattr(runlog.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")))
    log = runlog.RunLog(Acc(), str(tmp_path), {}, resume=False, total_steps=1)
    synced.clear()
    log.step(
        1,
        {
            k: 0.0
            for k in (
                "reward/mean",
                "completion/length",
                "policy/entropy",
                "loss/clip_frac",
                "oar/ess_ratio",
                "optim/grad_norm",
                "time/step_s",
            )
        },
    )
    assert synced == [str(tmp_path / "metrics.jsonl")]


def test_the_code_version_covers_a_module_named_by_import_path(tmp_path, monkeypatch):
    """--credit_module mypkg.credit (a dotted name, not a .py path) is versioned by its own file: edited between
    two halves of a run, the version changes; a name that cannot be found here adds nothing."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    module = tmp_path / "mypkg" / "credit.py"
    module.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = ckpt.run_code_version("mypkg.credit", "")
    assert first != ckpt.code_version() and ckpt.run_code_version("no_such_module_here") == ckpt.code_version()
    module.write_text("X = 2\n")
    assert ckpt.run_code_version("mypkg.credit", "") != first
