"""What each process runs: wire the parts from the config, top to bottom, train, export."""

import logging
from pathlib import Path

import torch
from transformers import enable_full_determinism, set_seed

from llmtune.checkpoint.hf_export import export_trained
from llmtune.checkpoint.manager import CheckpointManager
from llmtune.data.manager import build_data
from llmtune.data.templates import apply_recipe_template
from llmtune.features.registry import enabled_features
from llmtune.model import build_model, check_vocab, load_model_config, load_tokenizer
from llmtune.monitor import TrainMonitor, flops_per_token
from llmtune.optim import build_optimizer, build_scheduler
from llmtune.parallel import ParallelState
from llmtune.trainer import Trainer


def build_trainer(config, state: ParallelState) -> tuple[Trainer, object]:
    """(trainer, tokenizer) for this rank, resumed when the recipe says so; rank 0 writes the resolved config."""
    output_dir = Path(config.train.output_dir)
    if state.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        config.write(output_dir / "config.yaml")
    if config.train.deterministic:
        # transformers' own switch (as the HF Trainer's full_determinism): deterministic algorithms, and the
        # cuBLAS workspace setting without which they raise on CUDA.
        enable_full_determinism(config.train.seed)
    # The same seed on every rank: identical initial weights and data order.
    set_seed(config.train.seed)
    tokenizer = load_tokenizer(config.model)
    # sft needs a chat template; a pt recipe may name one too, for the exported model to carry.
    if config.task == "sft" or config.data.chat_template:
        apply_recipe_template(tokenizer, config.data.chat_template)
    data, validation = build_data(config, tokenizer, state)
    model_config = load_model_config(config.model)
    check_vocab(model_config, tokenizer)
    features = enabled_features(config)
    model = build_model(model_config, config.model, config.train, state, features)
    # From here on ranks draw different random numbers (dropout), each from its own stream.
    torch.manual_seed(config.train.seed + state.rank)
    optimizer = build_optimizer(model, config.train)
    total_steps = data.total_steps(config.train)
    scheduler = build_scheduler(optimizer, config.train, total_steps)
    monitor = TrainMonitor(output_dir, config.monitor, config.train.logging_steps, total_steps,
                           flops_per_token(model.hf_model, config.data.max_seq_len), state.world_size, state.rank)
    checkpoints = CheckpointManager(output_dir, config.checkpoint, state, config, tokenizer, model.hf_model)
    trainer = Trainer(model, optimizer, scheduler, data, validation, monitor, checkpoints, features, state,
                      config.train, total_steps)
    checkpoints.restore(trainer)
    return trainer, tokenizer


def run(config) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("llmtune").setLevel(logging.INFO)
    state = ParallelState.initialize(config.parallel.cp_size)
    try:
        trainer, tokenizer = build_trainer(config, state)
        trainer.train()
        if config.checkpoint.export_hf:
            export_trained(trainer.model.hf_model, tokenizer, Path(config.train.output_dir) / "hf", config.checkpoint,
                           state, trainer.features)
    finally:
        state.close()
