"""`llmtune plan` of a vision-language model: the freeze keys decide what trains and how it is stored, the vision
blocks are FSDP units of their own (gathered with the layers, not at the peak, outside the root), a micro-batch's
rows are taken as filled with images of data.image_max_pixels, each of the tokens the family's processor gives it,
and what the vision tower holds of them for backward is what a real forward of the tower holds (the tiny families
of tests/vision_models.py, built by transformers)."""

import math

import pytest
import torch
import yaml
from PIL import Image
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForImageTextToText, AutoTokenizer, Gemma3Config

from llmtune.config import load_config
from llmtune.data.images import MAX_PIXELS, ImageInputs, family_processor
from llmtune.features.multimodal_freezing import MultimodalFreezing
from llmtune.model.build import decoder_layers, load_model_config
from llmtune.model.checkpointing import enable_checkpointing
from llmtune.model.multimodal import image_input_names
from llmtune.run import cli
from llmtune.run.plan import plan_memory
from tests.vision_models import FAMILY, TEXT, tiny_vlm

SEQ_LEN, ROWS = 256, 2
SIDE = math.isqrt(MAX_PIXELS)  # data.image_max_pixels' default, 768 x 768
# The vision tower and the projector of two layouts, as transformers names their modules: Qwen's merger inside its
# tower, LLaVA's projector beside it.
PARTS = {"Qwen2-VL": ("model.visual", "model.visual.merger"),
         "LLaVA": ("model.vision_tower", "model.multi_modal_projector")}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny model of a family, by name, built once for the module."""
    built = {}

    def of(name: str):
        if name not in built:
            built[name] = tiny_vlm(tmp_path_factory.mktemp(name), FAMILY[name])
        return built[name]
    return of


def recipe_text(model, tmp_path, seq_len: int = SEQ_LEN, **train) -> dict:
    return {"model": {"name_or_path": str(model)}, "data": {"train_files": ["not/needed.jsonl"], "max_seq_len": seq_len},
            "train": {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": ROWS, **train}}


def recipe(model, tmp_path, seq_len: int = SEQ_LEN, **train):
    return load_config(recipe_text(model, tmp_path, seq_len, **train), [], "sft", world_size=1)


def plan_of(config):
    return plan_memory(config, load_model_config(config.model, config.head()), 1)


def numel(params) -> int:
    return sum(p.numel() for p in params)


@pytest.mark.parametrize("name", PARTS)
@pytest.mark.parametrize("tower, projector, language", [(True, True, False), (False, True, False),
                                                        (False, False, False), (True, False, True)])
def test_the_freeze_keys_decide_what_trains_and_how_it_is_stored(folder, tmp_path, name, tower, projector, language):
    config = recipe(folder(name), tmp_path, bf16=True, freeze_vision_tower=tower, freeze_multi_modal_projector=projector,
                    freeze_language_model=language)
    plan = plan_of(config)
    model = AutoModelForImageTextToText.from_pretrained(folder(name))
    tower_module, projector_module = (model.get_submodule(module) for module in PARTS[name])
    projector_params = set(projector_module.parameters())
    tower_params = set(tower_module.parameters()) - projector_params
    sizes = {"tower": numel(tower_params), "projector": numel(projector_params)}
    sizes["language"] = numel(model.parameters()) - sizes["tower"] - sizes["projector"]
    frozen = {"tower": tower, "projector": projector, "language": language}
    trained = sum(size for part, size in sizes.items() if not frozen[part])
    assert (plan.total_params, plan.trainable) == (numel(model.parameters()), trained)
    assert plan.vision.parts == (("vision_tower", sizes["tower"], 0 if tower else sizes["tower"]),
                                 ("projector", sizes["projector"], 0 if projector else sizes["projector"]))
    # One rank: fp32 master weights where they train, the frozen ones in bf16; fp32 gradients and two moments.
    assert plan.params == trained * 4 + (plan.total_params - trained) * 2
    assert (plan.grads, plan.optimizer) == (trained * 4, trained * 8)


@pytest.mark.parametrize("name", PARTS)
def test_the_vision_blocks_are_fsdp_units_gathered_with_the_layers_but_not_at_the_peak(folder, tmp_path, name):
    """At the start of backward the language model's last layer is in backward; the vision blocks, resharded after
    their forward, hold nothing gathered. They are among the units gathered together (all_layers), and their weights
    are not the root's."""
    plan = plan_of(recipe(folder(name), tmp_path, bf16=True))
    model = AutoModelForImageTextToText.from_pretrained(folder(name))
    units, language = decoder_layers(model), set(model.get_decoder().modules())
    assert any(unit not in language for unit in units), "the family's vision blocks are units"
    assert plan.largest_layer == max(numel(unit.parameters()) for unit in units if unit in language) * 2
    assert plan.all_layers == sum(numel(unit.parameters()) for unit in units) * 2
    in_units = {p for unit in units for p in unit.parameters()}
    assert plan.root == numel(p for p in model.parameters() if p not in in_units) * 2
    assert plan.sharded_modules == len(units) + 1


def image_inputs(model_folder, name: str) -> ImageInputs:
    """The run's image processing of the model (data/images.attach's)."""
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    processor = family_processor(FAMILY[name].model_type, str(model_folder), tokenizer)
    return ImageInputs(processor, processor.image_token, MAX_PIXELS, 1, str(model_folder))


@pytest.mark.parametrize("name", ["Qwen2-VL", "Qwen3-VL", "LLaVA", "LLaVA-NeXT", "Idefics3"])
def test_a_micro_batch_holds_as_many_images_as_its_rows_hold_of_the_tokens_the_processor_gives(folder, tmp_path,
                                                                                                name):
    inputs = image_inputs(folder(name), name)
    ids, tensors = inputs.encoded(Image.new("RGB", (SIDE, SIDE)))
    tokens = ids.count(inputs.image_token_id)
    if name.startswith("Qwen"):
        assert tokens == tensors["image_grid_thw"].prod() // 4  # one token per 2 x 2 merged patches
    vision = plan_of(recipe(folder(name), tmp_path)).vision
    assert (vision.side, vision.tokens, vision.images) == (SIDE, tokens, ROWS * (SEQ_LEN // tokens))
    # A row shorter than one image's tokens holds one.
    assert plan_of(recipe(folder(name), tmp_path, seq_len=tokens - 1)).vision.images == ROWS


class Made(TorchDispatchMode):
    """Every storage the ops of a forward make, held weakly: those still alive after it, once the step keeps only
    what it reads of the output, are what the forward's graph keeps for backward."""

    def __init__(self):
        super().__init__()
        self.storages = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                known = self.storages.get(storage._cdata)
                if known is None or known[0].expired():  # a freed storage's address taken again
                    self.storages[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        return out


def tower_holds(model, image: dict) -> int:
    """Bytes a real forward of the model's vision tower (model/multimodal.decode's call of it) leaves alive for
    backward, but the features the language model reads (pooler_output, Qwen3-VL's deepstack features), the weights
    and buffers. The image's tensors are copied in it, as FSDP2's mixed precision copies the run's inputs (a patch
    embedding keeps its pixels)."""
    weights = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    made = Made()
    with made:
        encoded = model.base_model.get_image_features(**{key: t.clone() for key, t in image.items()},
                                                      return_dict=True)
    read = [encoded.pooler_output, getattr(encoded, "deepstack_features", None)]
    del encoded
    features = {leaf.untyped_storage()._cdata for leaf in pytree.tree_leaves(read) if isinstance(leaf, torch.Tensor)}
    return sum(nbytes for cdata, (ref, nbytes) in made.storages.items()
               if not ref.expired() and cdata not in weights | features)


@pytest.mark.parametrize("name", ["Qwen2-VL", "Qwen3-VL", "LLaVA", "Idefics3"])
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_tower_holds_for_backward_what_a_real_forward_of_it_holds(folder, tmp_path, name, frozen, checkpointing):
    """A real fp32 forward on CPU of the tower built by transformers, frozen as the run freezes it and with
    activation checkpointing as build_model enables it, on the processor's tensors of the plan's image: what it leaves
    alive is the plan's figure for one image, exactly. Frozen, nothing."""
    config = recipe(folder(name), tmp_path, freeze_vision_tower=frozen, freeze_multi_modal_projector=frozen,
                    gradient_checkpointing=checkpointing)
    vision = plan_of(config).vision
    model = AutoModelForImageTextToText.from_pretrained(folder(name), dtype=torch.float32, attn_implementation="sdpa")
    MultimodalFreezing(config).build(model, None)
    if checkpointing:
        enable_checkpointing(model, "full")
    model.train()
    _, tensors = image_inputs(folder(name), name).encoded(Image.new("RGB", (SIDE, SIDE)))
    image = {key: tensors[key] for key in image_input_names(model.base_model) if key in tensors}
    held = tower_holds(model, image)
    assert vision.activations[checkpointing] == vision.images * held
    assert (held == 0) == frozen


def test_a_folder_of_config_json_alone_takes_the_image_processors_defaults_sized_to_the_tower(tmp_path):
    """Gemma 3's image processor class resizes to 224 pixels by default; the model's tower takes its config's
    image_size (here 28: 2 x 2 patches of 14, pooled into mm_tokens_per_image 4): the image is sized to the tower."""
    Gemma3Config(text_config={**TEXT, "vocab_size": 300, "head_dim": 16},
                 vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=28, patch_size=14, vision_use_head=False),
                 mm_tokens_per_image=4).save_pretrained(tmp_path / "gemma")
    assert [path.name for path in (tmp_path / "gemma").iterdir()] == ["config.json"]
    vision = plan_of(recipe(tmp_path / "gemma", tmp_path)).vision
    assert (vision.tokens, vision.images) == (4, ROWS * SEQ_LEN // 4)


def test_the_plan_says_the_tower_the_images_and_their_activations(folder, tmp_path, capsys):
    train = {"gradient_checkpointing": True, "freeze_vision_tower": False}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_text(folder("Qwen2-VL"), tmp_path, **train)))
    assert cli.main(["plan", str(path), "--task", "sft"]) == 0
    out = capsys.readouterr().out
    vision = plan_of(recipe(folder("Qwen2-VL"), tmp_path, **train)).vision
    (_, tower, _), (_, projector, _) = vision.parts
    assert f"vision: tower {tower / 1e9:.3g}B parameters, trained; projector {projector / 1e9:.3g}B parameters, " \
        "frozen\n" in out
    assert (f"images: {vision.images} of {SIDE} x {SIDE} a micro-batch, {vision.tokens} image tokens each: rows "
            "filled with images (no data is read; data.image_max_pixels)\n") in out
    assert f"    of which the vision tower's ({vision.images} images)" in out
    assert "  embeddings, lm_head, norm, projector gathered (fp32)" in out
