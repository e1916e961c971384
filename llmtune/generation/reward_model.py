"""A reward model's folder (a HF sequence classifier of one label, as `llmtune rm` exports) scoring prompts and
completions: each prompt + completion rendered and tokenized as rm training renders a pair's sequence
(data/preference.sequence_ids: a string prompt with the tokenizer's special tokens, the completion with EOS, no chat
template; messages by the folder's chat template, the prompt's rendering with its generation prompt beginning the
conversation's), so that a model trained by `llmtune rm` scores them as its training did; the score is the model's
logit at each sequence's last token that is not the pad id (the tokenizer's pad, else its EOS, as training's
data/collate.score_marks reads it), set on the config. The sequences are padded on the right and scored in batches,
fp32, on CUDA when there is one, else the CPU. One scorer serves grpo's reward functions (generation/scorers.py:
loaded whole by the process that scores, rank 0, on its first call) and `llmtune score` (run/score.py)."""

from functools import cached_property

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from llmtune.data.collate import collate, pad_token_id
from llmtune.data.preference import sequence_ids
from llmtune.data.templates import LabelRules
from llmtune.errors import UserError
from llmtune.model.build import is_classifier

BATCH_SIZE = 16  # sequences scored together


def check_reward_model(folder: str) -> None:
    """Refuses a folder whose config is not a sequence classifier of one label, naming what it is; the weights are
    not read."""
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    kind = (config.architectures or [type(config).__name__])[0]
    if not is_classifier(config):
        raise UserError(f"{folder}: a {kind}, not a reward model; give a sequence classifier of one label "
                        "(AutoModelForSequenceClassification, num_labels 1), e.g. the output_dir/hf of an llmtune rm "
                        "run")
    if config.num_labels != 1:
        raise UserError(f"{folder}: a {kind} of {config.num_labels} labels; a reward model has one (its score): give "
                        "the output_dir/hf of an llmtune rm run, or another classifier saved with num_labels 1")


class RewardModel:
    """The folder's tokenizer, read at once, and its model, loaded on the first score: a caller renders every
    sequence (and refuses what cannot be) before the weights are read."""

    def __init__(self, folder: str, batch_size: int = BATCH_SIZE):
        check_reward_model(folder)
        self.folder, self.batch_size = folder, batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        self.pad_id = pad_token_id(self.tokenizer)
        self.rules = LabelRules(template=f"the chat template of {folder}")

    def sequence(self, prompt: str | list[dict], completion: str | list[dict], where: str,
                 tools: list | None = None) -> list[int]:
        """The token ids of prompt + completion (and the tools a messages prompt is rendered with) as rm training
        renders them; `where` names the row in a refusal."""
        if isinstance(prompt, list) and not self.tokenizer.chat_template:
            raise UserError(f"{where}: a messages prompt needs a chat template, and {self.folder}'s tokenizer has "
                            "none; give prompt and completion as strings, or give the folder the chat template the "
                            "model was trained with")
        return sequence_ids(self.tokenizer, prompt, completion, self.rules, where, tools)

    @cached_property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")

    @cached_property
    def model(self):
        model = AutoModelForSequenceClassification.from_pretrained(self.folder, dtype=torch.float32,
                                                                   trust_remote_code=False)
        # transformers' classifier scores each sequence at its last token that is not the config's pad id.
        model.config.pad_token_id = self.pad_id
        return model.to(self.device).eval().requires_grad_(False)

    def scores(self, sequences: list[list[int]]) -> list[float]:
        """Each sequence's score, in order; batches of sequences of like length (sorted by it), padded on the
        right."""
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        scores = [0.0] * len(sequences)
        for first in range(0, len(order), self.batch_size):
            chosen = order[first:first + self.batch_size]
            inputs = collate([{"input_ids": sequences[i]} for i in chosen], self.pad_id).inputs
            with torch.no_grad():
                logits = self.model(input_ids=inputs["input_ids"].to(self.device),
                                    attention_mask=inputs["attention_mask"].to(self.device)).logits
            for i, value in zip(chosen, logits[:, 0].tolist()):
                scores[i] = value
        return scores

    def __call__(self, prompts: list, completions: list) -> list[float]:
        """TRL's reward function's prompts and completions (each completion in its prompt's form) -> their scores."""
        return self.scores([self.sequence(prompt, completion, f"completion {number}")
                            for number, (prompt, completion) in enumerate(zip(prompts, completions), 1)])
