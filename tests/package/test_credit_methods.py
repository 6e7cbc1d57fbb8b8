"""Credit methods of one's own (oar/credit.py's protocol, --credit_module): a method defined outside
oar/ trains through train.py with the built-ins' guarantees (weights independent of micro-batching
and of the process count, as tests/package/test_distributed.py checks for the built-ins), and a module that
cannot serve stops the run before the model loads, with a message naming it."""

from pathlib import Path

import pytest

import oar.training.run as oar_run
import torch

from test_distributed import _assert_learns, _assert_same_run
from tinyrun import ROOT, TINY, check_ok, launch, metrics, run_inprocess

PLUGIN = Path(__file__).resolve().parents[1] / "credit_plugin.py"  # equal-mass: needs the whole step, through gather
EXAMPLE = ROOT / "examples" / "position_decay.py"  # docs/credit-methods.md's worked example


def _args(model, out, micro_batch_size=8, module=PLUGIN, method="equal-mass"):
    return [
        "--model",
        str(model),
        "--dataset",
        str(model / "data.jsonl"),
        "--output_dir",
        str(out),
        "--steps",
        "2",
        "--save_every",
        "0",
        "--micro_batch_size",
        str(micro_batch_size),
        *TINY,
        "--credit_module",
        str(module),
        "--method",
        method,
        "--aggregation",
        "token_mean",
    ]


def _fake_step(reasoning, scored, lengths=None):
    """A Step and its one MicroBatch over hand-made masks (b, L): only what the two methods read."""
    from oar.credit import CreditSettings, MicroBatch, Step
    from oar.rollout import Rollout

    b, L = reasoning.shape
    valid = reasoning if lengths is None else torch.arange(L)[None] < torch.tensor(lengths)[:, None]
    ro = Rollout(
        torch.zeros(b, L, dtype=torch.long),
        torch.ones(b, L, dtype=torch.long),
        valid,
        reasoning,
        torch.zeros(b, L, dtype=torch.bool),
        torch.zeros(b, dtype=torch.bool),
        [""] * b,
        0,
    )
    step = Step(
        CreditSettings(),
        None,
        None,
        ro,
        torch.zeros(b),
        torch.zeros(b),
        scored,
        list(range(b)),
        [""] * b,
        "last",
        gather=lambda x: torch.cat([x, torch.tensor([10.0])]),
    )  # another process holds one rollout of 10 tokens
    return step, MicroBatch(slice(0, b), ro, torch.zeros(b, L + 1, 3))


def test_position_decay_and_equal_mass_by_hand():
    from credit_plugin import mean_length, weigh as equal_mass
    from oar.credit import credit_methods

    decay = credit_methods(str(EXAMPLE))["position-decay"].weigh  # loaded as train.py loads it

    reasoning = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    step, micro = _fake_step(reasoning, torch.tensor([True, False, True]))
    w = decay(step, None, micro)
    # row 0: 0.9^k = 1, 0.9, 0.81 (sum 2.71), times n_R / sum = 3 / 2.71; the answer column keeps 1.
    # row 1 is not scored and row 2 has no reasoning: all ones.
    torch.testing.assert_close(w[0], torch.tensor([3 / 2.71, 2.7 / 2.71, 2.43 / 2.71, 1.0]))
    assert w[1:].eq(1).all() and w[0, :3].sum().item() == pytest.approx(3.0)
    # equal-mass: lengths 4, 2 here and 10 on the other process: mean 16 / 3, so w = (16/3) / T_i on valid tokens
    step, micro = _fake_step(reasoning[:2], torch.tensor([True, True]), lengths=[4, 2])
    mean = mean_length(step)
    assert mean == pytest.approx(16 / 3)
    torch.testing.assert_close(equal_mass(step, mean, micro), torch.tensor([[4 / 3] * 4, [8 / 3, 8 / 3, 1.0, 1.0]]))


def test_a_method_of_ones_own_trains_and_ignores_micro_batching(tiny_model, tmp_path):
    whole, split = tmp_path / "8x1", tmp_path / "1x8"
    summary = run_inprocess(_args(tiny_model, whole, 8))
    run_inprocess(_args(tiny_model, split, 1))
    assert summary["method"] == "equal-mass"
    assert any(m["oar/weight_max"] != 1 for m in metrics(whole))  # its weights reached the loss
    _assert_learns(whole, tiny_model)
    _assert_same_run(split, whole, tiny_model)


@pytest.mark.slow
def test_a_method_of_ones_own_ignores_the_process_count(tiny_model, tmp_path):
    """Its prepare takes the step's mean length over every process: 2 processes must see one step."""
    one, two = tmp_path / "one", tmp_path / "two"
    run_inprocess(_args(tiny_model, one, 8))
    check_ok(launch(_args(tiny_model, two, 2), num_processes=2))
    assert '"processes": 2' in (two / "summary.json").read_text()
    _assert_same_run(two, one, tiny_model)


def test_the_documented_example_trains(tiny_model, tmp_path):
    """docs/credit-methods.md's command, on the tiny model: two steps of position-decay."""
    out = tmp_path / "run"
    summary = run_inprocess(_args(tiny_model, out, 8, EXAMPLE, "position-decay"))
    assert summary["method"] == "position-decay" and summary["skipped_steps"] == 0
    assert any(m["oar/weight_max"] > 1 for m in metrics(out))  # a rollout's first reasoning token was boosted


BROKEN = {  # module text (None: no such file) -> what the message must say besides the module's path
    "missing": (None, "no such file"),
    "unimportable": (
        "import no_such_package_anywhere\n",
        "could not import it (ModuleNotFoundError: No module named 'no_such_package_anywhere')",
    ),
    "no list": ("X = 1\n", "defines no CREDIT_METHODS"),
    "clash": (
        "from oar.credit import CreditMethod\n"
        "CREDIT_METHODS = [CreditMethod('grpo', lambda step, state, micro: None)]\n",
        "method 'grpo' clashes with the built-in method of that name",
    ),
    "not a method": ("CREDIT_METHODS = [lambda step, state, micro: None]\n", "CREDIT_METHODS[0]: <function <lambda>"),
    "bad signature": (
        "from oar.credit import CreditMethod\nCREDIT_METHODS = [CreditMethod('mine', lambda micro: None)]\n",
        "method 'mine': weigh(micro) must take (step, state, micro)",
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_module_that_cannot_serve_stops_the_run_before_the_model_loads(tiny_model, tmp_path, monkeypatch, case):

    text, needle = BROKEN[case]
    module = tmp_path / f"{case.replace(' ', '_')}.py"
    if text is not None:
        module.write_text(text)
    monkeypatch.setattr(oar_run, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        run_inprocess(_args(tiny_model, out, 8, module, "mine"))
    message = stop.value.code
    assert isinstance(message, str) and message.startswith(f"train.py: error: --credit_module {module}: "), message
    assert needle in message, message
    assert not out.exists()


def _plugin_weigh(tiny_model, module, name):
    """step_credit's `weigh` for method `name` of the --credit_module file `module`, on two tiny-model rollouts
    (rewards and advantages 0), and the rollouts."""
    from oar.credit import CreditSettings, step_credit
    from oar.sampler import format_prompt, sample
    from oar.training.models import load_model

    model, tok = load_model(str(tiny_model))
    ro = sample(model, tok, [format_prompt(tok, "Compute 3 + 4.")], group_size=2, seeds=[0, 1], max_new_tokens=5)
    zeros = torch.zeros(2)
    weigh = step_credit(
        CreditSettings(method=name, credit_module=str(module), group_size=2),
        model,
        tok,
        ro,
        zeros,
        zeros,
        zeros.bool(),
        [0, 1],
        ["7", "7"],
        "last",
    )
    return weigh, ro


def test_a_method_breaking_the_protocol_at_run_time_is_named(tiny_model, tmp_path):
    """What the loss relies on is checked for every method, each micro-batch: float weights of the
    micro-batch's shape, finite, and 1 for a method that declares it scores nothing."""
    from oar.credit import CreditError

    module = tmp_path / "bad_weights.py"
    module.write_text(
        "import torch\nfrom oar.credit import CreditMethod\nCREDIT_METHODS = [\n"
        "    CreditMethod('short', lambda step, state, micro: torch.ones(len(micro.rollouts), 3)),\n"
        "    CreditMethod('nan', lambda step, state, micro: "
        "torch.full(micro.rollouts.input_ids.shape, float('nan'))),\n"
        "    CreditMethod('half', lambda step, state, micro: "
        "torch.full(micro.rollouts.input_ids.shape, 0.5), scores=False),\n]\n"
    )
    for name, needle in (
        (
            "short",
            "weigh returned torch.float32 of shape (2, 3); it must return float weights of the micro-batch's shape",
        ),
        ("nan", "weigh returned non-finite weights for rows slice(0, 2, None)"),
        ("half", "scores=False promises weights 1"),
    ):  # it would train with 0.5 and log GRPO's 1
        weigh, ro = _plugin_weigh(tiny_model, module, name)
        with pytest.raises(CreditError) as err:
            weigh(slice(0, 2), ro, None)
        assert str(err.value).startswith(f"credit method '{name}': ") and needle in str(err.value), str(err.value)


def test_weights_a_method_computed_with_a_graph_add_no_gradient(tiny_model, tmp_path):
    """Weights are constants of the loss (maths §5): a plugin that reads the model without no_grad returns
    weights with a graph, and the loss must not backpropagate through them (it doubled the gradient of a
    w = 2 p(token) method)."""
    module = tmp_path / "graph_weights.py"
    module.write_text(
        "import torch\nfrom oar.credit import CreditMethod\n"
        "def weigh(step, state, micro):\n"
        "    w = next(step.model.parameters()).sum() * 0 + 2.0  # a graph back to the model\n"
        "    return torch.ones(micro.rollouts.input_ids.shape) * w\n"
        "CREDIT_METHODS = [CreditMethod('graph', weigh)]\n"
    )
    weigh, ro = _plugin_weigh(tiny_model, module, "graph")
    weights, _, _ = weigh(slice(0, 2), ro, None)
    assert not weights.requires_grad and torch.equal(weights, 2.0 * ro.completion_mask)


def test_a_method_name_the_table_lacks_is_named_with_the_choices():
    from oar.training.checks import check_config
    from oar.training.config import parse_args

    builtins = "grpo, oar-g, oar-p, entropy, entropy-mask, tempo, oar-g+tempo, random-gate, grail"
    for extra, message in (
        ([], f"--method mine: choose one of {builtins} (or name a module that defines it with --credit_module)."),
        (
            ["--credit_module", str(PLUGIN)],
            f"--method mine: choose one of {builtins}, equal-mass (with --credit_module {PLUGIN}).",
        ),
    ):
        with pytest.raises(ValueError) as err:
            check_config(parse_args(["--method", "mine", *extra]), num_processes=1)
        assert str(err.value) == message
