"""LLaMA-Factory's recipes and templates on real files written by others (../shared/real, where it is there; the test
suite never reads it, so that the suite passes on a clone of the project alone).

    python benchmarks/llamafactory_real.py [--real ../shared/real] [--rows 100] [--steps 3]
                                           [--parts templates runs] [--out results.json]

Templates (--parts templates). For every tokenizer there that encodes text (has a vocabulary) and has a chat template,
and each of LLaMA-Factory's templates llmtune reads (data/lf_templates.TEMPLATES): what a LLaMA-Factory recipe naming
it trains with (data/templates.apply_recipe_template: the model's own template, a llmtune built-in, or refused, as the
run decides it from three probe conversations); and where it trains, llmtune's token ids and trained tokens of the
first --rows rows of each of LLaMA-Factory's demo datasets (identity and alpaca_en_demo as sft conversations,
dpo_en_demo's pairs and kto_en_demo's examples as prompt and responses) against LLaMA-Factory's encoding of them
(lf_templates.encode; its trained tokens are each assistant turn's, the ids the turn adds to the conversation before
it; a pair's responses are what each adds to the prompt). Goal: every row alike, token for token, ids and trained
tokens: the probes decide, the demo data checks that they decide right.

Runs (--parts runs). LLaMA-Factory's examples/train_lora/qwen3_lora_{sft,dpo,kto}.yaml as published (their text:
tests/unit/test_llamafactory_recipes.py), changed only in model_name_or_path, dataset_dir (the LLaMA-Factory demo data
there), output_dir and max_steps (--steps), and logged every step (--logging_steps 1 on the command line): the model
a tiny Qwen3 shaped by Qwen3-4B's config.json there (its vocabulary, tied embeddings, rope, norms; 2 layers of width
64, seeded) with Qwen3-4B's real tokenizer, so that qwen3_nothink is resolved against its real chat template. Each on
1 process and on 2 (accumulation 4: the same 8 examples a step); the losses of each and their largest relative
difference (bf16 as published: the summation order moves the last bits), the start banner's template and batch lines.
Then its vision-language examples, qwen3vl_lora_{sft,dpo}.yaml, changed in the same lines alone: the model a tiny
Qwen3-VL of the real class (decoder as above; a vision tower of 2 blocks of width 32 at Qwen2.5-VL's patch size 14)
with Qwen3-4B's real tokenizer, a Qwen-VL chat template (ChatML, an image as <|vision_start|><|image_pad|>
<|vision_end|>) and Qwen2.5-VL-7B's real preprocessor_config.json; sft on mllm_demo (its three images) mixed with
identity and alpaca_en_demo as published, dpo on rlhf_v, LLaMA-Factory's Hub entry (llamafactory/RLHF-V), read from
a huggingface_hub cache laid out offline with pairs of mllm_demo's questions and images (no network here).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.unit.test_llamafactory_recipes: the published example recipes' text

DEMO = {"identity": "sft", "alpaca_en_demo": "sft", "dpo_en_demo": "dpo", "kto_en_demo": "kto"}
EXAMPLES = ("QWEN3_LORA_SFT", "QWEN3_LORA_DPO", "QWEN3_LORA_KTO")
VISION_EXAMPLES = ("QWEN3VL_LORA_SFT", "QWEN3VL_LORA_DPO")
# A Qwen-VL chat template in short (Qwen3-VL's own adds tools and reasoning): ChatML, no default system text, an image
# part written as the model's placeholder, which the processor expands into the image's tokens.
QWEN_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def demo_rows(data: Path, rows: int) -> dict[str, list[dict]]:
    """The first `rows` rows of each demo dataset in llmtune's canonical form, read through its dataset_info.json as
    llmtune reads it (data/registry.py, data/formats.py)."""
    from llmtune.data.formats import to_canonical
    from llmtune.data.registry import read_registry, registry_source

    path = data / "dataset_info.json"
    entries, out = read_registry(path), {}
    for name, task in DEMO.items():
        source = registry_source(entries, name, path, "data.datasets", task)
        raw = json.loads(Path(source.pattern).read_text(encoding="utf-8"))[:rows]
        out[name] = [to_canonical(row, source.row_format, f"{name} row {i}") for i, row in enumerate(raw)]
    return out


def lf_encoding(template, tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """LLaMA-Factory's ids of a conversation and its labels (-100 but on each assistant turn's ids)."""
    from llmtune.data.lf_templates import encode

    ids, labels = [], []
    for end in range(1, len(messages) + 1):
        turn = encode(template, tokenizer, messages[:end])[len(ids):]
        ids += turn
        labels += turn if messages[end - 1]["role"] == "assistant" else [-100] * len(turn)
    return ids, labels


def lf_responses(template, tokenizer, prompt: list[dict], responses: list[list[dict]]) -> tuple[list[int], ...]:
    """LLaMA-Factory's (prompt ids, each response's ids), as its pairwise and KTO processing split them."""
    from llmtune.data.lf_templates import encode

    prompt_ids = encode(template, tokenizer, prompt)
    return (prompt_ids, *(encode(template, tokenizer, prompt + response)[len(prompt_ids):] for response in responses))


def row_alike(tokenizer, template, name: str, row: dict) -> bool:
    """Whether llmtune trains on a demo row as LLaMA-Factory does with `template`: the same ids, the same trained."""
    from llmtune.data.preference import encode_pair
    from llmtune.data.templates import LabelRules, encode_sample

    if "sample" in row:
        sample = row["sample"]
        return encode_sample(tokenizer, sample, LabelRules(), name) == lf_encoding(template, tokenizer,
                                                                                 sample["messages"])
    pair = row.get("pair") or {"prompt": row["example"]["prompt"], "chosen": row["example"]["completion"],
                               "rejected": row["example"]["completion"]}
    ours = encode_pair(tokenizer, pair, LabelRules(), name, ("chosen", "rejected"))
    return list(ours) == list(lf_responses(template, tokenizer, pair["prompt"], [pair["chosen"], pair["rejected"]]))


def encodes(folder: Path):
    """The tokenizer of `folder` where it encodes text (a folder with no vocabulary encodes it to nothing, or to
    unknown tokens) and has a chat template, else None."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError):
        return None
    words = tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    return tokenizer if tokenizer.chat_template and set(words) - {tokenizer.unk_token_id} else None


def check_templates(real: Path, rows: int) -> list[dict]:
    """One record per (tokenizer, template name): what trains, and how many demo rows render alike."""
    from llmtune.data.lf_templates import PREFIX, TEMPLATES
    from llmtune.data.templates import apply_recipe_template
    from llmtune.errors import UserError

    demo = demo_rows(real / "llamafactory" / "data", rows)
    records = []
    for folder in sorted(p for p in (real / "tokenizers").iterdir() if p.is_dir()):
        if (tokenizer := encodes(folder)) is None:
            continue
        own = tokenizer.chat_template
        for name, template in TEMPLATES.items():
            tokenizer.chat_template = own  # as the folder gives it: a run sets the template it resolves
            try:
                source = apply_recipe_template(tokenizer, PREFIX + name)
            except UserError:
                records.append({"tokenizer": folder.name, "template": name, "trains with": "refused"})
                continue
            alike = {dataset: sum(row_alike(tokenizer, template, dataset, row) for row in found)
                     for dataset, found in demo.items()}
            records.append({"tokenizer": folder.name, "template": name, "trains with": source,
                            "rows alike": alike, "rows": {dataset: len(found) for dataset, found in demo.items()}})
    return records


def tiny_qwen3_shape(real: Path) -> dict:
    """Qwen3-4B's config.json, its decoder made 2 layers of width 64."""
    shape = json.loads((real / "configs" / "qwen3-4b" / "config.json").read_text())
    shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_window_layers=2)
    return {k: v for k, v in shape.items() if k != "architectures"}


def tiny_qwen3(real: Path, folder: Path) -> Path:
    """A tiny Qwen3 of Qwen3-4B's config.json (seeded) with Qwen3-4B's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**tiny_qwen3_shape(real))).save_pretrained(folder)
    AutoTokenizer.from_pretrained(real / "tokenizers" / "qwen3-4b").save_pretrained(folder)
    return folder


def tiny_qwen3_vl(real: Path, folder: Path) -> Path:
    """A tiny Qwen3-VL (seeded): tiny_qwen3's decoder with Qwen3-VL's interleaved multimodal rope, a vision tower at
    Qwen2.5-VL-7B's real image settings (patch 14, merge 2), Qwen3-4B's tokenizer (its vision tokens are the ids
    Qwen3-VL's config names) with QWEN_VL_TEMPLATE."""
    import torch
    from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = tiny_qwen3_shape(real)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta"),
                               "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    image_settings = json.loads((real / "configs" / "qwen2.5-vl-7b-instruct" / "preprocessor_config.json").read_text())
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=image_settings["patch_size"], spatial_merge_size=image_settings["merge_size"],
                  temporal_patch_size=image_settings["temporal_patch_size"], num_position_embeddings=16,
                  deepstack_visual_indexes=[0])
    torch.manual_seed(0)
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"])
    Qwen3VLForConditionalGeneration(config).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(real / "tokenizers" / "qwen3-4b")
    tokenizer.chat_template = QWEN_VL_TEMPLATE
    tokenizer.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(image_settings))
    return folder


def losses(output_dir: Path) -> list[float]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if "loss" in record]


def banner(output_dir: Path, *starts: str) -> list[str]:
    """The train.log lines that hold any of `starts`, without their time stamps."""
    lines = (output_dir / "train.log").read_text().splitlines()
    return [line[line.index(start):] for line in lines for start in starts if start in line]


def run_examples(real: Path, steps: int, root: Path) -> list[dict]:
    """LLaMA-Factory's qwen3 LoRA examples and its qwen3vl ones on 1 and 2 processes: their losses and banner
    lines."""
    from tests.unit import test_llamafactory_recipes as examples
    from tests.helpers import offline_hub
    from tests.vision_hub import rlhf_v_cache

    text_model, vision_model = tiny_qwen3(real, root / "tiny-qwen3"), tiny_qwen3_vl(real, root / "tiny-qwen3-vl")
    data = real / "llamafactory" / "data"
    demo = json.loads((data / "mllm_demo.json").read_text())
    # Enough pairs for the steps: 8 a step, as published.
    rlhf_v_cache(root / "hf_home", sorted({data / image for row in demo for image in row["images"]}), 8 * steps)
    env = {**os.environ, **offline_hub(root / "hf_home")}
    records = []
    for example in (*EXAMPLES, *VISION_EXAMPLES):
        record = {"example": example.lower() + ".yaml"}
        model = vision_model if example in VISION_EXAMPLES else text_model
        for nproc in (1, 2):
            out = root / f"{example}-{nproc}"
            recipe = root / f"{example}-{nproc}.yaml"
            recipe.write_text(examples.published(getattr(examples, example), model, data, out, steps))
            layout = ["--nproc", "2", "--gradient_accumulation_steps", "4"] if nproc == 2 else []
            done = subprocess.run([str(ROOT / "bin" / "llmtune"), "train", str(recipe), "--logging_steps", "1",
                                   *layout], capture_output=True, text=True, env=env)
            if done.returncode:
                record[f"{nproc} process(es)"] = {"exit": done.returncode, "error": done.stderr[-2000:]}
                continue
            record[f"{nproc} process(es)"] = {"losses": losses(out), "banner": banner(
                out, "renders conversations as", "start: global batch", "start: LLaMA-Factory recipe", "image")}
        runs = [record.get(f"{n} process(es)", {}).get("losses") for n in (1, 2)]
        if all(runs) and len(runs[0]) == len(runs[1]):
            record["largest relative difference"] = max(abs(a - b) / abs(a) for a, b in zip(*runs))
        records.append(record)
    return records


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", type=Path, default=ROOT.parent / "shared" / "real",
                        help="the folder of real files (tokenizers/, configs/, llamafactory/data/)")
    parser.add_argument("--rows", type=int, default=100, help="demo rows checked of each dataset")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps of each example run")
    parser.add_argument("--parts", nargs="+", choices=("templates", "runs"), default=["templates", "runs"],
                        help="what to check")
    parser.add_argument("--out", type=Path, help="write the results as JSON here too")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if not (args.real / "tokenizers").is_dir():
        sys.exit(f"{args.real}: no real files here (tokenizers/, configs/, llamafactory/data/); give --real")
    results = {}
    if "templates" in args.parts:
        results["templates"] = check_templates(args.real, args.rows)
    if "runs" in args.parts:
        with tempfile.TemporaryDirectory() as root:
            results["runs"] = run_examples(args.real, args.steps, Path(root))
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
