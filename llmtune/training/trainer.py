"""Trainer: the loop (optimizer steps of micro-batches) with global token counting, a non-finite guard
agreed by every rank, evaluation, and the callbacks' events (training/callbacks.py)."""

import logging
import math
import signal
import time
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Partial

from llmtune.data.collate import MicroBatch
from llmtune.errors import Preempted, TrainingStopped
from llmtune.model.build import reshard
from llmtune.model.loss import labelled_positions
from llmtune.monitor.metrics import StepRecord
from llmtune.training.callbacks import TrainerControl, hf_log_entries
from llmtune.training.loss_scale import LossScale
from llmtune.training.stop_signals import StopSignals

log = logging.getLogger(__name__)


class Trainer:
    """Every part is always there and decides for itself when it acts: validation when an evaluation is due
    (never without validation data), the evaluation by generation when one is due (never without its prompts), the
    monitor when a record is due, the checkpoints when a save is due
    (never when the recipe saves none), the features on every micro-batch (none: unchanged), the callbacks at
    their events (none: nothing happens there), the test split once training has ended (none: no test). A
    callback's control adds to what is due: an evaluation, a record, a save, the end of training."""

    def __init__(self, model, objective, optimizer, scheduler, data, validation, monitor, checkpoints, features, state,
                 train_cfg, total_steps: int, callbacks, ema, test, generation):
        self.model = model
        self.objective = objective
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.data = data
        self.validation = validation
        self.monitor = monitor
        self.checkpoints = checkpoints
        self.features = features
        self.state = state
        self.cfg = train_cfg
        self.total_steps = total_steps
        self.callbacks = callbacks
        self.ema = ema
        self.loss_scale = LossScale(train_cfg.fp16)
        self.test = test
        self.generation = generation
        self.step = 0
        self.skipped_in_a_row = 0
        self.open_epoch: int | None = None  # the epoch whose on_epoch_begin ran and whose on_epoch_end did not
        self.last_eval: dict = {}  # the newest evaluation's metrics, with its step

    def built(self) -> None:
        """The trainer is wired, before a resume: the callbacks' on_init_end."""
        self._event("on_init_end")

    def _event(self, name: str, **kwargs) -> None:
        """The callbacks' `name` event, then every rank's agreement on what they asked."""
        self._tell_callbacks()
        self.callbacks(name, **kwargs)
        self.callbacks.agree(self.state)

    def _tell_callbacks(self) -> None:
        """The run's position, as the callbacks' state gives it."""
        told, best = self.callbacks.state, self.checkpoints.best
        told.step, told.epoch = self.step, self.data.progress
        told.best_metric, told.best_step = (best["value"], best["step"]) if best else (None, None)

    def train(self) -> None:
        self.monitor.begin(self.step)
        self.generation.begin(self.step)
        try:
            self.model.train()
            if self.step == 0:  # the moving averages start from the weights training starts from (init_from's)
                self.ema.restart()
            steps = self.data.steps(self.total_steps - self.step)
            self._event("on_train_begin")
            if self.cfg.eval_on_start and self.step == 0:
                metrics = self._evaluate()
                self.monitor.evaluation(0, 0.0, metrics, self._on_log)
            with StopSignals(self.cfg.save_on_signals) as signals:
                while self.step < self.total_steps and not self.callbacks.control.should_training_stop:
                    self.advance(steps, signals)
            if self.open_epoch is not None:  # training ends inside an epoch: it ends too, as in the HF Trainer
                self.callbacks("on_epoch_end")
            self.checkpoints.finish_pending()
            if self.step < self.total_steps and self.state.is_main:
                log.info("training stopped at step %d of %d: a callback set control.should_training_stop", self.step,
                         self.total_steps)
            self._event("on_train_end")
            self._test()
        finally:
            self.monitor.end()

    def stop_for(self, reason: str) -> None:
        """Save here (unless this step was just saved) and stop every rank with Preempted."""
        if self.checkpoints.saved_step != self.step:
            self._save({})
        self.checkpoints.finish_pending()
        raise Preempted(f"stopped by {reason} after step {self.step} of {self.total_steps}; saved "
                        f"{self.checkpoints.root / f'global_step_{self.step}'}")

    def advance(self, steps, signals: StopSignals) -> None:
        """One turn of the loop: the next optimizer step from `steps` (DataManager.steps), then its evaluation,
        record and checkpoint when they are due or a callback asks for them."""
        started = time.perf_counter()
        epoch, micro_batches = next(steps)
        data_wait = time.perf_counter() - started
        if epoch != self.open_epoch:
            if self.open_epoch is not None:  # a stream's epoch ends when the next begins
                self.callbacks("on_epoch_end")
            self.open_epoch = epoch
            self.callbacks("on_epoch_begin")
        self.callbacks.control = TrainerControl()
        step_inputs = self.prepare(self.objective.rollout(self.model, self.step, micro_batches,
                                                          lambda batch: self._prepared(batch)[0]))
        self.callbacks("on_step_begin")
        stats = self.train_step(step_inputs)
        stats.data_wait, stats.step_time = data_wait, time.perf_counter() - started
        self.step += 1
        self._tell_callbacks()
        self.callbacks("on_step_end")
        finished_epoch = epoch if self.data.epoch_done else None
        if finished_epoch is not None:  # before the epoch's evaluation and save, as the HF Trainer calls it
            self.open_epoch = None
            self.callbacks("on_epoch_end")
        signal_number = self.callbacks.agree(self.state, signals.number)
        control = self.callbacks.control
        stopping = self.skipped_in_a_row >= self.cfg.max_skipped_steps

        def saving() -> bool:
            # A stop saves too: the skipped steps left the weights at the last good state.
            final = self.step == self.total_steps or stopping or control.should_training_stop
            return control.should_save or self.checkpoints.due(self.step, self.data.epoch_done, epoch, final)

        last = self.step == self.total_steps
        validate = (self.validation.due(self.step, last, finished_epoch) or control.should_evaluate
                    or (saving() and self.checkpoints.evaluates_first(False) and self.validation.dataset is not None))
        generate = self.generation.due(self.step, last) or (
            (control.should_evaluate or (saving() and self.checkpoints.evaluates_first(True)))
            and self.generation.enabled)
        eval_metrics = self._evaluate(validate, generate) if validate or generate else None
        record = self.monitor.record(self.step, self.data.progress, stats, eval_metrics,
                                     force=control.should_log or (saving() and self.checkpoints.logs_first),
                                     on_log=self._on_log)
        if record is not None:
            self.callbacks.agree(self.state)
        if saving():
            self._save(record or {})
        if stopping:
            self.checkpoints.finish_pending()
            raise TrainingStopped(
                f"stopped at step {self.step}: {self.skipped_in_a_row} optimizer steps in a row had a non-finite "
                f"loss or gradient norm (train.max_skipped_steps={self.cfg.max_skipped_steps}); lower "
                "train.learning_rate, check the data, or train in fp32")
        if signal_number:
            self.stop_for(signal.Signals(signal_number).name)

    def _on_log(self, record: dict) -> None:
        # Into the log history before on_log, as the HF Trainer adds it: a callback's edit of the record reaches
        # metrics.jsonl, not the history.
        self.callbacks.state.log_history += hf_log_entries(record)
        self.callbacks("on_log", logs=record)

    def _evaluate(self, validate: bool = True, generate: bool = True) -> dict:
        """Evaluate (the validation's loss, the evaluation by generation, each where asked and the run has it), tell
        the callbacks (on_evaluate, then every rank's agreement) and keep the metrics."""
        metrics = {}
        if validate and self.validation.dataset is not None:
            metrics.update({f"eval_{name}": value for name, value in self.evaluate(self.validation).items()})
            for decay in self.ema.decays if self.cfg.eval_ema else ():
                with self.ema.swapped_in(decay):
                    metrics.update({f"eval_{name}_ema{self.ema.suffix(decay)}": value
                                    for name, value in self.evaluate(self.validation).items()})
        if generate and self.generation.enabled:
            metrics.update(self.generation.evaluate(self.model, self.step))
        self.last_eval = {"step": self.step, **metrics}
        self._event("on_evaluate", metrics=metrics)
        return metrics

    def _test(self) -> None:
        """The test split (data.test_files), once, with the final weights, as the HF Trainer's evaluate(test_dataset,
        metric_key_prefix="test") after train(): on_evaluate, then its own record at the last step."""
        if self.test.dataset is None:
            return
        metrics = {f"test_{name}": value for name, value in self.evaluate(self.test).items()}
        self._event("on_evaluate", metrics=metrics)
        self.monitor.evaluation(self.step, self.data.progress, metrics, self._on_log)

    def _save(self, metrics: dict) -> None:
        path = self.checkpoints.save(self.step, self.model, self.optimizer, self.state_dict(), metrics, self.last_eval,
                                     self.tensor_state())
        self._event("on_save", checkpoint=path)

    def state_dict(self) -> dict:
        """Everything besides model and optimizer that decides what comes next; plain data."""
        return {"step": self.step, "global_batch": self.data.global_batch, "skipped_in_a_row": self.skipped_in_a_row,
                "skipped_steps": self.monitor.skipped_steps, "data": self.data.state_dict(),
                "scheduler": self.scheduler.state_dict(), "features": self.features.state_dict(),
                "callbacks": self.callbacks.state_dict(), "loss_scale": self.loss_scale.state_dict(),
                "log_history": self.callbacks.state.log_history, "objective": self.objective.state_dict(),
                "monitor": self.monitor.state_dict()}

    def tensor_state(self) -> dict:
        """Sharded tensors besides model and optimizer that a checkpoint holds (DCP, loaded in place): the moving
        averages."""
        return {"ema": self.ema.state_dict()} if self.ema.decays else {}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.skipped_in_a_row = state["step"], state["skipped_in_a_row"]
        self.monitor.skipped_steps = state["skipped_steps"]
        self.monitor.load_state_dict(state.get("monitor", {}))
        self.data.load_state_dict(state["data"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.features.load_state_dict(state["features"])
        self.callbacks.load_state_dict(state.get("callbacks", []))  # none in checkpoints written before callbacks
        self.callbacks.state.log_history = state.get("log_history", [])  # none in those written before it
        self.last_eval = state.get("eval_metrics", {})
        self.loss_scale.load_state_dict(state.get("loss_scale", {}))
        self.objective.load_state_dict(state.get("objective", {}))  # none in checkpoints written before grpo
        if "ema" in state.get("missing_tensors", ()):
            if self.state.is_main:
                log.warning("checkpoint: it holds no moving averages (written without train.ema_decay); they start "
                            "from its weights")
            self.ema.restart()

    def loaded(self, path) -> None:
        """The checkpoint at `path` has been restored: the callbacks' on_load."""
        self._event("on_load", checkpoint=path)

    def prepare(self, micro_batches: list[MicroBatch]) -> "StepInputs":
        """An optimizer step's micro-batches as the model takes them, on the device, and their counts. The features'
        transform (context parallelism's slice, the documents' layout) and the objective's counts run on the host
        copies the collator made, before anything goes to the device: what they read there waits for nothing, where
        the same reads of device tensors would each wait for the device to catch up (docs/training.md)."""
        batches, counts = [], []
        for batch in micro_batches:
            prepared, batch_counts = self._prepared(batch)
            batches.append(prepared)
            counts.append(batch_counts)
        return StepInputs(batches, torch.tensor(counts, dtype=torch.float64).sum(dim=0))

    def _prepared(self, batch: MicroBatch) -> tuple[MicroBatch, list[float]]:
        """One micro-batch transformed and counted on the host, then on the device: (its MicroBatch, whose inputs
        are the model's keyword arguments, the labelled tokens' positions among them, and its counts)."""
        inputs = self.features.transform(batch.inputs)
        inputs = {**inputs, "labelled": labelled_positions(inputs["shift_labels"])}
        counts = self.objective.local_counts(inputs, batch, self.state.cp_rank)
        return MicroBatch(inputs, batch.num_tokens, batch.sequences).to(self.state.device), counts

    def train_step(self, step: "StepInputs") -> StepRecord:
        """One optimizer step.

        The objective's loss terms are sums (over tokens, pairs, ...), each divided by its count over the whole step
        on every rank, counted before the first forward (tasks/objective.py). FSDP averages gradients over its N
        ranks, so the loss is also multiplied by N: the gradient is then exactly that of the step's mean, whatever
        the split over ranks, micro-batches and accumulation steps. A non-finite loss or gradient norm (both global,
        so every rank sees the same) skips the update on every rank.

        The host reads the step's numbers once, all together (its counts, loss and metric sums, gradient norm),
        after the last backward: the skip needs them, and they are the record's.
        """
        device, objective, batches = self.state.device, self.objective, step.batches
        # From the host: queued on the device's stream, nothing waited for.
        totals = self.state.all_reduce_sum(step.counts.to(device, non_blocking=True))
        weights = (objective.weights(totals) * (self.state.fsdp_group_size * self.loss_scale.scale)).float()
        sums = torch.zeros(sum(objective.sizes()), device=device, dtype=torch.float64)
        with self.features.around_step(self.model):
            objective.begin(self.model, ((batch.inputs, batch) for batch in batches))
            for i, batch in enumerate(batches):
                self.state.accumulate(self.model, last=i == len(batches) - 1)
                terms = objective.terms(self.model, batch.inputs, batch)
                (terms.loss * weights).sum().backward()
                sums += torch.cat([terms.loss.detach(), terms.metrics]).double()
                if i < len(batches) - 1:
                    self.callbacks("on_substep_end")
        sums = self.state.all_reduce_sum(sums)
        feature_metrics = self.features.step_metrics(self.state)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.loss_scale.unscale(trained)
        norm = clip_gradients(trained, self.cfg.max_grad_norm)
        numbers = torch.cat([totals, sums, norm.reshape(1)]).tolist()
        counts, grad_norm = numbers[:len(totals)], numbers[-1]
        values = objective.summary(numbers[len(totals):-1], counts)
        mean_loss = values.pop("loss")
        self.callbacks("on_pre_optimizer_step", grad_norm=grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        finite = math.isfinite(mean_loss) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.ema.update()
            self.callbacks("on_optimizer_step")
        self.loss_scale.update(finite)
        self.skipped_in_a_row = 0 if finite else self.skipped_in_a_row + self.loss_scale.counts_skip()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        count = dict(zip(objective.names(), counts))
        return StepRecord(loss=mean_loss, lr=lr, grad_norm=grad_norm, label_tokens=int(count["label_tokens"]),
                          input_tokens=int(count["input_tokens"]), samples=int(count[objective.samples]),
                          step_time=0.0, data_wait=0.0, skipped=not finite, features={**values, **feature_metrics},
                          loss_scale=self.loss_scale.scale if self.loss_scale.enabled else None)

    def evaluate(self, held_out) -> dict[str, float]:
        """The loss and metrics of a held-out split (the validation or the test one), as the objective defines them
        for a training step, over all its batches on all ranks."""
        objective, device = self.objective, self.state.device
        self.model.eval()
        counts = torch.zeros(len(objective.names()), dtype=torch.float64)
        sums = torch.zeros(sum(objective.sizes()), device=device, dtype=torch.float64)
        with torch.no_grad():
            objective.begin(self.model, ((batch.inputs, batch) for batch, _ in map(self._prepared, held_out.batches())))
            for batch in held_out.batches():
                batch, batch_counts = self._prepared(batch)
                counts += torch.tensor(batch_counts, dtype=torch.float64)
                terms = objective.terms(self.model, batch.inputs, batch)
                sums += torch.cat([terms.loss, terms.metrics]).double()
        reshard(self.model)
        self.model.train()
        numbers = self.state.all_reduce_sum(torch.cat([counts.to(device), sums])).tolist()
        return objective.summary(numbers[len(counts):], numbers[:len(counts)])


@dataclass
class StepInputs:
    """An optimizer step's micro-batches on the device (Trainer.prepare), each with the model's inputs as its inputs,
    and their counts summed on the host (float64, in Objective.names' order)."""
    batches: list[MicroBatch]
    counts: torch.Tensor


def clip_gradients(parameters: list, max_norm: float) -> torch.Tensor:
    """The global L2 norm of the gradients (a float64 scalar on their device, not read), before clipping them to
    max_norm (0: no clipping).

    The squares are summed row by row in fp32, then the rows' sums in fp64: FSDP2 shards dim 0, so a row is whole
    on one rank and its fp32 sum is the same on any number of ranks, where a whole gradient summed in fp32 comes out
    differently rounded from its shards' sums, and a clipping factor differing in its last bits would make the
    updates depend on the number of ranks. Across rows, fp64 leaves a difference far below what fp32 can tell, and
    the factor comes out the same. (Each element squared in fp64 does the same at 20x the time: 19 ms against 1 ms a
    step for a 32k x 256 embedding's gradient on CPU.)

    Sharded gradients are taken layout by layout (device mesh and placements), one collective each: DTensors of
    different device meshes (expert parallelism's experts beside the dense weights) cannot enter one operation.
    Each rank sums its own shards as plain tensors and the layout's sum is made whole once: the same sums in the same
    order as DTensor's operations would take them, without their dispatch on every parameter (about 5 operations a
    parameter, each tens of microseconds: milliseconds a step).
    """
    groups = _by_layout(parameters)
    total = torch.stack([_layout_square_sum(group) for group in groups.values()]).sum().sqrt()
    if max_norm:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _square_sum(grad: torch.Tensor) -> torch.Tensor:
    """The sum of the gradient's squares, fp64: each row's norm in fp32 (a row: dim 0's slice, which FSDP2 never
    splits), squared and added in fp64."""
    rows = grad.flatten(1) if grad.dim() > 1 else grad.unsqueeze(1)
    return torch.linalg.vector_norm(rows, dim=1).double().square().sum()


def _layout_square_sum(group: list) -> torch.Tensor:
    """The sum of the squares of the gradients of `group` (one layout), over every rank: the local shards' sums
    added, then summed over the mesh's sharded dimensions (a partial sum there, whatever form the shards take; a
    replicated dimension holds the same sum on each of its ranks)."""
    grad = group[0].grad
    local = torch.stack([_square_sum(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
                         for p in group]).sum()
    if not isinstance(grad, DTensor):
        return local
    placements = [placement if placement.is_replicate() else Partial() for placement in grad.placements]
    return DTensor.from_local(local, grad.device_mesh, placements, run_check=False).full_tensor()


def _by_layout(parameters: list) -> dict:
    """The parameters that have a gradient, by their gradient's device mesh and placements (None: not sharded), in
    their order."""
    groups = {}
    for p in parameters:
        if p.grad is not None:
            layout = (p.grad.device_mesh, tuple(p.grad.placements)) if isinstance(p.grad, DTensor) else None
            groups.setdefault(layout, []).append(p)
    return groups
