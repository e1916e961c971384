"""Where image rows come from besides a local file. LLaMA-Factory's rlhf_v entry (hf_hub_url llamafactory/RLHF-V, its
images a datasets Image column) read from the huggingface_hub cache offline: dpo on it trains as on the same pairs
from a local file of image paths. A stream (data.streaming): its packed rows carry their samples' images."""

import json

import datasets
import pytest
from huggingface_hub import constants

from llmtune.config import DataConfig
from llmtune.data.registry import split_sources
from llmtune.errors import UserError
from tests.vision_hub import RLHF_V, RLHF_V_ENTRY, rlhf_v_cache
from tests.vision_models import tiny_vlm, write_images


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    return tmp_path


def test_rlhf_v_from_the_hub_cache_trains_as_the_same_pairs_from_a_file(hf_home, tmp_path):
    import llmtune

    vlm = tiny_vlm(tmp_path / "model")
    local = tmp_path / "local"
    names = [local / "images" / name for name in write_images(local / "images")]
    rows = rlhf_v_cache(hf_home, names)
    assert sum(bool(row["images"]) for row in rows) == len(rows) - 1
    (local / "pairs.json").write_text(json.dumps(rows))
    hub = tmp_path / "hub_info"
    hub.mkdir()
    (hub / "dataset_info.json").write_text(json.dumps({"rlhf_v": RLHF_V_ENTRY}))
    (local / "dataset_info.json").write_text(json.dumps({"rlhf_v": {
        **{k: v for k, v in RLHF_V_ENTRY.items() if k != "hf_hub_url"}, "file_name": "pairs.json"}}))
    # Where the Hub copy is read: as data.train_files names a Hub dataset, at LLaMA-Factory's default split.
    [source] = split_sources(DataConfig(dataset_info=str(hub), datasets=["rlhf_v"]), "dpo", "train")
    assert source.pattern == f"{RLHF_V}::train"
    metrics = {}
    for name, folder in (("hub", hub), ("local", local)):
        llmtune.train("dpo", {"model": {"name_or_path": str(vlm)},
                              "data": {"dataset_info": str(folder), "datasets": ["rlhf_v"], "max_seq_len": 512,
                                       "cache_dir": str(tmp_path / f"cache_{name}")},
                              "train": {"output_dir": str(tmp_path / name), "max_steps": 2, "learning_rate": 2e-3,
                                        "warmup_ratio": 0, "logging_steps": 1, "per_device_train_batch_size": 2,
                                        "gradient_accumulation_steps": 1},
                              "checkpoint": {"export_hf": False}})
        metrics[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "grad_norm", "rewards/margins"):
        assert [m[key] for m in metrics["hub"]] == pytest.approx([m[key] for m in metrics["local"]], rel=1e-5,
                                                                 abs=1e-7), key
    assert metrics["hub"][-1]["loss"] != metrics["hub"][0]["loss"]


@pytest.mark.parametrize("entry, expected", [
    ({"hf_hub_url": RLHF_V, "subset": "v2", "split": "test"}, f"{RLHF_V}:v2:test"),
    ({"hf_hub_url": RLHF_V, "file_name": "local.json"}, f"{RLHF_V}::train"),  # LLaMA-Factory reads the Hub's
    ({"hf_hub_url": RLHF_V, "split": "a:b"}, "split must be a name without ':'"),
    ({"ms_hub_url": "org/name"}, "ms_hub_url is not read from dataset_info.json; download the files and set file_name"),
    ({"hf_hub_url": RLHF_V, "folder": "sub"}, "folder not supported; an entry may have file_name"),
])
def test_an_hf_hub_url_entry_is_the_hub_dataset_it_names(entry, expected, tmp_path):
    (tmp_path / "dataset_info.json").write_text(json.dumps({"d": {"formatting": "sharegpt", **entry}}))
    data_cfg = DataConfig(dataset_info=str(tmp_path), datasets=["d"])
    if ":" in expected and " " not in expected:
        assert split_sources(data_cfg, "sft", "train")[0].pattern == expected
    else:
        with pytest.raises(UserError, match=expected):
            split_sources(data_cfg, "sft", "train")


def test_a_streams_packed_rows_carry_their_samples_images(tmp_path):
    import torch

    from llmtune.config import ModelConfig
    from llmtune.data import images
    from llmtune.data.build import build_stream
    from llmtune.data.templates import recipe_tokenizer
    from tests.vision_models import image_conversations

    vlm, data = tiny_vlm(tmp_path / "model"), image_conversations(tmp_path / "mllm")
    data_cfg = DataConfig(dataset_info=str(data), datasets=["mllm"], max_seq_len=256, streaming=True,
                          cache_dir=str(tmp_path / "cache"))
    tokenizer = recipe_tokenizer("sft", ModelConfig(name_or_path=str(vlm)), data_cfg)
    token = images.of(tokenizer).image_token_id
    rows = list(build_stream("sft", data_cfg, tokenizer, 0))
    assert max(row["position_ids"].count(0) for row in rows) > 1, "several samples share a row"
    for row in rows:
        runs = [len(run) for run in "".join("i" if t == token else " " for t in row["input_ids"]).split()]
        grids = [images.unblob(blob)["image_grid_thw"] for blob in row[images.IMAGES]]
        assert runs == [int(grid.prod()) // 4 for grid in torch.cat(grids)] if grids else runs == []
    assert sum(len(row[images.IMAGES]) for row in rows) == 8  # the data's 4 images, twice


def test_a_vision_language_model_named_by_its_hub_id_brings_its_processor(hf_home, tmp_path):
    import llmtune
    from tests.helpers import add_to_hub_cache
    from tests.vision_models import image_conversations

    add_to_hub_cache(hf_home, "org/tiny-vlm", "model", tiny_vlm(tmp_path / "model"), "f" * 40, refs=("main",))
    data, out = image_conversations(tmp_path / "mllm"), tmp_path / "out"
    llmtune.train("sft", {"model": {"name_or_path": "org/tiny-vlm"},
                          "data": {"dataset_info": str(data), "datasets": ["mllm"], "max_seq_len": 256,
                                   "cache_dir": str(tmp_path / "cache")},
                          "train": {"output_dir": str(out), "max_steps": 1, "per_device_train_batch_size": 1,
                                    "gradient_accumulation_steps": 1}})
    # The image processor's settings came from the snapshot and went to the export.
    exported = json.loads((out / "hf" / "preprocessor_config.json").read_text())
    given = json.loads((tmp_path / "model" / "preprocessor_config.json").read_text())
    assert exported["size"] == {"longest_edge": given["max_pixels"], "shortest_edge": given["min_pixels"]}
    log = (out / "train.log").read_text()
    assert "images (" in log and "image tokens)" in log
