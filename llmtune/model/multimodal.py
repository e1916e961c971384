"""Vision-language models (transformers' AutoModelForImageTextToText families: Qwen2-VL to Qwen3.5, LLaVA, ...): which
configs are theirs, and the one forward of their decoder that every training forward method calls (`decode`).

The model's own base model (`hf_model.base_model`: Qwen2VLModel, LlavaModel) merges the image embeddings into the
text's and runs the language model; llmtune calls it with the images already encoded, through the image encoder's
own method (`get_image_features`, handed back as `mm_encoder_outputs`, which every such family takes), so that the
vision tower runs first on every micro-batch and on every rank: its blocks are FSDP units, whose all-gathers must
come in the same order on all ranks. A micro-batch without images (a text-only row of a mixed dataset, a filler)
gives the blank image (data/images.py's, flagged BLANK_IMAGES): it is encoded and its embeddings are added times 0
to the hidden states (the same values; every trainable vision weight gets its gradient, 0, on every rank).
"""

import inspect
import re
import sys
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

BLANK_IMAGES = "blank_images"  # a micro-batch's flag: its image inputs are the blank image's, read by no token


def is_multimodal(model_config) -> bool:
    """Whether the config is a vision-language model's (a vision tower's config beside the text model's)."""
    return getattr(model_config, "vision_config", None) is not None


def text_config(model_config):
    """The language model's config: a vision-language model's text_config, a text model's config itself."""
    return model_config.get_text_config() if is_multimodal(model_config) else model_config


def image_input_names(body) -> tuple[str, ...]:
    """The keyword arguments of the base model's image encoder (pixel_values, image_grid_thw, image_sizes, ...)."""
    parameters = inspect.signature(body.get_image_features).parameters.values()
    return tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def decode(hf_model, input_ids, attention_mask, position_ids, model_kwargs: dict):
    """The base model's outputs for a micro-batch whose image inputs are among `model_kwargs` (collate.image_inputs):
    the images encoded first, then the text with their embeddings in place."""
    body = hf_model.base_model
    names = image_input_names(body)
    # Gemma 3's token types, from which transformers builds its image tokens' mask where it builds one (flex
    # attention); the document attention reads the image blocks the packed documents' feature adds.
    kwargs = {**(token_types(hf_model, input_ids) if image_blocks(hf_model) else {}), **model_kwargs}
    blank = kwargs.pop(BLANK_IMAGES, False)
    encoded = body.get_image_features(**{name: kwargs.pop(name) for name in names if name in kwargs},
                                      return_dict=True)
    if not blank:
        return body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                    mm_encoder_outputs={"image": encoded}, **kwargs)
    outputs = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                   **kwargs)
    encodings = [leaf for leaf in pytree.tree_leaves(dict(encoded)) if isinstance(leaf, torch.Tensor)
                 and leaf.is_floating_point()]
    outputs.last_hidden_state = outputs.last_hidden_state + sum(leaf.sum() for leaf in encodings) * 0.0
    return outputs


def text_attention(hf_model) -> str | None:
    """The attention backend of the language model's layers (a vision tower keeps its own)."""
    return text_config(hf_model.config)._attn_implementation


def set_text_attention(hf_model, backend: str) -> None:
    """Set the language model's attention backend alone: a vision tower attends its own patches through its own
    (Qwen's cuts them per image), and a feature's backend of packed documents would cut them otherwise."""
    config = hf_model.config
    if not is_multimodal(config):
        hf_model.set_attn_implementation(backend)
        return
    key = next(key for key in config.sub_configs if getattr(config, key) is config.get_text_config())
    hf_model.set_attn_implementation({key: backend})


# The modules that project the vision tower's features to the language model's width, by the names the families
# give them (LLaVA's and Gemma 3's multi_modal_projector, Idefics3's connector, Qwen's merger inside its tower).
PROJECTORS = ("multi_modal_projector", "connector", "merger")
LANGUAGE_MODELS = ("language_model", "text_model")  # the families' names of it (Idefics3's and SmolVLM's the second)


def model_parts(hf_model) -> dict[str, list[str]]:
    """The module names of a vision-language model's three parts, as LLaMA-Factory's freeze_* keys name them:
    vision_tower (every module of the base model besides the language model and the projector), projector and
    language_model (with the lm_head). Empty for a text model."""
    if not is_multimodal(hf_model.config):
        return {}
    prefix, body = hf_model.base_model_prefix, hf_model.base_model
    projector = [name for name, _ in body.named_modules() if name.rpartition(".")[2] in PROJECTORS]
    projector = [name for name in projector if not any(name.startswith(outer + ".") for outer in projector)]
    language = [name for name, _ in body.named_children() if name in LANGUAGE_MODELS]
    tower = [name for name, _ in body.named_children() if name not in language and name not in projector]
    return {"vision_tower": [f"{prefix}.{name}" for name in tower],
            "projector": [f"{prefix}.{name}" for name in projector],
            "language_model": [f"{prefix}.{name}" for name in language] + ["lm_head"]}


def part_of(name: str, parts: dict[str, list[str]]) -> str | None:
    """Which part a parameter or module name belongs to: the one with the longest prefix of it (Qwen's merger is
    inside its vision tower's module)."""
    found = [(len(prefix), part) for part, prefixes in parts.items() for prefix in prefixes
             if name == prefix or name.startswith(prefix + ".")]
    return max(found)[1] if found else None


def frozen_parts(train_cfg) -> set[str]:
    """The parts train.freeze_vision_tower, freeze_multi_modal_projector and freeze_language_model freeze."""
    return {part for part, frozen in (("vision_tower", train_cfg.freeze_vision_tower),
                                      ("projector", train_cfg.freeze_multi_modal_projector),
                                      ("language_model", train_cfg.freeze_language_model)) if frozen}


def frozen_pattern(hf_model, train_cfg) -> str | None:
    """A regular expression (peft's exclude_modules, matched whole) of the modules in a frozen part, which peft must
    not adapt (LLaMA-Factory's forbidden modules); None for a text model or nothing frozen."""
    parts, frozen = model_parts(hf_model), frozen_parts(train_cfg)
    excluded = [prefix for part in frozen for prefix in parts.get(part, ())]
    if not excluded:
        return None
    # A trained part nested inside a frozen one (Qwen's merger in its vision tower) stays adaptable.
    kept = [prefix for part, prefixes in parts.items() if part not in frozen for prefix in prefixes
            if any(prefix.startswith(outer + ".") for outer in excluded)]
    inside = f"(?!(?:{'|'.join(map(re.escape, kept))})(?:\\.|$))" if kept else ""
    return f"{inside}(?:{'|'.join(map(re.escape, excluded))})(?:\\..*)?"


# The attribute of the run's tokenizer that holds a vision-language model's image processing (data/images.py).
IMAGE_INPUTS = "llmtune_images"


def save_processor(tokenizer, folder) -> None:
    """Beside a saved tokenizer, a vision-language model's image processor settings (preprocessor_config.json) and
    its processor's (processor_config.json, where the model's folder has one): the model's folder holds them all, as
    AutoProcessor reads them."""
    if (found := getattr(tokenizer, IMAGE_INPUTS, None)) is None:
        return
    found.processor.image_processor.save_pretrained(folder)
    settings = found.folder / "processor_config.json"
    if settings.is_file():
        (Path(folder) / settings.name).write_bytes(settings.read_bytes())


def image_blocks(hf_model):
    """For a family whose image tokens attend to each other both ways (Gemma 3), a function of [b, S] token ids ->
    their image blocks as its mask reads them: transformers' get_block_sequence_ids_for_mask of the image tokens'
    types, one number per run of an image's tokens, -1 elsewhere. None for the others, whose image tokens attend
    causally as text does."""
    if not is_multimodal(hf_model.config):  # Gemma 3's text model shares the module
        return None
    blocks = getattr(sys.modules[type(hf_model.base_model).__module__], "get_block_sequence_ids_for_mask", None)
    image_token = hf_model.config.image_token_id
    return blocks and (lambda input_ids: blocks((input_ids == image_token).int(), input_ids.device))


def token_types(hf_model, input_ids: torch.Tensor) -> dict:
    """The token types transformers' forward of the family reads beside the ids, 1 on image tokens, as its processor
    gives them: Qwen's mm_token_type_ids (its multimodal rope places the image tokens), Gemma 3's token_type_ids
    (its image blocks attend both ways); none for the other families."""
    parameters = inspect.signature(hf_model.forward).parameters
    types = (input_ids == hf_model.config.image_token_id).int()
    if "mm_token_type_ids" in parameters:
        return {"mm_token_type_ids": types}
    # PaliGemma's token_type_ids mean something else (its prompt and its answer): Gemma 3's go with image blocks.
    return {"token_type_ids": types} if "token_type_ids" in parameters and image_blocks(hf_model) else {}


def generation_inputs(hf_model, input_ids: torch.Tensor, images: list[dict]) -> dict:
    """What transformers' generate of a vision-language model takes besides the token ids of a batch whose rows hold
    images (`images`: each row's tensors, data/images.py's, in row order): the image tensors concatenated, and the
    family's token types (`token_types`)."""
    found = [tensors for tensors in images if tensors]
    if not found:
        return {}
    inputs = {name: torch.cat([tensors[name] for tensors in found]).to(input_ids.device) for name in found[0]}
    return {**inputs, **token_types(hf_model, input_ids)}
