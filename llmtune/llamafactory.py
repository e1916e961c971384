"""LLaMA-Factory's flat recipes (its examples/: `stage: sft`, `finetuning_type: lora`, `dataset: identity`, ...): a
YAML file with no sections, read as llmtune's sectioned recipe before anything else reads it (config.load_config).
Every key is placed in its section by the names llmtune reads (its own, config.KEY_ALIASES: LLaMA-Factory's and the
HF Trainer's), by RENAMED, or refused with the reason llmtune has no such thing (REFUSED); a key LLaMA-Factory
leaves out whose default there trains another model than llmtune's default takes LLaMA-Factory's (defaults), and
the start banner names them. A sectioned recipe keeps llmtune's defaults, whatever names it uses. Torch-free.
"""

from llmtune.errors import UserError

STAGES = ("pt", "sft", "rm", "dpo", "kto")
FREEZE = "freeze"  # finetuning_type freeze: peft.method none and train.trainable_layers (features/freezing.py)
FREEZE_LAYERS = 2  # its freeze_trainable_layers where a recipe with finetuning_type freeze leaves it out
LF_TEMPLATE = "llamafactory:"  # data.chat_template's form of a LLaMA-Factory template name (data/lf_templates.PREFIX)
# The tasks whose rows hold two sequences of one prompt: cutoff_len bounds each sequence there, as in
# LLaMA-Factory's pairwise and KTO processing.
PAIRED = ("dpo", "kto", "rm")
# LLaMA-Factory's keys that llmtune reads under a name of its own, where neither llmtune's keys nor
# config.KEY_ALIASES give it (`section.key`); their values are converted by `_value`.
RENAMED = {
    "dataset": "data.datasets",
    "eval_dataset": "data.val_datasets",
    "dataset_dir": "data.dataset_info",
    "val_size": "data.val_ratio",
    "max_samples": "data.max_samples",
    "preprocessing_num_workers": "data.num_proc",
    "plot_loss": "monitor.plots",
    "ddp_timeout": "parallel.timeout_minutes",
    "additional_target": "peft.modules_to_save",
    "template": "data.chat_template",
    "use_rslora": "peft.use_rslora",
}
# Keys that change nothing llmtune does, read and dropped (never silently: each is said here, and `do_train` must be
# true).
NOTHING_TO_DO = {
    "do_train": "llmtune trains",
    "overwrite_cache": "llmtune's data cache is keyed by the data, the tokenizer and the settings: it is rebuilt "
                      "whenever one changes",
    # LLaMA-Factory's video settings, which its image recipes carry: llmtune reads no videos (a video row is refused).
    "video_max_pixels": "llmtune reads images, not videos",
    "video_min_pixels": "llmtune reads images, not videos",
    "video_fps": "llmtune reads images, not videos",
    "video_maxlen": "llmtune reads images, not videos",
    # LLaMA-Factory's torchao float8 all-gather switch (its default off): llmtune's tensorwise float8 (fp8: true)
    # always gathers the weights in float8, which moves half the bytes.
    "fp8_enable_fsdp_float8_all_gather": "train.fp8's tensorwise scaling always all-gathers the weights in float8",
}
# LLaMA-Factory's fp8_backend values that are llmtune's float8 training (torchao's); another is refused.
FP8_BACKENDS = ("auto", "torchao")
# LLaMA-Factory's keys llmtune refuses, each with its reason and what to do instead.
REFUSED = {
    "deepspeed": "llmtune shards with FSDP2, not DeepSpeed: leave it out (parallel.* sets the layout; ZeRO-3 is its "
                 "default, dp_replicate gives HSDP)",
    "do_predict": "llmtune trains; generate with `llmtune generate` on the export",
    "do_eval": "evaluation runs during training: give eval_dataset or val_size with eval_steps",
    "predict_with_generate": "generate with `llmtune generate`, or evaluate by generation with eval_generation",
    "quantization_method": "llmtune quantizes the base to 4-bit NF4 alone (model.quantize: nf4): give quantize: nf4",
    "quantization_bit": "llmtune quantizes the base to 4-bit NF4 alone (model.quantize: nf4): give quantize: nf4",
    "flash_attn": "the attention backend is attn_implementation (auto picks flash attention where it can run)",
    "enable_liger_kernel": "Liger's kernels are fused_kernels: true (CUDA)",
    "use_unsloth": "llmtune does not run Unsloth's kernels",
    "mix_strategy": "llmtune concatenates its datasets (LLaMA-Factory's concat), or samples them by mix_weights",
    "interleave_probs": "llmtune samples its datasets by mix_weights",
    "tokenized_path": "llmtune caches the tokenized data itself (cache_dir)",
    "pissa_init": "peft's PiSSA reads the base weights at init, which the sharded model built on the meta device does "
                  "not give it",
    "loraplus_lr_ratio": "LoRA+ is not built: one learning rate for every trained weight",
    "use_galore": "GaLore is not built",
    "use_badam": "BAdam is not built",
    "use_apollo": "APOLLO is not built",
    "use_llama_pro": "LLaMA Pro's expanded layers are not built: finetuning_type freeze trains the last "
                     "freeze_trainable_layers layers",
}
# The names of lists that LLaMA-Factory writes as one string, its items separated by commas.
COMMA_LISTS = ("dataset", "eval_dataset", "lora_target", "additional_target", "freeze_trainable_modules",
               "freeze_extra_modules")


def is_flat(raw: dict, sections) -> bool:
    """Whether a recipe read from YAML is a flat one: it names no section, and holds keys with values (a mapping
    under another name is a misspelled section). A recipe that names sections and keys outside them is refused
    (`mixed`)."""
    return not any(key in sections for key in raw) and bool(_outside(raw, sections))


def mixed(raw: dict, sections) -> list[str]:
    """The keys with values outside any section of a recipe that also has sections."""
    return _outside(raw, sections) if any(key in sections for key in raw) else []


def _outside(raw: dict, sections) -> list[str]:
    return [key for key, value in raw.items() if key not in sections and not isinstance(value, dict)]


def stage(raw: dict, recipe: str) -> str:
    """The task a flat recipe's `stage` names (LLaMA-Factory's default: sft)."""
    found = raw.get("stage", "sft")
    if found not in STAGES:
        raise UserError(f"{recipe}: stage {found!r}: llmtune trains {', '.join(STAGES)}"
                        + ("; ppo is not built (online RL is llmtune grpo)" if found == "ppo" else ""))
    return found


def sectioned(raw: dict, recipe: str, task: str, qualified) -> dict:
    """The flat recipe `raw` in llmtune's sections, for the task the command trains (its stage). qualified(key,
    task) -> section.key (config.qualified: llmtune's keys and KEY_ALIASES)."""
    named = stage(raw, recipe)
    if named != task:
        raise UserError(f"{recipe}: stage {named}, but the command is llmtune {task}; run llmtune {named} {recipe} "
                        f"(or llmtune train {recipe}, which reads the stage)")
    problems, out = [], {}
    for key, value in raw.items():
        if key in ("stage", "neat_packing"):  # neat_packing: read with packing (defaults)
            continue
        if key == "eval_strategy":
            if value == "epoch":
                out.setdefault("train", {})["eval_epochs"] = 1
            elif value not in ("steps", "no"):
                problems.append(f"{recipe}: eval_strategy {value!r}: steps (eval_steps), epoch or no")
            continue
        if key == "fp8_backend":
            if value not in FP8_BACKENDS:
                problems.append(f"{recipe}: fp8_backend {value!r}: llmtune's float8 training (fp8) is torchao's; "
                                f"leave fp8_backend out, or set it to {' or '.join(FP8_BACKENDS)}")
            continue
        if key in REFUSED:
            problems.append(f"{recipe}: {key}: {REFUSED[key]}")
            continue
        if key in NOTHING_TO_DO:
            if key == "do_train" and value is not True:
                problems.append(f"{recipe}: do_train: {value!r}: llmtune trains; leave it out or true")
            continue
        try:
            target = RENAMED.get(key) or qualified(key, task)
        except UserError as err:
            problems.append(f"{recipe}: {str(err).lstrip('-')}")
            continue
        section, _, name = target.partition(".")
        out.setdefault(section, {})[name] = _value(key, value)
    if problems:
        raise UserError("\n".join(problems))
    return out


def _value(key: str, value):
    """A value in llmtune's form: comma-separated names as a list (`all` as peft's all-linear), ddp_timeout's seconds
    in minutes."""
    if key in COMMA_LISTS and isinstance(value, str):
        value = [item.strip() for item in value.split(",") if item.strip()]
        return ["all-linear"] if key == "lora_target" and value == ["all"] else value
    if key == "template" and isinstance(value, str):  # checked against the model's own (data/lf_templates.py)
        return LF_TEMPLATE + value
    if key == "ddp_timeout" and isinstance(value, (int, float)):
        return max(1, round(value / 60))
    return value


def take_defaults(raw: dict, out: dict, task: str) -> list[str]:
    """LLaMA-Factory's defaults where the flat recipe `raw` leaves a key out and llmtune's own would train another
    model, set in `out` (its sections, the command line's overrides applied); their descriptions, for the start
    banner."""
    taken = []

    def take(target: str, value, why: str) -> None:
        section, _, name = target.partition(".")
        values = out.setdefault(section, {})
        if name not in values:
            values[name] = value
            taken.append(why)

    peft = out.get("peft", {})
    take("peft.method", "lora", "finetuning_type lora")
    if peft.get("method", "lora") in ("lora", "qlora"):
        take("peft.r", 8, "lora_rank 8")
        rank = out["peft"]["r"]
        take("peft.alpha", 2 * rank, f"lora_alpha {2 * rank} (2 x lora_rank)")
    if peft.get("method") == FREEZE:
        take("train.trainable_layers", FREEZE_LAYERS, f"freeze_trainable_layers {FREEZE_LAYERS}")
    take("train.lr_scheduler_type", "linear", "lr_scheduler_type linear")
    if "datasets" in out.get("data", {}) or "val_datasets" in out.get("data", {}):
        take("data.dataset_info", "data", "dataset_dir data")
    data = out.setdefault("data", {})
    if task == "sft":
        # LLaMA-Factory packs sft samples only when asked (neat_packing asks too); packed without neat_packing, they
        # attend to each other.
        if raw.get("neat_packing"):
            data["packing"] = True
        elif data.get("packing") is None:
            take("data.packing", False, "packing false (sft)")
        elif data["packing"]:
            take("data.document_mask", False, "packed samples attending to each other (packing without neat_packing)")
    if task in PAIRED:
        cutoff = data.get("max_seq_len", 2048)
        # Each sequence of a pair within cutoff_len: a row of llmtune's holds both.
        data["max_seq_len"] = 2 * cutoff
        take(f"{task}.max_length", cutoff, f"cutoff_len {cutoff} for each of a pair's sequences")
    return taken
