"""What each process runs: wire the parts from the config, train, export."""

import logging
from pathlib import Path

from transformers import set_seed

from llmtune.checkpoint.hf_export import export_hf
from llmtune.data.build import build_stream, load_or_build
from llmtune.data.manager import DataManager, StreamingDataManager
from llmtune.data.templates import apply_recipe_template
from llmtune.model import CausalLMForTraining, check_vocab, load_hf_model, load_tokenizer, shard_model
from llmtune.monitor import TrainMonitor
from llmtune.optim import build_optimizer, build_scheduler
from llmtune.parallel import ParallelState
from llmtune.trainer import Trainer

log = logging.getLogger("llmtune")


def build_data(config, tokenizer, state: ParallelState):
    """The DataManager of this rank, and the validation dataset (or None)."""
    data_cfg, train_cfg = config.data, config.train
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if data_cfg.streaming:
        stream = build_stream(config.task, data_cfg, tokenizer, train_cfg.seed)
        return StreamingDataManager(stream, data_cfg, train_cfg, pad_id, state), None
    train, val, stats = load_or_build(config.task, data_cfg, tokenizer, train_cfg.seed,
                                      train_cfg.per_device_train_batch_size, state.local_rank == 0, state.barrier)
    if state.is_main:
        log.info("data: %s", stats.summary())
    return DataManager(train, data_cfg, train_cfg, pad_id, state.dp_size, state.dp_rank), val


def build_trainer(config, state: ParallelState) -> tuple[Trainer, object]:
    """(trainer, tokenizer) for this rank; rank 0 writes the resolved config first."""
    output_dir = Path(config.train.output_dir)
    if state.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        config.write(output_dir / "config.yaml")
        (output_dir / "metrics.jsonl").unlink(missing_ok=True)
    set_seed(config.train.seed)
    tokenizer = load_tokenizer(config.model)
    if config.task == "sft":
        apply_recipe_template(tokenizer, config.data.chat_template)
    data, _ = build_data(config, tokenizer, state)
    hf_model = load_hf_model(config.model, config.train.seed)
    check_vocab(hf_model, tokenizer, "model.tokenizer")
    model = shard_model(CausalLMForTraining(hf_model), state.mesh, config.train.bf16)
    optimizer = build_optimizer(model, config.train)
    total_steps = data.total_steps(config.train)
    scheduler = build_scheduler(optimizer, config.train, total_steps)
    monitor = TrainMonitor(output_dir, config.train.logging_steps, total_steps, config.monitor.console, state.is_main)
    return Trainer(model, optimizer, scheduler, data, monitor, state, config.train), tokenizer


def run(config) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("llmtune").setLevel(logging.INFO)
    state = ParallelState.initialize()
    try:
        trainer, tokenizer = build_trainer(config, state)
        trainer.train()
        if config.checkpoint.export_hf:
            export_hf(trainer.model, tokenizer, Path(config.train.output_dir) / "hf", state)
    finally:
        state.close()
