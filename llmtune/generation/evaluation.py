"""Evaluation by generation (eval_generation): a part of the Trainer like the validation, deciding for itself when it
is due. The held-out prompts' completions from the model being trained (generation/engine.py, every rank taking its
share), scored on rank 0 by the recipe's scorers; their means are the record's eval_gen/<scorer> values, which
callbacks and checkpoint.save_best read like any eval metric; every completion and its scores go to
output_dir/generations.jsonl."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from llmtune.config import GENERATION_METRICS
from llmtune.data.files import resolve_data_files
from llmtune.data.prompts import prompt_ids
from llmtune.errors import UserError
from llmtune.generation.engine import Sampling, generate
from llmtune.generation.prompts import completion_value, read_prompt_rows, stop_ids
from llmtune.generation.scorers import answer_scorers, load_scorers, score
from llmtune.model.build import generation_defaults
from llmtune.monitor.metrics import restart_records

log = logging.getLogger(__name__)
GENERATIONS = "generations.jsonl"
SCORERS_KEY = "eval_generation.scorers"


def prompt_rows(cfg) -> list[dict]:
    """eval_generation's prompt rows, every file's in order, the first max_samples of them."""
    rows = []
    for path in resolve_data_files(cfg.files, "eval_generation.files"):
        rows += read_prompt_rows(path)
    return rows[:cfg.max_samples] if cfg.max_samples is not None else rows


def scorers_of(cfg) -> list:
    """eval_generation's scorers, loaded."""
    return load_scorers(cfg.scorers, cfg.answer_column, cfg.regex, SCORERS_KEY)


def check_eval_generation(cfg, has_chat_template: bool) -> None:
    """Before any process starts: the prompt files read, the scorers imported, the answer column in every row, a
    chat template for prompts given as messages."""
    if not cfg.files:
        return
    rows = prompt_rows(cfg)
    scorers_of(cfg)
    if answer_scorers(cfg.scorers):
        lacking = next((i for i, row in enumerate(rows) if cfg.answer_column not in row), None)
        if lacking is not None:
            raise UserError(f"eval_generation.answer_column: prompt row {lacking} of eval_generation.files has no "
                            f"{cfg.answer_column!r} column, which {', '.join(answer_scorers(cfg.scorers))} compare "
                            "with; name the column that holds the answers")
    if not has_chat_template and any(isinstance(row["prompt"], list) for row in rows):
        raise UserError("eval_generation.files: prompts given as messages need a chat template, and the tokenizer has "
                        "none; set data.chat_template, or give the prompts as strings")


class GenerationEval:
    """The evaluation by generation of a run; with no eval_generation.files, never due."""

    def __init__(self, cfg, eval_steps: int, tokenizer, model, state, seed: int, output_dir: Path):
        self.cfg, self.tokenizer, self.state, self.seed = cfg, tokenizer, state, seed
        self.every = cfg.steps if cfg.steps is not None else eval_steps
        self.path = output_dir / GENERATIONS
        self.rows = prompt_rows(cfg) if cfg.files else []
        self.prompts = [prompt_ids(tokenizer, row["prompt"]) for row in self.rows]
        defaults = generation_defaults(model.hf_model)
        self.sampling = Sampling.resolve(cfg.sampling(), defaults)
        self.eos_ids = stop_ids(tokenizer, defaults)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.scorers = scorers_of(cfg) if self.rows else []

    @property
    def enabled(self) -> bool:
        return bool(self.rows)

    def due(self, step: int, last: bool) -> bool:
        """Every `steps` steps (when > 0) and at the run's last step."""
        return self.enabled and (last or (self.every > 0 and step % self.every == 0))

    def begin(self, step: int) -> None:
        """Training starts after `step`: generations.jsonl starts fresh, or keeps the evaluations up to the
        checkpoint's step (those of later steps are made again, the same)."""
        if self.state.is_main:
            restart_records(self.path, step)

    def evaluate(self, model, step: int) -> dict[str, float]:
        """The eval_gen/<scorer> means of the completions the model makes now, the same on every rank."""
        completions = generate(model, self.prompts, self.sampling, eos_ids=self.eos_ids, pad_id=self.pad_id,
                               device=self.state.device, seed=self.seed, step=step, batch_size=self.cfg.batch_size,
                               state=self.state)
        outcome = None
        if self.state.is_main:
            try:
                outcome = self._scored(completions, step)
            except UserError as err:
                outcome = str(err)
        outcome = self.state.broadcast_object(outcome)
        if isinstance(outcome, str):
            raise UserError(outcome)
        return outcome

    def _scored(self, completions, step: int) -> dict[str, float]:
        """Rank 0: the scores' means, and every completion with its scores appended to generations.jsonl."""
        rows = [self.rows[c.prompt] for c in completions]
        texts = [self.tokenizer.decode(c.ids, skip_special_tokens=True) for c in completions]
        values = [completion_value(row["prompt"], text) for row, text in zip(rows, texts)]
        names = dict.fromkeys(key for row in self.rows for key in row if key != "prompt")
        columns = {key: [row.get(key) for row in rows] for key in names}
        scores = score(self.scorers, [row["prompt"] for row in rows], values, [c.ids for c in completions], columns,
                       SCORERS_KEY, f"the completions of step {step}")
        with self.path.open("a", encoding="utf-8") as f:
            for i, (row, completion, value) in enumerate(zip(rows, completions, values)):
                record = {"step": step, **row, "completion": value, "completion_ids": completion.ids,
                          "truncated": completion.truncated,
                          **{name: scored[i] for name, scored in scores.items()}}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        means = {}
        for name, scored in scores.items():
            given = [v for v in scored if v is not None]
            if given:  # a scorer that scored nothing (None for every completion) logs no mean
                means[f"{GENERATION_METRICS}{name}"] = sum(given) / len(given)
        return means
