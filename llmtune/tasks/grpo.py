"""grpo: online RL with group-relative advantages (GRPO, Shao et al. 2024, and its kin DAPO, Dr. GRPO and GSPO, as
TRL's GRPOTrainer computes them).

Each optimizer step is one generation round (`rollout`, before the step's counts):
1. The round's prompts (every rank is handed all of them, data/manager.py) are each sampled num_generations times by
   the policy as it is now, through the generation engine (generation/engine.py): each rank generates whole groups
   (every world-th prompt), every completion seeded by (seed, step, prompt, sample), so the completions do not depend
   on the layout or on a resume; every rank learns them all.
2. Rank 0 scores them with the reward functions and every rank learns the rewards (a reward function that fails stops
   every rank with its name); the advantages are computed from them on every rank alike (tasks/grpo_losses.py).
3. The round's completions, in (prompt, sample) order, are cut as the data of any other task is: data-parallel rank r
   takes the r-th run of per_device_train_batch_size x gradient_accumulation_steps of them, in micro-batches of
   per_device_train_batch_size consecutive completions, each micro-batch one packed row of its prompt + completion
   sequences (the documents kept apart as in every packed row), the completion's tokens labelled. A prompt is
   computed once for its completions in the micro-batch: the first follows it, each other is a branch of it (the
   prompt's last token, which predicts the completion's first, then its tokens) that attends to the prompt as it
   would alone, where the features' attention allows (Features.keep_shared_prefixes).

The loss of a micro-batch recomputes the completions' log-probabilities with the training forward at the sampling
temperature (the sampler's are not used: the ratio is then exactly 1 on the first iteration, as the old policy is the
policy). Per token t of completion s, with w the importance ratio (token: pi / pi_old; sequence, GSPO: the geometric
mean of its tokens') and A_s its advantage:

    loss_t = -min(w A_s, clip(w, 1 - epsilon, 1 + epsilon_high) A_s)

weighted by loss_type's token weight and summed over the step, divided by the step's completions or completion
tokens over every rank and micro-batch (tasks/grpo_losses.py), plus the features' terms over the labelled tokens.
Under context parallelism a sequence-level ratio is a function of the whole completion: its loss is computed per
completion from the cp peers' sums (tasks/preference.py's whole_sums), counted once.
"""

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from llmtune.data.collate import collate, pad_token_id
from llmtune.data.files import resolve_data_files
from llmtune.data.formats import PROMPT_ROW
from llmtune.errors import UserError
from llmtune.generation.engine import Sampling, generate
from llmtune.generation.prompts import completion_value, stop_ids
from llmtune.generation.scorers import load_scorers, score
from llmtune.model.build import reshard
from llmtune.model.loss import IGNORE_INDEX, model_inputs
from llmtune.monitor.metrics import restart_records
from llmtune.tasks.grpo_losses import (DIVISORS, advantages, combined_rewards, k3_kl, nanstd, token_losses,
                                       token_weights)
from llmtune.tasks.objective import Objective, Terms
from llmtune.tasks.preference import disable_dropout, whole_sums
from llmtune.tasks.reference import build_reference

COMPLETIONS = "completions.jsonl"
REWARD_FUNCS = "grpo.reward_funcs"


@dataclass
class Round:
    """A generation round, as a checkpoint holds it (plain data): the step it began at, its completions ([prompt,
    sample, token ids, truncated], in prompt then sample order), their advantages, the order its optimizer steps take
    them in, its metrics, and, for a round trained more than once, every completion's old log-probabilities (by
    completion: its labelled tokens' in order)."""
    step: int
    completions: list[list]
    advantages: list[float]
    order: list[int]
    values: dict[str, float]
    old: dict[int, list[float]] | None = None


class GRPO(Objective):
    # Its completion tokens are the labelled tokens every task counts (label_tokens).
    counts = ("completions",)
    samples = unit = "completions"
    shown = ("reward", "reward_std", "completions/mean_length")
    rows_called = "prompts"

    def __init__(self, cfg, state, tokenizer, generation_config, seed: int, output_dir: Path, batch_size: int,
                 document_mask: bool, logging_steps: int, round_steps: int = 1, reference=None,
                 shares_prompts: bool = False):
        self.cfg, self.state, self.tokenizer, self.seed, self.reference = cfg, state, tokenizer, seed, reference
        # A micro-batch's completions of one prompt share it: computed once, the others branches of the first.
        self.shares_prompts = shares_prompts
        self.divisors = (DIVISORS[cfg.loss_type], "label_tokens")
        clipped = "label_tokens" if cfg.importance_sampling_level == "token" else "completions"
        # TRL's names; kl where there is a KL term.
        self.metrics = (("entropy", "label_tokens"), ("clip_ratio/low_mean", clipped),
                        ("clip_ratio/high_mean", clipped), ("clip_ratio/region_mean", clipped),
                        *((("kl", "label_tokens"),) if reference is not None else ()))
        self.scorers = load_scorers(cfg.reward_funcs, cfg.answer_column, cfg.regex, REWARD_FUNCS)
        self.reward_weights = torch.tensor(cfg.reward_weights or [1.0] * len(self.scorers), dtype=torch.float64)
        self.sampling = Sampling(**cfg.sampling())
        self.eos_ids = stop_ids(tokenizer, generation_config)
        self.pad_id = pad_token_id(tokenizer)
        self.micro_batch, self.document_mask = batch_size, document_mask
        self.path, self.logging_steps, self.restarted = output_dir / COMPLETIONS, logging_steps, False
        # A round: round_steps optimizer steps (each a share of its completions), num_iterations times over.
        self.round_steps = round_steps
        self.steps_per_round = round_steps * cfg.num_iterations
        self.round: Round | None = None

    @classmethod
    def build(cls, config, local, model_config, model, features, state, tokenizer, **parts) -> "GRPO":
        if config.grpo.disable_dropout:
            disable_dropout(model.hf_model)
        reference = build_reference(config, local, model_config, model, features, state) \
            if config.grpo.needs_reference() else None
        return cls(config.grpo, state, tokenizer, model.hf_model.generation_config, config.train.seed,
                   Path(config.train.output_dir), config.train.per_device_train_batch_size, config.data.document_mask,
                   config.train.logging_steps, config.grpo.round_steps(config.train, state.dp_size), reference,
                   # Rows attended across their documents (data.document_mask false) would attend across branches too.
                   features.keep_shared_prefixes() and config.data.document_mask)

    @classmethod
    def check(cls, config) -> None:
        """The reward functions imported, and the first row of every local JSONL prompt file holding a `prompt`."""
        cfg = config.grpo
        load_scorers(cfg.reward_funcs, cfg.answer_column, cfg.regex, REWARD_FUNCS)
        for name in resolve_data_files(config.data.train_files, "data.train_files"):
            if Path(name).suffix != ".jsonl":
                continue  # read by datasets in the run, which names a row without a prompt as well
            with open(name, encoding="utf-8") as f:
                first = json.loads(next(line for line in f if line.strip()))
            if not isinstance(first, dict) or "prompt" not in first:
                raise UserError(f"data.train_files: {name}: line 1 has no 'prompt' column (columns: "
                                f"{', '.join(first) if isinstance(first, dict) else type(first).__name__}); grpo "
                                "reads TRL's prompt-only forms: a 'prompt' string or list of messages per row, the "
                                "other columns handed to the reward functions")

    def global_batch_words(self, global_batch: int) -> str:
        """A step's completions, and the round they come from: `global_batch` prompts, each sampled num_generations
        times, trained over round_steps optimizer steps, num_iterations times."""
        generations, completions = self.cfg.num_generations, global_batch * self.cfg.num_generations
        words = f"{completions // self.round_steps} completions (a round of {global_batch} prompts x {generations} " \
                f"generations = {completions} completions"
        if self.steps_per_round > 1:
            words += f" over {self.round_steps} step(s), {self.cfg.num_iterations} time(s)"
        return words + ")"

    def metric_names(self) -> tuple[str, ...]:
        names = [f"rewards/{scorer.name}/{stat}" for scorer in self.scorers for stat in ("mean", "std")]
        return (*super().metric_names(), "reward", "reward_std", *names, "frac_reward_zero_std",
                *(f"completions/{name}" for name in ("mean_length", "min_length", "max_length", "clipped_ratio",
                                                      "mean_terminated_length", "min_terminated_length",
                                                      "max_terminated_length")),
                "generation/time_s", "generation/completions_per_s")

    def state_dict(self) -> dict:
        """The round being trained, where a resume inside it needs it (a round of several optimizer steps)."""
        return {"round": asdict(self.round)} if self.round is not None and self.steps_per_round > 1 else {}

    def load_state_dict(self, state: dict) -> None:
        found = state.get("round")
        if found is not None:
            old = found["old"]
            self.round = Round(**{**found, "old": {int(k): v for k, v in old.items()} if old is not None else None})

    def summary(self, sums: list[float], totals: list[float]) -> dict[str, float]:
        """Objective.summary, and the metrics of the round the step trained (a training step's; an evaluation has
        none)."""
        return {**super().summary(sums, totals), **(self.round.values if self.round is not None else {})}

    def count(self, inputs: dict, batch, cp_rank: int) -> list[float]:
        return [float(len(batch.sequences["length"])) * (cp_rank == 0)]

    def rollout(self, model, step: int, prompts: list[list[dict]], prepare) -> list:
        """The step's micro-batches for this rank: at the first step of a round its prompts' completions sampled by
        `model`, scored, their advantages computed (and, for a round trained more than once, the old policy's
        log-probabilities); at every step the round's slice for this step laid out (the module's docstring). The
        round's metrics are kept for the step's record. prepare(micro-batch): it as the model takes it (the
        trainer's)."""
        [rows] = prompts
        if self.state.is_main and not self.restarted:
            restart_records(self.path, step)
            self.restarted = True
        position = step % self.steps_per_round
        if position == 0 or self.round is None or self.round.step != step - position:
            if position:
                raise RuntimeError(f"step {step + 1} is inside a generation round that was not restored")
            self.round = self._new_round(model, step, rows, prepare)
        return self._layout(rows, self.round, position % self.round_steps)[0]

    def _new_round(self, model, step: int, rows: list[dict], prepare) -> Round:
        started = time.perf_counter()
        completions = generate(model, [row["input_ids"] for row in rows], self.sampling, eos_ids=self.eos_ids,
                               pad_id=self.pad_id, device=self.state.device, seed=self.seed, step=step,
                               state=self.state)
        elapsed = time.perf_counter() - started
        per_function = self._rewards(rows, completions, step)
        rewards = combined_rewards(per_function, self.reward_weights)
        advantage, zero_std = advantages(rewards, self.cfg.num_generations, self.cfg.scale_rewards)
        values = {**self._round_metrics(per_function, rewards, zero_std, completions),
                  "generation/time_s": elapsed, "generation/completions_per_s": len(completions) / elapsed}
        # A round of several optimizer steps: each trains a seeded share of its completions, mixed over the groups.
        order = torch.randperm(len(completions), generator=torch.Generator().manual_seed(self.seed + step)).tolist() \
            if self.round_steps > 1 else list(range(len(completions)))
        found = Round(step, [[c.prompt, c.sample, c.ids, c.truncated] for c in completions], advantage.tolist(),
                      order, values)
        if self.steps_per_round > 1:
            found.old = self._old_logps(model, rows, found, prepare)
        return found

    def _old_logps(self, model, rows: list[dict], found: Round, prepare) -> dict[int, list[float]]:
        """Every completion's tokens' log-probabilities under the policy that sampled them, at the sampling
        temperature, from the training forward (no gradient): each rank computes those of the micro-batches it
        trains in the round (a cp peer those of its slice of each), and every rank learns them all."""
        mine = {}
        with torch.no_grad():
            for share in range(self.round_steps):
                for batch, indices in zip(*self._layout(rows, found, share)):
                    inputs = prepare(batch).inputs
                    logps, _, _ = model.token_logps(**model_inputs(inputs), temperature=self.cfg.temperature)
                    sequence_ids = inputs["sequence_ids"]
                    labelled = (inputs["shift_labels"] != IGNORE_INDEX) & (sequence_ids >= 0)
                    for local, index in enumerate(indices):
                        mine[index] = logps[labelled & (sequence_ids == local)].tolist()
        reshard(model)
        old: dict[int, list[float]] = {}
        # A cp peer holds a contiguous slice of each row, in the order of the cp ranks: their values in that order.
        for _, values in sorted(self.state.all_gather_object((self.state.cp_rank, mine)), key=lambda x: x[0]):
            for index, part in values.items():
                old.setdefault(index, []).extend(part)
        return old

    def _rewards(self, rows: list[dict], completions, step: int) -> torch.Tensor:
        """[completions, reward functions] (NaN where a function returned None), scored on rank 0 and learnt by every
        rank; rank 0 also writes the round's samples to completions.jsonl at a logging step (the file starts afresh
        with a run, or keeps the records up to the step a resumed run goes on from: those after it are made again,
        the same)."""
        outcome = None
        if self.state.is_main:
            try:
                outcome = self._scored(rows, completions, step)
            except UserError as err:
                outcome = str(err)
        outcome = self.state.broadcast_object(outcome)
        if isinstance(outcome, str):
            raise UserError(outcome)
        return torch.tensor(outcome, dtype=torch.float64).view(len(completions), len(self.scorers))

    def _scored(self, rows: list[dict], completions, step: int) -> list[list[float]]:
        given = [rows[c.prompt][PROMPT_ROW] for c in completions]
        texts = [self.tokenizer.decode(c.ids, skip_special_tokens=True) for c in completions]
        values = [completion_value(row["prompt"], text) for row, text in zip(given, texts)]
        names = dict.fromkeys(key for row in given for key in row if key != "prompt")
        columns = {key: [row.get(key) for row in given] for key in names}
        scores = score(self.scorers, [row["prompt"] for row in given], values, [c.ids for c in completions], columns,
                       REWARD_FUNCS, f"the completions of step {step + 1}")
        logged = (step + 1) % self.logging_steps == 0 or step == 0
        with self.path.open("a", encoding="utf-8") as f:
            for i, (row, completion, value) in enumerate(zip(given, completions, values) if logged else ()):
                record = {"step": step + 1, **row, "completion": value, "completion_ids": completion.ids,
                          "truncated": completion.truncated, **{name: got[i] for name, got in scores.items()}}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        return [[math.nan if got[i] is None else got[i] for got in scores.values()] for i in range(len(completions))]

    def _round_metrics(self, per_function, rewards, zero_std, completions) -> dict[str, float]:
        """TRL's names and definitions of a round's reward and length metrics."""
        values = {"reward": rewards.nanmean().item(), "reward_std": nanstd(rewards).item(),
                  "frac_reward_zero_std": zero_std.double().mean().item()}
        for i, scorer in enumerate(self.scorers):
            values[f"rewards/{scorer.name}/mean"] = per_function[:, i].nanmean().item()
            values[f"rewards/{scorer.name}/std"] = nanstd(per_function[:, i]).item()
        lengths = [len(c.ids) for c in completions]
        ended = [len(c.ids) for c in completions if not c.truncated] or [0]
        values.update({"completions/mean_length": sum(lengths) / len(lengths),
                       "completions/min_length": min(lengths), "completions/max_length": max(lengths),
                       "completions/clipped_ratio": sum(c.truncated for c in completions) / len(completions),
                       "completions/mean_terminated_length": sum(ended) / len(ended),
                       "completions/min_terminated_length": min(ended),
                       "completions/max_terminated_length": max(ended)})
        return values

    def _layout(self, rows: list[dict], found: Round, share: int) -> tuple[list, list[list[int]]]:
        """(this data-parallel rank's micro-batches of the round's `share`-th optimizer step, the round's indices of
        the completions of each): the step's completions cut as any task's samples (data-parallel rank r takes the
        r-th run of micro_batch x accumulation), in micro-batches of micro_batch completions, each one packed row of
        prompt + completion sequences, the completion's tokens labelled (none where mask_truncated_completions drops
        a truncated one) and, per sequence, its advantage and loss tokens, and per token the old policy's
        log-probability where the round has them."""
        per_step = len(found.completions) // self.round_steps
        step_order = found.order[share * per_step:(share + 1) * per_step]
        per_rank = per_step // self.state.dp_size
        mine = step_order[self.state.dp_rank * per_rank:(self.state.dp_rank + 1) * per_rank]
        batches, owned = [], []
        for first in range(0, len(mine), self.micro_batch):
            # A prompt's completions side by side: each after its first a branch of it.
            indices = sorted(mine[first:first + self.micro_batch], key=lambda index: found.completions[index][0])
            row = {"input_ids": [], "labels": [], "position_ids": [], "advantage": [], "loss_tokens": []}
            if found.old is not None:
                row["old_logps"] = []
            previous = None
            for index in indices:
                prompt_index, _, ids, truncated = found.completions[index]
                prompt = rows[prompt_index]["input_ids"]
                # A branch holds the prompt's last token alone (computed again: it predicts the completion's first)
                # and attends to the prompt its group's first completion follows (model/attention.document_starts).
                head = prompt[-1:] if self.shares_prompts and prompt_index == previous and len(prompt) > 1 \
                    else prompt
                previous = prompt_index
                trained = not (self.cfg.mask_truncated_completions and truncated)
                row["input_ids"] += list(head) + list(ids)
                row["labels"] += [IGNORE_INDEX] * len(head) + (list(ids) if trained else [IGNORE_INDEX] * len(ids))
                row["position_ids"] += list(range(len(prompt) - len(head), len(prompt) + len(ids)))
                row["advantage"].append(found.advantages[index])
                row["loss_tokens"].append(float(len(ids) if trained else 0))
                if found.old is not None:
                    # In line with the shifted labels: the value of position t is that of token t + 1.
                    old = found.old[index] if trained else [0.0] * len(ids)
                    row["old_logps"] += [0.0] * (len(head) - 1) + old + [0.0]
            batches.append(collate([row], self.pad_id, self.document_mask, two_sequences=True))
            owned.append(indices)
        return batches, owned

    def _kl_weights(self, log_weights: torch.Tensor) -> torch.Tensor:
        """The factor of the KL term of each token (token level) or completion (sequence level): its unclipped
        importance ratio where use_bias_correction_kl (TRL's default, its coef_1), else 1."""
        return log_weights.exp() if self.cfg.use_bias_correction_kl else torch.ones_like(log_weights)

    def terms(self, model, inputs: dict, batch) -> Terms:
        logps, entropy, features_terms = model.token_logps(**model_inputs(inputs), temperature=self.cfg.temperature,
                                                           with_entropy=True)
        sequence_ids = inputs["sequence_ids"]
        mask = (inputs["shift_labels"] != IGNORE_INDEX) & (sequence_ids >= 0)
        owners = sequence_ids.clamp(min=0)
        advantage = batch.sequences["advantage"].to(logps.dtype)
        loss_tokens = batch.sequences["loss_tokens"]
        weight = token_weights(self.cfg.loss_type, loss_tokens, self.cfg.max_completion_length).to(logps.dtype)
        # The old policy's log-probabilities: the round's, or, in a round of one optimizer step, the policy's own
        # without their gradient (the same values).
        log_ratio = logps - inputs.get("old_logps", logps.detach())
        kl = k3_kl(logps, self.reference.token_logps(model_inputs(inputs), self.cfg.temperature)).where(mask, 0.0) \
            if self.reference is not None else None
        epsilon_low, epsilon_high = self.cfg.epsilon, self.cfg.clip_high
        if self.cfg.importance_sampling_level == "token":
            losses, low, high = token_losses(log_ratio, advantage[owners], epsilon_low, epsilon_high)
            if kl is not None:
                # TRL weights each token's k3 by its ratio before both the loss and the logged kl use it.
                kl = kl * self._kl_weights(log_ratio)
                losses = losses + self.cfg.beta * kl
            policy = (losses * weight[owners]).where(mask, 0.0).sum()
            clipped = torch.stack([low.where(mask, False).sum(), high.where(mask, False).sum(),
                                   (low | high).where(mask, False).sum()]).double()
        else:
            # GSPO: one ratio per completion, the mean of its tokens' log-ratios over the whole completion; its loss
            # (and its KL term, weighted by that ratio) computed per completion from the cp peers' sums, counted once.
            def whole(values):
                local = values.new_zeros(len(advantage)).index_add(0, owners.flatten(), values.flatten())
                return whole_sums(local, self.state)

            tokens = loss_tokens.to(logps.dtype)
            mean_log_ratio = whole(log_ratio.where(mask, 0.0)) / tokens.clamp(min=1)
            losses, low, high = token_losses(mean_log_ratio, advantage, epsilon_low, epsilon_high)
            losses = losses * tokens
            if kl is not None:
                kl_weights = self._kl_weights(mean_log_ratio)
                losses = losses + self.cfg.beta * whole(kl) * kl_weights
                # The logged kl, as TRL's: each token's k3 times its completion's ratio, summed over this slice.
                kl = kl * kl_weights[owners]
            policy = (losses * weight).sum() / self.state.cp_size
            clipped = torch.stack([low.sum(), high.sum(), (low | high).sum()]).double() * (self.state.cp_rank == 0)
        loss = torch.stack([policy, features_terms.reshape(())])
        with torch.no_grad():
            sums = [entropy.where(mask, 0.0).sum().double().reshape(1), clipped]
            metrics = torch.cat(sums + ([kl.sum().double().reshape(1)] if kl is not None else []))
        return Terms(loss, metrics)
