"""The HF Trainer side of benchmarks/throughput.py: the benchmark's model, tokens, optimizer and steps trained by
transformers' Trainer, in one process, as the Trainer trains on CPU.

- Model: the same config, seeded, fp32 weights; `bf16` in the contender's settings is the Trainer's own switch
  (on CPU: autocast over the fp32 weights). Its cache is switched off: training never reads it.
- Data: pt, the documents + EOS cut into blocks of the benchmark's length (plain_fsdp_loop.blocks), stacked by
  default_data_collator (equal rows, no padding); sft, the samples as written, in the Trainer's default random
  order, each batch padded to its longest by DataCollatorForSeq2Seq (pads: label -100, attention mask 0).
- Optimizer: the Trainer's default, fused AdamW, as llmtune's; the same learning rate, no weight decay,
  clipping at 1.0. No evaluation, no saving, no logging, no progress bar.
- Timing: the benchmark's StepClock, lapped at every on_step_end, from on_train_begin for the first step. The
  Trainer fetches a step's batches before on_step_begin, so timing begin to end would leave out the loading that
  llmtune's step includes; end to end, each lap is one whole turn of the Trainer's loop.
"""

import json
from collections import deque

import datasets
import torch
from plain_fsdp_loop import blocks
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer,
                          TrainerCallback, TrainingArguments, default_data_collator)

SEED = 42


class StepTimer(TrainerCallback):
    """Laps `clock` at the end of every optimizer step with the size of that step's batch (counting's: by default its
    real tokens)."""

    def __init__(self, clock, batch_tokens: deque):
        self.clock, self.batch_tokens = clock, batch_tokens

    def on_train_begin(self, args, state, control, **kwargs):
        self.clock.start()

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.lap(self.batch_tokens.popleft())


def real_tokens(row: dict) -> int:
    return len(row["input_ids"])


def counting(collate, batch_tokens: deque, size=real_tokens):
    """`collate` that queues the size of each batch it makes: the sum of `size` over its rows (by default their real,
    non-pad, tokens). A queue, because accelerate's loader collates one batch ahead of the step that trains on it;
    with one micro-batch per step, the step that ends takes the oldest count."""
    def collate_and_count(rows: list[dict]) -> dict:
        batch_tokens.append(sum(size(row) for row in rows))
        return collate(rows)

    return collate_and_count


def training_data(workload, tokenizer) -> tuple[datasets.Dataset, object]:
    """(rows, collator) of the workload's task."""
    if workload.task == "pt":
        rows = blocks(tokenizer, workload.data, workload.seq).tolist()
        return datasets.Dataset.from_dict({"input_ids": rows, "labels": rows}), default_data_collator
    with open(workload.data) as f:
        samples = [json.loads(line) for line in f]
    # Pads after the sample, as training pads (the demo tokenizer pads on the left, for generation): the same cost,
    # and the real tokens keep their positions.
    tokenizer.padding_side = "right"
    return datasets.Dataset.from_list(samples), DataCollatorForSeq2Seq(tokenizer)


def train_hf(workload, settings: dict, clock, output_dir: str) -> None:
    """warmup + steps optimizer steps of the HF Trainer, each lapped on `clock`; `settings`: TrainingArguments
    that this contender sets (bf16)."""
    config = AutoConfig.from_pretrained(workload.model)
    config.use_cache = False
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    train, collate = training_data(workload, AutoTokenizer.from_pretrained(workload.tokenizer))
    batch_tokens = deque()
    args = TrainingArguments(
        output_dir=output_dir, use_cpu=True, seed=SEED, max_steps=workload.warmup + workload.steps,
        per_device_train_batch_size=workload.batch, learning_rate=workload.learning_rate,
        eval_strategy="no", save_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True,
        **settings)
    Trainer(model=model, args=args, train_dataset=train, data_collator=counting(collate, batch_tokens),
            callbacks=[StepTimer(clock, batch_tokens)]).train()
