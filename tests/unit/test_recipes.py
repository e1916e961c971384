"""Every recipe in recipes/ loads on the layouts it is written for, and every model a recipe names by Hub id is
built on the meta device from its real shapes (tests/real_shapes.py): it has its published size, llmtune finds
its decoder layers to shard, and the recipe's context parallelism and sequence length fit it."""

import copy
import functools
import json
from pathlib import Path

import pytest
import torch
from peft import inject_adapter_in_model
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from llmtune.config import load_config
from llmtune.features.adapters import lora_config
from llmtune.features.registry import check_features
from llmtune.features.ulysses import layout_problems
from llmtune.model.build import decoder_layers
from llmtune.model.pretrained import Converted, weight_sources
from llmtune.model.state import saved_tensors
from tests.real_shapes import REAL_MODELS

RECIPES = Path(__file__).resolve().parents[2] / "recipes"

# Recipe -> (task, world sizes it must load on). The first world size is the layout its header names; the
# others are more nodes, on which it keeps its global batch. A recipe missing here fails
# test_every_recipe_has_a_layout, so that none goes unchecked.
LAYOUTS = {
    "demo/pt.yaml": ("pt", (1, 2)),
    "demo/sft.yaml": ("sft", (1, 2)),
    "demo/dpo.yaml": ("dpo", (1, 2)),
    "demo/grpo.yaml": ("grpo", (1, 2)),
    "demo/rm.yaml": ("rm", (1, 2)),
    "llama3/pt-continued.yaml": ("pt", (8, 16, 32)),
    "llama3/sft-8b.yaml": ("sft", (8, 16, 32)),
    "llama3/sft-8b-hsdp-2nodes.yaml": ("sft", (16, 32)),
    "llama3/qlora-70b-2gpus.yaml": ("sft", (2, 4, 8)),
    "qwen3/sft-8b.yaml": ("sft", (8, 16, 32)),
    "qwen3/sft-8b-lora.yaml": ("sft", (1, 2, 8)),
    "qwen3/sft-long-context-cp.yaml": ("sft", (8, 16)),
    "qwen3-moe/sft-30b-a3b-2nodes.yaml": ("sft", (16, 32)),
}
# The demo's recipes train models the demo writes itself; every other recipe names a real model.
REAL = sorted(name for name in LAYOUTS if not name.startswith("demo/"))


def recipe_files() -> list[str]:
    return sorted(str(path.relative_to(RECIPES)) for path in RECIPES.rglob("*.yaml"))


def load(name: str, world_size: int | None = None):
    task, world_sizes = LAYOUTS[name]
    return load_config(str(RECIPES / name), [], task, world_size or world_sizes[0])


@functools.cache
def meta_model(hub_id: str):
    """The model of `hub_id`, built from its real shapes with parameters on the meta device (no memory)."""
    shape = dict(REAL_MODELS[hub_id].shape)
    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_every_recipe_has_a_layout():
    assert recipe_files() == sorted(LAYOUTS), "add each recipe to LAYOUTS with its task and world sizes"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_recipe_loads_and_keeps_its_global_batch(name):
    for world_size in LAYOUTS[name][1]:
        config = load(name, world_size)
        train = config.train
        assert train.per_device_train_batch_size * config.dp_size(world_size) * train.gradient_accumulation_steps \
            == train.global_batch_size, f"{name} on {world_size} ranks"


@pytest.mark.parametrize("name", REAL)
def test_real_recipe_header_names_its_launch(name):
    task = LAYOUTS[name][0]
    header = "".join(line for line in (RECIPES / name).read_text().splitlines(keepends=True) if line.startswith("#"))
    assert f"llmtune {task} recipes/{name}" in header
    assert load(name).model.name_or_path in header


# A count agrees with a published size within one unit of its last printed digit: model cards print 2 or 3
# digits, some rounded and some cut (Qwen3-30B-A3B's 3.3B activated parameters are 3.35B). That still tells a
# layer, an expert or a wrong intermediate size from the right one (0.1B and more at these sizes); the Hub's
# exact count (Llama) must match to the parameter.
def assert_published(count: int, published_b: float):
    digits = len(str(published_b).split(".")[1])
    assert abs(count / 1e9 - published_b) <= 10 ** -digits + 1e-9, f"{count / 1e9:.3f}B, published {published_b}B"


@pytest.mark.parametrize("hub_id", sorted(REAL_MODELS))
def test_real_shapes_give_the_published_size(hub_id):
    real, model = REAL_MODELS[hub_id], meta_model(hub_id)
    shape = real.shape
    total = sum(p.numel() for p in model.parameters())  # a tied lm_head is the embedding: counted once
    assert_published(total, real.params_b)
    if real.non_embedding_b is not None:
        embeddings = {id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(),
                                                               model.get_output_embeddings())}
        assert_published(total - sum(embeddings.values()), real.non_embedding_b)
    if real.activated_b is not None:
        expert = 3 * shape["hidden_size"] * shape["moe_intermediate_size"]
        idle = (shape["num_experts"] - shape["num_experts_per_tok"]) * expert * shape["num_hidden_layers"]
        assert_published(total - idle, real.activated_b)


@pytest.mark.parametrize("name", REAL)
def test_recipe_fits_its_real_model(name):
    config = load(name)
    hub_id = config.model.name_or_path
    assert hub_id in REAL_MODELS, f"{name}: write the shapes of {hub_id} in tests/real_shapes.py"
    shape = REAL_MODELS[hub_id].shape
    model = meta_model(hub_id)
    assert len(decoder_layers(model)) == shape["num_hidden_layers"]
    assert layout_problems(model.config, config.parallel.cp_size) == []
    assert config.data.max_seq_len <= shape["max_position_embeddings"]
    assert config.train.bf16 and config.train.gradient_checkpointing and config.train.chunk_loss_size > 0
    check_features(config, model.config, LAYOUTS[name][1][0])


@pytest.mark.parametrize("name", REAL)
def test_the_loader_finds_every_weight_of_the_real_checkpoint_layout(name, tmp_path):
    """The recipe's model as save_pretrained stores it (the Hub's layout: Qwen3-MoE's experts one tensor each), as
    a safetensors header without its data: every weight is found under its stored name with its shape, the
    experts through a conversion each rank can apply to its own rows."""
    model = meta_model(load(name).model.name_or_path)
    tensors = saved_tensors(model)
    header, offset = {}, 0
    for key, tensor in revert_weight_conversion(model, dict(tensors)).items():
        end = offset + 2 * tensor.numel()
        header[key] = {"dtype": "BF16", "shape": list(tensor.shape), "data_offsets": [offset, end]}
        offset = end
    encoded = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(len(encoded).to_bytes(8, "little") + encoded)
    sources = weight_sources(model, tmp_path, tensors)
    assert tensors.keys() <= sources.keys()
    experts = [source for source in sources.values() if isinstance(source, Converted)]
    if model.config.model_type == "qwen3_moe":
        assert len(experts) == 2 * model.config.num_hidden_layers
        assert all(len(parts) == model.config.num_experts for source in experts for parts in source.parts.values())
    else:
        assert experts == []


def test_lora_recipe_header_gives_its_adapter_size():
    """The adapters the recipe's header counts: peft's layers on the real shapes, their parameters on the meta
    device."""
    config = load("qwen3/sft-8b-lora.yaml")
    model = copy.deepcopy(meta_model(config.model.name_or_path))
    inject_adapter_in_model(lora_config(config.peft), model, low_cpu_mem_usage=True)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert f"{adapters / 1e6:.1f}M parameters" in (RECIPES / "qwen3/sft-8b-lora.yaml").read_text()
