"""Tiny vision-language models of the real transformers classes, with a processor's files assembled offline (a
byte-level tokenizer with the family's special tokens, its chat template, the image processor's settings), small
images, and LLaMA-Factory-style data that mixes image rows with text rows: what the vision-language tests train."""

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import byte_level_tokenizer

def chatml_template(image: str) -> str:
    """ChatML with Qwen2-VL's default system text, an image part rendered as `image` (what the family's own template
    writes for one)."""
    return ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
            "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}" + image +
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


QWEN_VL_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
               "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
GEMMA3_SPECIALS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def qwen_image_processor(patch_size: int) -> dict:
    """Qwen's image settings (merge 2, CLIP's mean and std) at the family's patch size, at most 16 merged patches an
    image."""
    merged = (patch_size * 2) ** 2
    return {"temporal_patch_size": 2, "merge_size": 2, "patch_size": patch_size, "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD, "min_pixels": merged, "max_pixels": merged * 16,
            "image_processor_type": "Qwen2VLImageProcessor"}


TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512)
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # head_dim 16: 8 frequencies


@dataclass(frozen=True)
class VisionFamily:
    name: str
    model_type: str
    features: str  # what the tiny config keeps of the real family
    text: dict = field(default_factory=dict)  # on top of TEXT
    vision: dict = field(default_factory=dict)
    image_processor: dict = field(default_factory=lambda: qwen_image_processor(14))  # preprocessor_config.json
    processor: dict = field(default_factory=dict)  # processor_config.json
    specials: tuple = QWEN_VL_SPECIALS
    image_part: str = "<|vision_start|><|image_pad|><|vision_end|>"  # what the family's template writes for an image
    tokens: dict = field(default_factory=lambda: dict(QWEN_TOKENS))  # config keys of special token ids
    config: dict = field(default_factory=dict)  # the config's other keys
    named_tokens: dict = field(default_factory=dict)  # the tokenizer's attributes naming special tokens
    # Parameters the class initialises to zeros, a released model's are not (Gemma 3's projection: with it, every
    # image's embeddings would be 0, and how its tokens attend would change no loss).
    randomized: tuple = ()
    requires: str | None = None  # a package the family's processor needs (an optional extra's)


IDEFICS3 = VisionFamily(
    "Idefics3", "idefics3", "SigLIP-style vision tower on each crop of an image split into tiles and on the whole, "
                            "pixel shuffle connector, crops' row and column tokens, Llama language model",
    dict(model_type="llama"),
    dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
         patch_size=14),
    {"do_image_splitting": True, "max_image_size": {"longest_edge": 56}, "size": {"longest_edge": 112},
     "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "image_processor_type": "Idefics3ImageProcessor"},
    {"image_seq_len": 4},  # (56 / 14)^2 patches / scale_factor 2^2
    ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
     *(f"<row_{i}_col_{j}>" for i in (1, 2) for j in (1, 2))),
    "<image>", {"image_token_id": "<image>"}, {"scale_factor": 2})


VISION_FAMILIES = (
    VisionFamily("Qwen2-VL", "qwen2_vl", "multimodal rope, vision blocks with their own rotary, patch merger",
                 dict(rope_parameters=MROPE),
                 dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)),
    VisionFamily("Qwen2.5-VL", "qwen2_5_vl", "multimodal rope, windowed vision attention with full-attention blocks, "
                                             "gated vision MLP",
                 dict(rope_parameters=MROPE),
                 dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])),
    VisionFamily("Qwen3-VL", "qwen3_vl", "interleaved multimodal rope, q/k norm, learned vision positions, deepstack "
                                         "features added to the first decoder layers",
                 dict(head_dim=16, rope_parameters={**MROPE, "mrope_interleaved": True}),
                 dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                      deepstack_visual_indexes=[0]), qwen_image_processor(16)),
    VisionFamily("Qwen3-VL-MoE", "qwen3_vl_moe", "Qwen3-VL's vision tower and rope, routed experts (4, 2 per "
                                                 "token) in every decoder layer",
                 dict(head_dim=16, rope_parameters={**MROPE, "mrope_interleaved": True}, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
                 dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                      deepstack_visual_indexes=[0]), qwen_image_processor(16)),
    VisionFamily("LLaVA", "llava", "CLIP vision tower (its CLS token dropped), features of its second-to-last layer, "
                                   "MLP projector, Llama language model",
                 dict(model_type="llama"),
                 dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, image_size=28, patch_size=14),
                 {"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28}, "do_center_crop": True,
                  "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "image_processor_type": "CLIPImageProcessor"},
                 {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1},
                 ("<image>",), "<image>", {"image_token_index": "<image>"}),
    VisionFamily("LLaVA-NeXT", "llava_next", "any-resolution tiles of each image beside its overview, their "
                                             "features unpadded by the image's size, an image_newline per row",
                 dict(model_type="llama"),
                 dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, image_size=28, patch_size=14),
                 {"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28}, "do_center_crop": True,
                  "image_grid_pinpoints": [[28, 56], [56, 28], [56, 56]], "do_pad": True, "image_mean": CLIP_MEAN,
                  "image_std": CLIP_STD, "image_processor_type": "LlavaNextImageProcessor"},
                 {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1},
                 ("<image>",), "<image>", {"image_token_index": "<image>"},
                 {"image_grid_pinpoints": [[28, 56], [56, 28], [56, 56]]}),
    VisionFamily("Qwen3.5", "qwen3_5", "Qwen3-VL's vision tower and interleaved multimodal rope, linear-attention "
                                       "(gated delta net) layers beside gated full-attention ones",
                 dict(head_dim=16, rope_parameters={**MROPE, "mrope_section": [2, 1, 1], "mrope_interleaved": True,
                                                    "partial_rotary_factor": 0.5},  # rope on 8 of 16 dims
                      layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4),
                 dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16),
                 qwen_image_processor(16)),
    IDEFICS3,
    dataclasses.replace(IDEFICS3, name="SmolVLM", model_type="smolvlm",
                        features="Idefics3's vision tower, split images and connector; SmolVLM's processor",
                        image_processor={**IDEFICS3.image_processor, "image_processor_type": "SmolVLMImageProcessor"},
                        requires="num2words"),
    VisionFamily("Gemma 3", "gemma3", "SigLIP tower, its patches average-pooled to the image's tokens, which attend "
                                      "to each other both ways, sliding-window layers (window 8, shorter than an "
                                      "image) beside full ones",
                 dict(model_type="gemma3_text", head_dim=16, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"]),
                 dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, image_size=56, patch_size=7, vision_use_head=False),
                 {"size": {"height": 56, "width": 56}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                  "image_processor_type": "Gemma3ImageProcessor"},
                 {"image_seq_length": 16},  # (56 / 7)^2 patches pooled 2 x 2
                 GEMMA3_SPECIALS, "<start_of_image>",
                 {"image_token_index": "<image_soft_token>", "boi_token_index": "<start_of_image>",
                  "eoi_token_index": "<end_of_image>"}, {"mm_tokens_per_image": 16},
                 dict(zip(("boi_token", "eoi_token", "image_token"), GEMMA3_SPECIALS)),
                 ("multi_modal_projector.mm_input_projection_weight",)),
)
FAMILY = {family.name: family for family in VISION_FAMILIES}
IMAGE_SIZES = ((60, 40), (28, 28), (90, 56))


def tiny_vlm(folder: Path, family: VisionFamily = VISION_FAMILIES[0], seed: int = 0) -> Path:
    """A random model of the family's real class with its tokenizer, chat template and processor's settings."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    tokenizer = byte_level_tokenizer(folder, chatml_template(family.image_part), family.specials, family.named_tokens)
    tokens = {key: tokenizer.convert_tokens_to_ids(token) for key, token in family.tokens.items()}
    config = AutoConfig.for_model(
        family.model_type, text_config=dict(vocab_size=len(tokenizer), bos_token_id=None,
                                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                            **{**TEXT, **family.text}),
        vision_config=family.vision, tie_word_embeddings=False, **tokens, **family.config)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(family.randomized):
                parameter.normal_(std=0.02)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(family.image_processor))
    if family.processor:
        (folder / "processor_config.json").write_text(json.dumps(family.processor))
    return folder


def write_images(folder: Path) -> list[str]:
    """Three small seeded images of different shapes (PNG), their names."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for number, (width, height) in enumerate(IMAGE_SIZES, start=1):
        pixels = np.random.default_rng(number).integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{number}.png")
        names.append(f"{number}.png")
    return names


def image_conversations(folder: Path, copies: int = 2) -> Path:
    """A LLaMA-Factory dataset_info.json in `folder` naming mllm (sharegpt with images, `<image>` markers, paths
    relative to the folder: two rows of one image, one of two, one with none) and its images in images/."""
    names = [f"images/{name}" for name in write_images(folder / "images")]
    rows = [
        {"messages": [{"role": "user", "content": "<image>Who is this?"},
                      {"role": "assistant", "content": "It is the sum five."}], "images": [names[0]]},
        {"messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "A tool."},
                      {"role": "user", "content": "And this one?<image>"},
                      {"role": "assistant", "content": "The numbers 2 and 3."}], "images": [names[1], names[2]]},
        {"messages": [{"role": "user", "content": "What is 2 plus 3?"},
                      {"role": "assistant", "content": "It is 5."}], "images": []},
        {"messages": [{"role": "user", "content": "Add the numbers.<image>"},
                      {"role": "assistant", "content": "The sum is five."}], "images": [names[2]]},
    ] * copies
    (folder / "mllm.json").write_text(json.dumps(rows))
    (folder / "dataset_info.json").write_text(json.dumps({"mllm": {
        "file_name": "mllm.json", "formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))
    return folder


def image_pairs(folder: Path, copies: int = 2) -> Path:
    """A LLaMA-Factory dataset_info.json in `folder` naming mllm_pairs (ranking sharegpt with images, as its rlhf_v
    entry reads RLHF-V: conversations, chosen, rejected, images), one pair without an image, images in images/."""
    names = [f"images/{name}" for name in write_images(folder / "images")]

    def pair(question, chosen, rejected, images):
        return {"conversations": [{"from": "human", "value": question}], "chosen": {"from": "gpt", "value": chosen},
                "rejected": {"from": "gpt", "value": rejected}, "images": images}

    rows = [pair("<image>What is it?", "A tool.", "The sum is five.", [names[0]]),
            pair("What is 2 plus 3?", "It is 5.", "It is 6.", []),
            pair("<image>And this one?<image>", "The numbers 2 and 3.", "A tool.", [names[1], names[2]]),
            pair("Add the numbers.<image>", "The sum is five.", "It is 2.", [names[2]])] * copies
    (folder / "mllm_pairs.json").write_text(json.dumps(rows))
    (folder / "dataset_info.json").write_text(json.dumps({"mllm_pairs": {
        "file_name": "mllm_pairs.json", "ranking": True, "formatting": "sharegpt",
        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected", "images": "images"}}}))
    return folder


def logits_on_an_image_sample(trainer, tokenizer, state):
    """(the trained model's logits on the first training row that holds images, that row): train_and_export's
    `then`, for an export's logits to be compared with."""
    import torch

    from llmtune.data import images
    from llmtune.data.collate import collate

    row = next(row for row in trainer.data.loader.dataset if row[images.IMAGES])
    inputs = trainer.features.transform(collate([row], pad_id=0, blank_image=b"").inputs)
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(**{k: v for k, v in inputs.items() if k != "shift_labels"})
    return logits, row
