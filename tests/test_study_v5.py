"""scripts/study_v5.py's plan and scripts/attribution_v5.py on a model that earns reward."""

import math

import torch

from oar.arith import ArithConfig
from oar.credit import METHODS
from oar.testbeds import TESTBEDS


def test_plan_puts_seed_0_of_everything_first_with_one_budget(tmp_path):
    from scripts.study_v5 import parse_args, plan

    runs = plan(parse_args(["--root", str(tmp_path)]))
    assert len(runs) == 6 * 3 * 5 and {r["seed"] for r in runs[:18]} == {0}
    assert len({(r["settings"]["steps"], r["settings"].get("prompts_per_step"), r["settings"].get("group_size")) for r in runs}) == 1
    assert {r["settings"]["max_new_tokens"] for r in runs if r["testbed"] == "filler"} == {96}


def test_attribution_v5_weighs_the_same_rollouts_with_every_method(tiny_model):
    from oar.models import load_model
    from scripts import attribution_v5

    model, tok = load_model(str(tiny_model))
    torch.manual_seed(0)
    out = attribution_v5.run(model, tok, TESTBEDS["slip"], prompts=6, group_size=4, arith=ArithConfig(min_ops=1, max_ops=1, start_digits=1))
    table = {r["method"]: r for r in out["table"]}
    assert list(table) == list(METHODS) and 0 < out["sample_accuracy"] < 1
    used = table["grpo"]["rollouts"]
    assert used > 0 and all(r["rollouts"] == used for r in table.values())
    assert table["grpo"]["roc_auc"] == 0.5 and table["grpo"]["w_other"] == 1.0  # all ones: chance, weight 1
    assert table["entropy-mask"]["w_other"] <= 1.0 and table["tempo"]["frac_negative"] >= 0
    assert all(math.isnan(r["w_fork"]) for r in table.values())  # slip plants no fork
