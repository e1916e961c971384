"""Every check of a run before it trains, in one call for the two places that make it: the CLI before any process
starts, and under torchrun with Hub ids each worker once the ids are fetched (worker.fetch_in_turn). First the
output folder (writable, no other run's checkpoints or export) and the inputs (paths, data rows, chat template),
torch-free so that a wrong path is reported before torch is imported; then, against the model's transformers
config, the rows' images (data/image_rows.py), the enabled features' checks, the model's own (built on the meta
device) and model.init_from's checkpoint; last, the auto settings (train.per_device_train_batch_size, train.gradient_checkpointing) decided from the plan of a
step (run/micro_batch.py)."""

from pathlib import Path

from llmtune.checkpoint.folders import continues
from llmtune.errors import UserError
from llmtune.llamafactory import LF_TEMPLATE
from llmtune.run.inputs import (check_inputs, check_output_dir, fetch_hub_inputs, has_chat_template, hub_inputs,
                                local_inputs)
from llmtune.run.launch import launched_by_torchrun


def checked_inputs(config, world_size: int) -> tuple[object, dict]:
    """(the recipe as the run reads it, its Hub ids fetched and every check passed; the auto settings decided here,
    in config and in it: {key: value}). The recipe None under torchrun with Hub ids, whose workers fetch and check
    them in turn once the process group exists (worker.fetch_in_turn)."""
    if launched_by_torchrun() and hub_inputs(config):
        return None, {}
    local = local_inputs(config, fetch_hub_inputs(config))
    model_config = check_run(local, world_size)
    # Under torchrun every worker comes here: they agree on the settings once their process group exists
    # (micro_batch.agree_auto).
    if not config.has_auto() or launched_by_torchrun():
        return local, {}
    from llmtune.monitor.console import configure_logging
    from llmtune.run.micro_batch import decide_before_start

    configure_logging()  # the run's (worker.py), so that the decision's line shows
    return local, decide_before_start(config, local, model_config, world_size)


def check_run(local, world_size: int):
    """`local`: the recipe as the run reads it (inputs.local_inputs: Hub ids replaced by their snapshots). Returns the
    model's transformers config."""
    check_output_dir(local.train, local.checkpoint.resume_from_checkpoint)
    check_inputs(local)
    from llmtune.data.image_rows import check_image_rows
    from llmtune.features.registry import check_features
    from llmtune.model.build import check_model, load_model_config
    from llmtune.model.multimodal import is_multimodal
    from llmtune.generation.evaluation import check_eval_generation
    from llmtune.tasks.objective import objective_class
    from llmtune.training.callbacks import import_callback

    for path in local.train.callbacks:  # importable, before any process starts
        import_callback(path)
    check_eval_generation(local.eval_generation, bool(local.data.chat_template) or has_chat_template(
        Path(local.model.tokenizer or local.model.name_or_path)))
    objective_class(local.task).check(local)
    if (local.data.chat_template or "").startswith(LF_TEMPLATE):  # the template that renders as it names, or refused
        from llmtune.data.templates import recipe_tokenizer

        recipe_tokenizer(local.task, local.model, local.data)
    model_config = load_model_config(local.model, local.head())
    check_image_rows(local, is_multimodal(model_config))
    check_features(local, model_config, world_size)
    check_model(local.model, local.train, model_config)
    if local.model.init_from:
        check_init_from(local, model_config)
    return model_config


def check_init_from(local, model_config) -> None:
    """model.init_from: a complete checkpoint, kept by train.overwrite_output_dir, trained on this run's base when it
    holds only the trained parameters; and, for a run that trains every weight, of this model (names and shapes; a
    run with adapters or frozen modules has them checked once its model is built, by the checkpoint manager)."""
    from llmtune.checkpoint.validate import init_from_plan
    from llmtune.model.build import base_record, meta_model

    path = Path(local.model.init_from)
    if local.train.overwrite_output_dir and continues(Path(local.train.output_dir), str(path)):
        raise UserError(f"model.init_from: {path} is a checkpoint of train.output_dir, whose checkpoints "
                        "train.overwrite_output_dir: true removes before the run starts; copy it out first, or choose "
                        "another train.output_dir")
    freezes = local.peft.method != "none" or local.train.freezes()
    # As checkpoints name the model's tensors: those of the FSDP root's hf_model.
    current = None if freezes else {f"hf_model.{name}": list(tensor.shape) for name, tensor in
                                    meta_model(model_config, local.model).state_dict().items()}
    init_from_plan(path, base_record(local, local.model, model_config), current, local.model.strict_load,
                   local.checkpoint.verify_checksums)
