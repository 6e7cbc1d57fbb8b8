"""scripts/analysis/grail_compare.py end to end against a FAKE of GRAIL's trainer class, written here: two methods
with the names and signatures of GRAIL's, reading what the harness gives them (the accelerator, the tokenizer,
the run's settings), that compute oar's own weights, so every agreement the script reports is known: exact at
offset 0. A second fake returns them one column late, as GRAIL's code lays out its scores, and the script must
report the shift. No GRAIL code is needed or used."""

import importlib.metadata
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FAKE = """
import torch
from oar.credit_methods import gate
from oar.credit_settings import CreditSettings
from oar.grail import grail_scores, grail_weights, reweighted_rows
from oar.oar_grad import gradient_scores
from oar.rollout import build_rollout

LATE = {late}  # column j gets token j - 1's weight, as GRAIL's slice


class GrailTrainerV2:
    def _rollouts(self, input_ids, attention_mask, logits_to_keep, completion_ids):
        tok, lp = self.processing_class, input_ids.shape[1] - logits_to_keep
        assert self.accelerator.device.type == "cpu" and tok.pad_token_id is not None
        return build_rollout(tok, input_ids[:, :lp], attention_mask[:, :lp], completion_ids, {{tok.eos_token_id}}), lp

    def _out(self, w, lp, mask):
        w = w[:, lp:].float()
        if LATE:
            w = torch.cat([torch.ones_like(w[:, :1]), w[:, :-1]], dim=1)
        return w * mask

    def compute_grail_weights(
        self, model, input_ids, attention_mask, logits_to_keep, completion_ids, mask, advantages=None
    ):
        ro, lp = self._rollouts(input_ids, attention_mask, logits_to_keep, completion_ids)
        rows = reweighted_rows(advantages.view(-1), self.grail_rollout_symmetry) & ro.answer_mask.any(1)
        m = ro.reasoning_mask & rows[:, None]
        s = grail_scores(model, input_ids, attention_mask, m, ro.answer_mask, temperature=self.temperature)
        w = grail_weights(s, m, rows, spread=self.grail_std, center=self.grail_mean, w_min=self.grail_w_min,
                          w_max=self.grail_w_max).weights
        return self._out(w, lp, mask)

    def compute_oar_g_weights(self, model, input_ids, attention_mask, logits_to_keep, completion_ids, mask):
        ro, lp = self._rollouts(input_ids, attention_mask, logits_to_keep, completion_ids)
        (b, width), hidden = input_ids.shape, model.get_input_embeddings().embedding_dim
        noise = torch.zeros(b, width, hidden)
        noise[:, lp - 1 : width - 1] = torch.randn(b, logits_to_keep, hidden)  # one draw, global RNG, GRAIL's columns
        s = gradient_scores(model, input_ids, attention_mask, ro.reasoning_mask, ro.answer_mask,
                            noise_std=self.oar_g_noise_std, noise=noise)
        return self._out(gate(CreditSettings(), s, ro.reasoning_mask), lp, mask)
"""

SMALL = ["--prompts", "2", "--group_size", "4", "--max_new_tokens", "40", "--noise_seeds", "2"]
SMALL += ["--sft_steps", "80", "--sft_lr", "3e-3", "--grail_commit", "fake"]


def _run(tmp_path, late: bool) -> dict:
    from scripts.analysis.grail_compare import main

    fake = tmp_path / f"fake_{late}" / "grail_trainer.py"
    fake.parent.mkdir()
    fake.write_text(FAKE.format(late=late))
    out = tmp_path / f"compare_{late}.json"
    result = main(["--grail", str(fake), *SMALL, "--model_dir", str(tmp_path / "model"), "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))  # what it printed is what it wrote
    return result


@pytest.mark.slow  # an end-to-end run of the script, ~25 s
@pytest.mark.filterwarnings("ignore:OAR-G in half precision")  # the script also runs the fake in bfloat16
def test_the_script_finds_the_fakes_agreement_and_its_one_column_shift(tmp_path, capsys):
    exact = _run(tmp_path, late=False)
    ro = exact["rollouts"]
    assert ro["n"] == 8 and ro["wrong_with_box"] >= 2, ro  # the boxing model boxes, and some rollouts are wrong
    assert exact["command"].startswith("python scripts/analysis/grail_compare.py --grail ")
    trl = importlib.metadata.version("trl") if "trl" in sys.modules else None  # the fake needs no TRL; others may
    assert exact["grail"]["commit"] == "fake" and exact["versions"]["trl"] == trl
    assert exact["grail_weights"]["span_matches_grail"] is None  # the fake has no span method to check against

    # The fake computes oar's weights: the same on every reasoning token, best at offset 0.
    for c in (exact["grail_weights"]["vs_oar_method"], exact["oar_g"]["matched_noise"]):
        assert c["best_offset"] == 0 and c["spearman"]["+0"] == pytest.approx(1.0), c
        assert c["max_abs_diff_reasoning"] == pytest.approx(0.0, abs=1e-6), c
    assert exact["oar_g"]["grail_noise_reproduced"]  # the fake drew one randn(B, T, H), as GRAIL
    assert exact["grail_weights"]["ladder"][-1]["max_abs_diff_to_oar_reasoning"] == pytest.approx(0.0, abs=1e-6)
    assert exact["oar_g"]["profile"]["oar"]["mass_reasoning"] == pytest.approx(1.0)  # oar's gate keeps the mass

    # One column late: the weights differ on the tokens, and the agreement is at offset +1.
    late = _run(tmp_path, late=True)
    for c in (late["grail_weights"]["vs_oar_method"], late["oar_g"]["matched_noise"]):
        assert c["best_offset"] == 1 and c["spearman"]["+1"] > c["spearman"]["+0"], c
        assert c["max_abs_diff_reasoning"] > 0.05, c
    printed = capsys.readouterr().out
    assert "GRAIL vs oar grail" in printed and "rho@+1" in printed


def test_without_grail_it_says_what_to_pass():
    from scripts.analysis.grail_compare import main

    with pytest.raises(SystemExit) as stop:
        main([])
    message = str(stop.value.code)
    assert "--grail PATH" in message and "\n" not in message, message
