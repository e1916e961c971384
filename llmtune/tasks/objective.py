"""What a task trains: the Objective the Trainer calls for every micro-batch, whatever the task.

Every number an objective gives is a SUM that adds up over micro-batches and ranks, so that the step's value does
not depend on how its micro-batches are laid out:
- counts: before the first forward, each micro-batch's counts (the trainer's own: labelled tokens, input tokens and
  rows, then the objective's `counts`) are summed over the step's micro-batches and all-reduced over every rank: the
  step's totals.
- terms: each micro-batch's loss terms, each a sum its divisor (one of the counts) turns into a mean of the whole
  step: loss = sum_i terms[i] / totals[divisors[i]]. The trainer backpropagates that, times the number of ranks FSDP
  averages gradients over; logged, the terms are all-reduced and divided the same way.
- metrics: sums of the step's values (detached), each divided by its own count once they are all-reduced.

Under context parallelism a count or term is a sum over each rank's slice of the tokens, or, for a value of a whole
sequence, counted once over the cp peers (ParallelState.cp_rank == 0): see tasks/preference.py.
"""

from dataclasses import dataclass
from importlib import import_module

import torch

from llmtune.model.loss import IGNORE_INDEX
from llmtune.tasks.registry import TASKS

# The counts every task has, counted by trainer_counts; an objective's own follow them.
BASE_COUNTS = ("label_tokens", "input_tokens", "rows")


@dataclass
class Terms:
    """One micro-batch's share of the step: loss terms (differentiable) and metric sums (detached)."""
    loss: torch.Tensor  # [len(Objective.divisors)]
    metrics: torch.Tensor  # [len(Objective.metrics)]


class Objective:
    """A task's loss and metrics (subclasses per task; the registry names them). Class attributes:
    counts: the objective's own counts, after BASE_COUNTS; divisors: the count that divides each loss term;
    metrics: (name, count that divides it) of each metric; samples: the count metrics.jsonl's samples_per_s reads,
    and unit: its name there (pairs_per_s); shown: the metrics the console's lines show after the loss (those TRL's
    trainer of the task is read by)."""

    counts: tuple[str, ...] = ()
    divisors: tuple[str, ...] = ("label_tokens",)
    metrics: tuple[tuple[str, str], ...] = ()
    samples: str = "rows"
    unit: str = "samples"
    shown: tuple[str, ...] = ()
    rows_called: str | None = None  # the start banner's name of the data's rows, where not derived from unit
    # Whether the rows of two sequences leave out the second's beginning that the first holds (data/collate.py's
    # share_prefix): for an objective that reads no token of that beginning in the second, with a model that computes
    # such rows as it computes each sequence alone (Features.keep_shared_prefixes).
    shares_prefixes: bool = False

    def global_batch_words(self, global_batch: int) -> str | None:
        """The start banner's words for a step's global batch of `global_batch` data rows, where the objective has
        its own (grpo: prompts sampled into completions); None: the rows in the objective's unit."""
        return None

    @classmethod
    def check(cls, config) -> None:
        """Before any process starts (run/preflight.py): what the objective can refuse of the recipe then, as a
        UserError (grpo: its reward functions imported). The default refuses nothing."""

    def count(self, inputs: dict, batch, cp_rank: int) -> list[float]:
        """This micro-batch's values of `counts` (inputs: as the model gets them, after the features' transform)."""
        return []

    def begin(self, model, micro_batches) -> None:
        """Before the first loss of a step, or of a held-out split: `micro_batches`, an iterable of (inputs, batch),
        for an objective whose loss needs a value of all of them (KTO's reference point). The default reads
        nothing (an evaluation's iterable is then never run)."""

    def rollout(self, model, step: int, micro_batches: list, prepare) -> list:
        """The micro-batches of optimizer step `step` (0 for the first) as the data gave them -> those the loss
        reads, before anything is counted: grpo's prompts -> their completions, sampled from `model`.
        prepare(micro-batch) gives one as the model takes it, on the device. The default hands them on."""
        return micro_batches

    def state_dict(self) -> dict:
        """What a resume needs of the objective (plain data, in trainer_state.json): grpo's round being trained."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's state_dict()."""

    def terms(self, model, inputs: dict, batch) -> Terms:
        raise NotImplementedError

    def annotate(self, splits: dict, collate) -> dict:
        """The built splits (data/manager.build_data's hook), with any column the objective reads from its
        micro-batches added; `collate` makes micro-batches of their rows."""
        return splits

    def metric_names(self) -> tuple[str, ...]:
        """The names of the metrics `summary` gives besides the loss: the task's own in metrics.jsonl."""
        return tuple(name for name, _ in self.metrics)

    def sizes(self) -> list[int]:
        """The lengths of Terms.loss and Terms.metrics."""
        return [len(self.divisors), len(self.metrics)]

    def names(self) -> tuple[str, ...]:
        return BASE_COUNTS + self.counts

    def local_counts(self, inputs: dict, batch, cp_rank: int) -> list[float]:
        """Every count of one micro-batch on this rank: the labelled tokens of its slice, and its input tokens and rows
        once per cp group (cp peers hold the same rows), then the objective's."""
        rows_here = cp_rank == 0
        return [float((inputs["shift_labels"] != IGNORE_INDEX).sum()), float(batch.num_tokens * rows_here),
                float(len(inputs["input_ids"]) * rows_here), *self.count(inputs, batch, cp_rank)]

    def weights(self, totals: torch.Tensor) -> torch.Tensor:
        """The factor of each loss term: 1 / its divisor's step total (at least 1: a step without any adds 0)."""
        names = self.names()
        return torch.stack([1.0 / totals[names.index(d)].clamp(min=1.0) for d in self.divisors])

    def summary(self, sums: list[float], totals: list[float]) -> dict[str, float]:
        """{"loss": the step's (or a held-out split's) loss, then each metric}, from all-reduced sums (the loss terms',
        then the metrics', as Terms holds them) and totals, read on the host. A metric whose count is 0 (KTO's
        desirable examples, in a step that has none) is left out, not logged as 0."""
        names = self.names()
        loss_sums, metric_sums = sums[:len(self.divisors)], sums[len(self.divisors):]
        values = {"loss": sum(value * (1.0 / max(totals[names.index(divisor)], 1.0))
                              for value, divisor in zip(loss_sums, self.divisors))}
        for (name, divisor), value in zip(self.metrics, metric_sums):
            count = totals[names.index(divisor)]
            if count:
                values[name] = value / count
        return values


def objective_class(task: str) -> type[Objective]:
    """The registry's objective class of `task`, imported."""
    module, _, name = TASKS[task].objective.partition(":")
    return getattr(import_module(module), name)


def build_objective(config, **parts) -> Objective:
    """The objective of config.task, built by its `build(config, **parts)`: the parts of the run it may need (the
    model, features, state, ...), passed by the worker."""
    return objective_class(config.task).build(config, **parts)
