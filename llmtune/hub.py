"""Hub ids: tell one from a local path, and fetch its repository into the huggingface_hub cache.

Torch-free, so that the CLI fetches before any process starts. The cache, its locks and offline mode
(HF_HUB_OFFLINE=1) are huggingface_hub's own: `snapshot_download` returns the snapshot folder of one
commit, from the network or, offline, from the cache.
"""

import os
from dataclasses import dataclass, replace
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, IncompleteSnapshotError,
                                    LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)
from huggingface_hub.utils import validate_repo_id

from llmtune.config import DATA_SUFFIXES
from llmtune.errors import UserError

# What llmtune reads of a model repository: config and generation config, the safetensors weights with their
# index (model*.safetensors: the transformers names, not a second consolidated copy), the tokenizer and its chat
# template. Never .bin, .pt, .h5 or onnx weights.
TOKENIZER_FILES = ("*.json", "*.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja")
MODEL_FILES = (*TOKENIZER_FILES, "model*.safetensors")
# The model's own code, which transformers runs only when the recipe sets model.trust_remote_code.
CODE_FILES = ("*.py",)
# Small files of a repository, among those fetch reads of it (a dataset repository is read whole): fetching them
# alone tells the commit a revision names, and a snapshot fetched before holds them (huggingface_hub refuses a
# cached snapshot that lacks a file asked for).
PIN_FILES = {"model": ("*config.json",), "dataset": ("README.md",)}


@dataclass(frozen=True)
class HubRepo:
    repo_id: str
    kind: str  # "model" or "dataset"
    revision: str | None = None  # branch, tag or commit; None: main
    files: tuple[str, ...] | None = None  # the files to fetch (glob patterns); None: all

    def __str__(self) -> str:
        return f"{self.repo_id} (revision {self.revision or constants.DEFAULT_REVISION})"

    def pinning(self) -> "HubRepo":
        """This repository with only its PIN_FILES to fetch."""
        return replace(self, files=PIN_FILES[self.kind])


@dataclass(frozen=True)
class HubDataset:
    """A data source written org/name[@revision][:config[:split]]."""

    repo: HubRepo
    config: str | None
    split: str

    def pinned(self, commit: str) -> str:
        """This source at one commit, in the form it was written in (config and split spelt out)."""
        return f"{self.repo.repo_id}@{commit}:{self.config or ''}:{self.split}"


def is_hub_id(text: str) -> bool:
    """`org/name` by huggingface_hub's rules, and no local path: a path that exists always wins."""
    # os.path.exists: Path.exists raises for a path below a folder that cannot be read.
    if text.count("/") != 1 or os.path.exists(text):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def model_repo(text: str | None, revision: str | None = None, trust_remote_code: bool = False,
               tokenizer_only: bool = False) -> HubRepo | None:
    """The Hub repository that model.name_or_path or model.tokenizer names, or None for a local folder."""
    if not text or not is_hub_id(text):
        return None
    files = TOKENIZER_FILES if tokenizer_only else MODEL_FILES
    return HubRepo(text, "model", revision, files + CODE_FILES if trust_remote_code else files)


def model_config_repo(text: str | None, revision: str | None = None, trust_remote_code: bool = False) -> HubRepo | None:
    """The Hub repository model.name_or_path names, with the files its config is read from alone (the config files,
    and its code where the recipe trusts it): `llmtune plan`, which reads no weight."""
    repo = model_repo(text, revision, trust_remote_code)
    return replace(repo, files=PIN_FILES["model"] + (CODE_FILES if trust_remote_code else ())) if repo else None


def dataset_source(text: str, key: str) -> HubDataset | None:
    """The Hub dataset a data source names, or None for a local one. Git refs and repo ids hold no ':', so
    the first two split the source; a name that ends like a data file is a local file, missing or not. The
    split defaults to train, validation for data.val_files, test for data.test_files."""
    name, _, rest = text.partition(":")
    repo_id, _, revision = name.partition("@")
    config, _, split = rest.partition(":")
    if os.path.exists(text) or Path(repo_id).suffix in DATA_SUFFIXES or not is_hub_id(repo_id):
        return None
    default_split = {"data.val_files": "validation", "data.test_files": "test"}.get(key, "train")
    return HubDataset(HubRepo(repo_id, "dataset", revision or None), config or None, split or default_split)


def fetch(repo: HubRepo, key: str, local_files_only: bool = False) -> Path:
    """The snapshot folder of `repo`; with local_files_only (or HF_HUB_OFFLINE=1) from the cache alone.
    Its name is the commit."""
    try:
        # Offline mode is said again as local_files_only: huggingface_hub before 2.2 asks the Hub for the file list
        # of a commit even when offline, and fails.
        return Path(snapshot_download(repo.repo_id, repo_type=repo.kind, revision=repo.revision,
                                      allow_patterns=list(repo.files) if repo.files else None,
                                      local_files_only=local_files_only or constants.is_offline_mode()))
    except (LocalEntryNotFoundError, HfHubHTTPError) as err:
        raise UserError(f"{key}: {repo} {_problem(err, repo)}") from None


def _problem(err: Exception, repo: HubRepo) -> str:
    """What went wrong, and the fix, for the message that follows `key: repo`."""
    where = "on the Hub" if repo.kind == "model" else "among the Hub's datasets"
    offline = "HF_HUB_OFFLINE=1 forbids a download" if constants.is_offline_mode() else "the Hub cannot be reached"
    if isinstance(err, IncompleteSnapshotError):
        return f"is only partly in the Hub cache, and {offline}; fetch it once with network access"
    if isinstance(err, LocalEntryNotFoundError):
        then = "" if constants.is_offline_mode() else \
            " (HF_HUB_OFFLINE=1 then reads it from the cache, asking the Hub nothing)"
        return (f"is neither a local path nor in the Hub cache {constants.HF_HUB_CACHE}, and {offline}; fetch it "
                f"once with network access{then}, name a local path instead, or correct the name")
    if isinstance(err, GatedRepoError):
        return "is gated; accept its conditions on its Hub page and log in (hf auth login, or HF_TOKEN)"
    if isinstance(err, RepositoryNotFoundError):
        return (f"is neither a local path nor a repository {where} (or it is private: log in with hf auth login, "
                "or HF_TOKEN); correct the name")
    if isinstance(err, RevisionNotFoundError):
        return "has no such revision; name one of its branches, tags or commits"
    return f"could not be fetched ({' '.join(str(err).split())}); try again later"
