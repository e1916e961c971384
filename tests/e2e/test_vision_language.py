"""Vision-language models (a tiny Qwen2-VL of the real class): LLaMA-Factory's multimodal sharegpt rows become image
tokens the processor counts, never labelled; a packed row gives each sample the loss transformers' own forward gives
it alone (fp32, 1e-5); a run trains, packed and unpacked alike, and its export is the whole model."""

import dataclasses
import json
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from llmtune.config import DataConfig, ModelConfig
from llmtune.data import images
from llmtune.data.build import build_datasets, describe
from llmtune.data.collate import collate
from llmtune.data.templates import recipe_tokenizer
from llmtune.features.base import Features
from llmtune.features.documents import PackedDocuments
from llmtune.features.multimodal_positions import MultimodalPositions
from llmtune.model.build import CausalLMForTraining
from llmtune.model.loss import IGNORE_INDEX, LossOptions
from llmtune.model.multimodal import token_types
from tests.vision_models import (FAMILY, VISION_FAMILIES, chatml_template, image_conversations, image_pairs,
                                  logits_on_an_image_sample, tiny_vlm)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return tiny_vlm(tmp_path_factory.mktemp("qwen2_vl"))


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    return image_conversations(tmp_path_factory.mktemp("mllm"))


def data_config(conversations, tmp_path, **kwargs) -> DataConfig:
    return DataConfig(dataset_info=str(conversations), datasets=["mllm"], max_seq_len=256,
                      cache_dir=str(tmp_path / "cache"), **kwargs)


def test_image_tokens_are_the_processors_and_never_labelled(vlm, conversations, tmp_path):
    data_cfg = data_config(conversations, tmp_path, packing=False)
    tokenizer = recipe_tokenizer("sft", ModelConfig(name_or_path=str(vlm)), data_cfg)
    image_inputs = images.of(tokenizer)
    train, _, counts = build_datasets("sft", data_cfg, tokenizer, 0)
    token = image_inputs.image_token_id
    seen, image_tokens = 0, 0
    for row in train:
        grids = [images.unblob(blob)["image_grid_thw"] for blob in row[images.IMAGES]]
        ids, labels = row["input_ids"], row["labels"]
        # One run of image tokens per image, as long as its grid's merged patches (2 x 2 merge).
        runs = [len(run) for run in "".join("i" if t == token else " " for t in ids).split()]
        assert runs == [int(grid.prod()) // 4 for grid in torch.cat(grids)] if grids else runs == []
        assert all(label == IGNORE_INDEX for t, label in zip(ids, labels) if t == token)
        # What is trained is the assistant's turns alone.
        trained = tokenizer.decode([label for label in labels if label != IGNORE_INDEX])
        assert "user" not in trained and "<|vision" not in trained and trained.count("<|im_end|>") >= 1
        seen += len(grids)
        image_tokens += sum(runs)
    assert seen == 8  # the data's 4 images, twice
    stats = describe("sft", train, None, None, counts, data_cfg, 1, 0, token)
    assert (stats.images, stats.image_tokens) == (seen, image_tokens)
    assert f"{seen} images ({image_tokens} image tokens)" in stats.summary()


def test_a_family_whose_processor_needs_a_missing_package_is_refused_in_one_line(tmp_path, monkeypatch):
    from transformers.models.smolvlm import processing_smolvlm

    from llmtune.errors import UserError
    from tests.helpers import byte_level_tokenizer

    monkeypatch.setattr(processing_smolvlm, "num2words", None)  # as where num2words is not installed
    family = FAMILY["SmolVLM"]
    tokenizer = byte_level_tokenizer(tmp_path, chatml_template(family.image_part), family.specials)
    (tmp_path / images.PROCESSOR_FILE).write_text(json.dumps(family.image_processor))
    with pytest.raises(UserError, match=r"^model: smolvlm's processor needs a package this environment lacks "
                                        r"\(Package `num2words` is required.*\); pip install 'llmtune\[vision\]'"):
        images.family_processor("smolvlm", str(tmp_path), tokenizer)


def test_an_images_tokens_hold_none_of_the_tokenizers_own(vlm, conversations, tmp_path):
    """A tokenizer that begins every text with BOS (Gemma's, Llama's) puts none among an image's tokens: they are
    the processor's expansion of its image token alone."""
    from PIL import Image
    from tokenizers import processors

    tokenizer = recipe_tokenizer("sft", ModelConfig(name_or_path=str(vlm)), data_config(conversations, tmp_path))
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    assert tokenizer("What is it?")["input_ids"][0] == bos
    tokens, _ = images.of(tokenizer).encoded(Image.new("RGB", (28, 28)))
    assert bos not in tokens


def family_cases():
    """Every family, each skipped where the package its processor needs is absent (it is an optional extra's)."""
    import importlib.util

    return [pytest.param(family, id=family.name, marks=pytest.mark.skipif(
        family.requires is not None and importlib.util.find_spec(family.requires) is None,
        reason=f"{family.name}'s processor needs {family.requires}")) for family in VISION_FAMILIES]


@pytest.mark.parametrize("family", family_cases())
def test_packed_rows_give_each_sample_transformers_loss_alone(family, conversations, tmp_path):
    """The support matrix of vision-language families: each one's tiny model of the real class, its samples with
    images packed into rows, each sample's loss in its row that of transformers' own forward of it alone."""
    from transformers import AutoModelForImageTextToText

    vlm = tiny_vlm(tmp_path / "model", family)
    hf_model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()
    data_cfg = data_config(conversations, tmp_path)
    tokenizer = recipe_tokenizer("sft", ModelConfig(name_or_path=str(vlm)), data_cfg)
    packed, _, _ = build_datasets("sft", data_cfg, tokenizer, 0)
    alone = {}  # each sample's ids -> transformers' summed loss of it alone, with its images
    for sample in build_datasets("sft", dataclasses.replace(data_cfg, packing=False), tokenizer, 0)[0]:
        ids = torch.tensor([sample["input_ids"]])
        kwargs = images.merged(sample[images.IMAGES])
        if kwargs:  # the token types its processor gives: Qwen's rope and Gemma 3's image attention read them
            kwargs.update(token_types(hf_model, ids))
        with torch.no_grad():
            alone[tuple(sample["input_ids"])] = F.cross_entropy(
                hf_model(input_ids=ids, **kwargs).logits[0], torch.tensor(sample["labels"][1:] + [IGNORE_INDEX]),
                ignore_index=IGNORE_INDEX, reduction="sum").item()
    # Built once transformers' own attention has given the references: the feature replaces it.
    model = CausalLMForTraining(hf_model, LossOptions(), None).eval()
    features = Features([PackedDocuments(None), MultimodalPositions(None)])
    features.build(hf_model, None)
    model.features = features
    blank = images.of(tokenizer).blank()
    assert max(row["position_ids"].count(0) for row in packed) > 1, "several samples share a row"
    for row in packed:
        inputs = features.transform(collate([row], pad_id=0, blank_image=blank).inputs)
        with torch.no_grad():
            losses = F.cross_entropy(model(**{k: v for k, v in inputs.items() if k != "shift_labels"})[0],
                                     inputs["shift_labels"][0], ignore_index=IGNORE_INDEX, reduction="none")
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        for a, b in zip(starts, starts[1:]):
            assert losses[a:b].sum().item() == pytest.approx(alone[tuple(row["input_ids"][a:b])], rel=1e-5)


def recipe(vlm, conversations, output_dir, **train) -> dict:
    return {"model": {"name_or_path": str(vlm)},
            "data": {"dataset_info": str(conversations), "datasets": ["mllm"], "max_seq_len": 256,
                     "cache_dir": str(output_dir.parent / "cache")},
            "train": {"output_dir": str(output_dir), "max_steps": 3, "learning_rate": 2e-3, "warmup_ratio": 0,
                      "logging_steps": 1, "freeze_vision_tower": False, "freeze_multi_modal_projector": False,
                      **train},
            "checkpoint": {"export_dtype": "fp32"}}


def test_every_sample_each_step_gives_the_same_losses_packed_or_padded(vlm, conversations, tmp_path):
    """Each step trains the whole data set (8 samples, whatever the rows): packed into 3 rows of up to 256 tokens
    (3 micro-batches of one row), padded 2 to a micro-batch (accumulation 4) and 1 (accumulation 8): equal losses and
    gradient norms, the vision tower trained too."""
    import llmtune

    data_cfg = data_config(conversations, tmp_path)
    rows = len(build_datasets("sft", data_cfg, recipe_tokenizer("sft", ModelConfig(name_or_path=str(vlm)),
                                                                data_cfg), 0)[0])
    layouts = {"packed": dict(data={"packing": True}, per_device_train_batch_size=1, gradient_accumulation_steps=rows),
               "padded_micro2": dict(data={"packing": False}, per_device_train_batch_size=2,
                                     gradient_accumulation_steps=4),
               "padded_micro1": dict(data={"packing": False}, per_device_train_batch_size=1,
                                     gradient_accumulation_steps=8)}
    records = {}
    for name, layout in layouts.items():
        config = recipe(vlm, conversations, tmp_path / name, **{k: v for k, v in layout.items() if k != "data"})
        config["data"].update(layout["data"])
        llmtune.train("sft", config)
        records[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                         if "loss" in json.loads(line)]
    reference = records["packed"]
    assert len(reference) == 3 and reference[0]["loss"] > reference[-1]["loss"]
    for name, steps in records.items():
        assert [s["loss"] for s in steps] == pytest.approx([s["loss"] for s in reference], rel=1e-5), name
        assert [s["grad_norm"] for s in steps] == pytest.approx([s["grad_norm"] for s in reference], rel=1e-5), name


def test_export_is_the_whole_model_with_the_trained_logits_on_an_image(vlm, conversations, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from llmtune.config import load_config
    from tests.helpers import train_and_export

    unpacked = recipe(vlm, conversations, tmp_path / "out", per_device_train_batch_size=1,
                      gradient_accumulation_steps=2)
    unpacked["data"]["packing"] = False  # a row is one sample, which transformers' forward takes alone
    config = load_config(unpacked, [], "sft", world_size=1)

    logits, row = train_and_export(config, logits_on_an_image_sample)
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "out" / "hf", dtype=torch.float32).eval()
    assert type(exported).__name__ == "Qwen2VLForConditionalGeneration"
    original = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32)
    assert exported.state_dict().keys() == original.state_dict().keys(), "the vision tower is exported too"
    assert type(AutoImageProcessor.from_pretrained(tmp_path / "out" / "hf")).__name__.startswith("Qwen2VLImageProc")
    ids = torch.tensor([row["input_ids"]])
    tensors = [images.unblob(blob) for blob in row[images.IMAGES]]
    kwargs = {name: torch.cat([t[name] for t in tensors]) for name in tensors[0]}
    with torch.no_grad():
        found = exported(input_ids=ids, mm_token_type_ids=(ids == exported.config.image_token_id).int(),
                         **kwargs).logits
    torch.testing.assert_close(found, logits, rtol=0, atol=1e-5)


def test_a_stopped_run_resumes_bitwise(vlm, conversations, tmp_path):
    import llmtune
    from tests.helpers import StopAt

    def run(name, callbacks=(), resume=None):
        config = recipe(vlm, conversations, tmp_path / name, max_steps=4, per_device_train_batch_size=1,
                        gradient_accumulation_steps=2)
        config["checkpoint"].update(save_steps=2, resume_from_checkpoint=resume)
        llmtune.train("sft", config, callbacks=list(callbacks))
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    whole = run("whole")
    run("part", [StopAt(2)])
    resumed = run("part", resume="auto")
    assert [r["loss"] for r in resumed if "loss" in r] == [r["loss"] for r in whole if "loss" in r]
    assert all(torch.equal(a, b) for a, b in zip(load_file(tmp_path / "whole/hf/model.safetensors").values(),
                                                 load_file(tmp_path / "part/hf/model.safetensors").values()))


def test_dpo_on_image_pairs_gives_the_same_losses_on_any_layout(vlm, tmp_path):
    """dpo on LLaMA-Factory's ranking rows with images (a pair's two sequences share its prompt's images): pairs
    packed into one row per micro-batch or padded, 2 or 1 to a micro-batch, give equal per-step losses; the first
    step's is ln 2 (the reference is the policy at step 0)."""
    import llmtune

    pairs = image_pairs(tmp_path / "pairs")
    layouts = {"packed": (True, 2, 2), "padded": (False, 2, 2), "padded_micro1": (False, 1, 4)}
    records = {}
    for name, (packing, micro, accumulation) in layouts.items():
        llmtune.train("dpo", {"model": {"name_or_path": str(vlm)},
                              "data": {"dataset_info": str(pairs), "datasets": ["mllm_pairs"], "max_seq_len": 512,
                                       "packing": packing, "cache_dir": str(tmp_path / "cache")},
                              "train": {"output_dir": str(tmp_path / name), "max_steps": 3, "learning_rate": 2e-3,
                                        "warmup_ratio": 0, "logging_steps": 1, "per_device_train_batch_size": micro,
                                        "gradient_accumulation_steps": accumulation},
                              "checkpoint": {"export_hf": False}})
        records[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    reference = records["packed"]
    assert reference[0]["loss"] == pytest.approx(0.6931472, rel=1e-5)
    assert reference[-1]["loss"] < reference[0]["loss"]
    for name, steps in records.items():
        for key in ("loss", "rewards/margins", "grad_norm"):
            assert [s[key] for s in steps] == pytest.approx([s[key] for s in reference], rel=1e-5, abs=1e-6), \
                (name, key)


def test_generate_with_images_gives_transformers_greedy_completion(vlm, conversations, tmp_path, capsys):
    """`llmtune generate --prompt --image` and a --file row with an images column complete as transformers' own
    generate does from the ids and pixels transformers' image processor gives (the template's vision markers, one
    <|image_pad|> per merged patch)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from PIL import Image

    from llmtune.run.cli import main as cli_main

    image = conversations / "images" / "3.png"
    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(vlm)
    pixels = Qwen2VLImageProcessorPil.from_pretrained(vlm)(images=[Image.open(image).convert("RGB")],
                                                         return_tensors="pt")
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": "What is it?"}]}],
                                         tokenize=False, add_generation_prompt=True)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * (int(pixels["image_grid_thw"].prod()) // 4))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                             pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                             do_sample=False, max_new_tokens=6, eos_token_id=[], pad_token_id=0)
    expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert expected.strip(), "the random model says something"
    assert cli_main(["generate", str(vlm), "--prompt", "What is it?", "--image", str(image), "--do_sample", "false",
                     "--max_new_tokens", "6"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == expected
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": [{"role": "user", "content": "<image>What is it?"}],
                                   "images": [str(image.relative_to(conversations))]}) + "\n")
    shutil.copytree(conversations / "images", tmp_path / "images")
    assert cli_main(["generate", str(vlm), "--file", str(prompts), "--out", str(tmp_path / "out.jsonl"),
                     "--do_sample", "false", "--max_new_tokens", "6"]) == 0
    assert json.loads((tmp_path / "out.jsonl").read_text())["completion"][0]["content"] == expected


@pytest.mark.parametrize("name", ["Gemma 3", "Qwen3.5"])
def test_a_family_trains_packed_exports_whole_and_generates_as_transformers(name, conversations, tmp_path, capsys):
    """The families whose packed rows need more than document masks (Gemma 3's images attended both ways, Qwen3.5's
    linear attention) train, export their whole class, and `llmtune generate --image` completes as transformers'
    own processor and generate do."""
    import llmtune
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from llmtune.run.cli import main as cli_main

    family = FAMILY[name]
    vlm = tiny_vlm(tmp_path / "model", family)
    llmtune.train("sft", recipe(vlm, conversations, tmp_path / "out", max_steps=1, per_device_train_batch_size=1,
                                gradient_accumulation_steps=2))
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "out" / "hf", dtype=torch.float32).eval()
    original = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32)
    assert type(exported) is type(original) and exported.state_dict().keys() == original.state_dict().keys()
    image = conversations / "images" / "3.png"
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out" / "hf")
    processor = images.family_processor(family.model_type, str(tmp_path / "out" / "hf"), tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": "What is it?"}]}],
                                         tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[Image.open(image).convert("RGB")], return_tensors="pt")
    inputs.pop("attention_mask")
    with torch.no_grad():
        out = exported.generate(**inputs, do_sample=False, max_new_tokens=6, eos_token_id=[], pad_token_id=0)
    expected = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert expected.strip(), "the trained model says something"
    assert cli_main(["generate", str(tmp_path / "out" / "hf"), "--prompt", "What is it?", "--image", str(image),
                     "--do_sample", "false", "--max_new_tokens", "6"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == expected


@pytest.mark.parametrize("case, expected", [
    ("missing", r"mllm.json: row 1: the image images/none.png does not exist"),
    ("undecodable", r"mllm.json: row 1: .*broken.png cannot be decoded as an image"),
    ("count", r"mllm.json: row 1: the turns hold 2 <image> markers for 1 images"),
    ("url", r"mllm.json: row 1: the image https://example.com/a.png is a URL; llmtune reads no network"),
    ("text_model", r"mllm.json: row 1: the sample holds images, and the model is a text model"),
])
def test_bad_image_rows_are_refused_naming_the_row_before_any_process_starts(case, expected, vlm, tiny_model,
                                                                             tmp_path, capsys):
    """Under --nproc 2 the refusal is the CLI's own, one line and exit 2, before it launches a process (the data
    build, which would find it too, runs in the launched processes) and before anything is written."""
    import yaml

    from tests.e2e.test_cli_errors import in_process

    data = image_conversations(tmp_path / "mllm")
    (data / "images" / "broken.png").write_bytes(b"not an image")
    rows = json.loads((data / "mllm.json").read_text())
    first = rows[0]
    if case == "count":
        first["messages"][0]["content"] = "<image><image>Who is this?"
    elif case != "text_model":
        first["images"] = [{"missing": "images/none.png", "undecodable": "images/broken.png",
                            "url": "https://example.com/a.png"}[case]]
    (data / "mllm.json").write_text(json.dumps(rows))
    config = recipe(tiny_model if case == "text_model" else vlm, data, tmp_path / "out")
    if case == "text_model":
        config["data"]["chat_template"] = "chatml"
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(config))
    result = in_process(capsys, "sft", str(tmp_path / "recipe.yaml"), "--nproc", "2")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert re.match(f"llmtune: error: .*{expected}", lines[0]), lines[0]
    assert not (tmp_path / "out").exists()
