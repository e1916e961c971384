"""Hub ids under torchrun: two "nodes" of two processes each (two torchrun agents meeting on 127.0.0.1), each
node with a huggingface_hub cache of its own, offline, whose main names different commits (one node's cache
holds a later push). Rank 0 pins main to a commit; local rank 0 of each node fetches that commit while the
other ranks wait; then every rank reads the pinned commit from its node's cache. A missing id stops every rank
with rank 0's message."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmtune.hub import PIN_FILES
from tests.helpers import REPO, add_to_hub_cache, free_port, offline_hub

# main of node 0's cache, and of node 1's (both caches hold both commits).
COMMITS = [hashlib.sha1(b"org/tiny main").hexdigest(), hashlib.sha1(b"org/tiny main, a later push").hexdigest()]


@pytest.fixture(scope="module")
def reports(tiny_model, sft_file, tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("hub_fetch")
    homes = [root / "node0", root / "node1"]
    for home, main in zip(homes, COMMITS):
        for commit in COMMITS:
            add_to_hub_cache(home, "org/tiny", "model", tiny_model, commit, refs=("main",) if commit == main else ())
    recipes = []
    for model in ("org/tiny", "org/missing"):
        recipes.append(root / f"{model.split('/')[1]}.yaml")
        recipes[-1].write_text(yaml.safe_dump({
            "model": {"name_or_path": model},
            "data": {"train_files": [str(sft_file)], "chat_template": "basic"},
            "train": {"output_dir": str(root / "out")},
        }))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                                f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                                "--rdzv-id=llmtune-hub", "-m", "tests.dist.hub_fetch_worker", *map(str, recipes),
                                str(root)], cwd=REPO, env={**env, **offline_hub(home)}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
              for node, home in enumerate(homes)]
    for agent in agents:
        _, err = agent.communicate(timeout=600)
        assert agent.returncode == 0, err[-3000:]
    return [json.loads((root / f"rank_{rank}.json").read_text()) for rank in range(4)]


def pinned(reports: list[dict]) -> str:
    """The commit main names in rank 0's cache."""
    return (Path(reports[0]["hf_home"]) / "hub" / "models--org--tiny" / "refs" / "main").read_text()


def test_every_rank_reads_the_commit_rank_0_pinned(reports):
    commit = pinned(reports)
    assert len({r["hf_home"] for r in reports}) == 2, "two nodes, two caches"
    for report in reports:
        assert report["model"] == str(Path(report["hf_home"]) / "hub" / "models--org--tiny" / "snapshots" / commit)


def test_rank_0_pins_and_local_rank_0_of_each_node_fetches_while_the_others_wait(reports):
    commit = pinned(reports)
    assert [e["files"] for e in reports[0]["events"] if not e["local_files_only"]][0] == list(PIN_FILES["model"])
    for rank, report in enumerate(reports):
        fetches = [e for e in report["events"] if not e["local_files_only"] and e["files"] != list(PIN_FILES["model"])]
        if rank > 0:
            assert all(e["files"] != list(PIN_FILES["model"]) for e in report["events"]), "only rank 0 pins"
        if report["local_rank"] == 0:
            assert [e["revision"] for e in fetches] == [commit]
            continue
        assert fetches == [] and {e["revision"] for e in report["events"]} == {commit}
        downloader = next(r for r in reports if r["hf_home"] == report["hf_home"] and r["local_rank"] == 0)
        download_end = max(e["end"] for e in downloader["events"] if not e["local_files_only"])
        assert min(e["start"] for e in report["events"]) >= download_end, f"rank {rank} read before the download"


def test_a_missing_id_stops_every_rank_with_rank_0s_message(reports):
    cache = Path(reports[0]["hf_home"]) / "hub"
    for report in reports:
        assert report["error"].startswith(f"model.name_or_path: org/missing (revision main) is neither a local path "
                                          f"nor in the Hub cache {cache}, and HF_HUB_OFFLINE=1 forbids a download")
