"""Hub ids told from local paths, the data-source form org/name[@revision][:config[:split]], the files fetched of a
model repository, a failed fetch as one line, the recipe as the run reads it once fetched; a Hub dataset read from
an offline cache, map-style and streamed, and its tokenization cache keyed by its commit."""

import dataclasses
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import yaml
from huggingface_hub import constants
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, IncompleteSnapshotError, LocalEntryNotFoundError,
                                    RepositoryNotFoundError, RevisionNotFoundError)
from huggingface_hub.utils import filter_repo_objects

from llmtune.config import DataConfig, load_config
from llmtune.data.build import cache_key
from llmtune.data.sources import load_source
from llmtune import hub
from llmtune.errors import UserError
from llmtune.hub import HubRepo, dataset_source, is_hub_id, model_repo
from llmtune.run.inputs import hub_inputs, local_inputs
from tests.helpers import add_to_hub_cache


@pytest.mark.parametrize("text, key, expected", [
    ("org/name", "data.train_files", ("org/name", None, None, "train")),
    ("org/name", "data.val_files", ("org/name", None, None, "validation")),
    ("org/name", "data.test_files", ("org/name", None, None, "test")),
    ("org/name:chat", "data.train_files", ("org/name", None, "chat", "train")),
    ("org/name:chat:test", "data.val_files", ("org/name", None, "chat", "test")),
    ("org/name::test", "data.train_files", ("org/name", None, None, "test")),
    ("org/name@v1.0:chat:train", "data.train_files", ("org/name", "v1.0", "chat", "train")),
    ("org/name@refs/pr/1", "data.train_files", ("org/name", "refs/pr/1", None, "train")),
])
def test_a_hub_dataset_source_names_repository_revision_config_and_split(text, key, expected):
    source = dataset_source(text, key)
    assert (source.repo.repo_id, source.repo.revision, source.config, source.split) == expected
    assert source.repo.kind == "dataset"


@pytest.mark.parametrize("text", ["data/train.jsonl", "corpus/part.parquet", "data/*.jsonl", "no/such/file.jsonl",
                                  "./org/name", "/abs/org", "name", "org/na--me", "org/.name", "org/name.git"])
def test_local_paths_and_malformed_names_are_not_hub_datasets(text):
    assert dataset_source(text, "data.train_files") is None


def test_a_local_path_that_exists_wins_over_a_hub_id(tmp_path, monkeypatch):
    assert is_hub_id("org/name") and dataset_source("org/name", "data.train_files")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")
    assert dataset_source("org/name", "data.train_files") is None
    assert model_repo("org/name") is None


def test_a_pinned_source_reads_back_as_the_same_source_at_its_commit():
    source = dataset_source("org/name@v1:chat:test", "data.val_files")
    pinned = dataset_source(source.pinned("a" * 40), "data.train_files")
    assert pinned == dataclasses.replace(source, repo=dataclasses.replace(source.repo, revision="a" * 40))
    assert dataset_source(dataset_source("org/name", "data.val_files").pinned("b" * 40), "data.train_files").split == \
        "validation"


REPO_FILES = ["config.json", "generation_config.json", "model.safetensors.index.json",
              "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
              "chat_template.jinja", "pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "tf_model.h5",
              "flax_model.msgpack", "onnx/model.onnx", "consolidated.safetensors", "original/consolidated.00.pth",
              "modeling_tiny.py", "README.md", ".gitattributes"]
TOKENIZER = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
             "merges.txt", "chat_template.jinja", "config.json", "generation_config.json"}


def fetched(repo: HubRepo) -> set[str]:
    """The files snapshot_download fetches of REPO_FILES for `repo` (its own filter)."""
    return set(filter_repo_objects(REPO_FILES, allow_patterns=list(repo.files)))


def test_a_model_repository_is_fetched_without_weights_llmtune_does_not_read():
    weights = {"model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert fetched(model_repo("org/tiny", "v1")) == TOKENIZER | weights
    assert fetched(model_repo("org/tiny", "v1", trust_remote_code=True)) == TOKENIZER | weights | {"modeling_tiny.py"}
    assert fetched(model_repo("org/tok", tokenizer_only=True)) == TOKENIZER | {"model.safetensors.index.json"}


def test_the_files_that_pin_a_commit_are_among_those_fetched():
    """Else an offline pin finds the snapshot incomplete (huggingface_hub checks a cached snapshot against the
    commit's file list)."""
    for repo in (model_repo("org/tiny"), model_repo("org/tok", tokenizer_only=True)):
        assert fetched(repo.pinning()) and fetched(repo.pinning()) <= fetched(repo)


# What huggingface_hub's HTTP errors read of a response.
RESPONSE = SimpleNamespace(headers={}, status_code=404, request=None, url="https://huggingface.co/api/models/org/x")


@pytest.mark.parametrize("error, offline, problem", [
    (LocalEntryNotFoundError("not cached"), True, "is neither a local path nor in the Hub cache {cache}, and "
     "HF_HUB_OFFLINE=1 forbids a download; fetch it once with network access, name a local path instead, or correct "
     "the name"),
    (LocalEntryNotFoundError("not cached"), False, "is neither a local path nor in the Hub cache {cache}, and the Hub "
     "cannot be reached; fetch it once with network access (HF_HUB_OFFLINE=1 then reads it from the cache, asking the "
     "Hub nothing), name a local path instead, or correct the name"),
    (IncompleteSnapshotError("partial", snapshot_path="/x"), True, "is only partly in the Hub cache, and "
     "HF_HUB_OFFLINE=1 forbids a download; fetch it once with network access"),
    (GatedRepoError("403", response=RESPONSE), False, "is gated; accept its conditions on its Hub page and log in "
     "(hf auth login, or HF_TOKEN)"),
    (RepositoryNotFoundError("404", response=RESPONSE), False, "is neither a local path nor a repository on the Hub "
     "(or it is private: log in with hf auth login, or HF_TOKEN); correct the name"),
    (RevisionNotFoundError("404", response=RESPONSE), False, "has no such revision; name one of its branches, tags or "
     "commits"),
    (HfHubHTTPError("500 Server Error:\n  try later", response=RESPONSE), False,
     "could not be fetched (500 Server Error: try later); try again later"),
])
def test_a_failed_fetch_is_one_line_naming_the_key_the_id_its_revision_and_the_fix(monkeypatch, error, offline,
                                                                                  problem):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(hub, "snapshot_download", fail)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    with pytest.raises(UserError) as raised:
        hub.fetch(HubRepo("org/x", "model", "v2"), "model.name_or_path")
    assert str(raised.value) == f"model.name_or_path: org/x (revision v2) {problem.format(cache=constants.HF_HUB_CACHE)}"


@pytest.fixture
def recipe(tmp_path, sft_file):
    def load(**model) -> object:
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump({"model": model, "train": {"output_dir": str(tmp_path / "out")},
                                        "data": {"train_files": ["org/data", "org/data:small", str(sft_file)],
                                                 "val_files": ["org/data"], "test_files": ["org/data"]}}))
        return load_config(str(path), [], "sft", 1)
    return load


def test_the_run_reads_snapshot_folders_and_pinned_sources_while_the_recipe_keeps_its_hub_ids(recipe, sft_file):
    config = recipe(name_or_path="org/tiny", revision="v1")
    folders = {model_repo("org/tiny", "v1"): Path("/snap/1"),
               HubRepo("org/data", "dataset"): Path("/snap") / ("c" * 40)}
    assert set(hub_inputs(config)) == set(folders)
    local = local_inputs(config, folders)
    assert (local.model.name_or_path, local.model.tokenizer, local.model.revision) == ("/snap/1", None, None)
    assert local.data.train_files == [f"org/data@{'c' * 40}::train", f"org/data@{'c' * 40}:small:train", str(sft_file)]
    assert local.data.val_files == [f"org/data@{'c' * 40}::validation"]
    assert local.data.test_files == [f"org/data@{'c' * 40}::test"]
    assert (config.model.name_or_path, config.model.revision, config.data.train_files[0]) == ("org/tiny", "v1", "org/data")


def test_a_revision_without_a_hub_id_is_refused(recipe, tiny_model):
    with pytest.raises(UserError, match="model.revision: v1 names a revision of a Hub id, but model.name_or_path"):
        hub_inputs(recipe(name_or_path=str(tiny_model), revision="v1"))


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """An offline huggingface_hub cache (and datasets cache) under tmp_path, for this process."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    return tmp_path


def test_a_hub_dataset_reads_the_same_rows_map_style_and_streamed(hf_home, sft_file):
    add_to_hub_cache(hf_home, "org/data", "dataset", sft_file.parent, "d" * 40, refs=("main",))
    rows = [json.loads(line) for line in sft_file.read_text().splitlines()]
    assert load_source("org/data", "data.train_files").to_list() == rows
    assert list(load_source(f"org/data@{'d' * 40}::train", "data.train_files", streaming=True)) == rows


def test_the_tokenization_cache_key_follows_the_commit_a_hub_dataset_names(hf_home, sft_file, bare_tokenizer):
    """org/data, unpinned: its key changes when main moves to another commit, and comes back with it."""
    commits = [hashlib.sha1(f"push {n}".encode()).hexdigest() for n in range(2)]
    for commit in commits:
        add_to_hub_cache(hf_home, "org/data", "dataset", sft_file.parent, commit)
    data_cfg = DataConfig(train_files=["org/data"])
    keys = []
    for commit in (*commits, commits[0]):
        (hf_home / "hub" / "datasets--org--data" / "refs" / "main").write_text(commit)
        keys.append(cache_key("sft", data_cfg, bare_tokenizer, 42))
    assert keys[0] != keys[1] and keys[0] == keys[2]
