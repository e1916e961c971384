"""CheckpointManager: atomic DCP checkpoints of model, optimizer and trainer state; resume; retention.

    <output_dir>/checkpoints/global_step_<N>/   DCP shards of model + optimizer, .metadata
                                 extra_state/   rank_<r>.pt: that rank's RNG states (plain data)
                                 trainer_state.json, config.yaml, hf_config/ (config + tokenizer)
    <output_dir>/checkpoints/latest             names the newest complete checkpoint
    <output_dir>/checkpoints/best/              checkpoint.save_best: the best one so far (checkpoint/best.py)

A checkpoint is written under `.global_step_<N>.partial`, renamed once every rank has finished,
and only then named by `latest`: a folder called global_step_<N> is complete by construction,
and nothing else is ever loaded or counted.
"""

import json
import logging
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from llmtune.atomic import write_text
from llmtune.checkpoint.best import BEST, better, keep_as_best
from llmtune.checkpoint.folders import LATEST, complete_checkpoints
from llmtune.checkpoint.manifest import files_written_by, write_manifest
from llmtune.checkpoint.validate import check_base, check_complete, check_model_matches, init_from_plan
from llmtune.config import GENERATION_METRICS, RESUME_BEST, RESUME_NEWEST
from llmtune.errors import TrainingStopped, UserError
from llmtune.model.build import generation_defaults
from llmtune.model.multimodal import save_processor

log = logging.getLogger(__name__)


def resolve_resume(value: str | None, output_dir: Path, checksums: bool) -> Path | None:
    """The checkpoint to resume from, checked (validate.check_complete): a path, `best` (checkpoints/best), or `auto` /
    `latest`: the newest complete checkpoint of output_dir's run (never one newer than its `latest` pointer) that
    passes its checks, each one that fails said in the log (None, also said, when there is none yet)."""
    if not value:
        return None
    if value == RESUME_BEST:
        best = output_dir / "checkpoints" / BEST
        if not best.is_dir():
            raise UserError(f"checkpoint.resume_from_checkpoint=best: {best} does not exist (checkpoint.save_best "
                            "keeps it, once a save has been ranked); resume from auto or a checkpoint folder")
        check_complete(best, checksums)
        return best
    if value not in RESUME_NEWEST:
        check_complete(Path(value), checksums)
        return Path(value)
    candidates = complete_checkpoints(output_dir / "checkpoints")
    for candidate in reversed(candidates):
        try:
            check_complete(candidate, checksums)
            return candidate
        except UserError as err:
            log.warning("checkpoint: skipping %s, which fails its check: %s", candidate.name, err)
    if candidates:
        # Starting fresh here would train over a run whose checkpoints a person may still repair.
        raise UserError(f"checkpoint.resume_from_checkpoint={value}: every checkpoint in {output_dir / 'checkpoints'} "
                        "fails its check (see above); name one to resume from, or move the folder away to start fresh")
    log.warning("checkpoint: resume_from_checkpoint=%s, but %s has no checkpoint yet; starting fresh", value,
                output_dir / "checkpoints")
    return None


def rng_state() -> dict:
    numpy_state = np.random.get_state()
    return {"python": random.getstate(), "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trained_state(model, model_state: dict) -> dict:
    """The model's state without its frozen parameters, which the run re-reads from its base model: a checkpoint of
    an adapter run holds the adapters alone. (check_model_matches checks the names that are loaded.)"""
    frozen = {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}
    return {name: value for name, value in model_state.items() if name not in frozen}


def load_weights(path: Path, model, model_state: dict) -> None:
    """The checkpoint's values of `model_state`'s tensors (the model's, or some of them) into `model`, on every rank,
    resharded by DCP from however many ranks saved them; optimizer and trainer state untouched."""
    content = {"model": model_state}
    dcp.load(content, checkpoint_id=str(path))
    set_model_state_dict(model, content["model"], options=StateDictOptions(strict=False))


def _cause(err: BaseException) -> str:
    """One line on why a write failed; DCP's own exception carries each failed rank's."""
    if isinstance(err, CheckpointException):
        rank, (cause, _) = next(iter(err.failures.items()))
        return f"rank {rank}: {type(cause).__name__}: {cause}"
    return f"{type(err).__name__}: {err}"


class CheckpointManager:
    """Every run has one: it saves when the recipe's schedule says so (never, when it names none) and
    restores what the recipe's resume_from_checkpoint names."""

    def __init__(self, output_dir: Path, checkpoint_cfg, state, config, tokenizer, hf_model, base: dict):
        """base: for a run with frozen weights (adapters, frozen modules), whose checkpoints hold only the trained
        parameters, the weights it starts from (model.base_record), recorded in each checkpoint: it resumes only on
        the same base. None for a run that trains every weight."""
        self.output_dir = output_dir
        self.root = output_dir / "checkpoints"
        self.cfg = checkpoint_cfg
        self.state = state
        self.config = config
        self.tokenizer = tokenizer
        self.hf_model = hf_model
        self.base = base
        self.pending = None  # (future, partial folder, final folder) of an asynchronous save
        # Asynchronous saves run their collectives on a group of their own, beside training's.
        self.group = state.background_group() if checkpoint_cfg.async_save else None
        self.stall_seconds: list[float] = []
        self.saved_step: int | None = None  # the step of the last save begun
        self.best: dict | None = None  # save_best: {"metric", "value", "step"} of checkpoints/best

    def evaluates_first(self, generation: bool) -> bool:
        """A save asks for an evaluation at its step (unless the step had one): checkpoint.eval_on_save, or save_best
        ranking by a metric of that evaluation, which must describe the weights saved. generation: the evaluation by
        generation (its eval_gen/ metrics), else the validation (the other eval_ ones)."""
        metric = self.cfg.best_metric
        ranked = metric.startswith(GENERATION_METRICS) if generation else \
            metric.startswith("eval_") and not metric.startswith(GENERATION_METRICS)
        return self.cfg.eval_on_save or (self.cfg.save_best and ranked)

    @property
    def logs_first(self) -> bool:
        """A save asks for the step's record (save_best ranks by one of its values)."""
        return self.cfg.save_best

    def _ranks_best(self, step: int, metrics: dict) -> bool:
        """save_best: whether the checkpoint of `step`, whose logged values are `metrics` (the same on every rank),
        is the best so far (then recorded as such)."""
        if not self.cfg.save_best:
            return False
        value = metrics.get(self.cfg.best_metric)
        if value is None:
            if self.state.is_main:
                log.warning("checkpoint: step %d logged no %s (checkpoint.best_metric), so its checkpoint is not "
                            "ranked; name a value metrics.jsonl records", step, self.cfg.best_metric)
            return False
        if not better(value, self.best and self.best["value"], self.cfg.greater()):
            return False
        self.best = {"metric": self.cfg.best_metric, "value": value, "step": step}
        return True

    def due(self, step: int, epoch_done: bool, epoch: int, final: bool) -> bool:
        """final: the run ends after this step (its last step, or a stop), which saves whenever saving is on."""
        every_steps = self.cfg.save_steps > 0 and step % self.cfg.save_steps == 0
        every_epochs = self.cfg.save_epochs > 0 and epoch_done and (epoch + 1) % self.cfg.save_epochs == 0
        return every_steps or every_epochs or (final and (self.cfg.save_steps > 0 or self.cfg.save_epochs > 0))

    def save(self, step: int, model, optimizer, trainer_state: dict, metrics: dict | None = None,
             eval_metrics: dict | None = None, tensors: dict | None = None) -> Path:
        """metrics: what the step logged (save_best ranks by them); eval_metrics: the newest evaluation's, with its
        step. Both are recorded in trainer_state.json. tensors: sharded state beside model and optimizer, by name
        (Trainer.tensor_state). Returns the checkpoint's folder (being written, when asynchronous)."""
        started = time.perf_counter()
        self.finish_pending()
        self.saved_step = step
        best = self._ranks_best(step, metrics or {})
        trainer_state = {**trainer_state, "metrics": metrics or {}, "eval_metrics": eval_metrics or {},
                         "best": self.best}
        final = self.root / f"global_step_{step}"
        partial = self.root / f".global_step_{step}.partial"
        if self.cfg.save_only_model:
            content = {"model": trained_state(model, get_model_state_dict(model))}
        else:
            model_state, optim_state = get_state_dict(model, optimizer)
            content = {"model": trained_state(model, model_state), "optim": optim_state}
        content.update(tensors or {})
        self._written(partial, lambda: self._make_folder(partial))
        self._written(partial, lambda: self._write_states(partial, trainer_state))
        if self.cfg.async_save:
            future = dcp.async_save(content, checkpoint_id=str(partial), process_group=self.group)
            self.pending = (future, partial, final, best)
        else:
            self._written(partial, lambda: dcp.save(content, checkpoint_id=str(partial)))
            self._publish(partial, final, best)
        self.stall_seconds.append(time.perf_counter() - started)
        return final

    def _make_folder(self, partial: Path) -> None:
        if self.state.is_main:
            shutil.rmtree(partial, ignore_errors=True)
            (partial / "extra_state").mkdir(parents=True)

    def _write_states(self, partial: Path, trainer_state: dict) -> None:
        """Everything but the DCP shards: each rank's RNG state; on rank 0 the trainer state, the recipe, and what an
        offline export needs to rebuild the HF folder from this checkpoint alone."""
        torch.save(rng_state(), partial / "extra_state" / f"rank_{self.state.rank}.pt")
        if self.state.is_main:
            (partial / "trainer_state.json").write_text(json.dumps(
                {**trainer_state, "world_size": self.state.world_size, "task": self.config.task,
                 "save_only_model": self.cfg.save_only_model, "base": self.base}, indent=1))
            self.config.write(partial / "config.yaml")
            self.hf_model.config.save_pretrained(partial / "hf_config")
            if (defaults := generation_defaults(self.hf_model)) is not None:
                defaults.save_pretrained(partial / "hf_config")
            self.tokenizer.save_pretrained(partial / "hf_config")
            save_processor(self.tokenizer, partial / "hf_config")

    def _written(self, partial: Path, write) -> None:
        """write() on every rank, then every rank learns whether it failed anywhere (a full disk, a folder that
        cannot be written); that is also the barrier after it. On a failure every rank stops, the partial folder
        removed and the previous checkpoint, untouched, still the one to resume from."""
        error = None
        try:
            write()
        except (OSError, CheckpointException) as err:
            error = _cause(err)
        error = self.state.first_error(error)
        if error:
            if self.state.is_main:
                shutil.rmtree(partial, ignore_errors=True)
            kept = complete_checkpoints(self.root)
            raise TrainingStopped(
                f"checkpoint: could not write {partial} ({error}); it was removed and "
                f"{kept[-1] if kept else 'no earlier checkpoint'} is the one to resume from; free space or fix the "
                "folder, then run again with checkpoint.resume_from_checkpoint=auto (and "
                "train.overwrite_output_dir=false where the recipe sets it true)")

    def finish_pending(self) -> None:
        """Wait for an asynchronous save, then publish it."""
        if self.pending is None:
            return
        future, partial, final, best = self.pending
        self.pending = None
        self._written(partial, future.result)
        self._publish(partial, final, best)

    def _publish(self, partial: Path, final: Path, best: bool) -> None:
        """Every rank has written: the manifest of what each wrote, then rename, point `latest` at it (and best, when
        it is), and drop what retention allows."""
        written = files_written_by(partial, self.state.rank)
        self._written(partial, lambda: self._swap_in(partial, final, self.state.gather_object(written), best))
        if self.state.is_main:
            self._retain(final)
            log.info("checkpoint: saved %s", final)
        self.state.barrier()

    def _swap_in(self, partial: Path, final: Path, per_rank: list | None, best: bool) -> None:
        if not self.state.is_main:
            return
        write_manifest(partial, per_rank)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        write_text(self.root / LATEST, final.name)
        if best:
            keep_as_best(final)
            log.info("checkpoint: %s is the best so far (%s %.6g): kept as %s", final.name, self.best["metric"],
                     self.best["value"], self.root / BEST)

    def _retain(self, newest: Path) -> None:
        limit = self.cfg.save_total_limit
        if not limit:
            return
        complete = complete_checkpoints(self.root)
        for old in complete[:max(0, len(complete) - limit)]:
            if old != newest:
                shutil.rmtree(old)

    def restore(self, trainer) -> None:
        """Resume `trainer` (model, optimizer and trainer state) from the checkpoint the recipe names; else, with
        model.init_from, give the model that checkpoint's weights (the run still starts at step 0); or leave it
        fresh. The checkpoint is chosen and checked on rank 0 alone, and every rank learns the choice or the
        error: a check whose answer differed between ranks would hang the next collective."""
        init_from = self.config.model.init_from
        model_state = trained_state(trainer.model, get_model_state_dict(trainer.model)) if init_from else None
        chosen = plan = error = None
        if self.state.is_main:
            try:
                chosen = resolve_resume(self.cfg.resume_from_checkpoint, self.output_dir, self.cfg.verify_checksums)
                if chosen:
                    check_base(chosen, self.base)
                elif init_from:
                    shapes = {name: list(tensor.shape) for name, tensor in model_state.items()}
                    # The preflight (run/preflight.check_init_from) has read every file's checksum already, when
                    # asked: sizes are enough here.
                    plan = init_from_plan(Path(init_from), self.base, shapes, self.config.model.strict_load, False)
            except UserError as err:
                error = str(err)
        chosen, plan, error = self.state.broadcast_object((chosen, plan, error))
        if error:
            raise UserError(error)
        if plan:
            self._initialise(Path(init_from), trainer.model, model_state, *plan)
        if chosen:
            if init_from and self.state.is_main:
                log.info("checkpoint: model.init_from is not read: the run goes on from %s", chosen)
            trainer_state = self._load(chosen, trainer.model, trainer.optimizer, trainer.tensor_state())
            saved_batch = trainer_state.get("global_batch")  # checkpoints written before it was recorded lack it
            if self.state.is_main and saved_batch and saved_batch != trainer.data.global_batch:
                # Said before the data position is restored, which refuses a position inside the new batch.
                log.warning("checkpoint: the global batch changes from %d samples per optimizer step (the "
                            "checkpoint's, on %d ranks) to %d on %d ranks; set train.global_batch_size: %d to keep it",
                            saved_batch, trainer_state["world_size"], trainer.data.global_batch,
                            self.state.world_size, saved_batch)
            self.best = trainer_state.get("best")
            trainer.load_state_dict(trainer_state)
            trainer.loaded(chosen)

    def load_best(self, model) -> int | None:
        """checkpoint.export_from: best: the model's weights become checkpoints/best's, on every rank; returns its
        step, or None (said) when no checkpoint was ranked best, which leaves the last weights."""
        if self.best is None:
            if self.state.is_main:
                log.warning("checkpoint: export_from is best, but no saved checkpoint was ranked (no %s logged at a "
                            "save); exporting the last weights", self.cfg.best_metric)
            return None
        self.finish_pending()
        model_state = trained_state(model, get_model_state_dict(model))
        check_model_matches(self.root / BEST, model_state)
        load_weights(self.root / BEST, model, model_state)
        if self.state.is_main:
            log.info("checkpoint: exporting the best checkpoint's weights (step %d, %s %.6g)", self.best["step"],
                     self.best["metric"], self.best["value"])
        return self.best["step"]

    def _initialise(self, path: Path, model, model_state: dict, names: list[str], left_out: str) -> None:
        """model.init_from: the checkpoint's values of the tensors `names` into the model, resharded by DCP from
        however many ranks saved them. Nothing else of the checkpoint is read: optimizer, schedule, data position
        and RNG stay fresh."""
        if names:
            load_weights(path, model, {name: model_state[name] for name in names})
        if self.state.is_main:
            if left_out:
                log.warning("model.strict_load false: model.init_from %s left out %s; the model's tensors among them "
                            "keep the values the recipe's model gave them, the others are ignored", path, left_out)
            log.info("checkpoint: the model starts from the weights of %s (step 0, a fresh optimizer)", path)

    def _load(self, path: Path, model, optimizer, tensors: dict) -> dict:
        """Restore model, optimizer, `tensors` (Trainer.tensor_state, in place) and this rank's RNG; returns the trainer
        state to continue from, with `missing_tensors`: the names of `tensors` the checkpoint does not hold."""
        trainer_state = json.loads((path / "trainer_state.json").read_text())
        model_state, optim_state = get_state_dict(model, optimizer)
        model_state = trained_state(model, model_state)
        check_model_matches(path, model_state)
        content = {"model": model_state}
        if not trainer_state["save_only_model"]:
            content["optim"] = optim_state
        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        held = {name for name in tensors if any(key.startswith(f"{name}.") for key in saved)}
        content.update({name: tensors[name] for name in held})
        trainer_state["missing_tensors"] = sorted(tensors.keys() - held)
        dcp.load(content, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=content["model"],
                       optim_state_dict=content.get("optim", optim_state),
                       options=StateDictOptions(strict=False))
        if trainer_state["save_only_model"]:
            log.warning("checkpoint: %s holds the model only; the optimizer starts fresh", path)
        saved_world = trainer_state["world_size"]
        if saved_world == self.state.world_size:
            set_rng_state(torch.load(path / "extra_state" / f"rank_{self.state.rank}.pt", weights_only=True))
        elif self.state.is_main:
            log.warning("checkpoint: saved on %d ranks, resumed on %d: model, optimizer and data position carry "
                        "over; per-rank RNG states cannot and are reseeded", saved_world, self.state.world_size)
        log.info("checkpoint: resumed from %s at step %d", path, trainer_state["step"])
        return trainer_state
