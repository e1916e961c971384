"""What each process runs: wire the parts from the config, train, export."""

import json
import logging
from pathlib import Path

import torch
from transformers import set_seed

from llmtune.checkpoint.hf_export import export_trained
from llmtune.checkpoint.manager import CheckpointManager, resolve_resume
from llmtune.checkpoint.validate import check_complete
from llmtune.data.manager import build_data
from llmtune.data.templates import apply_recipe_template
from llmtune.features.ulysses import SequenceShard, register_attention
from llmtune.model import build_model, check_vocab, load_model_config, load_tokenizer
from llmtune.monitor import TrainMonitor, flops_per_token, make_profiler
from llmtune.optim import build_optimizer, build_scheduler
from llmtune.parallel import ParallelState
from llmtune.trainer import Trainer


def keep_metrics_up_to(path: Path, step: int) -> None:
    """A resumed run logs again the steps after its checkpoint: drop the records the crash left of them."""
    if path.is_file():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))


def build_trainer(config, state: ParallelState) -> tuple[Trainer, object]:
    """(trainer, tokenizer) for this rank, resumed when the recipe says so; rank 0 writes the resolved config."""
    output_dir = Path(config.train.output_dir)
    # Decided on rank 0 and broadcast: a check that differed between ranks would hang the next collective.
    resume = [resolve_resume(config.checkpoint.resume_from_checkpoint, output_dir) if state.is_main else None]
    torch.distributed.broadcast_object_list(resume, src=0)
    resume = resume[0]
    if state.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        config.write(output_dir / "config.yaml")
    if config.train.deterministic:
        torch.use_deterministic_algorithms(True)
    # The same seed on every rank: identical initial weights and data order.
    set_seed(config.train.seed)
    tokenizer = load_tokenizer(config.model)
    # sft needs a chat template; a pt recipe may name one too, for the exported model to carry.
    if config.task == "sft" or config.data.chat_template:
        apply_recipe_template(tokenizer, config.data.chat_template)
    data, validation = build_data(config, tokenizer, state)
    model_config = load_model_config(config.model)
    check_vocab(model_config, tokenizer)
    attention, shard = config.model.attn_implementation, None
    if state.cp_size > 1:
        attention = register_attention(state.cp_group, config.model.attn_implementation)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        shard = SequenceShard(state.cp_size, state.cp_rank, pad_id)
    model = build_model(config.model, config.train, state.fsdp_mesh, state.device, attention)
    if resume:
        check_complete(resume)
    # From here on ranks draw different random numbers (dropout), each from its own stream.
    torch.manual_seed(config.train.seed + state.rank)
    optimizer = build_optimizer(model, config.train)
    total_steps = data.total_steps(config.train)
    scheduler = build_scheduler(optimizer, config.train, total_steps)
    monitor = TrainMonitor(output_dir, config.monitor, config.train.logging_steps, total_steps,
                           flops_per_token(model_config, config.data.max_seq_len), state.world_size, state.is_main)
    profiler = make_profiler(config.monitor.profile_steps, output_dir, state.rank)
    ckpt = config.checkpoint
    checkpoints = CheckpointManager(output_dir, ckpt, state, config, tokenizer, model.hf_model) \
        if ckpt.save_steps or ckpt.save_epochs or resume else None
    trainer = Trainer(model, optimizer, scheduler, data, monitor, state, config.train, validation, profiler,
                      checkpoints, shard)
    if resume:
        trainer.load_state_dict(checkpoints.load(resume, model, optimizer))
    if state.is_main:
        if resume:
            keep_metrics_up_to(output_dir / "metrics.jsonl", trainer.step)
        else:
            (output_dir / "metrics.jsonl").unlink(missing_ok=True)
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
                           state)
    finally:
        state.close()
