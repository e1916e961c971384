"""DataManager: build the tokenized dataset once, then hand out optimizer steps of micro-batches.

Data order is a seeded permutation of the whole dataset, the same for every layout; the sampler
of data-parallel rank r takes every D-th sample of it. So optimizer step k consumes samples
perm[k*B:(k+1)*B] (B the global batch) whatever the number of ranks, micro-batch size or
accumulation steps are.
"""

import math
from functools import partial

import datasets
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from llmtune.data.collate import collate
from llmtune.data.pretrain import pack_documents
from llmtune.data.sft import detect_format, tokenize_examples
from llmtune.data.sources import load_rows
from llmtune.errors import UserError


def build_dataset(task: str, data_cfg, files: list[str], tokenizer) -> datasets.Dataset:
    rows = load_rows(files)
    if task == "pt":
        if data_cfg.format not in ("auto", "text"):
            raise UserError(f"data.format: pt reads raw text; set data.format to text or auto, not {data_cfg.format!r}")
        return pack_documents(rows, tokenizer, data_cfg.max_seq_len, files)
    fmt = detect_format(rows, data_cfg.format, files)
    return tokenize_examples(rows, tokenizer, fmt, data_cfg.max_seq_len)


class DataManager:
    def __init__(self, dataset: datasets.Dataset, data_cfg, train_cfg, pad_id: int, dp_size: int, dp_rank: int):
        self.micro_batches_per_step = train_cfg.gradient_accumulation_steps
        global_batch = train_cfg.per_device_train_batch_size * self.micro_batches_per_step * dp_size
        self.sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=data_cfg.shuffle,
                                          seed=train_cfg.seed, drop_last=True)
        self.loader = StatefulDataLoader(dataset, batch_size=train_cfg.per_device_train_batch_size,
                                         sampler=self.sampler, collate_fn=partial(collate, pad_id=pad_id),
                                         drop_last=True)
        self.steps_per_epoch = len(self.loader) // self.micro_batches_per_step
        if self.steps_per_epoch == 0:
            raise UserError(f"data: {len(dataset)} samples do not fill one optimizer step of {global_batch} samples "
                            "(per_device_train_batch_size x gradient_accumulation_steps x data-parallel ranks); "
                            "add data or lower the batch size")

    def total_steps(self, train_cfg) -> int:
        if train_cfg.max_steps > 0:
            return train_cfg.max_steps
        return math.ceil(train_cfg.num_train_epochs * self.steps_per_epoch)

    def steps(self, total_steps: int):
        """Yield (epoch, micro-batches of one optimizer step) until `total_steps` steps are given.

        An epoch's last micro-batches that do not fill a whole step are skipped, so every step has
        the same global batch size on every layout.
        """
        given, epoch = 0, 0
        while given < total_steps:
            self.sampler.set_epoch(epoch)
            batches = iter(self.loader)
            for _ in range(self.steps_per_epoch):
                yield epoch, [next(batches) for _ in range(self.micro_batches_per_step)]
                given += 1
                if given == total_steps:
                    return
            epoch += 1
