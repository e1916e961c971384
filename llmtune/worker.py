"""What each process runs: wire the parts from the config, train, export."""

import logging
from pathlib import Path

from transformers import set_seed

from llmtune.checkpoint.hf_export import export_hf
from llmtune.data.manager import DataManager, build_dataset
from llmtune.model import CausalLMForTraining, check_vocab, load_hf_model, load_tokenizer, shard_model
from llmtune.monitor import TrainMonitor
from llmtune.optim import build_optimizer, build_scheduler
from llmtune.parallel import ParallelState
from llmtune.trainer import Trainer


def build_trainer(config, files: list[str], state: ParallelState) -> tuple[Trainer, object]:
    """(trainer, tokenizer) for this rank; rank 0 writes the resolved config first."""
    output_dir = Path(config.train.output_dir)
    if state.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        config.write(output_dir / "config.yaml")
        (output_dir / "metrics.jsonl").unlink(missing_ok=True)
    set_seed(config.train.seed)
    tokenizer = load_tokenizer(config.model)
    # Rank 0 tokenizes first and fills the datasets cache; the others then read it.
    if not state.is_main:
        state.barrier()
    dataset = build_dataset(config.task, config.data, files, tokenizer)
    if state.is_main:
        state.barrier()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    data = DataManager(dataset, config.data, config.train, pad_id, state.dp_size, state.dp_rank)
    hf_model = load_hf_model(config.model, config.train.seed)
    check_vocab(hf_model, tokenizer, "model.tokenizer")
    model = shard_model(CausalLMForTraining(hf_model), state.mesh, config.train.bf16)
    optimizer = build_optimizer(model, config.train)
    total_steps = data.total_steps(config.train)
    scheduler = build_scheduler(optimizer, config.train, total_steps)
    monitor = TrainMonitor(output_dir, config.train.logging_steps, total_steps, config.monitor.console, state.is_main)
    return Trainer(model, optimizer, scheduler, data, monitor, state, config.train), tokenizer


def run(config, files: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    state = ParallelState.initialize()
    try:
        trainer, tokenizer = build_trainer(config, files, state)
        trainer.train()
        if config.checkpoint.export_hf:
            export_hf(trainer.model, tokenizer, Path(config.train.output_dir) / "hf", state)
    finally:
        state.close()
