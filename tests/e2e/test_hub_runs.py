"""Hub ids through the CLI, offline, from a huggingface_hub cache the tests fill (HF_HOME in a temporary folder,
HF_HUB_OFFLINE=1): a model at a tag and Hub datasets by config, split and commit train and export on one process;
on two, every process reads the same snapshots and the tokenization cache, keyed by the datasets' commits, is hit.
A name, revision, config or split that is not there stops the run with one line naming it, before any process
starts."""

import hashlib
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import add_to_hub_cache, offline_hub, read_metrics, run_cli

MODEL_COMMIT = hashlib.sha1(b"org/tiny v1").hexdigest()
DATA_COMMIT = hashlib.sha1(b"org/data main").hexdigest()
# What a download of org/tiny leaves on the Hub: files llmtune does not read.
NOT_FETCHED = (".gitattributes", "README.md", "pytorch_model.bin", "onnx/model.onnx", "consolidated.safetensors")
DATA_CARD = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train.jsonl
  - split: validation
    path: data/validation.jsonl
- config_name: small
  data_files:
  - split: train
    path: small/train.jsonl
---
"""


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_model, assets):
    """org/tiny: the tiny Llama at tag v1 only (no main, so a run that ignores model.revision finds nothing),
    fetched as llmtune fetches it (NOT_FETCHED left out); org/data: configs default (train, validation) and small
    (train), on main."""
    home = tmp_path_factory.mktemp("hf_home")
    add_to_hub_cache(home, "org/tiny", "model", tiny_model, MODEL_COMMIT, refs=("v1",), not_fetched=NOT_FETCHED)
    data = tmp_path_factory.mktemp("org_data")
    train = (assets / "data" / "sft_train.jsonl").read_text().splitlines()
    val = (assets / "data" / "sft_eval.jsonl").read_text().splitlines()
    for name, rows in (("data/train.jsonl", train[:48]), ("data/validation.jsonl", val[:8]),
                       ("small/train.jsonl", train[48:64])):
        (data / name).parent.mkdir(exist_ok=True)
        (data / name).write_text("\n".join(rows) + "\n")
    (data / "README.md").write_text(DATA_CARD)
    add_to_hub_cache(home, "org/data", "dataset", data, DATA_COMMIT, refs=("main",))
    return home


def write_recipe(folder: Path, model: dict | None = None, data: dict | None = None) -> str:
    """org/tiny at v1; train on org/data (default config, train split) and org/data's small config at its commit;
    validate on org/data's validation split. Outputs and the tokenization cache in `folder`."""
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": "org/tiny", "revision": "v1", **(model or {})},
        "data": {"train_files": ["org/data", f"org/data@{DATA_COMMIT}:small"], "val_files": ["org/data::validation"],
                 "chat_template": "basic", "max_seq_len": 64, "cache_dir": str(folder / "cache"), **(data or {})},
        "train": {"output_dir": str(folder / "out"), "max_steps": 3, "per_device_train_batch_size": 4,
                  "logging_steps": 1},
    }))
    return str(path)


@pytest.fixture(scope="module")
def runs(hf_home, tmp_path_factory):
    """The recipe on one process, then on two (its own output folder, the same tokenization cache)."""
    root = tmp_path_factory.mktemp("hub_runs")
    recipe = write_recipe(root)
    one = run_cli("sft", recipe, env=offline_hub(hf_home))
    two = run_cli("sft", recipe, f"train.output_dir={root / 'two'}", "--nproc", "2", env=offline_hub(hf_home))
    return root, one, two


@pytest.mark.slow
def test_a_hub_model_and_hub_datasets_train_offline_and_export(runs):
    root, one, _ = runs
    assert one.returncode == 0, one.stderr[-3000:]
    assert "data: built" in one.stderr
    records = read_metrics(root / "out")
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert "eval_loss" in records[-1], "the validation split of org/data was read"
    model = AutoModelForCausalLM.from_pretrained(root / "out" / "hf")
    tokenizer = AutoTokenizer.from_pretrained(root / "out" / "hf")
    with torch.no_grad():
        assert torch.isfinite(model(**tokenizer("7 + 8 =", return_tensors="pt")).logits).all()


def test_the_written_config_keeps_the_hub_ids(runs):
    root, one, _ = runs
    assert one.returncode == 0, one.stderr[-3000:]
    written = yaml.safe_load((root / "out" / "config.yaml").read_text())
    assert written["model"]["name_or_path"] == "org/tiny" and written["model"]["revision"] == "v1"
    assert written["data"]["train_files"] == ["org/data", f"org/data@{DATA_COMMIT}:small"]
    assert written["data"]["val_files"] == ["org/data::validation"]


def test_two_processes_read_the_snapshots_and_hit_the_tokenization_cache(runs):
    root, _, two = runs
    assert two.returncode == 0, two.stderr[-3000:]
    assert "data: cache hit" in two.stderr and "data: built" not in two.stderr
    assert [r["step"] for r in read_metrics(root / "two") if "loss" in r] == [1, 2, 3]


@pytest.mark.parametrize("model, data, expected", [
    ({"name_or_path": "org/missing"}, {}, "model.name_or_path: org/missing (revision v1) is neither a local path nor "
                                          "in the Hub cache"),
    ({"revision": "v9"}, {}, "model.name_or_path: org/tiny (revision v9) is neither a local path nor in the Hub cache"),
    ({}, {"train_files": ["org/nodata"]}, "data.train_files: org/nodata (revision main) is neither a local path nor "
                                          "in the Hub cache"),
    ({}, {"train_files": ["org/data@v2"]}, "data.train_files: org/data (revision v2) is neither a local path nor "
                                           "in the Hub cache"),
    ({}, {"train_files": ["org/data:large"]}, f"data.train_files: org/data (revision {DATA_COMMIT}): BuilderConfig "
                                              "'large' not found"),
    ({}, {"val_files": ["org/data:small"]}, f"data.val_files: org/data (revision {DATA_COMMIT}) has no split "
                                            "'validation' in its config 'small' (splits: train)"),
])
def test_a_missing_hub_input_is_one_line_naming_it_before_any_process_starts(hf_home, tmp_path, model, data,
                                                                             expected):
    result = run_cli("sft", write_recipe(tmp_path, model, data), "--nproc", "2", env=offline_hub(hf_home))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"llmtune: error: {expected}"), result.stderr
    assert not (tmp_path / "out").exists()
