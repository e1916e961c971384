"""Tiny vision-language models of the real transformers classes, with a processor's files assembled offline (a
byte-level tokenizer with the family's special tokens, its chat template, the image processor's settings), small
images, and LLaMA-Factory-style data that mixes image rows with text rows: what the vision-language tests train."""

import json
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import byte_level_tokenizer

# Qwen2-VL's chat template (its default system text, an image part as its vision markers), and its special tokens.
QWEN_VL_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_VL_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Qwen's image settings (merge 2, CLIP's mean and std).
QWEN_IMAGE_PROCESSOR = {"temporal_patch_size": 2,
                        "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                        "image_std": [0.26862954, 0.26130258, 0.27577711],
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
    patch_size: int = 14


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
                      deepstack_visual_indexes=[0]), patch_size=16),
)
FAMILY = {family.name: family for family in VISION_FAMILIES}
IMAGE_SIZES = ((60, 40), (28, 28), (90, 56))


def tiny_vlm(folder: Path, family: VisionFamily = VISION_FAMILIES[0], seed: int = 0) -> Path:
    """A random model of the family's real class with its tokenizer, chat template and image processor settings
    (Qwen's, at the family's patch size, at most 16 merged patches an image)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    tokenizer = byte_level_tokenizer(folder, QWEN_VL_TEMPLATE, QWEN_VL_SPECIALS)
    ids = dict(zip(QWEN_VL_SPECIALS, tokenizer.convert_tokens_to_ids(list(QWEN_VL_SPECIALS))))
    config = AutoConfig.for_model(
        family.model_type, text_config=dict(vocab_size=len(tokenizer), bos_token_id=None,
                                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                            **{**TEXT, **family.text}),
        vision_config=family.vision, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    merged = (family.patch_size * 2) ** 2
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {**QWEN_IMAGE_PROCESSOR, "patch_size": family.patch_size, "min_pixels": merged, "max_pixels": merged * 16}))
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
