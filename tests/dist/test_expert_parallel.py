"""Expert parallelism's dispatch (tests/dist/expert_parallel_worker.py, gloo), for every mixture-of-experts family
of tests/model_matrix.py (Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3), fp32, 1e-5 relative:
- on 2 processes (ep 2), computed by the class's eager loop and by transformers' grouped_mm, the experts of a layer
  split over the ranks give the unsplit experts module's output, and its gradients w.r.t. the hidden states, the
  routing weights and each rank's experts' parameters, also when every token goes to the first rank's experts and
  the second receives none;
- on 4 processes (ep 2 x efsdp 2: each expert also sharded by FSDP2 over the other two ranks, the rest of the model
  over all four), a whole model's per-rank losses and every gradient equal the unsplit model's, and so do
  llmtune's gradient norm (the experts' DTensors on a mesh of their own, counted once) and the clipped gradients;
  and every parameter set from a whole value rank by rank (model/state.copy_rows) reads back as it."""

import json
import subprocess
import sys

import pytest

from tests.dist.expert_parallel_worker import ROUTINGS
from tests.helpers import REPO
from tests.model_matrix import FAMILIES

FAMILY_NAMES = [family.name for family in FAMILIES if family.mixture_of_experts]
IMPLEMENTATIONS = {"eager": "forward", "grouped_mm": "grouped_mm_experts_forward"}


def launch(mode: str, nproc: int, out) -> list[dict]:
    """The worker's reports of `mode` on `nproc` processes. Run as a module from the repository, which puts it on the
    workers' path for the worker's imports from tests/."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                             "-m", "tests.dist.expert_parallel_worker", mode, str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (out / "reports.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    return launch("dispatch", 2, tmp_path_factory.mktemp("expert_parallel"))


@pytest.fixture(scope="module")
def fsdp_reports(tmp_path_factory) -> list[dict]:
    return launch("fsdp", 4, tmp_path_factory.mktemp("expert_parallel_fsdp"))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_split_experts_give_the_unsplit_output_and_gradients(reports, family):
    mine = [r for r in reports if r["family"] == family]
    assert {(r["rank"], r["implementation"], r["routing"]) for r in mine} == {
        (rank, implementation, routing) for rank in (0, 1) for implementation in IMPLEMENTATIONS
        for routing in ROUTINGS}
    for report in mine:
        assert report["differences"] == [], report
        # Routed through llmtune's dispatch, each rank holding half of the 4 experts, computed by the family's
        # implementation the model had before.
        assert report["dispatch"] == "llmtune_expert_parallel"
        assert report["local_compute"] == IMPLEMENTATIONS[report["implementation"]]
        assert report["local_experts"] == 2 and all(shape[0] == 2 for shape in report["local_shapes"])


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_experts_split_over_ep_and_sharded_by_fsdp_give_the_unsplit_models_losses_gradients_and_clipping(
        fsdp_reports, family):
    mine = [r for r in fsdp_reports if r["family"] == family]
    assert sorted(r["rank"] for r in mine) == [0, 1, 2, 3]
    for report in mine:
        assert report["differences"] == [], report
        # Each expert parameter a 2-D DTensor: its experts split over ep, each one's rows over efsdp.
        assert set(report["experts_placements"]) == {"(_StridedShard(dim=0, sf=2), Shard(dim=0))"}
