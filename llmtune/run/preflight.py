"""Every check of a run before it trains, in one call for the two places that make it: the CLI before any process
starts, and under torchrun with Hub ids each worker once the ids are fetched (worker.fetch_in_turn). First the
output folder (writable, no other run's checkpoints or export) and the inputs (paths, data rows, chat template),
torch-free so that a wrong path is reported before torch is imported; then, against the model's transformers
config, the enabled features' checks and the model's own (built on the meta device)."""

from llmtune.run.inputs import check_inputs, check_output_dir, fetch_hub_inputs, hub_inputs, local_inputs
from llmtune.run.launch import launched_by_torchrun


def checked_inputs(config, world_size: int):
    """The recipe as the run reads it, its Hub ids fetched and every check passed; None under torchrun with Hub ids,
    whose workers fetch and check them in turn once the process group exists (worker.fetch_in_turn)."""
    if launched_by_torchrun() and hub_inputs(config):
        return None
    local = local_inputs(config, fetch_hub_inputs(config))
    check_run(local, world_size)
    return local


def check_run(local, world_size: int) -> None:
    """`local`: the recipe as the run reads it (inputs.local_inputs: Hub ids replaced by their snapshots)."""
    check_output_dir(local.train, local.checkpoint.resume_from_checkpoint)
    check_inputs(local)
    from llmtune.features.registry import check_features
    from llmtune.model.build import check_model, load_model_config

    from llmtune.training.callbacks import import_callback

    for path in local.train.callbacks:  # importable, before any process starts
        import_callback(path)
    model_config = load_model_config(local.model)
    check_features(local, model_config, world_size)
    check_model(local.model, local.train, model_config)
