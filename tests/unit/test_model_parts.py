"""A vision-language model's three parts as LLaMA-Factory's freeze_* keys name them (model/multimodal.model_parts),
in every family of the tested matrix: every parameter of a module in one part (the base model's own, LLaVA-NeXT's
image_newline, in none: it trains whatever the keys say, as in LLaMA-Factory), the decoder's and the lm_head's in the
language model's, the vision tower and the projector not empty."""

import pytest
import torch
from transformers import AutoModelForImageTextToText

from llmtune.model.multimodal import model_parts, part_of
from tests.vision_models import VISION_FAMILIES, tiny_vlm


@pytest.mark.parametrize("family", VISION_FAMILIES, ids=[family.name for family in VISION_FAMILIES])
def test_every_parameter_is_in_its_part(family, tmp_path):
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm(tmp_path, family), dtype=torch.float32)
    parts = model_parts(model)
    owner = {name: part_of(name, parts) for name, _ in model.named_parameters()}
    own = {f"{model.base_model_prefix}.{name}" for name, _ in model.base_model.named_parameters(recurse=False)}
    assert {name for name, part in owner.items() if part is None} == own
    decoder = {id(p) for p in model.get_decoder().parameters()} | {id(model.lm_head.weight)}
    for name, param in model.named_parameters():
        assert (owner[name] == "language_model") == (id(param) in decoder), name
    assert {"vision_tower", "projector"} <= set(owner.values())
