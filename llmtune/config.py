"""Recipe YAML + command-line overrides -> a validated, typed Config.

Every section is a dataclass whose fields carry their default and a one-line help; the recipe
reference (docs/recipe.md) and --help are rendered from them, so the two cannot drift. All problems of a recipe are
reported together, before anything expensive (torch import, process group) happens.
"""

import dataclasses
import difflib
import os
import re
import signal
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from llmtune.atomic import write_text
from llmtune.errors import UserError
from llmtune import llamafactory
from llmtune.tasks.registry import PROMPTS, SCORE_HEAD, TASKS

DATA_FORMATS = ("auto", "text", "alpaca", "sharegpt", "messages", "prompt_completion", "prompt_response", "tokenized",
                "prompt_chosen_rejected", "chosen_rejected", "alpaca_ranking", "sharegpt_ranking",
                "prompt_completion_label", "alpaca_kto", "sharegpt_kto", "messages_kto")
TRUNCATIONS = ("truncate_prompt", "drop")
REMAINDERS = ("drop", "pad")
LR_SCHEDULERS = ("constant", "linear", "cosine", "wsd")
CHECKPOINTING = ("none", "selective", "full")  # train.gradient_checkpointing's modes, least recompute first; false is none, true full
DECAY_TYPES = ("linear", "cosine", "1-sqrt")
# train.fp8's scalings, torchao's recipe names; the first is what true means (torchao's Float8LinearConfig default).
FLOAT8_SCALINGS = ("tensorwise", "rowwise")
TRACKERS = ("tensorboard", "wandb", "mlflow")
# Names that users of other trainers write, read as llmtune's (config.yaml holds llmtune's), by whose names they are.
# A key of the train section may also be written in lr_scheduler_kwargs, as transformers takes it.
ALIASES_BY_ORIGIN = {
    "the HF Trainer's": {
        "train.torch_compile": "train.compile",
        "train.label_smoothing_factor": "train.label_smoothing",
        "train.full_determinism": "train.deterministic",
        "train.min_lr_rate": "train.min_lr_ratio",
        "train.num_decay_steps": "train.decay_steps",
        "train.report_to": "monitor.report_to",
        "train.metric_for_best_model": "checkpoint.best_metric",
        "train.greater_is_better": "checkpoint.greater_is_better",
        "train.run_name": "monitor.run_name",
        "train.dataloader_num_workers": "data.num_workers",
        "train.dataloader_pin_memory": "data.pin_memory",
        "train.dataloader_prefetch_factor": "data.prefetch_factor",
        "train.dataloader_persistent_workers": "data.persistent_workers",
    },
    "LLaMA-Factory's": {
        "model.model_name_or_path": "model.name_or_path",
        "data.cutoff_len": "data.max_seq_len",
        "peft.finetuning_type": "peft.method",
        "peft.lora_rank": "peft.r",
        "peft.lora_alpha": "peft.alpha",
        "peft.lora_dropout": "peft.dropout",
        "peft.lora_target": "peft.target_modules",
        "dpo.pref_beta": "dpo.beta",
        "dpo.pref_loss": "dpo.loss_type",
        "dpo.pref_ftx": "dpo.sft_weight",
        "dpo.dpo_label_smoothing": "dpo.label_smoothing",
        "kto.pref_beta": "kto.beta",
        "kto.kto_chosen_weight": "kto.desirable_weight",
        "kto.kto_rejected_weight": "kto.undesirable_weight",
        "train.freeze_trainable_layers": "train.trainable_layers",
        "train.freeze_trainable_modules": "train.trainable_layer_modules",
        "train.freeze_extra_modules": "train.trainable_extra_modules",
    },
    "TRL's": {"dpo.rpo_alpha": "dpo.sft_weight",
              "eval_generation.max_completion_length": "eval_generation.max_new_tokens"},
    "torchtune's": {"train.lr": "train.learning_rate"},  # its optimizer's lr
    "llmtune's earlier": {"monitor.wandb_project": "monitor.project"},
}
KEY_ALIASES = {alias: target for names in ALIASES_BY_ORIGIN.values() for alias, target in names.items()}
ALIAS_ORIGINS = {alias: origin for origin, names in ALIASES_BY_ORIGIN.items() for alias in names}
SCHEDULER_ALIASES = {"constant_with_warmup": "constant", "cosine_with_min_lr": "cosine", "warmup_stable_decay": "wsd"}
# LLaMA-Factory's finetuning_type values, as peft.method reads them; its freeze (the last layers trained) is llmtune's
# train.trainable_layers, a choice of parameters rather than a method (llamafactory.FREEZE).
FINETUNING_TYPES = {"full": "none", "lora": "lora"}
ATTENTION_BACKENDS = ("auto", "sdpa", "eager", "varlen", "flash_attention_2", "flash_attention_3", "flex_attention")
CATCHABLE_SIGNALS = {sig.name for sig in signal.Signals} - {"SIGKILL", "SIGSTOP"}
# Values of checkpoint.resume_from_checkpoint that mean the newest good checkpoint of output_dir (else a fresh start).
RESUME_NEWEST = ("auto", "latest")
# The value of checkpoint.resume_from_checkpoint that means output_dir's checkpoints/best.
RESUME_BEST = "best"
EXPORT_FROM = ("last", "best")
# train.per_device_train_batch_size's value that asks for the largest micro-batch the device holds (run/micro_batch.py).
AUTO = "auto"
# The files a data source may name (data.train_files, validation_files, a dataset_info.json entry's file_name).
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt")
# transformers' pattern for a Hub kernel (transformers.integrations.hub_kernels.is_kernel): org/name[@rev][:fn].
HUB_KERNEL = re.compile(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$")
PEFT_METHODS = ("none", "lora", "dora")
QUANTIZE = ("none", "nf4")
# peft.method: qlora reads as LoRA on a 4-bit base: peft.method lora with model.quantize nf4.
QLORA = "qlora"
# peft's other initialisations (pissa, olora, loftq, corda, eva, ...) read or rewrite the base weights or need data
# at init, which the sharded model built on the meta device does not give them.
LORA_INITS = (True, False, "gaussian")


# dpo.loss_type's losses; simpo and orpo need no reference model.
PREFERENCE_LOSSES = ("sigmoid", "robust", "hinge", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
REFERENCES = ("model", "adapter_off", "precomputed")


SIZE_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' -> bytes (transformers' max_shard_size notation)."""
    upper = text.strip().upper()
    for unit, factor in SIZE_UNITS.items():
        number = upper.removesuffix(unit).strip()
        if upper.endswith(unit) and number.replace(".", "", 1).isdigit():
            return int(float(number) * factor)
    raise ValueError(f"{text!r} is not a size like 5GB or 500MB")


def _field(default, help: str, **kwargs):
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help}, **kwargs)
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass
class ModelConfig:
    name_or_path: str | None = _field(None, "Model to fine-tune (config, safetensors weights, tokenizer): a local HF "
                                            "folder or a Hub id (org/name).")
    config: str | None = _field(None, "For pt from scratch: a HF config.json (file or folder); weights start random.")
    tokenizer: str | None = _field(None, "Tokenizer: a local HF folder or a Hub id (org/name); defaults to "
                                         "name_or_path.")
    revision: str | None = _field(None, "Branch, tag or commit of the Hub ids in name_or_path and tokenizer; "
                                        "default main.")
    trust_remote_code: bool = _field(False, "Allow model/tokenizer code shipped inside the folder to run.")
    attn_implementation: str = _field("auto", "Attention backend: auto (on CUDA with bf16: flash_attention_3 on "
                                              "Hopper, else flash_attention_2, where installed, else varlen; "
                                              "otherwise sdpa, or eager for a class without it), sdpa, eager, "
                                              "varlen (torch's own flash attention varlen kernels, CUDA), "
                                              "flash_attention_2, flash_attention_3, flex_attention or a Hub kernel "
                                              "(kernels-community/flash-attn2); checked before the run starts.")
    init_from: str | None = _field(None, "An llmtune checkpoint (a global_step_N folder, saved on any number of "
                                         "ranks) whose model weights a new run starts from, loaded over the model "
                                         "that name_or_path or config builds: step 0, a fresh optimizer, schedule "
                                         "and data position. An adapter run's checkpoint gives its adapters to a run "
                                         "with the same base and peft settings. A checkpoint found by "
                                         "checkpoint.resume_from_checkpoint wins (the run already went on from "
                                         "init_from).")
    strict_load: bool = _field(True, "Loading name_or_path's weights and init_from's: true refuses tensors the "
                                     "source lacks or holds in another shape (init_from: also tensors the model "
                                     "lacks), naming them; false loads what matches, keeps the fresh initialisation "
                                     "of the rest (name_or_path: transformers' own, seeded by train.seed and the "
                                     "tensor's name), ignores the source's extra tensors, and names them in one "
                                     "warning.")
    quantize: str = _field("none", "none | nf4: hold the frozen base's linear weights of the decoder layers in "
                                   "4-bit NormalFloat (QLoRA, with peft.method lora; peft.method: qlora sets both), "
                                   "sharded and all-gathered by FSDP2 in 4 bits; needs torchao (pip install -e "
                                   "\".[qlora]\").")

    def problems(self) -> list[str]:
        if self.quantize not in QUANTIZE:
            return [_choice_problem("model.quantize", self.quantize, QUANTIZE)]
        if bool(self.name_or_path) == bool(self.config):
            return ["model: set exactly one of model.name_or_path (a HF folder) or model.config "
                    "(a config for training from scratch)"]
        if self.config and not self.tokenizer:
            return ["model.tokenizer: training from model.config needs a tokenizer folder; set model.tokenizer"]
        if self.attn_implementation not in ATTENTION_BACKENDS and not HUB_KERNEL.match(self.attn_implementation):
            return [f"model.attn_implementation: {self.attn_implementation!r} is not an attention backend; use one of "
                    f"{', '.join(ATTENTION_BACKENDS)} or a Hub kernel (org/name, e.g. kernels-community/flash-attn2)"]
        return []


@dataclass
class DataConfig:
    train_files: list[str] = _field([], "Training sources: files (.jsonl .json .parquet .csv .txt), folders, globs, "
                                        "folders written by datasets' save_to_disk, or Hub datasets "
                                        "org/name[@revision][:config[:split]] (split default train; "
                                        "org/name::split for the default config).")
    mix_weights: list[float] = _field([], "One weight per train_files entry: each source's share of an epoch "
                                          "(sampled with repetition when it is smaller); empty = natural sizes.")
    val_files: list[str] = _field([], "Validation sources (same forms as train_files; a Hub dataset's split "
                                      "defaults to validation).")
    test_files: list[str] = _field([], "Test sources (same forms as train_files; a Hub dataset's split defaults "
                                       "to test), evaluated once when training ends: test_loss in metrics.jsonl's "
                                       "last record and in the run's summary.")
    dataset_info: str | None = _field(None, "A LLaMA-Factory dataset_info.json (or the folder holding it) that "
                                            "data.datasets, data.val_datasets and data.test_datasets name entries "
                                            "of.")
    datasets: list[str] = _field([], "Training datasets by their name in data.dataset_info (file_name, formatting "
                                     "alpaca/sharegpt, columns, tags), after data.train_files.")
    val_datasets: list[str] = _field([], "Validation datasets by their name in data.dataset_info, after "
                                         "data.val_files.")
    test_datasets: list[str] = _field([], "Test datasets by their name in data.dataset_info, after data.test_files.")
    val_ratio: float = _field(0.0, "Hold out this fraction of the training samples for validation (seeded); "
                                   "used when val_files is empty.")
    max_samples: int | None = _field(None, "The first N rows of each source (file, dataset), before any shuffle "
                                           "(LLaMA-Factory's max_samples); default: every row.")
    format: str = _field("auto", "auto | text | alpaca | sharegpt | messages | prompt_completion | prompt_response "
                                 "| tokenized; dpo: prompt_chosen_rejected | chosen_rejected | alpaca_ranking | "
                                 "sharegpt_ranking; kto: prompt_completion_label | alpaca_kto | sharegpt_kto | "
                                 "messages_kto; auto: detected from the columns of each source (see Data formats).")
    text_sample_by: str = _field("line", ".txt sources, what one document is: line (as datasets and LLaMA-Factory "
                                         "read them), paragraph (blank-line separated) or document (a whole file); "
                                         "blank lines are no documents.")
    chat_template: str | None = _field(None, "Chat template: a built-in name (basic, chatml, gemma, llama3: the last "
                                             "three as LLaMA-Factory renders them), a .jinja file, or "
                                             "llamafactory:NAME (LLaMA-Factory's template NAME: the tokenizer's own "
                                             "or a built-in that renders as it does, else refused); default: the "
                                             "tokenizer's own. sft and dpo render with it; it is saved with the "
                                             "exported tokenizer (pt too).")
    train_on_prompt: bool = _field(False, "sft: also train on the non-assistant tokens (system, user, tool results, "
                                          "template).")
    train_on_reasoning: bool = _field(True, "sft: train on the assistant's reasoning (reasoning_content / thinking) "
                                            "as the template renders it; false leaves the reasoning text out of the "
                                            "loss (the template's markup around it stays trained).")
    max_seq_len: int = _field(2048, "Tokens per row: pt packs blocks of this length; longer sft samples follow "
                                    "data.truncation.")
    truncation: str = _field("truncate_prompt", "Over-long samples: truncate_prompt (cut the oldest tokens from the "
                                                "left, keep the last response) or drop. Counts are reported.")
    packing: bool = _field(True, "Padding-free packing of several samples per row, position_ids restarting per "
                                 "sample; false pads each batch to its longest sample.")
    document_mask: bool = _field(True, "Keep attention inside each packed document/sample (via position_ids); "
                                       "false lets packed rows attend across documents.")
    pt_remainder: str = _field("drop", "pt: the last, shorter block of each packing window: drop or pad.")
    shuffle: bool = _field(True, "Shuffle samples each epoch (seeded by train.seed and the epoch); false keeps "
                                 "file order.")
    streaming: bool = _field(False, "Read the sources as a stream (for corpora larger than RAM); needs "
                                    "train.max_steps.")
    shuffle_buffer: int = _field(10000, "Streaming: samples in the shuffle buffer.")
    num_proc: int = _field(1, "Processes for tokenization (datasets.map), at most the CPUs this process may run on.")
    num_workers: int = _field(0, "Processes that read and collate the next micro-batches while the model trains "
                                 "(torch DataLoader workers), training and validation; 0 does it in the training "
                                 "process. The samples and their order do not depend on it. Not with "
                                 "data.streaming (HF: dataloader_num_workers).")
    pin_memory: bool = _field(True, "Hand the micro-batches over in page-locked memory, so that their copy to the "
                                    "GPU does not wait; CUDA only, a CPU run ignores it (HF: dataloader_pin_memory).")
    prefetch_factor: int | None = _field(None, "Micro-batches each worker prepares ahead; needs data.num_workers "
                                               "> 0; default: torch's, 2 (HF: dataloader_prefetch_factor).")
    persistent_workers: bool = _field(False, "Keep the workers from one epoch (and evaluation) to the next "
                                             "instead of starting them anew; needs data.num_workers > 0 (HF: "
                                             "dataloader_persistent_workers).")
    image_max_pixels: int = _field(768 * 768, "Vision-language models: an image with more pixels is scaled down, "
                                              "its aspect kept, before its processor (LLaMA-Factory's name and "
                                              "default).")
    image_min_pixels: int = _field(32 * 32, "Vision-language models: an image with fewer pixels is scaled up, its "
                                            "aspect kept (LLaMA-Factory's name and default).")
    cache_dir: str | None = _field(None, "Where tokenized datasets are cached; default $LLMTUNE_CACHE/data or "
                                         "~/.cache/llmtune/data.")

    def has_validation_sources(self) -> bool:
        return bool(self.val_files or self.val_datasets)

    def has_test_sources(self) -> bool:
        return bool(self.test_files or self.test_datasets)

    def problems(self) -> list[str]:
        out = []
        if not self.train_files and not self.datasets:
            out.append("data.train_files: no training files given; list at least one file, folder or glob (or name "
                       "data.datasets of a data.dataset_info)")
        if (self.datasets or self.val_datasets or self.test_datasets) and not self.dataset_info:
            out.append("data.dataset_info: data.datasets / data.val_datasets / data.test_datasets name entries of a "
                       "LLaMA-Factory dataset_info.json; set data.dataset_info to it (or to the folder holding it)")
        if self.max_samples is not None and self.max_samples < 1:
            out.append(f"data.max_samples: {self.max_samples} must be at least 1 (leave it out for every row)")
        for key, value, choices in (("format", self.format, DATA_FORMATS), ("truncation", self.truncation, TRUNCATIONS),
                                    ("pt_remainder", self.pt_remainder, REMAINDERS),
                                    ("text_sample_by", self.text_sample_by, ("line", "paragraph", "document"))):
            if value not in choices:
                out.append(_choice_problem(f"data.{key}", value, choices))
        if self.max_seq_len < 2:
            out.append(f"data.max_seq_len: {self.max_seq_len} is too small; it must be at least 2")
        sources = len(self.train_files) + len(self.datasets)
        if self.mix_weights and (len(self.mix_weights) != sources or min(self.mix_weights) <= 0):
            out.append(f"data.mix_weights: give one positive weight per data.train_files and data.datasets entry "
                       f"({sources}), not {self.mix_weights}")
        if not 0.0 <= self.val_ratio < 1.0:
            out.append(f"data.val_ratio: {self.val_ratio} must be in [0, 1)")
        if self.val_ratio and (self.val_files or self.val_datasets):
            out.append("data.val_ratio: set either data.val_files (data.val_datasets) or data.val_ratio, not both")
        if self.streaming and self.val_ratio:
            out.append("data.val_ratio: a stream cannot be split; give data.val_files instead")
        if not 0 < self.image_min_pixels <= self.image_max_pixels:
            out.append(f"data.image_min_pixels, data.image_max_pixels: {self.image_min_pixels} and "
                       f"{self.image_max_pixels} must be positive, the first no larger than the second")
        if self.num_proc < 1 or self.shuffle_buffer < 1:
            out.append("data: num_proc and shuffle_buffer must be at least 1")
        if self.num_workers < 0:
            out.append(f"data.num_workers: {self.num_workers} must be 0 (no workers) or more")
        if self.num_workers == 0:
            for key, value in (("prefetch_factor", self.prefetch_factor is not None),
                               ("persistent_workers", self.persistent_workers)):
                if value:
                    out.append(f"data.{key}: only DataLoader workers prefetch or persist; set data.num_workers > 0 "
                               f"or leave data.{key} out")
        if self.prefetch_factor is not None and self.prefetch_factor < 1:
            out.append(f"data.prefetch_factor: {self.prefetch_factor} must be at least 1")
        if self.streaming and self.num_workers:
            # datasets deals a stream's shards out to the workers, whose batches then interleave: another order,
            # which a resume would not continue exactly.
            out.append("data.num_workers: a stream is read in the training process (workers would change the "
                       "order of its samples); set data.num_workers=0 with data.streaming")
        return out


@dataclass
class TrainConfig:
    output_dir: str = _field("", "Where config.yaml, metrics.jsonl and hf/ (the exported model) are written. A new "
                                 "run refuses a folder holding another run's checkpoints or export (see "
                                 "overwrite_output_dir and checkpoint.resume_from_checkpoint).")
    overwrite_output_dir: bool = _field(False, "Start over in an output_dir that holds an earlier run: its "
                                               "checkpoints and export are removed before this run writes.")
    per_device_train_batch_size: int | str = _field(8, "Samples per micro-batch on each data-parallel rank, or "
                                                       "auto: the largest that llmtune plan says fits the device "
                                                       "(CUDA: its memory; CPU: the available RAM shared by the "
                                                       "node's processes) and divides global_batch_size over the "
                                                       "data-parallel ranks, decided before the first step; needs "
                                                       "global_batch_size, which accumulation keeps.")
    gradient_accumulation_steps: int = _field(1, "Micro-batches per optimizer step.")
    global_batch_size: int | None = _field(None, "Samples per optimizer step over all ranks; if set, gradient "
                                                 "accumulation is derived from it (must divide evenly).")
    learning_rate: float = _field(5e-5, "Peak learning rate of AdamW.")
    weight_decay: float = _field(0.0, "AdamW weight decay (not applied to biases and norm weights).")
    adam_beta1: float = _field(0.9, "AdamW beta1.")
    adam_beta2: float = _field(0.999, "AdamW beta2.")
    adam_epsilon: float = _field(1e-8, "AdamW epsilon.")
    lr_scheduler_type: str = _field("cosine", "After a linear warm-up: constant, linear (to 0), cosine (to "
                                              "min_lr_ratio) or wsd (warm-up, stable, then decay over decay_steps "
                                              "to min_lr_ratio); transformers' schedules, also by their HF names "
                                              "(constant_with_warmup, cosine_with_min_lr, warmup_stable_decay).")
    min_lr_ratio: float = _field(0.0, "cosine and wsd: learning rate at the end of the decay, as a fraction of "
                                      "learning_rate (HF: min_lr_rate).")
    warmup_ratio: float = _field(0.0, "Fraction of the total steps spent warming up linearly.")
    warmup_steps: int = _field(0, "Warm-up steps; overrides warmup_ratio when > 0 (a number below 1 is read as "
                                  "warmup_ratio, as transformers reads it).")
    decay_steps: float = _field(0.1, "wsd: steps of the final decay; a number below 1 is a fraction of the total "
                                     "steps (HF: num_decay_steps).")
    decay_type: str = _field("cosine", "wsd: shape of the final decay: linear, cosine or 1-sqrt.")
    max_steps: int = _field(-1, "Optimizer steps to run; > 0 overrides num_train_epochs.")
    num_train_epochs: float = _field(3.0, "Epochs to run when max_steps <= 0 (fractions allowed).")
    max_grad_norm: float = _field(1.0, "Clip the global gradient norm to this; 0 disables clipping.")
    logging_steps: int = _field(10, "Log loss, lr, grad_norm and tokens/s every this many optimizer steps.")
    seed: int = _field(42, "Seed of model init and data order; identical on every rank.")
    bf16: bool = _field(False, "bf16 compute with fp32 master weights and fp32 gradient reduction.")
    fp16: bool = _field(False, "fp16 compute with fp32 master weights and fp32 gradient reduction, and dynamic loss "
                               "scaling (as torch's GradScaler: from 65536, halved on a step whose gradients "
                               "overflow, which is skipped, doubled after 2000 good steps); for GPUs without bf16. "
                               "Not with bf16.")
    fp8: bool | str = _field(False, "float8 matmuls (torchao's float8 training) in the decoder layers' linear "
                                    "layers large enough to gain (torchao's size filter for the scaling; the others "
                                    "stay bf16): false, true or tensorwise (one scale per tensor, the weights "
                                    "all-gathered by FSDP2 in float8; torchao's and torchtitan's default), or "
                                    "rowwise (a scale per row, the weights gathered in bf16); on GPUs with float8 "
                                    "tensor cores (compute capability 8.9+: H100, H200, L4, ...); needs train.bf16, "
                                    "train.compile (which fuses the casts and scalings) and torchao (pip install -e "
                                    "\".[fp8]\"). Weights, gradients, checkpoints and exports stay as without it.")
    chunk_loss_size: int = _field(1024, "Tokens per chunk of the LM loss, computed from the hidden states without "
                                        "the full [tokens, vocab] logits; 0 computes the full logits.")
    fused_kernels: bool = _field(False, "Liger's fused kernels on CUDA: fused linear cross-entropy for the loss and "
                                        "the model's RMSNorm, SwiGLU and RoPE; needs liger-kernel (pip install "
                                        "liger-kernel) and a CUDA device; CPU runs keep the reference path.")
    z_loss: float = _field(0.0, "Coefficient of the z-loss (logsumexp(logits)^2 per labelled token); 0 = off.")
    label_smoothing: float = _field(0.0, "Label smoothing of the cross-entropy, as in torch's cross_entropy.")
    router_aux_loss_coef: float | None = _field(None, "Mixture-of-experts models: coefficient of the router's "
                                                      "load-balancing loss added to the loss; default the model "
                                                      "config's router_aux_loss_coef, 0 = off.")
    gradient_checkpointing: bool | str = _field(False, "What each decoder layer keeps for backward: false (none: "
                                                       "every activation), true or full (its input alone: the "
                                                       "layer recomputed in backward, transformers' gradient "
                                                       "checkpointing), selective (torchtitan's op-level "
                                                       "policy: attention's and every other matmul's outputs "
                                                       "kept, the cheap elementwise work recomputed), or auto "
                                                       "(the least recompute whose planned peak fits the device's "
                                                       "memory, the RAM available on CPU: none, selective, then "
                                                       "full; decided before the run starts, said in the start "
                                                       "banner).")
    compile: bool = _field(False, "torch.compile each decoder layer.")
    max_skipped_steps: int = _field(5, "Stop after this many optimizer steps in a row skipped for a non-finite "
                                       "loss or gradient norm.")
    eval_steps: int = _field(0, "Validation loss every this many steps (0: only at the end); needs validation data.")
    eval_epochs: int = _field(0, "Validation loss also at the end of every this many epochs (0: never); needs "
                                 "validation data.")
    eval_on_start: bool = _field(False, "Validation loss before the first step of a new run (step 0 in "
                                        "metrics.jsonl), as a check of the starting point.")
    max_eval_steps: int = _field(0, "At most this many validation micro-batches per rank in each evaluation (the "
                                    "first ones of each rank's share); 0 = the whole validation set.")
    per_device_eval_batch_size: int = _field(8, "Rows per validation micro-batch on each data-parallel rank.")
    deterministic: bool = _field(False, "Deterministic algorithms, set as transformers' enable_full_determinism sets "
                                        "them (cuBLAS workspace, cuDNN); slower on GPU.")
    save_on_signals: list[str] = _field(["SIGTERM", "SIGINT", "SIGUSR1"], "On any of these signals, on any rank, "
                                        "every rank saves a checkpoint after the current optimizer step and the run "
                                        "exits 75; [] leaves the signals' default actions.")
    freeze_vision_tower: bool = _field(True, "Vision-language models: the vision tower stays as loaded, neither "
                                             "trained nor adapted by peft (LLaMA-Factory's name and default).")
    freeze_multi_modal_projector: bool = _field(True, "Vision-language models: the projector of the image features "
                                                      "stays as loaded (LLaMA-Factory's name and default).")
    freeze_language_model: bool = _field(False, "Vision-language models: the language model (and lm_head) stays as "
                                                "loaded (LLaMA-Factory's name and default).")
    trainable_modules: list[str] = _field([], "Regular expressions (re.search on parameter names): only the "
                                              "parameters they match are trained, the rest frozen; empty = all.")
    frozen_modules: list[str] = _field([], "Regular expressions (re.search on parameter names): the parameters they "
                                           "match are frozen (applied after trainable_modules).")
    trainable_layers: int | None = _field(None, "LLaMA-Factory's freeze tuning: train the last N decoder layers (the "
                                                "first -N when negative), the rest frozen; peft.method freeze sets "
                                                f"{llamafactory.FREEZE_LAYERS}; null = off.")
    trainable_layer_modules: list[str] = _field(["all"], "With trainable_layers: the modules of those layers that "
                                                         "train (self_attn, mlp, ...; all = every one).")
    trainable_extra_modules: list[str] = _field([], "With trainable_layers: modules outside the decoder layers that "
                                                    "train too (embed_tokens, norm, lm_head, ...).")
    callbacks: list[str] = _field([], "Callbacks, each package.module:Class (made without arguments; llmtune.train "
                                      "also takes instances: callbacks=[...]): called on every rank at the HF "
                                      "Trainer's events (on_step_end, on_evaluate, ...); see docs/training.md.")
    early_stopping_patience: int = _field(0, "Stop training when checkpoint.best_metric (eval_loss by default) has not "
                                             "improved for this many evaluations in a row; 0 = off.")
    early_stopping_threshold: float = _field(0.0, "The improvement early stopping asks for: more than this.")
    ema_decay: float | list[float] | None = _field(None, "Keep an exponential moving average of the trainable "
                                                         "weights with this decay (a list: one average per decay), "
                                                         "fp32 and sharded like the weights, in every checkpoint; "
                                                         "e.g. 0.9999. null = none.")
    eval_ema: bool = _field(False, "At every evaluation also evaluate each moving average (eval_loss_ema, or "
                                   "eval_loss_ema_<decay> for several); needs ema_decay.")

    def problems(self) -> list[str]:
        out = []
        if not self.output_dir:
            out.append("train.output_dir: not set; name the folder where the run writes its outputs")
        if isinstance(self.per_device_train_batch_size, str) and self.per_device_train_batch_size != AUTO:
            out.append(f"train.per_device_train_batch_size: {self.per_device_train_batch_size!r} is neither a number "
                       f"of samples nor {AUTO}")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps",
                     "max_skipped_steps", "per_device_eval_batch_size"):
            if isinstance(getattr(self, name), int) and getattr(self, name) < 1:
                out.append(f"train.{name}: {getattr(self, name)} must be at least 1")
        for name in ("eval_steps", "eval_epochs", "max_eval_steps", "early_stopping_patience"):
            if getattr(self, name) < 0:
                out.append(f"train.{name}: {getattr(self, name)} must not be negative (0 turns it off)")
        if self.early_stopping_threshold < 0:
            out.append(f"train.early_stopping_threshold: {self.early_stopping_threshold} must not be negative")
        out += [f"train.ema_decay: {decay} must be between 0 and 1 (e.g. 0.9999)" for decay in self.ema_decays()
                if not 0.0 < decay < 1.0]
        if self.eval_ema and not self.ema_decays():
            out.append("train.eval_ema: there is no moving average to evaluate; set train.ema_decay")
        out += [f"train.callbacks: {path!r} is not written package.module:Class" for path in self.callbacks
                if not re.fullmatch(r"[\w.]+:[\w.]+", path)]
        if self.bf16 and self.fp16:
            out.append("train.fp16: and train.bf16 are both on; choose one compute precision")
        if isinstance(self.gradient_checkpointing, str) and self.gradient_checkpointing not in (*CHECKPOINTING, AUTO):
            out.append(_choice_problem("train.gradient_checkpointing", self.gradient_checkpointing,
                                       ("true", "false", *CHECKPOINTING, AUTO)))
        if isinstance(self.fp8, str) and self.fp8 not in FLOAT8_SCALINGS:
            out.append(_choice_problem("train.fp8", self.fp8, ("true", "false", *FLOAT8_SCALINGS)))
        elif self.fp8 and not self.bf16:
            out.append("train.fp8: float8 training computes in bf16 what it leaves out of float8; set train.bf16: true")
        elif self.fp8 and not self.compile:
            # torchtitan's rule too: eager float8 casts and scales each tensor in kernels of their own, which cost
            # more than the float8 matmul saves (the first GPU: rowwise eager ran at 0.60x of bf16).
            out.append("train.fp8: float8 only pays under torch.compile, which fuses its casts and scalings; set "
                       "train.compile: true, or train.fp8: false")
        if self.lr_scheduler_type not in LR_SCHEDULERS:
            out.append(_choice_problem("train.lr_scheduler_type", self.lr_scheduler_type,
                                       LR_SCHEDULERS + tuple(SCHEDULER_ALIASES)))
        if self.lr_scheduler_type == "linear" and self.min_lr_ratio:
            out.append(f"train.min_lr_ratio: {self.min_lr_ratio}, but the linear schedule decays to 0 (as "
                       "transformers' does); use lr_scheduler_type cosine or wsd for a floor, or min_lr_ratio 0")
        if self.decay_type not in DECAY_TYPES:
            out.append(_choice_problem("train.decay_type", self.decay_type, DECAY_TYPES))
        if self.decay_steps < 0 or (self.decay_steps >= 1 and self.decay_steps != int(self.decay_steps)):
            out.append(f"train.decay_steps: {self.decay_steps} must be a whole number of steps, or a fraction below 1")
        if self.chunk_loss_size < 0 or self.z_loss < 0 or (self.router_aux_loss_coef or 0) < 0:
            out.append("train: chunk_loss_size, z_loss and router_aux_loss_coef must not be negative (0 turns them "
                       "off)")
        if not 0.0 <= self.label_smoothing <= 1.0:
            out.append(f"train.label_smoothing: {self.label_smoothing} must be in [0, 1]")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            out.append(f"train.min_lr_ratio: {self.min_lr_ratio} must be in [0, 1]")
        if not 0.0 <= self.warmup_ratio < 1.0:
            out.append(f"train.warmup_ratio: {self.warmup_ratio} must be in [0, 1)")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            out.append("train: set train.max_steps > 0 or train.num_train_epochs > 0")
        if self.learning_rate < 0 or self.max_grad_norm < 0 or self.weight_decay < 0:
            out.append("train: learning_rate, max_grad_norm and weight_decay must not be negative")
        out += [f"train.save_on_signals: {name!r} is not a signal a process can catch; use names such as "
                "SIGTERM, SIGINT, SIGUSR1" for name in self.save_on_signals if name not in CATCHABLE_SIGNALS]
        for key in ("trainable_modules", "frozen_modules"):
            out += [f"train.{key}: {pattern!r} is not a regular expression ({err})"
                    for pattern, err in _regex_errors(getattr(self, key))]
        if self.trainable_layers is None:
            unset = {"trainable_layer_modules": ["all"], "trainable_extra_modules": []}
            out += [f"train.{key}: read with train.trainable_layers (finetuning_type freeze); set that too, or leave "
                    f"{key} out" for key, value in unset.items() if getattr(self, key) != value]
        return out

    def freezes(self) -> bool:
        """Whether a chosen part of the weights trains and the rest is frozen (features/freezing.py)."""
        return bool(self.trainable_modules or self.frozen_modules) or self.trainable_layers is not None

    def checkpointing(self) -> str:
        """train.gradient_checkpointing as one of CHECKPOINTING (model/checkpointing.py), or auto before it is
        decided (Config.use_auto)."""
        value = self.gradient_checkpointing
        return "full" if value is True else "none" if value is False else value

    def float8_scaling(self) -> str | None:
        """train.fp8 as one of FLOAT8_SCALINGS (torchao's recipe names), or None when off; true is tensorwise."""
        return FLOAT8_SCALINGS[0] if self.fp8 is True else self.fp8 or None

    def half_precision(self) -> str | None:
        """The compute dtype below fp32, bf16 or fp16, or None (fp32)."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else None

    def ema_decays(self) -> list[float]:
        if self.ema_decay is None:
            return []
        return self.ema_decay if isinstance(self.ema_decay, list) else [self.ema_decay]


def _regex_errors(patterns: list[str]) -> list[tuple[str, str]]:
    errors = []
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as err:
            errors.append((pattern, str(err)))
    return errors


@dataclass
class PeftConfig:
    method: str = _field("none", "none | lora | dora: train low-rank adapters (built with peft) instead of the "
                                 "weights, which stay frozen; qlora: lora on a 4-bit base (model.quantize: nf4).")
    r: int = _field(16, "Rank of the adapters.")
    alpha: float = _field(32.0, "Scale of the adapters' update: alpha / r (alpha / sqrt(r) with use_rslora).")
    dropout: float = _field(0.0, "Dropout on the adapters' input.")
    target_modules: str | list[str] = _field("all-linear", "Layers that get adapters: all-linear (every linear "
                                                           "layer of the decoder blocks), a list of module names "
                                                           "(q_proj, ...) or one regular expression (peft's rules).")
    modules_to_save: list[str] = _field([], "Modules trained in full besides the adapters and saved with them "
                                            "(e.g. embed_tokens, lm_head when new tokens are trained).")
    use_rslora: bool = _field(False, "Rank-stabilised scaling alpha / sqrt(r).")
    init_lora_weights: bool | str = _field(True, "peft's initialisation: true (A Kaiming-uniform, B zero), gaussian, "
                                                 "or false (B random too: the adapters change the model from the "
                                                 "first step).")
    adapter_path: str | None = _field(None, "An adapter folder (adapter_config.json + adapter_model.safetensors) "
                                            "to continue training from; its adapter_config.json gives method, r, "
                                            "alpha, target and saved modules.")

    def problems(self) -> list[str]:
        out = []
        if self.method not in PEFT_METHODS:
            out.append(_choice_problem("peft.method", self.method, PEFT_METHODS))
        if self.r < 1:
            out.append(f"peft.r: {self.r} must be a positive rank (at least 1)")
        if not 0.0 <= self.dropout < 1.0:
            out.append(f"peft.dropout: {self.dropout} must be in [0, 1)")
        if self.init_lora_weights not in LORA_INITS:
            out.append(f"peft.init_lora_weights: {self.init_lora_weights!r} is not supported; use true, false or "
                       "gaussian (initialisations that read the base weights do not run on a sharded model)")
        return out


@dataclass
class ParallelConfig:
    dp_replicate: int = _field(1, "HSDP: groups of ranks that each hold a whole copy of the model, sharded within "
                                  "the group; gradients are reduce-scattered within a group at every micro-batch "
                                  "and all-reduced across groups once per step. Set it to the number of nodes so "
                                  "that only the all-reduce crosses them; 1 = plain FSDP over every rank.")
    dp_shard: int = _field(-1, "Data-parallel ranks one copy of the model is sharded over (times cp_size: the cp "
                               "peers share the shards too); -1 = the ranks left, world / (dp_replicate x cp_size).")
    cp_size: int = _field(1, "Context-parallel ranks per sequence, each holding 1/cp_size of its tokens; 1 = off.")
    cp_type: str = _field("ulysses", "Context parallelism: ulysses (all-to-all attention over heads).")
    tp_size: int = _field(1, "Tensor-parallel ranks (consecutive: a node's GPUs) that split every decoder layer's "
                             "linear weights, its heads and the vocabulary between them, by the model family's own "
                             "plan (config.base_model_tp_plan); the other dimensions are laid over world / tp_size; "
                             "1 = off.")
    sequence_parallel: bool = _field(True, "With tp_size > 1: the norms and the residual stream between the "
                                           "tensor-parallel regions hold 1/tp_size of each row's tokens per rank "
                                           "(activations 1/tp_size; the all-reduces become reduce-scatters and "
                                           "all-gathers); false keeps them whole on every tp rank.")
    expert_parallel: int = _field(1, "MoE models: ranks each routed expert layer's experts are split over (each "
                                     "rank holds experts / n of them, tokens sent to their expert's rank by "
                                     "all-to-all); n consecutive dp_shard ranks (with tp_size, of dp_shard x "
                                     "tp_size, each tp rank routing its 1/tp of the tokens); n divides them and the "
                                     "expert count; 1 = off.")
    reshard_after_forward: bool | int = _field(True, "After a decoder layer's forward: true frees its gathered "
                                                     "weights (gathered again for backward), false keeps them until "
                                                     "its backward (one all-gather less, every layer's weights whole "
                                                     "at once), or a number n: keep 1/n of them per rank, gathered "
                                                     "for backward within groups of n ranks (n divides dp_shard x "
                                                     "cp_size, e.g. the GPUs of a node).")
    reshard_between_micro_batches: bool = _field(True, "false: between the micro-batches of one accumulation keep "
                                                       "every layer's weights gathered and its gradients whole, "
                                                       "reduced once at the step's last micro-batch (fewer "
                                                       "collectives; the memory of the whole model's weights and "
                                                       "fp32 gradients on every rank: llmtune plan shows it).")
    prefetch_layers: int = _field(1, "Decoder layers whose weights are gathered ahead of the one computing, in "
                                     "forward and backward: 1 is FSDP2's own overlap, more overlaps slower links at "
                                     "the memory of one more gathered layer each, 0 gathers each layer when it runs.")
    cpu_offload: bool = _field(False, "Keep the sharded parameters, gradients and AdamW state on the CPU, the "
                                      "optimizer step there (FSDP2's CPUOffloadPolicy; on CUDA each layer is copied "
                                      "to the GPU from pinned memory for its forward and backward): a model whose "
                                      "weights and optimizer state do not fit the devices trains, slower.")
    timeout_minutes: float = _field(30.0, "How long a collective waits for the slowest rank before the run fails "
                                          "(a hung rank). Waits for one rank's Hub download or tokenization have "
                                          "their own limit of 24 hours.")

    def problems(self) -> list[str]:
        out = []
        if self.cp_size < 1:
            out.append(f"parallel.cp_size: {self.cp_size} must be at least 1")
        if self.tp_size < 1:
            out.append(f"parallel.tp_size: {self.tp_size} must be at least 1")
        if self.timeout_minutes <= 0:
            out.append(f"parallel.timeout_minutes: {self.timeout_minutes} must be above 0")
        if self.cp_type != "ulysses":
            out.append(_choice_problem("parallel.cp_type", self.cp_type, ("ulysses",)))
        if self.dp_replicate < 1:
            out.append(f"parallel.dp_replicate: {self.dp_replicate} must be at least 1")
        if self.dp_shard != -1 and self.dp_shard < 1:
            out.append(f"parallel.dp_shard: {self.dp_shard} must be at least 1, or -1 (the ranks left)")
        after = self.reshard_after_forward
        if not isinstance(after, bool) and after < 2:
            out.append(f"parallel.reshard_after_forward: {after!r} must be true, false or a "
                       "number of ranks of at least 2")
        if self.prefetch_layers < 0:
            out.append(f"parallel.prefetch_layers: {self.prefetch_layers} must be at least 0")
        if self.expert_parallel < 1:
            out.append(f"parallel.expert_parallel: {self.expert_parallel} must be at least 1")
        elif self.expert_parallel > 1 and self.cp_size > 1:
            out.append(f"parallel.expert_parallel: {self.expert_parallel} with cp_size {self.cp_size} is not "
                       "supported yet; set one of them to 1")
        return out

    def shard_size(self, world_size: int) -> int:
        """The ranks FSDP shards one copy of the model over (dp_shard x cp_size); a tensor-parallel weight is split
        over tp_size ranks besides."""
        return world_size // (self.dp_replicate * self.tp_size)

    def data_parallel_size(self, world_size: int) -> int:
        """The ranks that read different rows (dp_replicate x dp_shard): cp and tp peers read the same ones."""
        return world_size // (self.cp_size * self.tp_size)

    def describe(self, world_size: int) -> str:
        """The layout as the start banner and llmtune plan say it: the mesh, then what differs from plain FSDP2."""
        shard = self.shard_size(world_size)
        tp = f" x tp {self.tp_size}" if self.tp_size > 1 else ""
        words = [f"{world_size} rank(s) = replicate {self.dp_replicate} x shard {shard // self.cp_size} x cp "
                 f"{self.cp_size}{tp}; every parameter sharded over {shard} rank(s)"
                 + (f", its {self.dp_replicate} copies' gradients all-reduced once per step" if self.dp_replicate > 1
                    else "")]
        if self.tp_size > 1:
            words.append(f"tp {self.tp_size}: every decoder layer's linear weights, heads and the vocabulary split "
                         f"over {self.tp_size} consecutive ranks by the model's plan"
                         + (", norms and residual stream sequence-parallel" if self.sequence_parallel else ""))
        if self.cpu_offload:
            words.append("parameters, gradients and optimizer state in CPU memory (parallel.cpu_offload)")
        after = self.reshard_after_forward
        if after is False:
            words.append("layers stay gathered from forward to backward (parallel.reshard_after_forward: false)")
        elif after is not True:
            words.append(f"after forward, each layer held by groups of {after} ranks "
                         f"(parallel.reshard_after_forward: {after})")
        if not self.reshard_between_micro_batches:
            words.append("layers gathered and gradients whole between micro-batches "
                         "(parallel.reshard_between_micro_batches: false)")
        if self.prefetch_layers != 1:
            words.append(f"{self.prefetch_layers} layer(s) prefetched (parallel.prefetch_layers)")
        if self.expert_parallel > 1:
            ranks = "ranks, tp peers among them" if self.tp_size > 1 else "shard ranks"
            words.append(f"ep {self.expert_parallel}: experts split over {self.expert_parallel} consecutive {ranks} "
                         "(parallel.expert_parallel)")
        return "; ".join(words)

    def layout_problem(self, world_size: int) -> str | None:
        """Why the layout cannot be laid over world_size ranks, or None."""
        cp, replicate, tp = self.cp_size, self.dp_replicate, self.tp_size
        if tp < 1 or world_size % tp:
            return (f"parallel.tp_size: {tp} does not divide the world size {world_size}; use a world size that is a "
                    "multiple of it")
        if cp < 1 or world_size % (cp * tp):
            return (f"parallel.cp_size: {cp}{f' x tp_size {tp}' if tp > 1 else ''} does not divide the world size "
                    f"{world_size}; use a world size that is a multiple of it")
        if world_size % (replicate * cp * tp):
            return (f"parallel.dp_replicate: {replicate} x cp_size {cp}{f' x tp_size {tp}' if tp > 1 else ''} does "
                    f"not divide the world size {world_size}; choose a dp_replicate that divides "
                    f"{world_size // (cp * tp)}")
        shard = world_size // (replicate * cp * tp)
        if self.dp_shard not in (-1, shard):
            return (f"parallel.dp_shard: dp_replicate {replicate} x dp_shard {self.dp_shard} x cp_size {cp}"
                    f"{f' x tp_size {tp}' if tp > 1 else ''} is not the world size {world_size}; set dp_shard: "
                    f"{shard}, or -1 for the ranks left")
        if shard * tp % self.expert_parallel:
            ranks = f"dp_shard {shard}{f' x tp_size {tp}' if tp > 1 else ''}"
            return (f"parallel.expert_parallel: {self.expert_parallel} does not divide {ranks}; choose a divisor of "
                    f"{shard * tp}")
        size, after = shard * cp, self.reshard_after_forward
        if not isinstance(after, bool) and (size % after or after >= size):
            return (f"parallel.reshard_after_forward: {after} must divide the {size} ranks a copy of the model is "
                    f"sharded over (dp_shard x cp_size) and be fewer than them; use true, false or a divisor")
        return None


@dataclass
class CheckpointConfig:
    save_steps: int = _field(0, "Save a checkpoint every this many optimizer steps (0: never), and at the end.")
    save_epochs: int = _field(0, "Save a checkpoint every this many epochs (0: never), and at the end.")
    save_total_limit: int | None = _field(None, "Keep at most this many complete checkpoints (oldest deleted "
                                                "first, never the latest).")
    save_only_model: bool = _field(False, "Save the model only, no optimizer state (smaller; a resume starts the "
                                          "optimizer fresh).")
    async_save: bool = _field(False, "Write checkpoints in the background while training goes on.")
    resume_from_checkpoint: str | None = _field(None, "A checkpoint folder, or auto (the newest in output_dir that "
                                                      "passes its checks; starts fresh when there is none; latest "
                                                      "is the same), or best (output_dir's checkpoints/best, kept "
                                                      "by save_best).")
    verify_checksums: bool = _field(False, "On resume, also check every checkpoint file's checksum (reads the whole "
                                           "checkpoint once more); sizes are always checked.")
    export_hf: bool = _field(True, "At the end, write output_dir/hf: a folder AutoModelForCausalLM loads.")
    export_merged: bool = _field(False, "peft runs: also write output_dir/hf, the adapters merged into the "
                                        "weights (output_dir/adapter is always written).")
    export_dtype: str = _field("bf16", "Dtype of the exported weights: bf16 or fp32.")
    save_best: bool = _field(False, "Also keep checkpoints/best: the saved checkpoint with the best best_metric so "
                                    "far, which save_total_limit never deletes (resume_from_checkpoint: best). A "
                                    "save evaluates first when the metric is an eval one not yet measured at its "
                                    "step.")
    best_metric: str = _field("eval_loss", "The metrics.jsonl value that ranks checkpoints (save_best, export_from: "
                                           "best, train.early_stopping_patience): eval_loss, or another logged one "
                                           "(loss, a feature's metric).")
    greater_is_better: bool | None = _field(None, "Whether a larger best_metric is better; default: false for a "
                                                  "name ending in loss, else true.")
    export_from: str = _field("last", "What becomes output_dir/hf: last (the weights at the end) or best (those of "
                                      "checkpoints/best; needs save_best). HF's load_best_model_at_end reads as "
                                      "save_best and export_from: best.")
    eval_on_save: bool = _field(False, "Evaluate before every save, so that each checkpoint records its eval metrics "
                                       "at its own step.")
    export_ema: bool = _field(False, "At the end, also export each moving average of train.ema_decay as "
                                     "output_dir/hf_ema (hf_ema_<decay> for several; adapter runs: adapter_ema), "
                                     "as output_dir/hf is written.")
    max_shard_size: str = _field("5GB", "Largest safetensors file of the export (e.g. 5GB, 500MB).")

    def problems(self) -> list[str]:
        out = []
        if self.export_dtype not in ("bf16", "fp32"):
            out.append(_choice_problem("checkpoint.export_dtype", self.export_dtype, ("bf16", "fp32")))
        try:
            parse_size(self.max_shard_size)
        except ValueError as err:
            out.append(f"checkpoint.max_shard_size: {err}")
        if self.save_steps < 0 or self.save_epochs < 0 or (self.save_total_limit is not None and self.save_total_limit < 1):
            out.append("checkpoint: save_steps and save_epochs must be >= 0, save_total_limit >= 1")
        if self.export_from not in EXPORT_FROM:
            out.append(_choice_problem("checkpoint.export_from", self.export_from, EXPORT_FROM))
        if self.export_from == "best" and not self.save_best:
            out.append("checkpoint.export_from: best exports checkpoints/best, which only checkpoint.save_best keeps; "
                       "set checkpoint.save_best: true")
        if self.save_best and not (self.save_steps or self.save_epochs):
            out.append("checkpoint.save_best: the best checkpoint is chosen among the saved ones, and this run saves "
                       "none; set checkpoint.save_steps or save_epochs")
        return out

    def greater(self) -> bool:
        """Whether a larger best_metric is better (greater_is_better, else by its name, as the HF Trainer decides)."""
        if self.greater_is_better is not None:
            return self.greater_is_better
        return not self.best_metric.endswith("loss")


@dataclass
class MonitorConfig:
    console: bool = _field(True, "Print each logged step on rank 0 (metrics.jsonl is always written).")
    progress_bar: bool = _field(True, "A progress bar on rank 0 that moves every optimizer step (loss, lr, "
                                      "tokens/s), logged lines written above it; only when stderr is a terminal.")
    report_to: list[str] = _field([], "Trackers that also get every record (as train/loss, train/lr, ..., "
                                      "eval/loss, by step) and the resolved recipe: tensorboard "
                                      "(output_dir/tensorboard), wandb (output_dir/wandb), mlflow "
                                      "(MLFLOW_TRACKING_URI, else output_dir/mlruns); none or [] for none. A resumed "
                                      "run continues the same runs (their ids in output_dir/trackers.json). Each "
                                      "needs its package: pip install 'llmtune[tensorboard]' (or wandb, mlflow).")
    run_name: str | None = _field(None, "The run's name in W&B and MLflow; default: the name of train.output_dir.")
    project: str | None = _field(None, "The W&B project and the MLflow experiment; default: WANDB_PROJECT or "
                                       "MLFLOW_EXPERIMENT_NAME, else llmtune.")
    peak_tflops: float | None = _field(None, "Peak dense TFLOP/s of one device, for MFU; default: a table of "
                                             "known GPUs (none on CPU, so mfu is null).")
    profile_steps: list[int] = _field([], "[start, end]: torch.profiler traces of these steps, per rank, in "
                                          "output_dir/profile.")
    profile_ranks: list[int] = _field([], "The ranks whose steps profile_steps traces; [] (the default): every rank.")
    profile_memory: bool = _field(False, "The traces also record each operator's tensor memory (torch.profiler's "
                                         "profile_memory).")
    with_stack: bool = _field(False, "The traces also record the Python source line of each operator "
                                     "(torch.profiler's with_stack).")
    record_shapes: bool = _field(False, "The traces also record the shapes of each operator's inputs "
                                        "(torch.profiler's record_shapes).")
    plots: bool = _field(True, "Draw the curves into output_dir/plots when the run ends (needs the plots extra); "
                               "false leaves them to llmtune plot.")

    def problems(self) -> list[str]:
        out = [_choice_problem("monitor.report_to", name, TRACKERS) for name in self.report_to if name not in TRACKERS]
        if self.profile_steps and (len(self.profile_steps) != 2 or not 0 < self.profile_steps[0] <= self.profile_steps[1]):
            out.append(f"monitor.profile_steps: {self.profile_steps} must be [start, end] with 0 < start <= end")
        if self.profile_ranks and not self.profile_steps:
            out.append("monitor.profile_ranks: traces no step without monitor.profile_steps; set profile_steps: "
                       "[start, end], or remove profile_ranks")
        if any(rank < 0 for rank in self.profile_ranks):
            out.append(f"monitor.profile_ranks: {self.profile_ranks} must be ranks, 0 or more")
        return out

    def rank_problems(self, world_size: int) -> list[str]:
        """profile_ranks that a run on world_size ranks does not have (their traces would never be written)."""
        missing = [rank for rank in self.profile_ranks if rank >= world_size]
        return [f"monitor.profile_ranks: {missing} are not ranks of this run, which has {world_size} (0 to "
                f"{world_size - 1}); name ranks below {world_size}"] if missing else []


# The names of the evaluation by generation's metrics in records (eval_gen/accuracy): eval_ in front, as the HF
# Trainer's metric_for_best_model reads an eval metric.
GENERATION_METRICS = "eval_gen/"
# The built-in scorers of eval_generation (generation/scorers.py), each logged under its name.
BUILTIN_SCORERS = ("accuracy", "numeric_match", "regex_match")
SAMPLING_HELP = " Unset: the model's generation_config.json, else transformers' default"


@dataclass
class EvalGenerationConfig:
    files: list[str] = _field([], "Held-out prompts to generate from during the run: JSONL files (paths or globs) with "
                                  "a 'prompt' column, a string or a list of messages (TRL's prompt-only forms; "
                                  "messages rendered with the chat template and its generation prompt); the other "
                                  "columns reach the scorers. Empty: no evaluation by generation.")
    max_samples: int | None = _field(None, "Generate from the first this many prompts of the files; null: all.")
    steps: int | None = _field(None, "Generate every this many optimizer steps, and at the run's last step; "
                                     "default: train.eval_steps (0: at the last step alone).")
    scorers: list[str] = _field(["accuracy"], "Scoring functions, each logged as eval_gen/<its name>, the mean of "
                                              "its scores: built-ins accuracy (the completion, stripped, equals "
                                              "answer_column's value), numeric_match (its last number equals "
                                              "answer_column's) and regex_match (regex matches it from its start), or "
                                              "package.module:function with TRL's reward-function signature "
                                              "(prompts, completions, completion_ids, the other columns as keyword "
                                              "lists; one float or None per completion).")
    answer_column: str = _field("solution", "The column accuracy and numeric_match compare with (TRL's accuracy "
                                            "reward reads 'solution').")
    regex: str | None = _field(None, "regex_match's pattern (Python re, DOTALL).")
    max_new_tokens: int | None = _field(None, "The most tokens of a completion (TRL's max_completion_length); unset: "
                                              "the model's generation_config.json, else 256 (TRL's).")
    do_sample: bool | None = _field(None, "Sample (true) or take the likeliest token (false)." + SAMPLING_HELP + ".")
    temperature: float | None = _field(None, "Sampling temperature; 0: greedy decoding, as do_sample: false."
                                             + SAMPLING_HELP + " (1.0).")
    top_p: float | None = _field(None, "Nucleus sampling's probability mass." + SAMPLING_HELP + " (1.0).")
    top_k: int | None = _field(None, "Sample among the k likeliest tokens; 0: all." + SAMPLING_HELP + " (50).")
    min_p: float | None = _field(None, "Drop tokens below min_p x the likeliest's probability." + SAMPLING_HELP
                                       + " (none).")
    repetition_penalty: float | None = _field(None, "transformers' repetition penalty." + SAMPLING_HELP + " (1.0).")
    num_return_sequences: int | None = _field(None, "Completions per prompt." + SAMPLING_HELP + " (1).")
    batch_size: int = _field(64, "Completions decoded together on a rank.")

    def problems(self) -> list[str]:
        out = []
        for name in ("max_samples", "steps", "max_new_tokens", "num_return_sequences", "batch_size", "top_k",
                     "temperature"):
            value = getattr(self, name)
            least = 0 if name in ("steps", "top_k", "temperature") else 1
            if value is not None and value < least:
                out.append(f"eval_generation.{name}: {value} must be at least {least}")
        for name in ("top_p", "min_p"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                out.append(f"eval_generation.{name}: {value} must be between 0 and 1")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            out.append(f"eval_generation.repetition_penalty: {self.repetition_penalty} must be above 0")
        if self.temperature == 0 and self.do_sample:
            out.append("eval_generation.temperature: 0 is greedy decoding (as do_sample: false); leave do_sample: "
                       "true out, or sample at a temperature above 0")
        greedy = self.do_sample is False or self.temperature == 0
        if greedy and (self.num_return_sequences or 1) > 1:
            out.append("eval_generation.num_return_sequences: greedy decoding (do_sample: false) gives one completion "
                       "per prompt, as transformers' generate; set do_sample: true or num_return_sequences: 1")
        if not self.files:
            return out
        out += [f"eval_generation.scorers: {name!r} is neither a built-in scorer ({', '.join(BUILTIN_SCORERS)}) nor "
                "written package.module:function" for name in self.scorers
                if name not in BUILTIN_SCORERS and not re.fullmatch(r"[\w.]+:[\w.]+", name)]
        if not self.scorers:
            out.append("eval_generation.scorers: name at least one scorer (accuracy, or package.module:function)")
        if "regex_match" in self.scorers and not self.regex:
            out.append("eval_generation.regex: regex_match needs the pattern; set eval_generation.regex")
        if self.regex:
            try:
                re.compile(self.regex)
            except re.error as err:
                out.append(f"eval_generation.regex: {self.regex!r} is not a valid regular expression ({err})")
        return out

    def sampling(self) -> dict:
        """The sampling keys the recipe sets (generation/engine.Sampling.resolve fills the rest)."""
        return {name: getattr(self, name) for name in ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k",
                                                        "min_p", "repetition_penalty", "num_return_sequences")}


BETA_HELP = ("The strength of the preference: a response's reward is beta x (its log-probability under the policy - "
             "under the reference) (TRL's beta, LLaMA-Factory's pref_beta).")


@dataclass
class PairConfig:
    """The keys of the tasks whose rows are pairs of sequences of one prompt (dpo, kto, rm), each task's section its
    subclass: how long a pair may be, and the dropout."""

    section: typing.ClassVar[str] = ""
    max_length: int | None = _field(None, "The most tokens of prompt + response, for each of a row's two sequences "
                                          "(TRL's max_length); the two take up to twice this in a row of "
                                          "data.max_seq_len; default data.max_seq_len / 2.")
    max_prompt_length: int | None = _field(None, "The most tokens of a prompt: a longer one keeps its end; default: "
                                                 "no limit of its own.")
    truncation: bool = _field(True, "A prompt + response longer than max_length: the prompt keeps its end (at least "
                                    "half of max_length, or what the longer response leaves) and the responses are "
                                    "cut at their end; false refuses the row, naming it.")
    disable_dropout: bool = _field(True, "Dropout off in the model trained (TRL's default): with a reference, every "
                                         "reward is then 0 while the policy equals it.")

    def problems(self) -> list[str]:
        out = []
        if self.max_length is not None and self.max_length < 2:
            out.append(f"{self.section}.max_length: {self.max_length} must be at least 2")
        if self.max_prompt_length is not None and (self.max_prompt_length < 1 or (
                self.max_length is not None and self.max_prompt_length >= self.max_length)):
            out.append(f"{self.section}.max_prompt_length: {self.max_prompt_length} must be at least 1 and below "
                       f"{self.section}.max_length, to leave room for the responses")
        return out


@dataclass
class PreferenceConfig(PairConfig):
    """The keys the preference tasks share (dpo's section, kto's): a reference model and the strength beta."""

    beta: float = _field(0.1, BETA_HELP)
    reference: str = _field("model", "The reference model: model (a frozen copy of the starting weights, sharded "
                                     "like the policy; ref_model names another), adapter_off (with peft adapters: "
                                     "the policy with its adapters off, no copy) or precomputed (its log-probabilities "
                                     "computed once before training and cached beside the tokenized data). dpo's "
                                     "losses without a reference (simpo, orpo) build none.")
    ref_model: str | None = _field(None, "reference model: a HF folder or Hub id to use instead of the starting "
                                         "weights.")

    def needs_reference(self) -> bool:
        return True

    def problems(self) -> list[str]:
        out = super().problems()
        if self.reference not in REFERENCES:
            out.append(_choice_problem(f"{self.section}.reference", self.reference, REFERENCES))
        if self.beta <= 0:
            out.append(f"{self.section}.beta: {self.beta} must be above 0")
        if self.ref_model is not None and self.reference == "adapter_off":
            out.append(f"{self.section}.ref_model: the adapter_off reference is the policy itself; set "
                       f"{self.section}.reference: model to use ref_model")
        return out


@dataclass
class DPOConfig(PreferenceConfig):
    section: typing.ClassVar[str] = "dpo"
    beta: float = _field(0.1, BETA_HELP + " orpo: the weight of the odds-ratio term.")
    loss_type: list[str] = _field(["sigmoid"], "The pair loss: sigmoid (DPO; cDPO with label_smoothing), robust, "
                                               "hinge, ipo (on per-token log-probabilities), simpo (no reference, "
                                               "length-normalised, margin simpo_gamma), orpo (no reference: odds "
                                               "ratio plus the chosen responses' NLL); a list adds several, weighted "
                                               "by loss_weights.")
    loss_weights: list[float] = _field([], "One weight per loss_type entry; empty = 1 each.")
    label_smoothing: float = _field(0.0, "sigmoid, robust and simpo: the probability that a pair's preference is "
                                         "flipped (cDPO, robust DPO; TRL's CPO for simpo), in [0, 0.5).")
    simpo_gamma: float = _field(0.5, "simpo: the target reward margin.")
    sft_weight: float = _field(0.0, "Weight of an added NLL term on the chosen responses (RPO; TRL's rpo_alpha, "
                                    "LLaMA-Factory's pref_ftx), averaged over the chosen tokens of the whole step.")

    def needs_reference(self) -> bool:
        return any(loss not in REFERENCE_FREE for loss in self.loss_type)

    def problems(self) -> list[str]:
        out = super().problems()
        out += [_choice_problem("dpo.loss_type", loss, PREFERENCE_LOSSES) for loss in self.loss_type
                if loss not in PREFERENCE_LOSSES]
        if not self.loss_type:
            out.append(f"dpo.loss_type: name at least one loss ({', '.join(PREFERENCE_LOSSES)})")
        if self.loss_weights and len(self.loss_weights) != len(self.loss_type):
            out.append(f"dpo.loss_weights: give one weight per dpo.loss_type entry ({len(self.loss_type)}), not "
                       f"{self.loss_weights}")
        if not 0.0 <= self.label_smoothing < 0.5:
            out.append(f"dpo.label_smoothing: {self.label_smoothing} must be in [0, 0.5)")
        if self.sft_weight < 0:
            out.append(f"dpo.sft_weight: {self.sft_weight} must not be negative")
        return out


@dataclass
class KTOConfig(PreferenceConfig):
    section: typing.ClassVar[str] = "kto"
    desirable_weight: float = _field(1.0, "Weight of the desirable examples' losses (TRL's desirable_weight): raise "
                                          "it, or lower undesirable_weight, when desirable examples are fewer.")
    undesirable_weight: float = _field(1.0, "Weight of the undesirable examples' losses (TRL's undesirable_weight).")

    def problems(self) -> list[str]:
        out = super().problems()
        out += [f"kto.{key}: {value} must not be negative" for key, value in
                (("desirable_weight", self.desirable_weight), ("undesirable_weight", self.undesirable_weight))
                if value < 0]
        return out


@dataclass
class RMConfig(PairConfig):
    """rm: a reward model trained on preference pairs (TRL's RewardConfig names and defaults)."""

    section: typing.ClassVar[str] = "rm"
    center_rewards_coefficient: float | None = _field(
        None, "Weight of a term that draws the rewards towards 0: the mean over the step's pairs of (chosen reward + "
              "rejected reward)^2 (TRL's center_rewards_coefficient; its paper recommends 0.01); none: no term.")

    def problems(self) -> list[str]:
        out = super().problems()
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            out.append(f"rm.center_rewards_coefficient: {self.center_rewards_coefficient} must not be negative")
        return out


GRPO_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass
class GRPOConfig:
    """grpo's keys, by TRL's GRPOConfig names and with its defaults (1.16)."""
    section: typing.ClassVar[str] = "grpo"
    reward_funcs: list[str] = _field([], "The reward functions, their rewards summed (weighted by reward_weights): "
                                         "built-ins accuracy, numeric_match and regex_match (as eval_generation's "
                                         "scorers), package.module:function with TRL's reward-function signature "
                                         "(prompts, completions, completion_ids, the data's other columns as keyword "
                                         "lists; one float or None per completion), or a reward model's folder "
                                         "(AutoModelForSequenceClassification, its score of prompt + completion "
                                         "rendered as llmtune rm trains on them: docs/rm.md).")
    reward_weights: list[float] | None = _field(None, "One weight per reward function; default: 1 each.")
    answer_column: str = _field("solution", "The column accuracy and numeric_match compare with.")
    regex: str | None = _field(None, "regex_match's pattern (Python re, DOTALL).")
    num_generations: int = _field(8, "Completions sampled per prompt: a group, whose rewards are normalized together.")
    max_completion_length: int = _field(512, "The most tokens of a completion; a longer one is cut (truncated).")
    generation_batch_size: int | None = _field(None, "Completions sampled per generation round, over all ranks: a "
                                                     "multiple of num_generations; default per_device_train_batch_size"
                                                     " x data-parallel size x steps_per_generation.")
    steps_per_generation: int | None = _field(None, "Micro-batches per rank per generation round (TRL's); default "
                                                    "train.gradient_accumulation_steps: one round per optimizer step.")
    temperature: float = _field(1.0, "Sampling temperature; the policy's log-probabilities are taken at it too.")
    top_p: float = _field(1.0, "Nucleus sampling's probability mass.")
    top_k: int = _field(0, "Sample among the k likeliest tokens; 0: all.")
    min_p: float | None = _field(None, "Drop tokens below min_p x the likeliest's probability.")
    repetition_penalty: float = _field(1.0, "transformers' repetition penalty.")
    loss_type: str = _field("dapo", "How token losses become the step's loss: grpo (each completion's mean, then the "
                                    "mean over completions), bnpo and dapo (the mean over every completion token of "
                                    "the step), dr_grpo (the sum over tokens / (completions x "
                                    "max_completion_length)). Each is over the whole optimizer step, every rank and "
                                    "micro-batch.")
    scale_rewards: str | bool = _field("group", "Advantages divided by the group's reward std (group; TRL's true), "
                                                "the round's (batch) or not at all (none, TRL's false: Dr. GRPO).")
    epsilon: float = _field(0.2, "The ratio's clipping range below 1 (and above 1 unless epsilon_high is set).")
    epsilon_high: float | None = _field(None, "The ratio's clipping range above 1 (DAPO's clip-higher: 0.28); "
                                              "default epsilon.")
    importance_sampling_level: str = _field("token", "The importance ratio of each token (token) or of its whole "
                                                     "completion, the geometric mean of its tokens' (sequence: GSPO).")
    num_iterations: int = _field(1, "Optimizer passes over each generation round (mu); after the first, the ratio is "
                                    "against the policy that sampled.")
    beta: float = _field(0.0, "The KL penalty's weight (k3 estimate against the reference); 0 builds no reference.")
    use_bias_correction_kl: bool = _field(True, "Multiply the KL term by the importance ratio (TRL's default).")
    reference: str = _field("model", "The reference when beta > 0: model (a frozen copy of the starting weights, or "
                                     "ref_model) or adapter_off (with peft adapters: the policy with its adapters "
                                     "off).")
    ref_model: str | None = _field(None, "reference model: a HF folder or Hub id to use instead of the starting "
                                         "weights.")
    mask_truncated_completions: bool = _field(False, "Truncated completions add nothing to the loss (DAPO).")
    disable_dropout: bool = _field(False, "Dropout off in the policy (TRL's GRPO default: left on).")

    def __post_init__(self):
        # TRL's booleans, as its GRPOConfig reads them.
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)

    def needs_reference(self) -> bool:
        """The KL term's reference, built when beta > 0 (TRL's: none at its default beta 0)."""
        return self.beta > 0

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def sampling(self) -> dict:
        """The sampling keys, as generation/engine.Sampling takes them: always sampled, num_generations completions of
        each prompt."""
        return {"max_new_tokens": self.max_completion_length, "do_sample": True, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty, "num_return_sequences": self.num_generations}

    def problems(self) -> list[str]:
        out = [_choice_problem(f"grpo.{key}", getattr(self, key), choices) for key, choices in
               (("loss_type", GRPO_LOSSES), ("scale_rewards", SCALE_REWARDS),
                ("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS), ("reference", ("model", "adapter_off")))
               if getattr(self, key) not in choices]
        if self.num_generations < 2:
            out.append(f"grpo.num_generations: {self.num_generations} must be at least 2: a group's advantages are "
                       "its rewards less their mean")
        for key in ("max_completion_length", "num_iterations", "generation_batch_size", "steps_per_generation"):
            value = getattr(self, key)
            if value is not None and value < 1:
                out.append(f"grpo.{key}: {value} must be at least 1")
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            out.append("grpo.generation_batch_size: set it or grpo.steps_per_generation, not both")
        if self.temperature == 0:
            out.append("grpo.temperature: 0 is greedy decoding, which gives a group's completions alike: their "
                       "advantages are 0 and teach nothing; sample at a temperature above 0 (TRL's default 1.0)")
        elif self.temperature < 0:
            out.append(f"grpo.temperature: {self.temperature} must be above 0")
        if not 0.0 < self.top_p <= 1.0:
            out.append(f"grpo.top_p: {self.top_p} must be above 0 and at most 1")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            out.append(f"grpo.min_p: {self.min_p} must be between 0 and 1")
        out += [f"grpo.{key}: {value} must not be negative" for key, value in
                (("top_k", self.top_k), ("epsilon", self.epsilon), ("epsilon_high", self.epsilon_high or 0),
                 ("beta", self.beta)) if value < 0]
        if self.repetition_penalty <= 0:
            out.append(f"grpo.repetition_penalty: {self.repetition_penalty} must be above 0")
        out += [f"grpo.reward_funcs: {name!r} is neither a built-in ({', '.join(BUILTIN_SCORERS)}), nor written "
                "package.module:function, nor a reward model's folder (a path with a /)" for name in self.reward_funcs
                if name not in BUILTIN_SCORERS and not re.fullmatch(r"[\w.]+:[\w.]+", name) and "/" not in name]
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            out.append(f"grpo.reward_weights: {len(self.reward_weights)} weights for {len(self.reward_funcs)} reward "
                       "functions; give one per function")
        if "regex_match" in self.reward_funcs and not self.regex:
            out.append("grpo.regex: regex_match needs the pattern; set grpo.regex")
        if self.ref_model is not None and self.reference == "adapter_off":
            out.append("grpo.ref_model: the adapter_off reference is the policy itself; set grpo.reference: model to "
                       "use ref_model")
        return out

    def round_completions(self, train, dp_size: int) -> int:
        """The completions of one generation round over all ranks (TRL's generation_batch_size)."""
        if self.generation_batch_size is not None:
            return self.generation_batch_size
        steps = self.steps_per_generation or train.gradient_accumulation_steps
        return train.per_device_train_batch_size * dp_size * steps

    def run_problems(self, config, dp_size: int) -> list[str]:
        """What only a grpo run must have: reward functions, prompts it reads whole, a round cut into whole groups and
        into the optimizer steps that train it."""
        out = [] if self.reward_funcs else \
            ["grpo.reward_funcs: name at least one reward function (accuracy, or package.module:function)"]
        if config.data.streaming:
            out.append("data.streaming: grpo reads its prompts whole before training; set data.streaming: false")
        if config.data.has_validation_sources() or config.data.val_ratio or config.data.has_test_sources():
            out.append("data.val_files: grpo has no validation or test loss; measure held-out prompts with "
                       "eval_generation.files (and its scorers) instead")
        return out + self._round_problems(config.train, dp_size)

    def round_prompts(self, train, dp_size: int) -> int:
        """The prompts of one generation round, each sampled num_generations times."""
        return self.round_completions(train, dp_size) // self.num_generations

    def round_steps(self, train, dp_size: int) -> int:
        """The optimizer steps that share one round's completions (each trains per_device_train_batch_size x
        data-parallel size x gradient_accumulation_steps of them); the round is trained num_iterations times over."""
        return self.round_completions(train, dp_size) // (train.per_device_train_batch_size * dp_size
                                                          * train.gradient_accumulation_steps)

    def _round_problems(self, train, dp_size: int) -> list[str]:
        if not isinstance(train.per_device_train_batch_size, int):
            return ["train.per_device_train_batch_size: grpo counts completions per micro-batch; give a number, not "
                    "auto"]
        per_step = train.per_device_train_batch_size * dp_size * train.gradient_accumulation_steps
        completions = self.round_completions(train, dp_size)
        if completions % self.num_generations:
            return [f"grpo.generation_batch_size: a round of {completions} completions is not a whole number of "
                    f"groups of num_generations={self.num_generations}; choose a multiple of {self.num_generations}"]
        if completions % per_step:
            return [f"grpo.generation_batch_size: a round of {completions} completions is not a whole number of "
                    f"optimizer steps of {per_step} (per_device_train_batch_size x data-parallel size x "
                    f"gradient_accumulation_steps); choose a multiple of {per_step}"]
        return []


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "peft": PeftConfig,
    "checkpoint": CheckpointConfig,
    "monitor": MonitorConfig,
    "eval_generation": EvalGenerationConfig,
    "dpo": DPOConfig,
    "kto": KTOConfig,
    "grpo": GRPOConfig,
    "rm": RMConfig,
}


@dataclass
class Config:
    task: str
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    parallel: ParallelConfig
    peft: PeftConfig
    checkpoint: CheckpointConfig
    monitor: MonitorConfig
    # The sections of tasks: only their own recipes give them.
    dpo: DPOConfig = field(default_factory=DPOConfig)
    kto: KTOConfig = field(default_factory=KTOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    eval_generation: EvalGenerationConfig = field(default_factory=EvalGenerationConfig)
    # LLaMA-Factory's defaults a flat recipe took (llamafactory.take_defaults), for the start banner; the resolved
    # config.yaml holds their values.
    recipe_defaults: list[str] = field(default_factory=list)

    def dp_size(self, world_size: int) -> int:
        return self.parallel.data_parallel_size(world_size)

    def preference(self) -> PairConfig | None:
        """The section of a task whose rows are pairs (dpo's, kto's, rm's), None for another task."""
        section = TASKS[self.task].section
        found = getattr(self, section) if section else None
        return found if isinstance(found, PairConfig) else None

    def head(self) -> str:
        """What the task's model ends in (tasks/registry.py): LM_HEAD, or rm's SCORE_HEAD."""
        return TASKS[self.task].head

    def reference_section(self) -> "PreferenceConfig | GRPOConfig | None":
        """The task's section that names a reference model (reference, ref_model): dpo's, kto's, grpo's; None for
        another task."""
        section = TASKS[self.task].section
        found = getattr(self, section) if section else None
        return found if hasattr(found, "ref_model") else None

    def micro_batch_shape(self) -> tuple[int, int]:
        """(rows, tokens of each) of a micro-batch at its largest: per_device_train_batch_size rows of data.max_seq_len;
        grpo's, one packed row of its completions, each after a prompt of up to data.max_seq_len tokens."""
        if TASKS[self.task].rows == PROMPTS:
            return 1, self.train.per_device_train_batch_size * (self.data.max_seq_len + self.grpo.max_completion_length)
        return self.train.per_device_train_batch_size, self.data.max_seq_len

    def holds_reference_copy(self) -> bool:
        """Whether the run holds a second, frozen copy of the model while it trains (reference: model)."""
        section = self.reference_section()
        return section is not None and section.needs_reference() and section.reference == "model"

    def has_auto(self) -> bool:
        """Whether a setting is auto, to be decided from the plan before the run starts (run/micro_batch.py)."""
        return AUTO in (self.train.per_device_train_batch_size, self.train.checkpointing())

    def use_auto(self, decided: dict, world_size: int) -> None:
        """The auto settings as decided ({key: value}: plan.auto_settings)."""
        if "train.per_device_train_batch_size" in decided:
            self.use_micro_batch(decided["train.per_device_train_batch_size"], world_size)
        if "train.gradient_checkpointing" in decided:
            self.train.gradient_checkpointing = decided["train.gradient_checkpointing"]

    def use_micro_batch(self, micro_batch: int, world_size: int) -> None:
        """per_device_train_batch_size: auto, resolved: this micro-batch, and the accumulation that keeps
        train.global_batch_size on world_size ranks."""
        self.train.per_device_train_batch_size = micro_batch
        per_step = micro_batch * self.dp_size(world_size)
        self.train.gradient_accumulation_steps = self.train.global_batch_size // per_step

    def to_dict(self) -> dict:
        """The sections, as a recipe: the file written from it loads back to an equal Config. Accumulation derived
        from train.global_batch_size is left out, so that the file also loads on another number of ranks; so are
        other tasks' sections."""
        recipe = {name: dataclasses.asdict(getattr(self, name)) for name in task_sections(self.task)}
        if self.train.global_batch_size is not None:
            del recipe["train"]["gradient_accumulation_steps"]
        return recipe

    def write(self, path: Path) -> None:
        header = f"# resolved recipe of this run: llmtune {self.task} {path.name}\n"
        write_text(path, header + yaml.safe_dump(self.to_dict(), sort_keys=False))


def task_sections(task: str) -> dict:
    """The sections a recipe of `task` has: every section but the other tasks' own."""
    others = {entry.section for entry in TASKS.values()} - {TASKS[task].section}
    return {name: cls for name, cls in SECTIONS.items() if name not in others}


def parse_overrides(tokens: list[str], task: str = "sft") -> tuple[list[str], int | None]:
    """`a.b=c`, `--a.b=c` and `--a.b c` -> ["a.b=c", ...], a key written without its section (`--learning_rate
    2e-5`, `learning_rate=2e-5`) given the one it belongs to in a recipe of `task`; plus the value of --nproc."""
    overrides, nproc, i = [], None, 0
    while i < len(tokens):
        token = tokens[i]
        name = token[2:] if token.startswith("--") else token
        if token.startswith("--") and "=" not in name:
            if i + 1 >= len(tokens):
                raise UserError(f"{token} needs a value")
            name, i = f"{name}={tokens[i + 1]}", i + 1
        key, _, value = name.partition("=")
        if key == "nproc":
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"--nproc: {value!r} is not a positive number of processes")
            nproc = int(value)
        elif "=" in name:
            overrides.append(f"{qualified(key, task)}={value}")
        else:
            raise UserError(f"unexpected argument {token!r}; overrides are written --key value or section.key=value")
        i += 1
    return overrides, nproc


def key_names(task: str) -> dict[str, set[str]]:
    """Each key's name -> the section.key it can stand for in a recipe of `task`: its sections' own keys, and
    KEY_ALIASES' targets."""
    names: dict[str, set[str]] = {}
    sections = task_sections(task)
    for section, cls in sections.items():
        for f in dataclasses.fields(cls):
            names.setdefault(f.name, set()).add(f"{section}.{f.name}")
    for alias, target in KEY_ALIASES.items():
        if target.partition(".")[0] in sections:
            names.setdefault(alias.partition(".")[2], set()).add(target)
    return names


def qualified(key: str, task: str) -> str:
    """`section.key` as given; a key without its section -> the one section.key it stands for in a recipe of
    `task`."""
    if "." in key:
        return key
    names = key_names(task)
    if key not in names:
        close = difflib.get_close_matches(key, list(names), n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join('--' + c for c in close)}?" if close else f"see llmtune {task} --help"
        raise UserError(f"--{key}: no recipe key has this name; {hint}")
    if len(names[key]) > 1:
        raise UserError(f"--{key}: several sections have this key ({', '.join(sorted(names[key]))}); write it with "
                        "its section, e.g. --" + sorted(names[key])[0])
    return next(iter(names[key]))


def load_config(recipe: str | Path | dict, overrides: list[str], task: str, world_size: int,
                task_flag: bool = False) -> Config:
    """Read the recipe (a YAML file's path, or its mapping as a dict), apply `section.key=value` overrides, check types
    and cross-field rules. task_flag: the command took the task from its --task option (llmtune data and plan, sft
    unless given), which is then the fix for another task's section.

    Raises UserError listing every problem found (one per line).
    """
    raw = _read_recipe(recipe)
    if isinstance(recipe, dict):
        recipe = "recipe"  # the name the messages give it
    flat = dict(raw) if llamafactory.is_flat(raw, SECTIONS) else None
    if flat is not None:
        raw = llamafactory.sectioned(flat, str(recipe), task, qualified)
    elif outside := llamafactory.mixed(raw, SECTIONS):
        raise UserError(f"{recipe}: {', '.join(outside)} outside any section, beside sections: write every key in "
                        "its section (model, data, train, ...), or none, as LLaMA-Factory's flat recipes do")
    problems: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or not name:
            problems.append(f"override {item!r}: write overrides as section.key=value, e.g. train.learning_rate=3e-5")
            continue
        _drop_other_names(raw, KEY_ALIASES.get(key, key))
        raw.setdefault(section, {})
        if isinstance(raw[section], dict):
            raw[section][name] = yaml.safe_load(value) if value else None
    recipe_defaults = llamafactory.take_defaults(flat, raw, task) if flat is not None else []
    _canonical_names(raw, recipe, problems)
    sections = {}
    for section, values in raw.items():
        if section not in SECTIONS:
            problems.append(f"{recipe}: unknown section {section!r}{_closest(section, SECTIONS)}")
        elif values is not None and not isinstance(values, dict):
            problems.append(f"{recipe}: section {section!r} must be a mapping of key: value")
    for section, cls in SECTIONS.items():
        values = raw.get(section) if isinstance(raw.get(section), dict) else {}
        sections[section] = _build_section(section, cls, values, task, problems)
    if problems:
        raise UserError("\n".join(problems))
    config = Config(task=task, **sections, recipe_defaults=recipe_defaults)
    provided = {f"{s}.{k}" for s, v in raw.items() if isinstance(v, dict) for k in v}
    for section in sections.values():
        problems.extend(section.problems())
    _global_batch_wins(provided, {item.partition("=")[0] for item in overrides})
    problems.extend(_batch_problems(config, world_size, provided))
    problems.extend(_evaluation_problems(config))
    if config.checkpoint.export_ema and not config.train.ema_decays():
        problems.append("checkpoint.export_ema: there is no moving average to export; set train.ema_decay")
    problems.extend(config.monitor.rank_problems(world_size))
    problems.extend(_task_problems(config, provided, task_flag))
    problems.extend(_task_run_problems(config, world_size))
    problems.extend(_quantize_problems(config))
    if problems:
        raise UserError("\n".join(problems))
    return config


def default_task(recipe: str) -> str:
    """The task `llmtune data` and `llmtune plan` take without --task: a flat LLaMA-Factory recipe's stage, else
    sft."""
    raw = _read_recipe(recipe)
    return llamafactory.stage(raw, recipe) if llamafactory.is_flat(raw, SECTIONS) else "sft"


def flat_recipe_task(recipe: str) -> str:
    """The task of a flat LLaMA-Factory recipe: its stage (`llmtune train`)."""
    raw = _read_recipe(recipe)
    if not llamafactory.is_flat(raw, SECTIONS):
        raise UserError(f"{recipe}: llmtune train reads the task from a LLaMA-Factory recipe's stage, and this recipe "
                        f"has sections; name its task: llmtune {'|'.join(TASKS)} {recipe}")
    return llamafactory.stage(raw, recipe)


def _drop_other_names(raw: dict, target: str) -> None:
    """The recipe's value of `target` (section.key) under any of its names taken out, for an override to replace:
    the command line wins over the recipe whichever names the two use (lora_target: all in the recipe,
    peft.target_modules=all-linear on the command line)."""
    for name in (target, *(alias for alias, aliased in KEY_ALIASES.items() if aliased == target)):
        section, _, key = name.partition(".")
        values = raw.get(section)
        if isinstance(values, dict):
            values.pop(key, None)
            kwargs = values.get("lr_scheduler_kwargs") if section == "train" else None
            if isinstance(kwargs, dict):
                kwargs.pop(key, None)


def _canonical_names(raw: dict, recipe: str, problems: list[str]) -> None:
    """Rewrite in place, as llmtune's, the names that users bring from other trainers (ALIASES_BY_ORIGIN):
    KEY_ALIASES, the train keys in lr_scheduler_kwargs, SCHEDULER_ALIASES, FINETUNING_TYPES, peft.method qlora,
    warmup_steps below 1 (a ratio) and report_to none."""
    sections = {name: values for name, values in raw.items() if isinstance(values, dict)}
    train = sections.get("train", {})  # no alias adds the train section: its aliases are written in it
    kwargs = train.pop("lr_scheduler_kwargs", None) or {}
    if not isinstance(kwargs, dict):
        problems.append(f"{recipe}: train.lr_scheduler_kwargs must be a mapping, e.g. {{min_lr_rate: 0.1}}")
        kwargs = {}
    given = [(f"train.lr_scheduler_kwargs.{key}", "train", key, value) for key, value in kwargs.items()]
    for alias in KEY_ALIASES:
        section, key = alias.split(".")
        if key in sections.get(section, {}):
            given.append((alias, section, key, sections[section].pop(key)))
    for name, section, key, value in given:
        target_section, _, target_key = KEY_ALIASES.get(f"{section}.{key}", f"{section}.{key}").partition(".")
        values = raw.setdefault(target_section, {})
        if not isinstance(values, dict):
            continue
        if target_key in values and values[target_key] != value:
            target = f"{target_section}.{target_key}"
            origin = ALIAS_ORIGINS.get(f"{section}.{key}")
            problems.append(f"{recipe}: {name} is {f'{origin} name for {target}' if origin else target}, which is "
                            "also given with another value; keep one")
        values[target_key] = value
    peft = raw.get("peft") if isinstance(raw.get("peft"), dict) else {}
    if peft.get("method") == QLORA:
        model = raw.setdefault("model", {})
        if isinstance(model, dict):
            if model.get("quantize", "nf4") != "nf4":
                problems.append(f"{recipe}: peft.method qlora is lora with model.quantize nf4, but model.quantize is "
                                f"{model['quantize']}; set peft.method: lora to train on the unquantized base")
            peft["method"], model["quantize"] = "lora", "nf4"
    elif peft.get("method") in FINETUNING_TYPES:
        peft["method"] = FINETUNING_TYPES[peft["method"]]
    elif peft.get("method") == llamafactory.FREEZE:
        peft["method"] = "none"
        train_values = raw.setdefault("train", {})
        if isinstance(train_values, dict):
            train_values.setdefault("trainable_layers", llamafactory.FREEZE_LAYERS)
    if train.pop("load_best_model_at_end", False) is True:
        checkpoint = raw.setdefault("checkpoint", {})
        if isinstance(checkpoint, dict):
            checkpoint.setdefault("save_best", True)
            checkpoint.setdefault("export_from", "best")
    best = raw.get("checkpoint", {}).get("best_metric") if isinstance(raw.get("checkpoint"), dict) else None
    if "train.metric_for_best_model" in {name for name, *_ in given} and isinstance(best, str) \
            and not best.startswith("eval_"):
        raw["checkpoint"]["best_metric"] = f"eval_{best}"  # the HF Trainer's reading of its own key
    if train.get("lr_scheduler_type") in SCHEDULER_ALIASES:
        train["lr_scheduler_type"] = SCHEDULER_ALIASES[train["lr_scheduler_type"]]
    warmup = train.get("warmup_steps")
    if isinstance(warmup, float) and 0 < warmup < 1:
        if train.get("warmup_ratio", warmup) != warmup:
            problems.append(f"{recipe}: train.warmup_steps {warmup} is a ratio, and train.warmup_ratio is also given "
                            "with another value; keep one")
        train["warmup_ratio"], train["warmup_steps"] = warmup, 0
    monitor = raw.get("monitor") if isinstance(raw.get("monitor"), dict) else {}
    trackers = monitor.get("report_to")
    if trackers is not None:
        trackers = [trackers] if isinstance(trackers, str) else trackers
        if isinstance(trackers, list):
            monitor["report_to"] = [name for name in trackers if name != "none"]


def plain(value):
    """A recipe value given from Python, as YAML would give it: paths (os.PathLike) as strings, tuples as lists,
    within lists and mappings too."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def _read_recipe(recipe: str | Path | dict) -> dict:
    if isinstance(recipe, dict):
        raw = plain(recipe)  # a copy: the caller's dict stays as it was given
        if not all(isinstance(section, str) for section in raw):
            raise UserError("recipe: a recipe is a mapping of sections (model, data, train, ...) named by strings")
        return raw
    path = Path(recipe)
    if not path.is_file():
        raise UserError(f"{path}: recipe file not found; pass the path of a YAML recipe")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a recipe is a mapping of sections (model, data, train, ...)")
    return raw


def _build_section(section: str, cls, values: dict, task: str, problems: list[str]):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            problems.append(_unknown_key(section, key, task, fields))
            continue
        ok, converted = _coerce(value, hints[key])
        if ok:
            kwargs[key] = converted
        else:
            problems.append(f"{section}.{key}: {value!r} is not a valid {_type_name(hints[key])}")
    return cls(**kwargs)


def _unknown_key(section: str, key: str, task: str, fields) -> str:
    """A key its section lacks, answered with where it is: the same name in another section of the task's recipe (or
    another trainer's name for one, KEY_ALIASES), in another task's section, else the closest names of every
    section."""
    here = f"{section}.{key}: unknown key in section {section!r}"
    names = key_names(task)
    if key in names:
        return f"{here}; did you mean {' or '.join(repr(name) for name in sorted(names[key]))}?"
    elsewhere = [f"llmtune {owner} ({target})" for owner, entry in TASKS.items() if entry.section and owner != task
                 for target in sorted(key_names(owner).get(key, ())) if target.startswith(f"{entry.section}.")]
    if elsewhere:
        owners = elsewhere[0] if len(elsewhere) == 1 else f"{', '.join(elsewhere[:-1])} and {elsewhere[-1]}"
        return f"{here}; it belongs to {owners}, not to {task}"
    close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
    if close:
        return f"{here}; did you mean {' or '.join(repr(name) for name in sorted(names[close[0]]))}?"
    return f"{here}; valid: {', '.join(fields)}"


def _coerce(value, hint) -> tuple[bool, object]:
    """Check `value` against a field's type; numbers written as strings (YAML reads 3e-5 as a string) are
    accepted for float fields, and a single string for a list of strings."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        return type(None) in options, None
    for option in options:
        if option is bool and isinstance(value, bool):
            return True, value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return True, value
        if option is float and not isinstance(value, bool):
            if isinstance(value, (int, float)):
                return True, float(value)
            if isinstance(value, str):
                try:
                    return True, float(value)
                except ValueError:
                    pass
        if option is str and isinstance(value, str):
            return True, value
        if typing.get_origin(option) is list:
            item = typing.get_args(option)[0]
            values = [value] if isinstance(value, (str, int, float)) and not isinstance(value, bool) else value
            if isinstance(values, list):
                converted = [_coerce(v, item) for v in values]
                if all(ok for ok, _ in converted):
                    return True, [v for _, v in converted]
    return False, None


def _type_name(hint) -> str:
    if isinstance(hint, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is list:
        return f"list of {_type_name(typing.get_args(hint)[0])}s"
    return {bool: "boolean (true/false)", int: "integer", float: "number", str: "string"}[hint]


def _closest(name: str, valid) -> str:
    match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else f"; valid: {', '.join(valid)}"


def _choice_problem(key: str, value: str, choices) -> str:
    return f"{key}: {value!r} is not valid{_closest(value, choices)}"


def _global_batch_wins(provided: set[str], overridden: set[str]) -> None:
    """--global_batch_size N on the command line replaces the accumulation the recipe sets (the HF Trainer's habit
    of one more flag), rather than being refused as two answers to one question. The other way round is refused:
    a recipe's global batch is kept on purpose on any number of ranks."""
    if "train.global_batch_size" in overridden and "train.gradient_accumulation_steps" not in overridden:
        provided.discard("train.gradient_accumulation_steps")


def _batch_problems(config: Config, world_size: int, provided: set[str]) -> list[str]:
    train, layout = config.train, config.parallel.layout_problem(world_size)
    if layout:
        return [layout]
    if config.data.streaming and train.max_steps <= 0:
        return ["train.max_steps: a stream has no known length, so data.streaming needs train.max_steps > 0"]
    if train.per_device_train_batch_size == AUTO:
        return _auto_batch_problems(config, world_size, provided)
    micro_batch = train.per_device_train_batch_size
    if train.global_batch_size is None or isinstance(micro_batch, str) or micro_batch < 1:
        return []  # a micro-batch that is no positive number is the train section's problem
    per_step = train.per_device_train_batch_size * config.dp_size(world_size)
    accumulation, rest = divmod(train.global_batch_size, per_step)
    if rest or accumulation < 1:
        return [f"train.global_batch_size: {train.global_batch_size} is not a multiple of "
                f"per_device_train_batch_size x data-parallel size = {per_step}; choose a multiple of {per_step}"]
    if "train.gradient_accumulation_steps" in provided and accumulation != train.gradient_accumulation_steps:
        return [f"train.global_batch_size: {train.global_batch_size} = {train.per_device_train_batch_size} per device "
                f"x {config.dp_size(world_size)} ranks x {accumulation} accumulation steps, but "
                f"train.gradient_accumulation_steps is {train.gradient_accumulation_steps}; set only one of them"]
    train.gradient_accumulation_steps = accumulation
    return []


def _auto_batch_problems(config: Config, world_size: int, provided: set[str]) -> list[str]:
    """per_device_train_batch_size: auto chooses the micro-batch (run/micro_batch.py) and derives accumulation from
    the global batch, which must be given and whole on every data-parallel rank."""
    train, dp = config.train, config.dp_size(world_size)
    if train.global_batch_size is None:
        return ["train.per_device_train_batch_size: auto keeps the global batch through accumulation; set "
                "train.global_batch_size (samples per optimizer step over all ranks)"]
    if "train.gradient_accumulation_steps" in provided:
        return ["train.gradient_accumulation_steps: with per_device_train_batch_size auto, accumulation is "
                "global_batch_size / (micro-batch x data-parallel size); leave gradient_accumulation_steps out"]
    if train.global_batch_size < dp or train.global_batch_size % dp:
        return [f"train.global_batch_size: {train.global_batch_size} is not a multiple of the data-parallel size "
                f"{dp}; choose a multiple of {dp}"]
    return []


def pair_length(config: Config) -> int:
    """The most tokens of one of a row's two sequences (prompt + response) for a preference task: its max_length,
    else half a row."""
    return config.preference().max_length or config.data.max_seq_len // 2


def _task_problems(config: Config, provided: set[str], task_flag: bool) -> list[str]:
    """The task's own section, given to another task; the keys that do not apply to the task."""
    section = TASKS[config.task].section
    owners = {entry.section: task for task, entry in TASKS.items() if entry.section}
    out = [f"{name}: this section is for llmtune {owners[name]}, not {config.task}; "
           + (f"pass --task {owners[name]}" if task_flag else f"leave it out of a {config.task} recipe")
           for name in sorted({key.partition(".")[0] for key in provided} & set(owners)) if name != section]
    out += _reference_problems(config)
    preference = config.preference()
    if preference is None:
        return out
    name, data, train = preference.section, config.data, config.train
    if 2 * pair_length(config) > data.max_seq_len:
        out.append(f"{name}.max_length: two sequences of {preference.max_length} tokens do not fit a row of "
                   f"data.max_seq_len={data.max_seq_len}; raise data.max_seq_len to {2 * preference.max_length} or "
                   f"lower {name}.max_length")
    for key, value in (("z_loss", train.z_loss), ("label_smoothing", train.label_smoothing)):
        if value:
            out.append(f"train.{key}: applies to the token loss of pt and sft, not to {config.task}'s loss"
                       + (" (dpo.label_smoothing is cDPO's)" if config.task == "dpo" else ""))
    if data.streaming:
        out.append(f"data.streaming: {name}'s rows are built whole before training; set data.streaming: false")
    if not data.document_mask:
        out.append(f"data.document_mask: false would let a row's second sequence attend to its first (a row holds "
                   f"both); leave data.document_mask true for {name}")
    return out


def _task_run_problems(config: Config, world_size: int) -> list[str]:
    """The task section's own checks of the whole recipe (its run_problems), where it has them."""
    section = TASKS[config.task].section
    check = getattr(getattr(config, section), "run_problems", None) if section else None
    return check(config, config.dp_size(world_size)) if check and not config.parallel.layout_problem(world_size) else []


def _reference_problems(config: Config) -> list[str]:
    """A reference the run cannot build as its task's section names it."""
    section = config.reference_section()
    if section is None or not section.needs_reference():
        return []
    name, out = section.section, []
    if section.reference == "adapter_off" and config.peft.method == "none":
        out.append(f"{name}.reference: adapter_off is the policy with its adapters off, and this run trains no "
                   f"adapters; set peft.method (lora or dora) or {name}.reference: model")
    if config.model.init_from and section.reference != "adapter_off" and not section.ref_model:
        out.append(f"{name}.reference: {section.reference} is built from model.name_or_path, but model.init_from "
                   f"starts the policy from other weights; set {name}.ref_model to the weights the reference should "
                   "have (e.g. the folder init_from's run exported)")
    return out


def _quantize_problems(config: Config) -> list[str]:
    """model.quantize with what cannot train on a 4-bit base (the model's shapes and torchao: features/quantization)."""
    if config.model.quantize == "none":
        return []
    method = config.peft.method
    if method == "none":
        return ["model.quantize: nf4 holds the frozen base in 4 bits, and this run trains every weight (peft.method: "
                "none), which cannot be stored quantized; set peft.method: lora (peft.method: qlora sets both)"]
    if method == "dora":
        return ["peft.method: dora cannot run on a base of model.quantize nf4: peft's DoRA reads a torchao weight "
                "through its dequantize(), which torchao's NF4Tensor does not have; set peft.method: lora"]
    return []


def _evaluation_problems(config: Config) -> list[str]:
    """Settings that evaluate, or rank by an eval metric, in a run with nothing to evaluate on: no validation data
    and no eval_generation.files (either evaluation serves eval_steps, eval_on_start and eval_on_save), or a metric
    of the one the run lacks."""
    train, checkpoint, best = config.train, config.checkpoint, config.checkpoint.best_metric
    validation = config.data.has_validation_sources() or bool(config.data.val_ratio)
    generation = bool(config.eval_generation.files)
    if generation and config.head() == SCORE_HEAD:
        return [f"eval_generation.files: llmtune {config.task} trains a sequence classifier, which generates no text; "
                "leave eval_generation out (its validation pairs give eval_accuracy)"]
    ranking = [key for key, on in (("checkpoint.save_best", checkpoint.save_best),
                                   ("train.early_stopping_patience", train.early_stopping_patience)) if on]
    if best.startswith(GENERATION_METRICS):
        return [f"{key}: ranks by {best}, a metric of the evaluation by generation, which this run has not; give "
                "eval_generation.files" for key in ranking] if not generation else []
    asked = [] if validation or generation else \
        [key for key, on in (("train.eval_steps", train.eval_steps), ("train.eval_epochs", train.eval_epochs),
                             ("train.eval_on_start", train.eval_on_start),
                             ("checkpoint.eval_on_save", checkpoint.eval_on_save)) if on]
    if best.startswith("eval_") and not validation:
        asked += ranking
    return [f"{key}: this run has no validation data to evaluate on; give data.val_files (or data.val_datasets, "
            "data.val_ratio)" for key in asked]


def recipe_keys(sections: dict = SECTIONS):
    """(section, key, default as YAML writes it, help) of every recipe key of `sections`, in their order."""
    for section, cls in sections.items():
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            # Flow style: a list or mapping default on one line, as a table cell and a --help line hold it.
            text = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
            yield section, f.name, text, f.metadata["help"]


def reference_table() -> str:
    """The recipe reference (docs/recipe.md, written by docs/recipe_table.py): every field, its default and its
    meaning."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{section}.{key}` | `{default}` | {help.replace('|', '/')} |"
             for section, key, default, help in recipe_keys()]
    return "\n".join(rows)


def recipe_help(task: str) -> str:
    """`llmtune TASK --help`: every recipe key of the task with its default and help, as the command line takes
    it."""
    names = key_names(task)
    lines = ["recipe keys: in the recipe's sections, or on the command line as --key VALUE (the key alone where no",
             "other section has it) or section.key=VALUE; a later override wins.", ""]
    lines += textwrap.wrap(f"per_device_train_batch_size and global_batch_size count {TASKS[task].batch}.",
                           width=110, break_on_hyphens=False)
    current = None
    for section, key, default, help in recipe_keys(task_sections(task)):
        if section != current:
            lines += ["", f"{section}:"]
            current = section
        option = key if len(names[key]) == 1 else f"{section}.{key}"
        lines.append(f"  --{option} (default: {default})")
        # Not broken at hyphens: "blank-line" split over two lines reads as two words.
        lines += textwrap.wrap(help, width=110, initial_indent="      ", subsequent_indent="      ",
                               break_on_hyphens=False)
    lines += ["", "names of other trainers, also read (config.yaml holds llmtune's):"]
    lines += [f"  {alias} (--{alias.partition('.')[2]}) = {target} ({ALIAS_ORIGINS[alias]} name)"
              for alias, target in KEY_ALIASES.items() if target.partition(".")[0] in task_sections(task)]
    lines += ["  lr_scheduler_type: " + ", ".join(f"{hf} = {ours}" for hf, ours in SCHEDULER_ALIASES.items()),
              "  train.lr_scheduler_kwargs: {min_lr_rate, num_decay_steps, decay_type} = the train keys above",
              "  train.warmup_steps below 1 = train.warmup_ratio; monitor.report_to: none = []",
              "  train.load_best_model_at_end: true = checkpoint.save_best: true and checkpoint.export_from: best; "
              "metric_for_best_model gets eval_ in front, as HF does",
              "  finetuning_type: " + ", ".join(f"{lf} = peft.method {ours}" for lf, ours in FINETUNING_TYPES.items())
              + ", freeze = peft.method none and train.trainable_layers "
              f"(default {llamafactory.FREEZE_LAYERS})"]
    return "\n".join(lines)
