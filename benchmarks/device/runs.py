"""The runs stage of benchmarks/device/proof.py (b): runs of tiny models through llmtune.train (the CLI's checks and
worker, in the calling process), one after another in one process that imports torch once for all of them, each on
the path this machine gives it (on a GPU: CUDA, nccl, bf16), each judged by what it must equal.

- pt and sft with every attention backend llmtune takes (config.ATTENTION_BACKENDS) that this machine has, on packed
  rows (pt: documents of log-uniform lengths, benchmarks/gpu.py's corpus; sft: the demo's conversations), their losses
  within TOLERANCE of sdpa's; a control, sdpa with the document mask off, must differ from sdpa's by more than
  TOLERANCE, else the comparison could not tell a backend that attends across documents;
- dpo at step 0 (the policy is its reference): ln 2; LoRA at step 0 (its B is 0): the sft run's first loss;
  QLoRA (nf4) and a mixture of experts (Qwen3-MoE, its router loss logged) train with finite losses;
- Liger's fused kernels, pinned CPU offload, per_device_train_batch_size: auto (from the device's memory),
  torch.compile: sft sdpa's losses within TOLERANCE;
- a run stopped halfway and resumed (train.deterministic) against the straight run: the same losses, bitwise;
- the export, loaded back with AutoModelForCausalLM: the trained model's logits (fp32, within 1e-4);
- float8 training (sm_89+): a 50M-parameter Llama's losses within 1% of its bf16 twin's.
Every run also gives `llmtune plan`'s peak for its config.yaml beside its measured peak (CUDA: the run's
torch.cuda.max_memory_allocated above what the process held before it). On a CPU (the dry run) the runs compute in
fp32 with shorter rows and one decoder layer, and those that need CUDA are skipped ("no CUDA").
"""

import contextlib
import importlib.util
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import yaml

import llmtune
from benchmarks.device.items import NO_CUDA, Failed, Results, Skipped, planned_gib
from tests.helpers import StopAt, read_metrics, save_tiny_model, train_and_export

# Relative difference of two runs' losses, step by step, that one attention kernel (or fused kernel, offload, micro-
# batch, compile) may make: bf16 rounds each matmul differently per kernel; fp32 only sums in another order. On a
# CPU in fp32 at REAL's sizes, sdpa with the document mask off moved the pt run's losses by up to 1.7%, 3.4 times the
# bf16 tolerance.
TOLERANCE = {True: 5e-3, False: 1e-4}  # by bf16
FP8_TOLERANCE = 0.01  # tests/e2e/test_fp8_run.py's
LOGITS_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Sizes:
    llama: dict  # the tiny Llama's config, on top of tests/helpers.save_tiny_model's
    seq: int  # pt and sft rows
    pair_seq: int  # dpo rows (a pair each)
    micro: int
    batch: int  # global batch
    steps: int


# A Llama whose decoder linears nf4 can hold (each a whole number of its 16,384-value groups); on a GPU with heads
# flash attention and flex attention take (64 wide) and GQA, tests/conftest.py's nf4_llama; on a CPU the smallest, of
# one decoder layer.
REAL = Sizes(llama=dict(hidden_size=256, intermediate_size=512, num_key_value_heads=2, max_position_embeddings=512),
             seq=512, pair_seq=256, micro=4, batch=8, steps=6)
DRY = Sizes(llama=dict(hidden_size=128, intermediate_size=128, num_key_value_heads=4, max_position_embeddings=128,
                       num_hidden_layers=1),
            seq=64, pair_seq=128, micro=2, batch=4, steps=2)
# The demo's rows the runs read (more than 6 steps of 8 packed rows take): fewer to tokenize.
SFT_ROWS, PAIRS = 512, 64
# One decoder layer whose attention and MLP projections torchao's float8 filter takes (tests/e2e/test_fp8_run.py's).
FP8_LLAMA = dict(hidden_size=2304, intermediate_size=4608, num_hidden_layers=1, num_attention_heads=18,
                 num_key_value_heads=6, tie_word_embeddings=False, max_position_embeddings=REAL.seq)


@contextlib.contextmanager
def kept_process_state():
    """What a run may leave changed in this process, put back after it: the environment and the deterministic
    switches (train.deterministic sets them for the process), and transformers' llama module (Liger patches it)."""
    from transformers.models.llama import modeling_llama

    env, llama = dict(os.environ), dict(vars(modeling_llama))
    switches = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                torch.backends.cudnn.benchmark)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        vars(modeling_llama).update(llama)
        torch.use_deterministic_algorithms(switches[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = switches[1:]


def max_relative_difference(losses: list[float], reference: list[float]) -> float:
    if len(losses) != len(reference):
        raise Failed(f"{len(losses)} losses logged, the reference has {len(reference)}")
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


class Runs:
    """The inputs of every run (written once into `root`; a stage started again after a crash finds them) and what
    the cases share: the recipe, a run with its numbers, the comparisons."""

    def __init__(self, results: Results, root: Path, dry_run: bool):
        from transformers import AutoTokenizer, LlamaForCausalLM

        from benchmarks.gpu import write_corpus
        from llmtune.demo.assets import write_demo_assets

        self.results, self.root, self.cuda = results, root, torch.cuda.is_available()
        self.sizes, self.tolerance = DRY if dry_run else REAL, TOLERANCE[self.cuda]
        self.assets = root / "assets"
        if not (self.assets / "tokenizer").exists():
            write_demo_assets(self.assets)
        self.tokenizer = AutoTokenizer.from_pretrained(self.assets / "tokenizer")
        self.llama = root / "llama"
        if not self.llama.exists():
            save_tiny_model(self.llama, LlamaForCausalLM, self.tokenizer, tie_word_embeddings=False, **self.sizes.llama)
        self.corpus = root / "corpus.jsonl"
        if not self.corpus.exists():
            write_corpus(self.assets, self.corpus, 2 * self.sizes.steps * self.sizes.batch * self.sizes.seq,
                         self.sizes.seq)
        self.files = {"sft": root / "sft.jsonl", "dpo": root / "pairs.jsonl"}
        for (task, path), rows in zip(self.files.items(), (SFT_ROWS, PAIRS)):
            lines = (self.assets / "data" / f"{task}_train.jsonl").read_text().splitlines()[:rows]
            path.write_text("\n".join(lines) + "\n")

    def needs_cuda(self, why: str) -> None:
        if not self.cuda:
            raise Skipped(f"{NO_CUDA}: {why}")

    def recipe(self, name: str, task: str, **sections) -> dict:
        """The run's recipe: a few steps of the tiny Llama on packed rows, nothing saved; `sections` added to it,
        section by section."""
        data = {"pt": {"train_files": [str(self.corpus)], "max_seq_len": self.sizes.seq},
                "sft": {"train_files": [str(self.files["sft"])], "chat_template": "basic",
                        "max_seq_len": self.sizes.seq},
                "dpo": {"train_files": [str(self.files["dpo"])], "chat_template": "basic",
                        "max_seq_len": self.sizes.pair_seq}}[task]
        recipe = {
            "model": {"name_or_path": str(self.llama), "attn_implementation": "sdpa"},
            "data": {**data, "cache_dir": str(self.root / "cache")},
            "train": {"output_dir": str(self.root / "out" / re.sub(r"\W+", "_", name)), "max_steps": self.sizes.steps,
                      "per_device_train_batch_size": self.sizes.micro, "global_batch_size": self.sizes.batch,
                      "logging_steps": 1, "learning_rate": 5e-3, "bf16": self.cuda},
            "checkpoint": {"export_hf": False},
            "monitor": {"plots": False, "console": False},
        }
        for section, keys in sections.items():
            recipe[section] = {**recipe.get(section, {}), **keys}
        return recipe

    def train(self, task: str, recipe: dict, callbacks=(), run=None) -> tuple[list[dict], dict]:
        """(metrics.jsonl's records, the run's numbers: its losses, the planned and measured peaks) of llmtune.train
        on the recipe, or of run() that trains it otherwise. Fails on a loss that is not finite."""
        import gc

        held = 0
        if self.cuda:
            # What earlier runs left is freed before this run's peak is measured; a CPU measures none, and spares the
            # collection's 0.3 s a run.
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
        with kept_process_state():
            (run or (lambda: llmtune.train(task, recipe, callbacks=list(callbacks))))()
        out = Path(recipe["train"]["output_dir"])
        records = read_metrics(out)
        losses = [r["loss"] for r in records if "loss" in r]
        numbers = {"losses": losses, "planned_gib": planned_gib(out / "config.yaml", task),
                   "peak_gib": max(r["mem_gib"] for r in records) - held / 2**30 if self.cuda else None}
        if not losses or not all(math.isfinite(loss) for loss in losses):
            raise Failed(f"losses {losses}", **numbers)
        return records, numbers

    def reference(self, name: str) -> list[float]:
        row = self.results.rows.get(name)
        if row is None or row["status"] != "passed":
            raise Skipped(f"ran, but {name} did not pass: nothing to compare with")
        return row["losses"]

    def within(self, numbers: dict, reference: str, tolerance: float | None = None) -> dict:
        """The run's numbers, with its losses checked against the reference run's."""
        tolerance = tolerance or self.tolerance
        difference = max_relative_difference(numbers["losses"], self.reference(reference))
        numbers = {**numbers, "difference": difference,
                   "check": f"losses within {difference:.1e} of {reference}'s (tolerance {tolerance:.0e})"}
        if difference > tolerance:
            raise Failed(f"losses {difference:.2e} from {reference}'s, beyond {tolerance:.0e}", **numbers)
        return numbers


def backend_case(task: str, backend: str):
    def case(runs: Runs) -> dict:
        from llmtune.model.attention import backend_problems

        problems = backend_problems(backend, cuda=runs.cuda, bf16=runs.cuda)
        if problems:
            raise Skipped(f"{NO_CUDA}: {problems[0]}" if not runs.cuda else "; ".join(problems))
        _, numbers = runs.train(task, runs.recipe(f"{task} {backend}", task, model={"attn_implementation": backend}))
        return numbers if backend == "sdpa" else runs.within(numbers, f"{task} sdpa")
    return case


def control(runs: Runs) -> dict:
    """sdpa attending across the documents of each row: its losses must differ from pt sdpa's beyond the tolerance."""
    _, numbers = runs.train("pt", runs.recipe("pt control", "pt", data={"document_mask": False}))
    difference = max_relative_difference(numbers["losses"], runs.reference("pt sdpa"))
    check = f"attending across documents moves the losses by {difference:.1e}, beyond the {runs.tolerance:.0e} " \
        "the backends are held to"
    if difference <= runs.tolerance:
        raise Failed(f"attending across documents moved the losses by {difference:.1e} only: the backends' "
                     "comparison cannot tell it", **numbers)
    return {**numbers, "difference": difference, "check": check}


def dpo(runs: Runs) -> dict:
    _, numbers = runs.train("dpo", runs.recipe("dpo", "dpo", train={"per_device_train_batch_size": 1,
                                                                    "global_batch_size": 4}))
    first = numbers["losses"][0]
    if abs(first - math.log(2)) > 1e-3:
        raise Failed(f"step 0's loss {first:.6f}, not ln 2 (the policy is its reference)", **numbers)
    return {**numbers, "check": f"step 0's loss {first:.6f} = ln 2 within 1e-3"}


def lora(runs: Runs) -> dict:
    _, numbers = runs.train("sft", runs.recipe("sft LoRA", "sft", peft={"method": "lora", "r": 8}))
    first, base = numbers["losses"][0], runs.reference("sft sdpa")[0]
    if abs(first - base) > runs.tolerance * abs(base):
        raise Failed(f"step 0's loss {first:.6f}, not the base model's {base:.6f} (B starts at 0)", **numbers)
    return {**numbers, "check": f"step 0's loss {first:.6f} is the base model's {base:.6f}"}


def qlora(runs: Runs) -> dict:
    if importlib.util.find_spec("torchao") is None:
        raise Skipped("torchao is not installed (the qlora extra)")
    _, numbers = runs.train("sft", runs.recipe("sft QLoRA", "sft", peft={"method": "qlora", "r": 8}))
    return {**numbers, "check": "finite losses on the nf4 base"}


def mixture_of_experts(runs: Runs) -> dict:
    from tests.model_matrix import FAMILIES

    folder = runs.root / "qwen3_moe"
    if not folder.exists():
        family = next(f for f in FAMILIES if f.model_type == "qwen3_moe")
        tok = runs.tokenizer
        config = family.hf_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
        config.max_position_embeddings = runs.sizes.seq
        config.save_pretrained(folder)
    records, numbers = runs.train("pt", runs.recipe("pt Qwen3-MoE", "pt", model={
        "name_or_path": None, "config": str(folder), "tokenizer": str(runs.assets / "tokenizer")}))
    if not all(math.isfinite(r.get("aux_loss", math.nan)) for r in records):
        raise Failed("a step without a finite router aux_loss", **numbers)
    return {**numbers, "check": f"router aux_loss logged, expert load {records[-1]['expert_load']:.2f}"}


def fused_kernels(runs: Runs) -> dict:
    runs.needs_cuda("Liger's kernels run on CUDA only")
    if importlib.util.find_spec("liger_kernel") is None:
        raise Skipped("liger-kernel is not installed")
    _, numbers = runs.train("sft", runs.recipe("sft Liger", "sft", train={"fused_kernels": True}))
    return runs.within(numbers, "sft sdpa")


def offload(runs: Runs) -> dict:
    _, numbers = runs.train("sft", runs.recipe("sft offload", "sft", parallel={"cpu_offload": True}))
    return runs.within(numbers, "sft sdpa")


def auto_micro_batch(runs: Runs) -> dict:
    recipe = runs.recipe("sft auto", "sft", train={"per_device_train_batch_size": "auto"})
    _, numbers = runs.train("sft", recipe)
    config = Path(recipe["train"]["output_dir"]) / "config.yaml"
    chosen = yaml.safe_load(config.read_text())["train"]["per_device_train_batch_size"]
    numbers = runs.within(numbers, "sft sdpa")
    return {**numbers, "check": f"micro-batch {chosen} chosen; {numbers['check']}"}


def resume(runs: Runs) -> dict:
    """train.deterministic: the straight run, then one stopped halfway and resumed from its checkpoint there."""
    half = runs.sizes.steps // 2
    sections = dict(train={"deterministic": True}, checkpoint={"save_steps": half, "export_hf": False})
    _, straight = runs.train("sft", runs.recipe("sft straight", "sft", **sections))
    resumed = runs.recipe("sft resumed", "sft", **sections)
    runs.train("sft", resumed, callbacks=[StopAt(half)])
    _, numbers = runs.train("sft", {**resumed, "checkpoint": {**resumed["checkpoint"],
                                                               "resume_from_checkpoint": "auto"}})
    if numbers["losses"] != straight["losses"]:
        difference = max_relative_difference(numbers["losses"], straight["losses"])
        raise Failed(f"the resumed run's losses differ from the straight run's by up to {difference:.2e}", **numbers)
    return {**numbers, "check": f"{len(numbers['losses'])} losses, resumed after step {half}, equal bitwise to the "
                                "straight run's"}


def export(runs: Runs) -> dict:
    """An fp32 run exported in fp32, made in this process as tests/e2e/test_export.py makes it
    (tests/helpers.train_and_export: the trained model is at hand only there): the exported folder, loaded by
    transformers, gives the trained model's logits."""
    from transformers import AutoModelForCausalLM

    from llmtune.config import load_config

    recipe = runs.recipe("sft export", "sft", train={"bf16": False}, checkpoint={"export_dtype": "fp32"})
    config = load_config(recipe, [], "sft", world_size=1)
    ids = (torch.arange(40) % (len(runs.tokenizer) - 3) + 3)[None]
    trained = {}

    def logits(trainer, tokenizer, state) -> None:
        trainer.model.eval()
        with torch.no_grad():
            trained["logits"] = trainer.model(ids.to(state.device))

    _, numbers = runs.train("sft", recipe, run=lambda: train_and_export(config, logits))
    exported = AutoModelForCausalLM.from_pretrained(Path(config.train.output_dir) / "hf", dtype=torch.float32)
    device = trained["logits"].device
    with torch.no_grad():
        difference = (exported.to(device).eval()(ids.to(device)).logits - trained["logits"]).abs().max().item()
    numbers = {**numbers, "difference": difference,
               "check": f"exported logits within {difference:.1e} of the trained model's"}
    if difference > LOGITS_TOLERANCE:
        raise Failed(f"the exported model's logits differ by {difference:.2e}, beyond {LOGITS_TOLERANCE:.0e}",
                     **numbers)
    return numbers


def float8(runs: Runs, twin: bool) -> dict:
    """The float8 run (train.fp8 true: tensorwise, compiled, as it must be; twin: its bf16 twin, eager, the
    reference) of a one-layer Llama large enough for torchao's filter."""
    from transformers import LlamaForCausalLM

    from llmtune.features.float8 import device_problem

    problem = device_problem()
    if problem:
        raise Skipped(f"{NO_CUDA}: {problem}" if not runs.cuda else problem)
    if importlib.util.find_spec("torchao") is None:
        raise Skipped("torchao is not installed (the fp8 extra)")
    folder = runs.root / "fp8_llama"
    if not folder.exists():
        save_tiny_model(folder, LlamaForCausalLM, runs.tokenizer, **FP8_LLAMA)
    name = "pt float8 twin (bf16)" if twin else "pt float8"
    # tests/e2e/test_fp8_run.py's learning rate: at the other runs' 5e-3 this model's loss jumps from 6.2 to 16 at
    # step 2 (seen on the first GPU, in bf16 too), and float8's rounding then moves the chaotic steps after it by 4%.
    _, numbers = runs.train("pt", runs.recipe(name, "pt", model={"name_or_path": str(folder)},
                                              train={"fp8": not twin, "compile": not twin,
                                                     "learning_rate": 1e-4}))
    return numbers if twin else runs.within(numbers, "pt float8 twin (bf16)", FP8_TOLERANCE)


def compiled(runs: Runs) -> dict:
    runs.needs_cuda("the dry run leaves out compiling (minutes on a CPU; the suite compiles there)")
    _, numbers = runs.train("sft", runs.recipe("sft compile", "sft", train={"compile": True}))
    return runs.within(numbers, "sft sdpa")


def cases() -> list[tuple[str, Callable[[Runs], dict]]]:
    """(name, case) in the order they run: the references first, what only a GPU can show before the rest."""
    from llmtune.config import ATTENTION_BACKENDS

    backends = ["sdpa", *(b for b in ATTENTION_BACKENDS if b not in ("auto", "sdpa"))]
    return [
        *((f"pt {b}", backend_case("pt", b)) for b in backends),
        ("pt control: sdpa, document mask off", control),
        *((f"sft {b}", backend_case("sft", b)) for b in backends),
        ("sft Liger fused kernels", fused_kernels),
        ("pt float8 twin (bf16)", lambda runs: float8(runs, twin=True)),
        ("pt float8", lambda runs: float8(runs, twin=False)),
        ("dpo", dpo),
        ("sft LoRA", lora),
        ("sft QLoRA (nf4)", qlora),
        ("pt Qwen3-MoE", mixture_of_experts),
        ("sft pinned CPU offload", offload),
        ("sft auto micro-batch", auto_micro_batch),
        ("sft resumed bitwise", resume),
        ("sft export round trip", export),
        ("sft torch.compile", compiled),
    ]


def run_cases(results: Results, root: Path, dry_run: bool) -> None:
    root.mkdir(parents=True, exist_ok=True)
    runs = Runs(results, root, dry_run)
    for name, case in cases():
        results.run(name, lambda: case(runs))
