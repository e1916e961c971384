"""Expert parallelism's dispatch on 2 processes (one torchrun launch, gloo; tests/dist/expert_parallel_worker.py):
for every mixture-of-experts family of tests/model_matrix.py (Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3), computed
by the class's eager loop and by transformers' grouped_mm, the experts of a layer split over the 2 ranks give the
unsplit experts module's output, and its gradients w.r.t. the hidden states, the routing weights and each rank's
experts' parameters (fp32, 1e-5 relative), also when every token goes to the first rank's experts and the second
receives none."""

import json
import subprocess
import sys

import pytest

from tests.dist.expert_parallel_worker import ROUTINGS
from tests.helpers import REPO
from tests.model_matrix import FAMILIES

FAMILY_NAMES = [family.name for family in FAMILIES if family.mixture_of_experts]
IMPLEMENTATIONS = {"eager": "forward", "grouped_mm": "grouped_mm_experts_forward"}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("expert_parallel")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(REPO / "tests" / "dist" / "expert_parallel_worker.py"), str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (out / "reports.jsonl").read_text().splitlines()]


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
