"""GPU throughput of `llmtune pt`: tokens/s per GPU, MFU and peak memory of a Llama-3-shaped model trained from
random weights (nothing downloaded), beside the figures torchtitan publishes for Llama-3.1-8B on 8 H100s.

    python benchmarks/gpu.py [--model 8b|3b|1b] [--seq 8192] [--batch 1] [--steps 20] [--warmup 5] [--nproc N]
                             [--checkpointing on|off|both] [--compile on|off|both] [--fp8 off|tensorwise|rowwise|both]
                             [--attn auto] [--fused-kernels] [--document-mask on|off] [--out DIR]

Each configuration (activation checkpointing on/off x torch.compile on/off x float8 training off or with a scaling,
float8 only compiled, as train.fp8 asks) is one `llmtune pt RECIPE --nproc N` run (torchrun underneath when N > 1)
of warmup + steps optimizer steps, bf16, on packed rows of seq tokens: a corpus of documents of random lengths
(log-uniform from 128 to 2 x seq tokens), so position_ids restart inside rows and, with the document mask on
(llmtune's default), attention stays inside each document. From the run's
metrics.jsonl (one record per step), over the timed steps after the warm-up (compilation happens there):
- tokens/s/GPU: the median of the records' tokens_per_s, which counts the input tokens of all ranks, over N;
- MFU: the median of the records' mfu (the monitor's FLOPs per token x tokens/s per GPU over the device's dense bf16
  peak; its attention term counts the whole row, as torchtitan's does, even where the document mask skips work);
- peak GiB: rank 0's torch.cuda.max_memory_allocated.

Without a CUDA device it says so and exits 0, writing nothing.
"""

import argparse
import itertools
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

# Llama-3.1-8B, Llama-3.2-3B and Llama-3.2-1B as their config.json describe them (rope scaling left out: it changes no FLOP).
SHAPES = {
    "8b": ("Llama-3.1-8B", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)),
    "3b": ("Llama-3.2-3B", dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                                intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)),
    "1b": ("Llama-3.2-1B", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)),
}
LLAMA3_MAX_POSITIONS = 131072

# torchtitan's benchmarks/llama3_h100_202412_torchtitan.md, Table 1: Llama-3.1-8B, FSDP on 8 H100s (96GB HBM2e,
# 500 W), seq 8192, bf16, local batch 2, selective activation checkpointing, December 2024.
# (label, tokens/s/GPU, memory GiB)
TORCHTITAN_GPUS = 8
TORCHTITAN = [("FSDP", 5762, 82.4), ("FSDP + torch.compile", 6667, 77.0)]

MIN_DOC_TOKENS = 128
SWITCHES = {"on": (True,), "off": (False,), "both": (False, True)}  # --checkpointing, --compile
# --fp8: train.fp8's values to run (False: off); both = each scaling
FLOAT8 = {"off": (False,), "tensorwise": ("tensorwise",), "rowwise": ("rowwise",), "both": ("tensorwise", "rowwise")}


def at_least(minimum: int):
    """An argparse type: an integer of at least `minimum` (a run needs a timed step, a row, a GPU)."""
    def parse(text: str) -> int:
        if not text.lstrip("-").isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer of at least {minimum}")
        return int(text)
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", choices=tuple(SHAPES), help="model shape: 8b (Llama-3.1-8B), 3b (Llama-3.2-3B) or "
                        "1b (Llama-3.2-1B); "
                        "default 8b on more than one GPU, else 1b (the 8B's weights and AdamW state do not fit one)")
    parser.add_argument("--seq", type=at_least(2), default=8192, help="tokens per packed row (data.max_seq_len); "
                        "default %(default)s")
    parser.add_argument("--batch", type=at_least(1), default=1, help="rows per micro-batch on each GPU "
                        "(train.per_device_train_batch_size); default %(default)s")
    parser.add_argument("--steps", type=at_least(1), default=20, help="optimizer steps timed after the warm-up; "
                        "default %(default)s")
    parser.add_argument("--warmup", type=at_least(0), default=5, help="optimizer steps run first and not timed "
                        "(compilation happens there); default %(default)s")
    parser.add_argument("--nproc", type=at_least(1), help="GPUs (processes) per run; default all visible")
    parser.add_argument("--checkpointing", choices=tuple(SWITCHES), default="both", help="activation checkpointing "
                        "(train.gradient_checkpointing); both runs each; default %(default)s")
    parser.add_argument("--compile", choices=tuple(SWITCHES), default="both", help="torch.compile of each decoder "
                        "layer (train.compile); both runs each; default %(default)s")
    parser.add_argument("--fp8", choices=tuple(FLOAT8), default="off", help="float8 training of the large linear "
                        "layers with this scaling (train.fp8; needs torchao and a GPU with float8 tensor cores), in "
                        "the compiled configurations; both runs each scaling; default %(default)s")
    parser.add_argument("--attn", default="auto", help="attention backend (model.attn_implementation); default "
                        "%(default)s: flash attention where installed, else sdpa")
    parser.add_argument("--fused-kernels", action="store_true", help="Liger's fused kernels (train.fused_kernels: "
                        "true; needs liger-kernel); default off")
    parser.add_argument("--document-mask", choices=("on", "off"), default="on", help="keep attention inside each "
                        "packed document (data.document_mask); off attends across the whole row, as torchtitan's "
                        "published runs do, for the same attention work as theirs; default %(default)s")
    parser.add_argument("--out", help="folder for the recipes, data, metrics and logs of the runs; default a "
                        "temporary folder, removed at the end")
    return parser


def write_corpus(assets: Path, path: Path, tokens: int, seq: int) -> None:
    """A pt corpus of at least `tokens` tokens in documents of log-uniform random lengths (MIN_DOC_TOKENS to
    2 x seq, some longer than a row), each made of whole demo documents. What is short of a full run, e.g. the
    blocks packing drops, is read again in a second epoch: the speed does not depend on which rows are read."""
    from transformers import AutoTokenizer

    texts = [json.loads(line)["text"] for line in (assets / "data" / "pt.jsonl").read_text().splitlines()]
    sizes = [len(ids) for ids in AutoTokenizer.from_pretrained(assets / "tokenizer")(texts)["input_ids"]]
    rng = random.Random(0)
    with path.open("w") as f:
        while tokens > 0:
            target = math.exp(rng.uniform(math.log(MIN_DOC_TOKENS), math.log(2 * seq)))
            picked, length = [], 0
            while length < target:
                picked.append(rng.randrange(len(texts)))
                length += sizes[picked[-1]]
            f.write(json.dumps({"text": " ".join(texts[i] for i in picked)}) + "\n")
            tokens -= length


def write_inputs(out: Path, shape: dict, args, nproc: int) -> tuple[Path, Path, Path]:
    """(model config folder, tokenizer folder, corpus) under `out`. The tokenizer is the demo's, whose 256 ids are
    far fewer than the model's 128,256 (llmtune only asks for at least as many): every token still costs the full
    embedding lookup and lm_head, so the speed does not depend on which ids the data holds."""
    from transformers import LlamaConfig

    from llmtune.demo.assets import write_demo_assets

    write_demo_assets(out / "assets")
    model_dir = out / "model"
    LlamaConfig(rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=max(LLAMA3_MAX_POSITIONS, args.seq),
                **shape).save_pretrained(model_dir)
    corpus = out / "corpus.jsonl"
    write_corpus(out / "assets", corpus, (args.warmup + args.steps) * args.batch * nproc * args.seq, args.seq)
    return model_dir, out / "assets" / "tokenizer", corpus


def write_recipe(run_dir: Path, inputs: tuple[Path, Path, Path], args, checkpointing: bool | str, compiled: bool,
                 fp8: bool | str) -> Path:
    """run_dir/recipe.yaml: a pt run with one metrics record per step and nothing saved; checkpointing:
    train.gradient_checkpointing's value, fp8 train.fp8's."""
    model_dir, tokenizer, corpus = inputs
    run_dir.mkdir(parents=True, exist_ok=True)
    train = {"output_dir": str(run_dir), "max_steps": args.warmup + args.steps, "logging_steps": 1,
             "per_device_train_batch_size": args.batch, "bf16": True, "gradient_checkpointing": checkpointing,
             "compile": compiled}
    # Only when asked: the recipe stays valid for an llmtune without the keys.
    if args.fused_kernels:
        train["fused_kernels"] = True
    if fp8:
        train["fp8"] = fp8
    recipe = run_dir / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"config": str(model_dir), "tokenizer": str(tokenizer), "attn_implementation": args.attn},
        # One cache for every configuration: the corpus is tokenized and packed once.
        "data": {"train_files": [str(corpus)], "max_seq_len": args.seq, "document_mask": args.document_mask == "on",
                 "cache_dir": str(run_dir.parent / "cache")},
        "train": train,
        "checkpoint": {"export_hf": False},
        "monitor": {"console": False},
    }))
    return recipe


def measure(recipe: Path, nproc: int, warmup: int) -> dict:
    """{tokens_per_gpu, mfu, mem_gib} of the timed steps of one `llmtune pt` run, or {failed: its last line}."""
    log = recipe.parent / "llmtune.log"
    with log.open("w") as f:
        done = subprocess.run([sys.executable, "-m", "llmtune", "pt", str(recipe), "--nproc", str(nproc)], cwd=REPO,
                              stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        # Under torchrun the worker's error (an out-of-memory one, say) comes before torchrun's own summary.
        lines = log.read_text().strip().splitlines() or ["no output"]
        return {"failed": f"exit {done.returncode}: {next((l for l in reversed(lines) if 'Error' in l), lines[-1])}"}
    records = [json.loads(line) for line in (recipe.parent / "metrics.jsonl").read_text().splitlines()]
    timed = records[warmup:]
    mfu = [r["mfu"] for r in timed if r["mfu"] is not None]
    return {"tokens_per_gpu": statistics.median(r["tokens_per_s"] for r in timed) / nproc,
            "mfu": statistics.median(mfu) if mfu else None, "mem_gib": max(r["mem_gib"] for r in timed)}


def row(label: str, gpus: int, tokens_per_gpu: float, mfu: str, mem_gib: float) -> str:
    return f"{label:<45} {gpus:>4} {tokens_per_gpu:>13,.0f} {mfu:>6} {mem_gib:>9.1f}"


def print_reference(model: str, nproc: int) -> None:
    print(f"\ntorchtitan's published figures, the reference to beat: Llama-3.1-8B, {TORCHTITAN_GPUS}x H100 "
          "(96GB HBM2e, 500 W), seq 8192, bf16, local batch 2, selective activation checkpointing, attention across "
          "the whole row; memory as they report it")
    for label, tokens_per_gpu, mem_gib in TORCHTITAN:
        print(row(label, TORCHTITAN_GPUS, tokens_per_gpu, "", mem_gib))
    if model != "8b" or nproc != TORCHTITAN_GPUS:
        print(f"not comparable: these runs are {SHAPES[model][0]}-shaped on {nproc} GPU(s); torchtitan's figures are "
              f"for the Llama-3.1-8B shape on {TORCHTITAN_GPUS} GPUs (run --model 8b --nproc {TORCHTITAN_GPUS})")


def run_all(out: Path, args, model: str, nproc: int) -> None:
    import torch

    name, shape = SHAPES[model]
    inputs = write_inputs(out, shape, args, nproc)
    print(f"{name} shape, random weights, on {torch.cuda.get_device_name()}; seq {args.seq}, micro-batch {args.batch} "
          f"per GPU, bf16, packed rows (document mask {args.document_mask}), attention {args.attn}"
          f"{', fused kernels' if args.fused_kernels else ''}; {args.steps} steps timed after {args.warmup}")
    print(f"{'configuration':<45} {'GPUs':>4} {'tokens/s/GPU':>13} {'MFU':>6} {'peak GiB':>9}")
    for checkpointing, compiled, fp8 in itertools.product(SWITCHES[args.checkpointing], SWITCHES[args.compile],
                                                          FLOAT8[args.fp8]):
        if fp8 and not compiled:
            continue  # train.fp8 needs train.compile
        label = f"checkpointing {'on' if checkpointing else 'off'}, compile {'on' if compiled else 'off'}" + \
            (f", fp8 {fp8}" if fp8 else "")
        recipe = write_recipe(out / label.replace(", ", "_").replace(" ", "_"), inputs, args, checkpointing, compiled,
                              fp8)
        result = measure(recipe, nproc, args.warmup)
        if "failed" in result:
            print(f"{label:<45} {nproc:>4} failed ({result['failed']})", flush=True)
            continue
        mfu = f"{result['mfu']:.1%}" if result["mfu"] is not None else "n/a"  # n/a: a device the monitor's table lacks
        print(row(label, nproc, result["tokens_per_gpu"], mfu, result["mem_gib"]), flush=True)
    print_reference(model, nproc)


def main() -> None:
    args = build_parser().parse_args()
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device; this benchmark measures GPUs only")
        return
    nproc = args.nproc or torch.cuda.device_count()
    if nproc > torch.cuda.device_count():
        sys.exit(f"benchmarks/gpu.py: --nproc {nproc} but only {torch.cuda.device_count()} GPU(s) are visible")
    model = args.model or ("8b" if nproc > 1 else "1b")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        run_all(Path(args.out), args, model, nproc)
        return
    with tempfile.TemporaryDirectory() as tmp:
        run_all(Path(tmp), args, model, nproc)


if __name__ == "__main__":
    main()
