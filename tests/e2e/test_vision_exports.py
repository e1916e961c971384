"""What a vision-language model's (a tiny Qwen2-VL's) export holds. LoRA, LLaMA-Factory's defaults (the vision tower
and projector frozen, adapters on the language model's linear layers alone): the adapter (peft loads it on the base
loaded by AutoModelForImageTextToText) and the merged whole model, each giving the trained logits on an image sample
(fp32, 1e-5), the frozen tower and projector bitwise the base's. Trained on text alone: the whole model still, its
tower as it came."""

import json

import torch
from safetensors.torch import load_file

from llmtune.config import load_config
from llmtune.data import images
from llmtune.model.multimodal import model_parts, part_of
from tests.helpers import train_and_export
from tests.vision_models import image_conversations, logits_on_an_image_sample, tiny_vlm


def test_lora_exports_the_adapter_and_the_merged_model_with_the_frozen_tower_unchanged(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    vlm, data = tiny_vlm(tmp_path / "model"), image_conversations(tmp_path / "mllm")
    out = tmp_path / "out"
    config = load_config({
        "model": {"name_or_path": str(vlm)},
        "data": {"dataset_info": str(data), "datasets": ["mllm"], "max_seq_len": 256, "packing": False,
                 "cache_dir": str(tmp_path / "cache")},
        "train": {"output_dir": str(out), "max_steps": 3, "learning_rate": 5e-2, "warmup_ratio": 0,
                  "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2},
        "peft": {"method": "lora", "target_modules": ["all-linear"]},
        "checkpoint": {"export_dtype": "fp32", "export_merged": True}}, [], "sft", world_size=1)

    logits, row = train_and_export(config, logits_on_an_image_sample)
    base = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32)
    parts = model_parts(base)
    # The adapters are the language model's alone.
    adapted = {name.removeprefix("base_model.model.") for name in load_file(out / "adapter" / "adapter_model.safetensors")}
    assert adapted and {part_of(name, parts) for name in adapted} == {"language_model"}
    merged = AutoModelForImageTextToText.from_pretrained(out / "hf", dtype=torch.float32).eval()
    trained, frozen = merged.state_dict(), base.state_dict()
    assert trained.keys() == frozen.keys()
    for name, tensor in frozen.items():
        if part_of(name, parts) in ("vision_tower", "projector"):
            assert torch.equal(trained[name], tensor), name
    assert any(not torch.equal(trained[name], frozen[name]) for name in frozen
               if part_of(name, parts) == "language_model"), "the adapters trained and were merged"
    ids = torch.tensor([row["input_ids"]])
    kwargs = images.merged(row[images.IMAGES])
    kwargs["mm_token_type_ids"] = (ids == base.config.image_token_id).int()
    with torch.no_grad():
        from_merged = merged(input_ids=ids, **kwargs).logits
        from_adapter = PeftModel.from_pretrained(base, out / "adapter").eval()(input_ids=ids, **kwargs).logits
    torch.testing.assert_close(from_merged, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(from_adapter, logits, rtol=0, atol=1e-5)


def test_a_vision_language_model_trained_on_text_alone_exports_whole(tmp_path):
    import llmtune
    from transformers import AutoModelForImageTextToText

    vlm, out = tiny_vlm(tmp_path / "model"), tmp_path / "out"
    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                          {"role": "assistant", "content": f"It is {a + b}."}]} for a in range(4) for b in range(2)]
    (tmp_path / "text.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    llmtune.train("sft", {"model": {"name_or_path": str(vlm)},
                          "data": {"train_files": [str(tmp_path / "text.jsonl")], "max_seq_len": 128,
                                   "cache_dir": str(tmp_path / "cache")},
                          "train": {"output_dir": str(out), "max_steps": 2, "learning_rate": 1e-2, "warmup_ratio": 0,
                                    "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1},
                          "checkpoint": {"export_dtype": "fp32"}})
    base = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32)
    exported = AutoModelForImageTextToText.from_pretrained(out / "hf", dtype=torch.float32)
    assert type(exported) is type(base)
    trained, original, parts = exported.state_dict(), base.state_dict(), model_parts(base)
    assert trained.keys() == original.keys()
    changed = {part_of(name, parts) for name in original if not torch.equal(trained[name], original[name])}
    assert changed == {"language_model"}
