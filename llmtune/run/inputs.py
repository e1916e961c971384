"""The inputs a recipe names: its Hub ids fetched into local snapshots, and checks that every path exists, before
any process or process group starts."""

import importlib.util
import json
import os
from dataclasses import replace
from pathlib import Path

from llmtune.checkpoint.folders import complete_checkpoints, continues, earlier_run
from llmtune.config import RESUME_BEST, RESUME_NEWEST
from llmtune.data.files import check_has_rows, is_saved_dataset, resolve_data_files
from llmtune.data.registry import Source, split_sources
from llmtune.errors import UserError
from llmtune.hub import HubRepo, dataset_source, fetch, model_config_repo, model_repo
from llmtune.tasks.registry import DOCUMENTS, TASKS


def hub_inputs(config) -> dict[HubRepo, str]:
    """Every Hub repository the recipe names (model, tokenizer, data sources) -> the first key naming it."""
    model = config.model
    found = {}
    for key, repo in (("model.name_or_path", _model_repo(model, model.name_or_path, tokenizer_only=False)),
                      ("model.tokenizer", _model_repo(model, model.tokenizer, tokenizer_only=True)),
                      (_reference_key(config), _reference_repo(config))):
        if repo:
            found.setdefault(repo, key)
    if model.revision and not found:
        raise UserError(f"model.revision: {model.revision} names a revision of a Hub id, but model.name_or_path and "
                        "model.tokenizer are local folders; remove model.revision, or name a Hub id (org/name)")
    for split in ("train", "val", "test"):  # data files, and the hf_hub_url entries of a dataset_info.json
        for source in split_sources(config.data, config.task, split):
            if hub := dataset_source(source.pattern, source.key):
                found.setdefault(hub.repo, source.key)
    return found


def _model_repo(model, text: str | None, tokenizer_only: bool) -> HubRepo | None:
    return model_repo(text, model.revision, model.trust_remote_code, tokenizer_only=tokenizer_only)


def _reference_key(config) -> str:
    section = config.reference_section()
    return f"{section.section}.ref_model" if section else ""


def _reference_repo(config) -> HubRepo | None:
    """A task's ref_model (dpo's, kto's, grpo's), a model of its own: model.revision names the policy's revision, not
    its."""
    section = config.reference_section()
    return model_repo(section.ref_model, None, config.model.trust_remote_code, tokenizer_only=False) \
        if section else None


def pin_hub_inputs(config) -> dict[HubRepo, str]:
    """The commit each Hub repository's revision names now (from the cache alone when offline)."""
    return {repo: fetch(repo.pinning(), key).name for repo, key in hub_inputs(config).items()}


def fetch_hub_inputs(config, commits: dict[HubRepo, str] | None = None,
                     local_files_only: bool = False) -> dict[HubRepo, Path]:
    """The snapshot folder of every Hub repository the recipe names, at commits[repo] where given."""
    return {repo: fetch(replace(repo, revision=commits[repo]) if commits else repo, key, local_files_only)
            for repo, key in hub_inputs(config).items()}


def fetched_config(model):
    """The model section as `llmtune plan` reads it: a Hub id's config files alone fetched (name_or_path its snapshot
    folder), through hub.fetch, which fails at once where the Hub cannot be reached (transformers' download of a
    config retries it for a minute)."""
    repo = model_config_repo(model.name_or_path, model.revision, model.trust_remote_code)
    return replace(model, name_or_path=str(fetch(repo, "model.name_or_path")), revision=None) if repo else model


def local_inputs(config, folders: dict[HubRepo, Path]):
    """The recipe as the run reads it: Hub models and tokenizers replaced by their snapshot folders, Hub data
    sources pinned to their snapshot's commit (org/name@commit:config:split). config.yaml keeps the recipe's own."""
    model, data = config.model, config.data

    def folder(text: str | None, tokenizer_only: bool) -> str | None:
        repo = _model_repo(model, text, tokenizer_only=tokenizer_only)
        return str(folders[repo]) if repo else text

    def sources(patterns: list[str], key: str) -> list[str]:
        pinned = [(pattern, dataset_source(pattern, key)) for pattern in patterns]
        return [source.pinned(folders[source.repo].name) if source else pattern for pattern, source in pinned]

    local_model = replace(model, name_or_path=folder(model.name_or_path, tokenizer_only=False),
                          tokenizer=folder(model.tokenizer, tokenizer_only=True), revision=None)
    reference = _reference_repo(config)
    # A task's reference model: its folder too.
    section = config.reference_section()
    task_section = {section.section: replace(section, ref_model=str(folders[reference]))} if reference else {}
    local_data = replace(data, train_files=sources(data.train_files, "data.train_files"),
                         val_files=sources(data.val_files, "data.val_files"),
                         test_files=sources(data.test_files, "data.test_files"))
    return replace(config, model=local_model, data=local_data, **task_section)


def check_data_sources(sources: list[Source]) -> None:
    for source in sources:
        if hub_source := dataset_source(source.pattern, source.key):
            # datasets is imported only for a Hub source: it makes every CLI start slower.
            from llmtune.data.sources import hub_builder

            hub_builder(hub_source, source.key)
        elif not is_saved_dataset(source.pattern):
            for name in resolve_data_files([source.pattern], source.key):
                check_has_rows(name, source.key)


def check_model_paths(model) -> None:
    """The model folder (or config) and the tokenizer folder must exist locally (Hub ids are fetched before)."""
    if model.name_or_path and not (Path(model.name_or_path) / "config.json").is_file():
        raise UserError(f"model.name_or_path: {model.name_or_path} is not a HF model folder (no config.json "
                        "there); point it at a folder written by save_pretrained, or at a Hub id (org/name)")
    if model.config and not (Path(model.config).is_file() or (Path(model.config) / "config.json").is_file()):
        raise UserError(f"model.config: {model.config} is neither a config.json file nor a folder holding one")
    tokenizer = model.tokenizer or model.name_or_path
    if not Path(tokenizer).is_dir():
        raise UserError(f"model.tokenizer: tokenizer folder {tokenizer} not found; point it at a folder "
                        "written by a tokenizer's save_pretrained, or at a Hub id (org/name)")


def has_chat_template(tokenizer_dir: Path) -> bool:
    """Where transformers keeps a saved chat template: its own file, or inside tokenizer_config.json."""
    if (tokenizer_dir / "chat_template.jinja").is_file() or (tokenizer_dir / "chat_template.json").is_file():
        return True
    config = tokenizer_dir / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def check_wandb_login() -> None:
    """W&B needs a login unless it runs offline; without one, wandb.init fails (or waits at a prompt) only once the
    data is built and the model loaded."""
    if os.environ.get("WANDB_MODE") in ("offline", "dryrun", "disabled"):
        return
    import wandb

    # Credentials from WANDB_API_KEY, the settings or ~/.netrc (`wandb login`), read without a prompt or a Hub call.
    if not wandb.login(prompt=False, verify=False):
        raise UserError("monitor.report_to: wandb has no W&B login on this machine; set WANDB_API_KEY or run wandb "
                        "login, or train offline with WANDB_MODE=offline (then wandb sync the run under "
                        "OUTPUT_DIR/wandb), or take wandb out of monitor.report_to")


def check_optional_packages(config) -> None:
    for package in config.monitor.report_to:
        if importlib.util.find_spec(package) is None:
            raise UserError(f"monitor.report_to: {package} needs the {package} package, which is not installed; pip "
                            f"install 'llmtune[{package}]', or take {package} out of monitor.report_to")
    if "wandb" in config.monitor.report_to:
        check_wandb_login()
    # peft is a dependency of llmtune; an environment can still lack it (installed with --no-deps, uninstalled).
    if config.peft.method != "none" and importlib.util.find_spec("peft") is None:
        raise UserError(f"peft.method: {config.peft.method} needs the peft package, which is not installed; pip "
                        "install peft, or set peft.method: none")


def check_output_dir(train_cfg, resume: str | None) -> None:
    """train.output_dir can be created and written, and a run that does not go on from its checkpoints does not
    write into another run's: its checkpoints would be resumed from, and its export shipped, as this run's."""
    out = Path(train_cfg.output_dir)
    # The nearest existing folder decides; os.path.exists is False below a file and below a folder that cannot be
    # read (where Path.exists raises).
    nearest = next(p for p in (out, *out.parents) if os.path.exists(p))
    if not nearest.is_dir():
        raise UserError(f"train.output_dir: {out} cannot be created: {nearest} is a file; choose another folder")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise UserError(f"train.output_dir: {out} cannot be {'written' if nearest == out else 'created'}: no "
                        f"permission to write in {nearest}; choose a folder you can write, or change its permissions")
    held = earlier_run(out)
    goes_on = continues(out, resume)
    if train_cfg.overwrite_output_dir:
        if goes_on:
            raise UserError(f"train.overwrite_output_dir: true starts over, removing the checkpoints of {out}, "
                            f"and checkpoint.resume_from_checkpoint: {resume} goes on from one of them; keep one of "
                            "the two")
        return
    saved = complete_checkpoints(out / "checkpoints")
    if not held or (goes_on and saved):
        return
    ways = "set train.overwrite_output_dir: true to start over (it removes them first), or choose another " \
           "train.output_dir"
    # auto goes on from a complete checkpoint alone: offered where there is one.
    if not goes_on and saved:
        ways = f"set checkpoint.resume_from_checkpoint: auto to go on from it, {ways}"
    raise UserError(f"train.output_dir: {out} holds {' and '.join(held)} of an earlier run, which this run would mix "
                    f"with its own; {ways}")


def check_inputs(config) -> None:
    """Every path the recipe names exists (the checkpoint to resume from too); a task that renders conversations (all
    but pt's documents) has a chat template; optional sinks are installed."""
    check_optional_packages(config)
    check_model_paths(config.model)
    reference = config.reference_section() and config.reference_section().ref_model
    if reference and not (Path(reference) / "config.json").is_file():
        raise UserError(f"{_reference_key(config)}: {reference} is not a HF model folder (no config.json there); point it at a "
                        "folder written by save_pretrained, or at a Hub id (org/name)")
    tokenizer_dir = Path(config.model.tokenizer or config.model.name_or_path)
    if TASKS[config.task].rows != DOCUMENTS and not config.data.chat_template and not has_chat_template(tokenizer_dir):
        raise UserError(f"data.chat_template: the tokenizer in {tokenizer_dir} has no chat template; set "
                        "data.chat_template to a built-in one (basic, chatml, gemma, llama3) or to a .jinja file")
    for split in ("train", "val", "test"):
        check_data_sources(split_sources(config.data, config.task, split))
    template = config.data.chat_template
    if template and template.endswith(".jinja") and not Path(template).is_file():
        raise UserError(f"data.chat_template: template file {template} not found")
    resume = config.checkpoint.resume_from_checkpoint
    if resume and resume not in (*RESUME_NEWEST, RESUME_BEST) and not Path(resume).is_dir():
        raise UserError(f"checkpoint.resume_from_checkpoint: {resume} is not a checkpoint folder; name a "
                        "global_step_N folder, or auto (or best)")
