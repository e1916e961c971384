"""Checks that every path a recipe names exists, before any process or process group starts."""

import importlib.util
import json
from pathlib import Path

from llmtune.data.files import check_has_rows, is_saved_dataset, resolve_data_files
from llmtune.errors import UserError


def check_data_sources(patterns: list[str], key: str) -> None:
    for pattern in patterns:
        if not is_saved_dataset(pattern):
            for name in resolve_data_files([pattern], key):
                check_has_rows(name, key)


def check_model_paths(model) -> None:
    """The model folder (or config) and the tokenizer folder must exist locally."""
    if model.name_or_path and not (Path(model.name_or_path) / "config.json").is_file():
        raise UserError(f"model.name_or_path: {model.name_or_path} is not a HF model folder (no config.json "
                        "there); point it at a folder written by save_pretrained")
    if model.config and not (Path(model.config).is_file() or (Path(model.config) / "config.json").is_file()):
        raise UserError(f"model.config: {model.config} is neither a config.json file nor a folder holding one")
    tokenizer = model.tokenizer or model.name_or_path
    if not Path(tokenizer).is_dir():
        raise UserError(f"model.tokenizer: tokenizer folder {tokenizer} not found; point it at a folder "
                        "written by a tokenizer's save_pretrained")


def has_chat_template(tokenizer_dir: Path) -> bool:
    """Where transformers keeps a saved chat template: its own file, or inside tokenizer_config.json."""
    if (tokenizer_dir / "chat_template.jinja").is_file() or (tokenizer_dir / "chat_template.json").is_file():
        return True
    config = tokenizer_dir / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def check_optional_packages(monitor) -> None:
    for wanted, package, key in ((monitor.tensorboard, "tensorboard", "monitor.tensorboard"),
                                 (monitor.wandb_project, "wandb", "monitor.wandb_project")):
        if wanted and importlib.util.find_spec(package) is None:
            raise UserError(f"{key}: needs the {package} package, which is not installed; pip install "
                            f"'llmtune[{package}]', or turn {key} off")


def check_inputs(config) -> None:
    """Every path the recipe names exists (the checkpoint to resume from too); sft has a chat template; optional
    sinks are installed."""
    check_optional_packages(config.monitor)
    check_model_paths(config.model)
    tokenizer_dir = Path(config.model.tokenizer or config.model.name_or_path)
    if config.task == "sft" and not config.data.chat_template and not has_chat_template(tokenizer_dir):
        raise UserError(f"data.chat_template: the tokenizer in {tokenizer_dir} has no chat template; set "
                        "data.chat_template to a built-in one (basic) or to a .jinja file")
    check_data_sources(config.data.train_files, "data.train_files")
    check_data_sources(config.data.val_files, "data.val_files")
    template = config.data.chat_template
    if template and template.endswith(".jinja") and not Path(template).is_file():
        raise UserError(f"data.chat_template: template file {template} not found")
    resume = config.checkpoint.resume_from_checkpoint
    if resume and resume != "latest" and not Path(resume).is_dir():
        raise UserError(f"checkpoint.resume_from_checkpoint: {resume} is not a checkpoint folder; name a "
                        "global_step_N folder, or latest")
