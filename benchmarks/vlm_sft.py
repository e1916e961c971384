"""Vision-language sft on CPU: llmtune sft's tokens/s against TRL's SFTTrainer on the same tiny Qwen2-VL, the same
conversations and the same images, taking turns in one process.

    pip install -e '.[bench]'    # TRL, for this benchmark only: llmtune never imports it
    python benchmarks/vlm_sft.py [--rows 256] [--batch 8] [--seq 1536] [--max-side 448] [--steps 10] [--warmup 2]
                                 [--repeats 1] [--contenders NAME ...] [--out results.json]

Workload. A random Qwen2-VL of the real class (tests/vision_models.tiny_vlm, made larger: decoder of 4 layers,
hidden 256, MLP 688, 4 heads of 64; vision tower of 4 blocks, width 128, 4 heads, its merger out to 256; 4.7M
parameters, 1.3M of them in the tower and merger) with the tests' byte-level tokenizer (vocab about 400), its ChatML
template and Qwen's image processor (patch 14, merge 2), whose min_pixels is 56 x 56 and max_pixels --max-side
squared: an image of w x h pixels becomes about (w / 28) x (h / 28) image tokens (256 for 448 x 448). Its seeded
initial weights are saved once and loaded by both. fp32, one process.
--rows LLaMA-Factory sharegpt rows (tests/vision_models.image_conversations' form: `<image>` markers where each image
belongs, an `images` column of paths, a dataset_info.json), seeded (vlm_rows): 1 turn (70%) or 2, the words of each
user text and answer log-normal (medians 12 and 20, clipped to [3, 60]), 0, 1 or 2 images (20%, 60%, 20%), each a
PNG of its own with sides drawn log-uniform in [112, --max-side]. At the defaults: 256 rows, 261 images, rows of
80 to 492 tokens (median 194, mean 204), 36% of all tokens image tokens. llmtune reads them through
data.dataset_info / data.datasets; TRL reads the same rows in its VLM form (trl_rows: each turn's content as parts,
{"type": "image"} where the marker stood, {"type": "text", "text": ...}, and an `images` column of the same files as
PIL images). Both render them through the model's chat template and expand each image through the same processor
(llmtune.data.images.family_processor, given TRL as its processing_class, the tokenizer's chat template its own:
transformers' AutoProcessor cannot be built for Qwen2-VL here, its video processor needs torchvision): the same
token ids, checked for every row before anything runs (same_ids).

Settings.
- TRL SFTTrainer: SFTConfig's defaults (learning rate 2e-5, max_length 1024: no row here is cut; packing and
  padding_free off: TRL refuses both for images; every non-pad token labelled, assistant_only_loss off), its own
  collator (DataCollatorForVisionLanguageModeling: each batch of --batch rows, in its random order, rendered and its
  images processed on the fly, padded to the batch's longest), gradient checkpointing (its default), the whole model
  trained; bf16 off, for fp32 as llmtune (TRL's default on CPU, autocast to bf16, is another computation).
- TRL, no checkpointing: the same with gradient_checkpointing false, the work llmtune does (it checkpoints nothing
  by default).
- llmtune sft: its defaults (rows of --seq tokens packed with the samples' images, document masks, Qwen's multimodal
  rope positions per sample, the assistant's turns labelled, every image's pixels processed into the data cache
  when the data is built, before the first step), the same learning rate, and the whole model trained as TRL trains
  it: train.freeze_vision_tower and train.freeze_multi_modal_projector false (llmtune's defaults, LLaMA-Factory's,
  freeze both, which would spare it the tower's backward). Its rows per step are chosen for about the real tokens of
  TRL's step, as throughput.py --sft does: --batch x (packed rows / rows), the rows counted by packing the lengths
  as llmtune does, at least 1 (at the defaults one row of 1536 tokens, about 1,490 real, against TRL's 8 rows of
  about 1,630). llmtune's trainer is built after TRL's, so TRL's steps run under llmtune's setting of
  glibc's malloc (run/cpu_memory.py) and of torch's threads (run/threads.py: this process's cores), which TRL's run
  here shares; the threads are recorded.

Speed. As preference.py: this machine is shared, so llmtune and TRL take turns in one process, step by step, and
see the same machine: after each of TRL's optimizer steps (a callback at on_step_end), one of llmtune's. Each step is
timed by throughput.py's StepClock (llmtune: one Trainer.advance, data included; TRL: from the end of llmtune's step
to its next on_step_end, its collation and image processing included), the first --warmup left out. Tokens are every
input token the model sees, text and image tokens alike, padding excluded: llmtune's step record's input_tokens, and
the sum of the attention mask of each batch TRL's collator makes (its padded size and the collator's time are kept
beside). Tokens/s: the mean tokens of a timed step over the median step time (preference.speed). The ratio is taken
in each process, then its median over --repeats. Goal: llmtune sft / TRL SFTTrainer >= 1.5.
"""
import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# As preference.py: this folder last on sys.path (benchmarks/peft.py must not stand in for the peft package), where it
# gives throughput, hf_trainer_baseline and preference; the repository first, for tests/vision_models.py.
sys.path[:] = [str(REPO)] + [p for p in sys.path if Path(p or ".").resolve() not in (HERE, REPO)] + [str(HERE)]

from preference import speed, spread, taking_turns  # noqa: E402
from throughput import (RESULT, StepClock, Workload, contender_options, llmtune_step, packed_rows,  # noqa: E402
                        peak_rss_gib, run_contenders)

LEARNING_RATE = 2e-5  # SFTConfig's default
TRL_MAX_LENGTH = 1024  # SFTConfig's default max_length: a longer row would be cut, its image tokens with it
SEED = 42
DATASET = "vlm"
# Qwen2-VL at the benchmark's size (on top of tests/vision_models.TEXT): head_dim 64, so mrope's sections are 32
# frequencies (Qwen2-VL's own, [16, 24, 24], are of head_dim 128).
TEXT = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=4096)
MROPE_SECTION = [8, 12, 12]
VISION = dict(depth=4, embed_dim=128, hidden_size=256, num_heads=4, mlp_ratio=4, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2)
MIN_SIDE = 56  # the processor's min_pixels' side, and the least --max-side
SMALLEST_SIDE = 112  # the shortest image side drawn (16 image tokens for a square)
# Words of the tokenizer's training lines (tests/helpers.byte_level_tokenizer): a few tokens each at most.
WORDS = ("what", "is", "2", "plus", "3", "it", "5", "add", "the", "numbers", "with", "tool", "sum", "five")
# Words of each user text and answer: log-normal (median e^mu), clipped to [shortest, longest].
LENGTHS = {"user": dict(mu=math.log(12), sigma=0.6), "assistant": dict(mu=math.log(20), sigma=0.6),
           "shortest": 3, "longest": 60}
IMAGE_COUNTS = ((0, 0.2), (1, 0.6), (2, 0.2))  # images per row, and their shares
TWO_TURNS = 0.3  # share of rows of two user turns (each answered)

TRL, NO_CHECKPOINTING, LLMTUNE = "TRL SFTTrainer", "TRL, no checkpointing", "llmtune sft"
# Each contender (one fresh process, its steps in turn with llmtune's): its SFTConfig arguments beyond the common ones.
CONTENDERS = {TRL: {}, NO_CHECKPOINTING: {"gradient_checkpointing": False}}
SPEED_GOAL = ">= 1.5"  # llmtune sft / TRL SFTTrainer, tokens/s taking turns
# What llmtune changes from its defaults: the whole model trained, as TRL trains it.
LLMTUNE_TRAIN = {"freeze_vision_tower": False, "freeze_multi_modal_projector": False}


def beside(trl: str) -> str:
    """The name of llmtune sft's steps taken in turn with those of TRL contender `trl`."""
    return f"{LLMTUNE}, in turn with {trl}"


# --- the model and the data: written by the parent


def vision_family(max_side: int):
    """tests/vision_models' Qwen2-VL at the benchmark's size, its images of up to max_side x max_side pixels kept
    whole (the processor's max_pixels)."""
    from tests.vision_models import FAMILY, MROPE, qwen_image_processor

    family = FAMILY["Qwen2-VL"]
    processor = {**qwen_image_processor(VISION["patch_size"]), "min_pixels": MIN_SIDE ** 2, "max_pixels": max_side ** 2}
    return dataclasses.replace(family, text={**family.text, **TEXT, "rope_parameters": {**MROPE, "mrope_section":
                                                                                          MROPE_SECTION}},
                               vision={**family.vision, **VISION}, image_processor=processor)


def write_model(folder: Path, max_side: int) -> dict:
    """The seeded model with its tokenizer, template and processor's settings: its parameters, by part."""
    from transformers import AutoModelForImageTextToText

    from tests.vision_models import tiny_vlm

    tiny_vlm(folder, vision_family(max_side), seed=SEED)
    model = AutoModelForImageTextToText.from_pretrained(folder)
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in model.model.visual.parameters())
    return {"params": total, "vision_params": vision}


def vlm_rows(folder: Path, rows: int, max_side: int, seed: int = 0) -> list[dict]:
    """`rows` sharegpt rows with their images (PNGs in folder/images, one per image, noise of seeded sizes), written
    as a LLaMA-Factory dataset_info.json in `folder` naming DATASET (image_conversations' entry): the rows."""
    import numpy as np
    from PIL import Image

    draw = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)

    def text(role: str) -> str:
        drawn = draw.lognormvariate(LENGTHS[role]["mu"], LENGTHS[role]["sigma"])
        length = round(min(max(drawn, LENGTHS["shortest"]), LENGTHS["longest"]))
        return " ".join(draw.choice(WORDS) for _ in range(length))

    def image() -> str:
        name = f"images/{len(list((folder / 'images').iterdir()))}.png"
        smallest = min(SMALLEST_SIDE, max_side)
        width, height = (round(math.exp(draw.uniform(math.log(smallest), math.log(max_side)))) for _ in range(2))
        pixels = np.random.default_rng(draw.getrandbits(32)).integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / name)
        return name

    out = []
    for _ in range(rows):
        turns = 2 if draw.random() < TWO_TURNS else 1
        count = draw.choices([c for c, _ in IMAGE_COUNTS], [w for _, w in IMAGE_COUNTS])[0]
        # The images in the user turns, the first in the first turn, the second in the last; each marker before or
        # after its turn's text.
        holds = [[] for _ in range(turns)]
        for number in range(count):
            holds[min(number, turns - 1)].append("<image>")
        messages, images = [], []
        for held in holds:
            words = text("user")
            for marker in held:
                words = marker + words if draw.random() < 0.5 else words + marker
            messages += [{"role": "user", "content": words}, {"role": "assistant", "content": text("assistant")}]
        for message in messages:  # the paths in the markers' order
            images += [image() for _ in range(message["content"].count("<image>"))]
        out.append({"messages": messages, "images": images})
    (folder / f"{DATASET}.json").write_text(json.dumps(out))
    (folder / "dataset_info.json").write_text(json.dumps({DATASET: {
        "file_name": f"{DATASET}.json", "formatting": "sharegpt",
        "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))
    return out


def trl_messages(messages: list[dict]) -> list[dict]:
    """LLaMA-Factory's turns in TRL's VLM form: each content as parts, an image part where each marker stood."""
    def parts(content: str) -> list[dict]:
        out = []
        for number, piece in enumerate(content.split("<image>")):
            if number:
                out.append({"type": "image"})
            if piece:
                out.append({"type": "text", "text": piece})
        return out

    return [{"role": m["role"], "content": parts(m["content"])} for m in messages]


def trl_rows(folder: Path) -> list[dict]:
    """The data set's rows as TRL's SFTTrainer reads a VLM data set: messages of parts, images as PIL images."""
    from PIL import Image

    rows = json.loads((folder / f"{DATASET}.json").read_text())
    return [{"messages": trl_messages(row["messages"]),
             "images": [Image.open(folder / path).convert("RGB") for path in row["images"]]} for row in rows]


def processor(model: Path):
    """The processor both read the images with (llmtune.data.images.family_processor), the tokenizer's chat template
    its own, as a processor saved with the model carries it (TRL's collator renders through the processor's)."""
    from transformers import AutoTokenizer

    from llmtune.data.images import family_processor

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    built = family_processor("qwen2_vl", str(model), tokenizer)
    built.chat_template = tokenizer.chat_template
    return built



def with_images(messages: list[dict], images: list) -> list[dict]:
    """TRL's messages with each image part given its image, in order: what TRL's collator hands the processor
    (trl.data_utils.prepare_multimodal_messages, of parts already in place)."""
    left = iter(images)
    return [{**m, "content": [{**part, "image": next(left)} if part["type"] == "image" else part
                              for part in m["content"]]} for m in messages]


def processor_ids(model: Path, data: Path) -> list[list[int]]:
    """Each row's token ids as TRL's collator makes them (transformers' processor: the template rendered, each
    image's tokens expanded, no special tokens added), a row at a time."""
    built = processor(model)
    return [[int(t) for t in built.apply_chat_template(with_images(row["messages"], row["images"]), tokenize=True,
                                                       return_dict=True, return_tensors="pt",
                                                       processor_kwargs={"add_special_tokens": False})
             ["input_ids"][0]] for row in trl_rows(data)]


def llmtune_ids(model: Path, data: Path, seq: int, cache: Path) -> list[list[int]]:
    """Each row's token ids as llmtune sft builds them (unpacked, from the same dataset_info.json)."""
    from llmtune.config import DataConfig, ModelConfig
    from llmtune.data.build import build_datasets
    from llmtune.data.templates import recipe_tokenizer

    data_cfg = DataConfig(dataset_info=str(data), datasets=[DATASET], max_seq_len=seq, packing=False,
                          cache_dir=str(cache))
    tokenizer = recipe_tokenizer("sft", ModelConfig(name_or_path=str(model)), data_cfg)
    return [list(row["input_ids"]) for row in build_datasets("sft", data_cfg, tokenizer, 0)[0]]


def same_ids(model: Path, data: Path, seq: int, cache: Path) -> list[list[int]]:
    """The rows' token ids, the same for llmtune and TRL's processor (else the benchmark stops): TRL's, in the rows'
    order."""
    theirs = processor_ids(model, data)
    ours = llmtune_ids(model, data, seq, cache)
    if sorted(map(tuple, ours)) != sorted(map(tuple, theirs)):
        missing = len(set(map(tuple, theirs)) - set(map(tuple, ours)))
        raise SystemExit(f"llmtune and TRL's processor make {missing} of {len(theirs)} rows different token ids "
                         f"({len(ours)} rows built by llmtune)")
    return theirs


# --- in a worker process: TRL's steps and llmtune's, taking turns


def counting_batches(collate, batch_tokens: deque, batches: list):
    """`collate` that queues each batch's real tokens (its attention mask's sum: text and image tokens, no padding)
    for TRL's StepTimer, and keeps its padded size and the time it took."""
    def collate_and_count(rows: list[dict]) -> dict:
        started = time.perf_counter()
        out = collate(rows)
        mask = out["attention_mask"]
        batch_tokens.append(int(mask.sum()))
        batches.append({"tokens": int(mask.sum()), "padded": mask.numel(), "collate_s": time.perf_counter() - started})
        return out

    return collate_and_count


def trl_trainer(name: str, workload: Workload, out: Path, batch_tokens: deque, batches: list):
    """TRL contender `name`'s SFTTrainer on the rows in TRL's form, the model loaded from the saved weights, its own
    collator wrapped to count each batch's tokens."""
    import datasets
    import torch
    from hf_trainer_baseline import SEED as HF_SEED
    from transformers import AutoModelForImageTextToText
    from trl import SFTConfig, SFTTrainer

    rows = datasets.Dataset.from_list(trl_rows(Path(workload.data)))
    model = AutoModelForImageTextToText.from_pretrained(workload.model, dtype=torch.float32)
    args = SFTConfig(output_dir=str(out / "trl"), use_cpu=True, seed=HF_SEED,
                     max_steps=workload.warmup + workload.steps, per_device_train_batch_size=workload.batch,
                     learning_rate=workload.learning_rate, bf16=False, save_strategy="no", logging_strategy="no",
                     report_to="none", disable_tqdm=True, **CONTENDERS[name])
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=processor(Path(workload.model)))
    trainer.data_collator = counting_batches(trainer.data_collator, batch_tokens, batches)
    return trainer


def llmtune_runner(workload: Workload, state, out: Path):
    """One step of llmtune sft per call (throughput.llmtune_step: one Trainer.advance), from the saved weights, the
    whole model trained, its data built into a cache of its own run."""
    workload = dataclasses.replace(workload, llmtune_data={**workload.llmtune_data, "cache_dir": str(out / "cache")})
    return llmtune_step(workload, {"model": {"name_or_path": workload.model, "config": None}, "train": LLMTUNE_TRAIN},
                        state, out)


def run_turns(name: str, workload: Workload, out: Path) -> dict:
    """warmup + steps optimizer steps of TRL contender `name` and as many of llmtune sft's, taking turns
    (preference.taking_turns): {runner: StepClock result}; TRL's with its timed batches' padded sizes and collation
    times, both with torch's threads."""
    import torch

    from llmtune.run.parallel import ParallelState

    batch_tokens, batches = deque(), []
    trainer = trl_trainer(name, workload, out, batch_tokens, batches)
    # llmtune's process group and trainer once TRL's accelerator has decided it trains in one CPU process.
    state = ParallelState.initialize()
    (out / "llmtune").mkdir()
    step = llmtune_runner(workload, state, out / "llmtune")
    clocks = {name: StepClock(workload.warmup), beside(name): StepClock(workload.warmup)}
    trainer.add_callback(taking_turns(clocks[name], batch_tokens, clocks[beside(name)], step))
    trainer.train()
    state.close()
    results = {runner: {**clock.result(), "threads": torch.get_num_threads()} for runner, clock in clocks.items()}
    timed = batches[workload.warmup:workload.warmup + workload.steps]  # the loader collates one batch ahead
    results[name].update(padded_tokens=[b["padded"] for b in timed], collate_s=[b["collate_s"] for b in timed])
    return results


def worker(name: str, root: Path) -> None:
    results = run_turns(name, Workload.read(root), Path(tempfile.mkdtemp(dir=root, prefix="run-")))
    print(RESULT + json.dumps({"runners": results, "peak_rss_gib": peak_rss_gib()}), flush=True)


# --- in the parent: the model, the data, the runs, the table


def prepare(root: Path, args) -> tuple[Workload, dict]:
    """Write the model and the rows under root, check both sides' token ids; print what will be measured; the
    workload and the setup, for the JSON."""
    import numpy as np
    from transformers import AutoTokenizer

    if not MIN_SIDE <= args.max_side <= 768:
        raise SystemExit(f"--max-side {args.max_side}: from {MIN_SIDE} to 768 (llmtune's data.image_max_pixels, "
                         "768 x 768, would scale a larger image before the processor, TRL would not)")
    model, data = root / "model", root / "data"
    params = write_model(model, args.max_side)
    rows = vlm_rows(data, args.rows, args.max_side)
    ids = same_ids(model, data, args.seq, root / "ids-cache")
    image_token = AutoTokenizer.from_pretrained(str(model)).convert_tokens_to_ids("<|image_pad|>")
    lengths = np.array([len(row) for row in ids])
    image_tokens = np.array([row.count(image_token) for row in ids])
    longest = int(lengths.max())
    if longest > min(TRL_MAX_LENGTH, args.seq):
        raise SystemExit(f"a row of {longest} tokens: TRL would cut it (max_length {TRL_MAX_LENGTH}) or llmtune drop "
                         f"it (--seq {args.seq}); lower --max-side or raise --seq")
    row_count = packed_rows(lengths, args.seq)
    per_step = max(1, round(args.batch * row_count / len(rows)))
    images = int(sum(len(row["images"]) for row in rows))
    setup = {**params, "rows": len(rows), "images": images, "tokens": int(lengths.sum()),
             "image_tokens": int(image_tokens.sum()), "row_tokens_mean": float(lengths.mean()),
             "trl_rows_per_step": args.batch, "llmtune_packed_rows_per_step": per_step, "row_len": args.seq,
             "max_side": args.max_side, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
             "learning_rate": LEARNING_RATE}
    print(f"Qwen2-VL {params['params'] / 1e6:.1f}M parameters ({params['vision_params'] / 1e6:.1f}M vision tower and "
          f"merger; decoder {TEXT['num_hidden_layers']} layers, hidden {TEXT['hidden_size']}), fp32, one process; "
          f"{args.steps} steps timed after {args.warmup}, {args.repeats} repeat(s)")
    print(f"{len(rows)} rows, {images} images ({min(SMALLEST_SIDE, args.max_side)}-{args.max_side} px a side); "
          f"tokens a row: {spread(lengths.tolist())}, mean {lengths.mean():.0f}, "
          f"{image_tokens.sum() / lengths.sum():.0%} of them image tokens; the same ids for llmtune and TRL")
    print(f"TRL: {args.batch} rows per step, padded to the longest; llmtune: {per_step} packed row(s) of {args.seq} "
          f"tokens per step ({row_count} rows hold the data, {lengths.sum() / row_count / args.seq:.0%} full)")
    workload = Workload(task="sft", model=str(model), tokenizer=str(model), data=str(data), seq=args.seq,
                        batch=args.batch, llmtune_batch=per_step,
                        llmtune_data={"dataset_info": str(data), "datasets": [DATASET], "max_seq_len": args.seq},
                        steps=args.steps, warmup=args.warmup, learning_rate=LEARNING_RATE)
    return workload, setup


def summary(results: list[dict]) -> dict:
    """One runner's figures over its repeats: tokens/s (preference.speed), and the step time and tokens per step,
    each the median of its repeats' medians (means) over the timed steps."""
    return {"tokens_per_s": statistics.median(speed(r) for r in results),
            "step_s": statistics.median(statistics.median(r["step_times_s"]) for r in results),
            "tokens_per_step": statistics.median(statistics.mean(r["step_tokens"]) for r in results),
            "each_repeat": [speed(r) for r in results], "threads": sorted({r["threads"] for r in results})}


def speed_table(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per TRL contender: its figures and those of llmtune sft's steps beside it, llmtune / TRL in each repeat (the
    same process: the same drift of the machine) and their median; TRL's padding share and its collator's share of
    its steps' time."""
    table = {}
    for trl in (name for name in CONTENDERS if name in runs):
        each = [speed(a) / speed(b) for a, b in zip(runs[beside(trl)], runs[trl])]
        padded = sum(sum(r["padded_tokens"]) for r in runs[trl])
        table[trl] = {"trl": summary(runs[trl]), "llmtune": summary(runs[beside(trl)]),
                      "ratio": statistics.median(each), "each_repeat": each,
                      "goal": SPEED_GOAL if trl == TRL else "",
                      "trl_padding_share": 1 - sum(sum(r["step_tokens"]) for r in runs[trl]) / padded,
                      "trl_collate_share": sum(sum(r["collate_s"]) for r in runs[trl])
                      / sum(sum(r["step_times_s"]) for r in runs[trl])}
    return table


def figures(row: dict) -> str:
    return (f"{row['tokens_per_s']:>8.1f}  {row['step_s']:>6.3f}s  {row['tokens_per_step']:>11.0f}  "
            + " ".join(f"{s:.1f}" for s in row["each_repeat"]))


def print_table(speeds: dict[str, dict]) -> None:
    header = f"{'tokens/s':>8}  {'step':>7}  {'tokens/step':>11}  each repeat"
    for trl, row in speeds.items():
        width = len(beside(trl)) + 2
        threads = "/".join(map(str, row["trl"]["threads"]))
        print(f"\nSpeed, taking turns in one process ({threads} thread(s); medians over the timed "
              f"steps):\n{'':{width}}{header}\n{trl:{width}}{figures(row['trl'])}\n"
              f"{beside(trl):{width}}{figures(row['llmtune'])}\n"
              f"{LLMTUNE} / {trl}: {row['ratio']:.2f}x tokens/s" + (f" (goal {row['goal']})" if row["goal"] else "")
              + ", each repeat " + " ".join(f"{r:.2f}" for r in row["each_repeat"])
              + f"; TRL's batches {row['trl_padding_share']:.0%} padding, its collator {row['trl_collate_share']:.0%} "
                "of its step time")


def report(runs: dict[str, list[dict]]) -> dict:
    speeds = speed_table(runs)
    print_table(speeds)
    return {"speed": speeds}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256, help="Conversation rows written (one epoch of data).")
    parser.add_argument("--batch", type=int, default=8, help="Rows per optimizer step (TRL's; llmtune's about).")
    parser.add_argument("--seq", type=int, default=1536, help="llmtune's tokens per packed row (data.max_seq_len).")
    parser.add_argument("--max-side", type=int, default=448,
                        help=f"Longest image side drawn, in pixels ({MIN_SIDE}-768), and the processor's max_pixels' "
                             "side: up to (side / 28)^2 image tokens an image.")
    contender_options(parser, CONTENDERS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    # Every contender is TRL's, each taking turns with llmtune sft.
    run_contenders(args, worker, prepare, True, report, __file__)


if __name__ == "__main__":
    main()
