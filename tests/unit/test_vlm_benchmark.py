"""benchmarks/vlm_sft.py documents every option in --help; its rows are seeded, each image where its marker stands in
both forms (LLaMA-Factory's and TRL's); llmtune's steps count every text and image token the model sees, padding
excluded, as transformers' processor makes them (a step of the whole data set, twice), and so do TRL's, where TRL is
installed. Its timed runs are by hand (docs/benchmarks.md)."""

import importlib.util
from pathlib import Path

import pytest

from tests.helpers import script_module, undocumented_options

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vlm_sft.py"
HAS_TRL = importlib.util.find_spec("trl") is not None
MAX_SIDE = 112  # the prepared run's: images of 112 x 112, 16 tokens each


@pytest.fixture(scope="module")
def benchmark():
    return script_module(SCRIPT)


def test_help_documents_every_option():
    assert not undocumented_options(SCRIPT)


def test_rows_are_seeded_with_each_image_where_its_marker_stands(benchmark, tmp_path):
    from PIL import Image

    rows = benchmark.vlm_rows(tmp_path / "a", 32, 224)
    assert rows == benchmark.vlm_rows(tmp_path / "b", 32, 224)
    assert (tmp_path / "a" / "images" / "0.png").read_bytes() == (tmp_path / "b" / "images" / "0.png").read_bytes()
    assert rows != benchmark.vlm_rows(tmp_path / "c", 32, 224, seed=1)
    assert {len(row["images"]) for row in rows} == {0, 1, 2}
    for row in rows:
        assert sum(m["content"].count("<image>") for m in row["messages"]) == len(row["images"])
        # TRL's form: an image part where each marker stood, the text around it as text parts.
        parts = benchmark.trl_messages(row["messages"])
        assert ["".join("<image>" if p["type"] == "image" else p["text"] for p in m["content"]) for m in parts] == \
            [m["content"] for m in row["messages"]]
    sizes = [Image.open(path).size for path in (tmp_path / "a" / "images").iterdir()]
    assert len(sizes) == sum(len(row["images"]) for row in rows)  # an image of its own each
    assert len(set(sizes)) > len(sizes) / 2
    assert all(benchmark.SMALLEST_SIDE <= side <= 224 for size in sizes for side in size)


@pytest.fixture(scope="module")
def prepared(benchmark, tmp_path_factory):
    """6 rows, all in one step of either side (TRL's batch of 6 rows; llmtune's packed row or rows), 2 steps."""
    root = tmp_path_factory.mktemp("vlm_sft")
    args = benchmark.build_parser().parse_args(["--rows", "6", "--batch", "6", "--max-side", str(MAX_SIDE),
                                                "--steps", "2", "--warmup", "0"])
    workload, setup = benchmark.prepare(root, args)
    return root, workload, setup


def test_the_setup_counts_each_images_tokens(benchmark, prepared):
    """prepare's tokens are transformers' processor's (checked against llmtune's built rows there): each image's
    tokens its grid's merged patches, 2 x 2 to a token."""
    root, _, setup = prepared
    processor = benchmark.processor(root / "model")
    images = [image for row in benchmark.trl_rows(root / "data") for image in row["images"]]
    grids = processor.image_processor(images=images, return_tensors="pt")["image_grid_thw"]
    assert setup["images"] == len(images) > 0
    assert setup["image_tokens"] == int(grids.prod(dim=1).sum()) // 4
    assert setup["tokens"] > setup["image_tokens"]


def test_llmtune_counts_every_text_and_image_token(benchmark, prepared):
    from llmtune.run.parallel import ParallelState

    root, workload, setup = prepared
    (root / "llmtune").mkdir()
    state = ParallelState.initialize()
    try:
        step = benchmark.llmtune_runner(workload, state, root / "llmtune")
        tokens = [step()[0] for _ in range(workload.warmup + workload.steps)]
    finally:
        state.close()
    assert tokens == [setup["tokens"]] * 2


@pytest.mark.skipif(not HAS_TRL, reason="TRL is not installed (pip install -e '.[bench]'): its side is not run")
def test_trl_counts_the_same_tokens_taking_turns(benchmark, prepared):
    root, workload, setup = prepared
    (root / "turns").mkdir()
    results = benchmark.run_turns(benchmark.NO_CHECKPOINTING, workload, root / "turns")
    trl, llmtune = results[benchmark.NO_CHECKPOINTING], results[benchmark.beside(benchmark.NO_CHECKPOINTING)]
    assert trl["step_tokens"] == llmtune["step_tokens"] == [setup["tokens"]] * 2
    # TRL's batch is padded to its longest row.
    assert all(padded > setup["tokens"] for padded in trl["padded_tokens"])
    assert len(trl["step_times_s"]) == len(trl["collate_s"]) == 2
