"""This rank's data: the DataManager hands out optimizer steps of micro-batches and saves and restores
its position; Validation gives this rank's share of the validation (or the test) split. build_data makes them.

Map-style data (StepSampler): the order of an epoch is a seeded permutation of the whole dataset
(file order with data.shuffle off), the same for every layout. Optimizer step k of an epoch
consumes samples perm[k*B:(k+1)*B] (B the global batch) whatever the number of ranks, micro-batch
size or accumulation steps, and the position saved as (epoch, step in epoch) resumes on any
data-parallel size at the exact next sample.

Streaming data: each data-parallel rank reads its own shard of the stream, so the order depends
on the data-parallel size, and a resume must keep it.

A torch DataLoader reads and collates the micro-batches, in data.num_workers processes besides the training one
(training and validation; a stream always in the training process). The sampler runs in the training process and
DataLoader hands the batches out in the sampler's order, so the workers change when a batch is made, never which.
"""

import hashlib
import itertools
import json
import logging
import math
from dataclasses import replace
from functools import partial

import datasets
from datasets.distributed import split_dataset_by_node
import torch
from torch.utils.data import DataLoader, Sampler

from llmtune.data import images
from llmtune.data.build import build_stream, load_or_build, load_or_build_stream_held_out
from llmtune.data.collate import collate, pad_token_id
from llmtune.data.preference import PairLimits, two_sequence_rows
from llmtune.errors import UserError
from llmtune.tasks.registry import PROMPTS, SCORE_HEAD, TASKS

log = logging.getLogger(__name__)


def dataset_fingerprint(dataset: datasets.Dataset | None) -> str:
    """What tells built datasets apart without reading them whole: the number of rows, the columns, and the first,
    middle and last rows (the cache's key would not do: it holds the files' modification times, which differ
    between nodes that hold the same data)."""
    if dataset is None:
        return "none"
    rows = [dataset[i] for i in sorted({0, len(dataset) // 2, len(dataset) - 1})] if len(dataset) else []
    summary = json.dumps([len(dataset), dataset.column_names, rows], default=str)
    return hashlib.sha256(summary.encode()).hexdigest()[:16]


class Validation:
    """This rank's share of the validation split in micro-batches, and when an evaluation is due. Without
    validation data it is never due (a run without validation has this do-nothing one)."""

    def __init__(self, dataset: datasets.Dataset | None, batch_size: int, collate_fn, data_cfg, dp_size: int,
                 dp_rank: int, train_cfg, cuda: bool = False):
        self.dataset = dataset
        self.collate = collate_fn
        self.eval_steps, self.eval_epochs = train_cfg.eval_steps, train_cfg.eval_epochs
        if dataset is not None:
            # Made once, so that persistent workers serve every evaluation.
            self.loader = loader(dataset, data_cfg, cuda, batch_size=batch_size, collate_fn=self.collate,
                                 sampler=range(dp_rank, len(dataset), dp_size))
            count = math.ceil(math.ceil(len(dataset) / dp_size) / batch_size)
            self.count = min(count, train_cfg.max_eval_steps or count)

    @property
    def fingerprint(self) -> str:
        return dataset_fingerprint(self.dataset)

    def due(self, step: int, last: bool, finished_epoch: int | None = None) -> bool:
        """Every eval_steps steps (when > 0), at the end of every eval_epochs-th epoch (finished_epoch: the epoch this
        step ended, counted from 0) and at the run's last step."""
        if self.dataset is None:
            return False
        every_epochs = self.eval_epochs > 0 and finished_epoch is not None and (finished_epoch + 1) % self.eval_epochs == 0
        return last or every_epochs or (self.eval_steps > 0 and step % self.eval_steps == 0)

    def batches(self):
        """This rank's share of the validation set (every D-th row) in micro-batches, the first max_eval_steps of
        them when that is set.

        Every rank yields the same number of batches, so FSDP's collectives stay in step: a rank
        whose share has run out yields a batch that counts nothing (MicroBatch.emptied).
        """
        given = 0
        for batch in self.loader:
            if given == self.count:  # max_eval_steps
                break
            given += 1
            yield batch
        for _ in range(self.count - given):
            yield self.collate([self.dataset[0]]).emptied()


class StepSampler(Sampler[int]):
    """This rank's samples of an epoch, from a given optimizer step on.

    The epoch's order is a permutation of the dataset seeded by seed and epoch (file order without
    shuffling), the same on every layout, cut into global batches of micro x G x D samples. Each global
    batch is cut in turn into its G x D micro-batches of consecutive samples, and data-parallel rank r
    takes the r-th run of G of them. So a micro-batch holds the same samples whether G micro-batches of
    a step run on one rank or on G ranks, and their gradients are summed in the same floating-point
    additions either way.
    """

    def __init__(self, size: int, micro_batch: int, accumulation: int, dp_size: int, dp_rank: int, shuffle: bool,
                 seed: int):
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.share = micro_batch * accumulation
        self.global_batch = self.share * dp_size
        self.offset = dp_rank * self.share
        self.steps_per_epoch = size // self.global_batch
        self.epoch = self.start_step = 0

    def __iter__(self):
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)) \
            if self.shuffle else torch.arange(self.size)
        for step in range(self.start_step, self.steps_per_epoch):
            start = step * self.global_batch + self.offset
            yield from order[start:start + self.share].tolist()

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.share


def loader(dataset, data_cfg, cuda: bool, **kwargs) -> DataLoader:
    """A DataLoader with the recipe's workers, and a random generator of its own. Each iterator it opens draws a
    seed from that generator, by default the global one: a resumed run opens its epoch after the RNG state was
    restored, an uninterrupted run before its first step, and dropout would then draw different numbers after a
    resume.

    Memory is pinned only for batches bound for a CUDA device (cuda): without one pinning has no use, and torch
    warns at every iterator. Without workers prefetch_factor and persistent_workers keep their defaults, as torch
    requires (DataConfig.problems refuses others).

    Worker processes end with the run: when the run lets its data go (the iterator shuts its workers down), else
    when the process ends through process_exit, whose exit handlers include multiprocessing's, which terminates
    daemonic children (DataLoader's workers are). A process killed outright leaves them to DataLoader's watchdog,
    which ends a worker seconds after its parent is gone (it looks every 5 seconds).
    """
    return DataLoader(dataset, generator=torch.Generator(), num_workers=data_cfg.num_workers,
                      pin_memory=data_cfg.pin_memory and cuda, prefetch_factor=data_cfg.prefetch_factor,
                      persistent_workers=data_cfg.persistent_workers, **kwargs)


class DataManager:
    """The optimizer steps of a map-style dataset, each `accumulation` micro-batches of `micro_batch` samples on each
    of dp_size ranks, made by `collate_fn`; each batch handed to `repeat` optimizer steps in a row (grpo's round of
    prompts, trained over several steps)."""

    def __init__(self, dataset: datasets.Dataset, data_cfg, micro_batch: int, accumulation: int, dp_size: int,
                 dp_rank: int, seed: int, collate_fn, cuda: bool = False, repeat: int = 1):
        self.accumulation, self.repeat = accumulation, repeat
        self.given = repeat  # the steps the current batch was handed to (repeat: it is done)
        self._current = None
        self.sampler = StepSampler(len(dataset), micro_batch, self.accumulation, dp_size, dp_rank, data_cfg.shuffle,
                                   seed)
        self.loader = loader(dataset, data_cfg, cuda, batch_size=micro_batch, sampler=self.sampler,
                             collate_fn=collate_fn)
        self.steps_per_epoch = self.sampler.steps_per_epoch
        self.global_batch = self.sampler.global_batch
        self.epoch = 0
        self.step_in_epoch = 0
        self._batches = None
        if self.steps_per_epoch == 0:
            raise UserError(f"data: {len(dataset)} samples do not fill one optimizer step of "
                            f"{self.global_batch} samples (per_device_train_batch_size x "
                            "gradient_accumulation_steps x data-parallel ranks); add data or lower the batch size")

    @property
    def fingerprint(self) -> str:
        return dataset_fingerprint(self.loader.dataset)

    def total_steps(self, train_cfg) -> int:
        if train_cfg.max_steps > 0:
            return train_cfg.max_steps
        return math.ceil(train_cfg.num_train_epochs * self.steps_per_epoch * self.repeat)

    def steps(self, count: int):
        """Yield (epoch, micro-batches of one optimizer step) `count` times, from the saved position on.

        An epoch's last samples that do not fill a whole step are skipped, so every step has the
        same global batch on every layout.
        """
        for _ in range(count):
            if self._current is None or self.given == self.repeat:
                self.given %= self.repeat  # a resume inside a batch's steps reads the batch again (load_state_dict)
                if self.step_in_epoch == self.steps_per_epoch:
                    self.epoch, self.step_in_epoch = self.epoch + 1, 0
                if self.step_in_epoch == 0 or self._batches is None:
                    self.sampler.epoch, self.sampler.start_step = self.epoch, self.step_in_epoch
                    self._batches = iter(self.loader)
                self._current = [next(self._batches) for _ in range(self.accumulation)]
                self.step_in_epoch += 1
            self.given += 1
            yield self.epoch, self._current

    @property
    def epoch_done(self) -> bool:
        return self.step_in_epoch == self.steps_per_epoch and self.given == self.repeat

    @property
    def progress(self) -> float:
        """Epochs done, fractional, as the HF Trainer logs `epoch`: 1.5 is halfway through the second epoch."""
        steps = self.step_in_epoch * self.repeat - (self.repeat - self.given if self.step_in_epoch else 0)
        return self.epoch + steps / (self.steps_per_epoch * self.repeat)

    def state_dict(self) -> dict:
        """The position in samples, so that a resume with another split of the same global batch continues; with
        repeat, also the steps the current batch was handed to."""
        state = {"epoch": self.epoch, "samples_in_epoch": self.step_in_epoch * self.global_batch}
        return {**state, "given": self.given} if self.repeat > 1 else state

    def load_state_dict(self, state: dict) -> None:
        steps, rest = divmod(state["samples_in_epoch"], self.global_batch)
        if rest:
            raise UserError(f"checkpoint: {state['samples_in_epoch']} samples of epoch {state['epoch']} were consumed, "
                            f"not a whole number of global batches of {self.global_batch}; resume with the global "
                            "batch size of the checkpoint")
        self.epoch, self.step_in_epoch = state["epoch"], steps
        self.given = state.get("given", self.repeat)
        if self.given < self.repeat:  # inside a batch's steps: it is read again, and handed to the rest of them
            self.step_in_epoch -= 1
        self._batches = self._current = None


class StreamingDataManager:
    """The same interface over an iterable dataset. The ranks agree at every step that each still
    has a full step of data, and start the next epoch together when one has not. The position is
    (epoch, step in epoch), the same on every rank: a resume re-opens the epoch's stream and skips
    the samples already consumed, which is exact (the shuffle buffer is seeded by seed and epoch)
    at the cost of reading them again."""

    def __init__(self, dataset: datasets.IterableDataset, data_cfg, train_cfg, pad_id: int, state):
        self.state = state
        self.data_cfg = data_cfg
        self.micro_batch = train_cfg.per_device_train_batch_size
        self.accumulation = train_cfg.gradient_accumulation_steps
        self.global_batch = self.micro_batch * self.accumulation * state.dp_size
        stream = split_dataset_by_node(dataset, rank=state.dp_rank, world_size=state.dp_size)
        if data_cfg.shuffle:
            stream = stream.shuffle(seed=train_cfg.seed, buffer_size=data_cfg.shuffle_buffer)
        self.stream = stream
        self.collate = partial(collate, pad_id=pad_id, document_mask=data_cfg.document_mask)
        self.epoch = 0
        self.step_in_epoch = 0
        self._batches = None

    def total_steps(self, train_cfg) -> int:
        return train_cfg.max_steps

    def _open_epoch(self):
        consumed = self.step_in_epoch * self.accumulation * self.micro_batch
        stream = self.stream.skip(consumed) if consumed else self.stream
        # skip() returns a new dataset whose epoch must be set again for the same shuffle.
        stream.set_epoch(self.epoch)
        return iter(loader(stream, self.data_cfg, self.state.device.type == "cuda", batch_size=self.micro_batch,
                           drop_last=True, collate_fn=self.collate))

    def steps(self, count: int):
        given = 0
        while given < count:
            if self._batches is None:
                self._batches = self._open_epoch()
            micro_batches = list(itertools.islice(self._batches, self.accumulation))
            if not self.state.all_agree(len(micro_batches) == self.accumulation):
                if self.step_in_epoch == 0:
                    raise UserError("data: a whole pass over the stream gave no full optimizer step on every rank; "
                                    "add data or lower the batch size")
                self.epoch, self.step_in_epoch, self._batches = self.epoch + 1, 0, None
                continue
            self.step_in_epoch += 1
            given += 1
            yield self.epoch, micro_batches

    epoch_done = False  # a stream's epoch ends only when it runs dry
    # Reading a stream's first rows would fill its shuffle buffer: its sources and settings are the recipe's, which
    # the ranks compare anyway.
    fingerprint = "stream"

    @property
    def progress(self) -> float:
        """The passes over the stream begun before this one: its length, and so the fraction, is not known."""
        return float(self.epoch)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "dp_size": self.state.dp_size}

    def load_state_dict(self, state: dict) -> None:
        if state["dp_size"] != self.state.dp_size:
            raise UserError(f"checkpoint: a stream is sharded by data-parallel rank; resume it on {state['dp_size']} "
                            f"data-parallel ranks, not {self.state.dp_size}")
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
        self._batches = None


def build_data(config, tokenizer, state, annotate=None,
               share_prefixes: bool = False) -> tuple[DataManager | StreamingDataManager, Validation, Validation]:
    """This rank's training data, validation and test split, from the recipe's data section. annotate(splits,
    collate) -> splits: columns added to the built splits ({"train", "val", "test"} -> dataset or None) before they
    are handed out, given the collate that makes their micro-batches (the task's objective: a precomputed reference's
    log-probabilities). share_prefixes: rows of two sequences leave out the second's beginning that the first holds
    (collate.share_prefix; the objective's shares_prefixes)."""
    data_cfg, train_cfg = config.data, config.train
    pad_id = pad_token_id(tokenizer)
    cuda = state.device.type == "cuda"
    # A stream never holds rows of two sequences (config.py refuses data.streaming for the preference tasks).
    pairs = two_sequence_rows(config.task)
    rows_collate = partial(collate, pad_id=pad_id, document_mask=data_cfg.document_mask, two_sequences=pairs,
                           scored=TASKS[config.task].head == SCORE_HEAD,
                           pack=pairs and data_cfg.packing, share_prefixes=share_prefixes,
                           blank_image=image_inputs.blank() if (image_inputs := images.of(tokenizer)) else None)
    if data_cfg.streaming:
        stream = build_stream(config.task, data_cfg, tokenizer, train_cfg.seed)
        data = StreamingDataManager(stream, data_cfg, train_cfg, pad_id, state)
        val, test = load_or_build_stream_held_out(config.task, data_cfg, tokenizer, train_cfg.seed, state) \
            if data_cfg.has_validation_sources() or data_cfg.has_test_sources() else (None, None)
        for split, name in ((val, "val"), (test, "test")):
            if split is not None and state.is_main:
                log.info("data: %d samples from data.%s_files / data.%s_datasets", len(split), name, name)
    else:
        train, val, test, stats = load_or_build(config.task, data_cfg, tokenizer, train_cfg.seed,
                                                train_cfg.per_device_train_batch_size, state, PairLimits.of(config))
        if state.is_main:
            log.info("data: %s", stats.summary())
        if annotate is not None:
            # One unit a row, unpacked: the hook reads its values back by row.
            splits = annotate({"train": train, "val": val, "test": test}, partial(rows_collate, pack=False))
            train, val, test = splits["train"], splits["val"], splits["test"]
        data = DataManager(train, data_cfg, train_cfg.per_device_train_batch_size,
                           train_cfg.gradient_accumulation_steps, state.dp_size, state.dp_rank, train_cfg.seed,
                           rows_collate, cuda) if TASKS[config.task].rows != PROMPTS else \
            DataManager(train, data_cfg, config.grpo.round_prompts(train_cfg, state.dp_size), 1, 1, 0,
                        train_cfg.seed, list, cuda, config.grpo.round_steps(train_cfg, state.dp_size)
                        * config.grpo.num_iterations)

    def held_out(split, cfg) -> Validation:
        return Validation(split, train_cfg.per_device_eval_batch_size, rows_collate, data_cfg, state.dp_size,
                          state.dp_rank, cfg, cuda)

    # The test split is read whole, once: max_eval_steps bounds the evaluations during training.
    return data, held_out(val, train_cfg), held_out(test, replace(train_cfg, max_eval_steps=0))
