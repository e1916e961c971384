"""The tasks, in one place: `llmtune TASK recipe.yaml` and `llmtune.train(TASK, ...)` accept these names.

A task is a registration here plus its objective: a class (in this package) that names the step's counts, computes
a micro-batch's loss terms and metrics, and builds any extra model it needs (a reference); the Trainer calls it and
never asks which task it is. The entry also names the task's rows, which the data layer builds (data/build.py reads
`rows`, never the task's name), and its recipe section, if it has one (config.py).

Torch-free and importing nothing of llmtune: the CLI lists and checks tasks before torch is imported, and the recipe
layer reads the rows and sections here. The objective is named by its import path and imported by the run that
trains it (tasks/objective.py).
"""

from dataclasses import dataclass

# What a task's rows are, each built by its own path in data/build.py.
DOCUMENTS = "documents"  # text packed into blocks, every token trained (pt)
CONVERSATIONS = "conversations"  # samples rendered by the chat template, the assistant's tokens trained (sft)
PAIRS = "pairs"  # a prompt with a chosen and a rejected response, both rendered (dpo)
UNPAIRED = "unpaired"  # a prompt and one response labelled desirable or undesirable (kto)
PROMPTS = "prompts"  # a prompt alone, its completions sampled during training (grpo)

# What a task's model ends in: transformers' causal LM (the lm_head's next-token logits), or its sequence classifier
# with one label (a score head: one number per sequence, read at its last token).
LM_HEAD = "lm"
SCORE_HEAD = "score"


@dataclass(frozen=True)
class Task:
    objective: str  # "module:Class" of the objective (tasks/objective.py's Objective)
    rows: str
    section: str | None  # the recipe section of the task's own keys, None for none
    description: str  # the first line of `llmtune TASK --help`
    head: str = LM_HEAD  # what the model ends in: LM_HEAD or SCORE_HEAD
    batch: str = ""  # what per_device_train_batch_size and global_batch_size count, for `llmtune TASK --help`


# The preference tasks' batches, as TRL and LLaMA-Factory count them.
PACKED_PER_MICRO_BATCH = "as TRL and LLaMA-Factory count them, each micro-batch's packed into one row"
PAIR_BATCH = f"pairs (a prompt with its chosen and rejected responses), {PACKED_PER_MICRO_BATCH}"


TASKS = {
    "pt": Task("llmtune.tasks.language_model:LanguageModel", DOCUMENTS, None,
               "Pre-training: packed blocks of text, every token trained.",
               batch="rows of data.max_seq_len tokens, the documents packed into them"),
    "sft": Task("llmtune.tasks.language_model:LanguageModel", CONVERSATIONS, None,
                "Supervised fine-tuning: conversations rendered by the chat template, the assistant's tokens "
                "trained.", batch="samples; with data.packing (llmtune's default) rows of data.max_seq_len tokens "
                "packed with samples, as TRL counts them with packing (a LLaMA-Factory recipe counts samples unless "
                "it sets packing: true)"),
    "dpo": Task("llmtune.tasks.dpo:DPO", PAIRS, "dpo",
                "Preference training (DPO and its kin): a chosen and a rejected response to each prompt, the policy "
                "moved towards the chosen one against a reference model.",
                batch=PAIR_BATCH),
    "kto": Task("llmtune.tasks.kto:KTO", UNPAIRED, "kto",
                "KTO: prompts with one response each, labelled desirable or undesirable, the policy moved towards the "
                "desirable ones against a reference model.",
                batch=f"examples (a prompt with its response), {PACKED_PER_MICRO_BATCH}"),
    "grpo": Task("llmtune.tasks.grpo:GRPO", PROMPTS, "grpo",
                 "Online RL (GRPO and its kin): completions sampled from the policy for each prompt, scored by reward "
                 "functions, the policy moved towards the completions better than their group's mean.",
                 batch="completions (each prompt sampled grpo.num_generations times), as TRL counts them, each "
                       "micro-batch's packed into one row"),
    "rm": Task("llmtune.tasks.reward:RM", PAIRS, "rm",
               "Reward modelling: a chosen and a rejected response to each prompt, a score head on the model trained "
               "to score the chosen one higher (Bradley-Terry); exported as a sequence classifier.", SCORE_HEAD,
               batch=PAIR_BATCH),
}
