"""scripts/study_ledger.py: finished runs move to a new machine only with the weights they started from."""

import json

import pytest
import torch
from safetensors.torch import save_file


def _model(path, value: float):
    path.mkdir(parents=True)
    save_file({"w": torch.full((3, 2), value), "b": torch.zeros(2)}, str(path / "model.safetensors"))
    (path / "build_info.json").write_text(json.dumps({"seed": 0, "heldout_accuracy": 0.5}))
    return path


def _finished_run(root, model):
    run = root / "slip" / "grpo-s0"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": str(model), "output_dir": str(run), "method": "grpo"}))
    (run / "summary.json").write_text(json.dumps({"accuracy_after": 0.7}))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "study_time.json").write_text(json.dumps({"seconds": 5.0, "model": str(model)}))
    (run / "checkpoint-1").mkdir()  # not kept: the ledger holds a few kB per run
    return run


def test_a_run_recorded_on_one_machine_is_restored_on_another_with_its_paths(tmp_path):
    from scripts import study_ledger

    ledger, a, b = tmp_path / "ledger", tmp_path / "a", tmp_path / "b"
    model_a = _model(a / "models" / "slip", 1.0)
    study_ledger.check_build(ledger, "slip", model_a)
    _finished_run(a, model_a)
    study_ledger.record_run(ledger, a, "slip", "grpo-s0")
    assert sorted(p.name for p in (ledger / "runs" / "slip" / "grpo-s0").iterdir()) == sorted(study_ledger.RUN_FILES)

    model_b = b / "models" / "slip"  # a new machine: the kept model is copied in, not rebuilt
    assert study_ledger.restore_model(ledger, "slip", model_b) and not study_ledger.restore_model(ledger, "slip", model_b)
    assert study_ledger.weights_sha256(model_b) == study_ledger.weights_sha256(model_a)
    study_ledger.check_build(ledger, "slip", model_b)
    (b / "slip" / "grpo-s0").mkdir(parents=True)  # an unfinished attempt: replaced by the finished one
    assert study_ledger.restore(ledger, b, "slip", model_b) == 1
    config = json.loads((b / "slip" / "grpo-s0" / "config.json").read_text())
    assert config["model"] == str(model_b) and config["output_dir"] == str(b / "slip" / "grpo-s0")
    assert json.loads((b / "slip" / "grpo-s0" / "study_time.json").read_text())["model"] == str(model_b)
    assert study_ledger.restore(ledger, b, "slip", model_b) == 0  # already there


def test_a_rebuild_with_other_weights_stops_the_study(tmp_path):
    from scripts import study_ledger

    ledger = tmp_path / "ledger"
    study_ledger.check_build(ledger, "slip", _model(tmp_path / "a", 1.0))
    with pytest.raises(SystemExit, match="not the model the ledger's runs started from"):
        study_ledger.check_build(ledger, "slip", _model(tmp_path / "b", 1.0 + 1e-7))


def test_an_unfinished_run_is_not_recorded(tmp_path):
    from scripts import study_ledger

    (tmp_path / "slip" / "grpo-s0").mkdir(parents=True)
    with pytest.raises(ValueError, match="not a finished run"):
        study_ledger.record_run(tmp_path / "ledger", tmp_path, "slip", "grpo-s0")
