"""A reward model as a scoring function: a HF sequence classifier's first logit of each prompt + completion, computed
as TRL's GRPOTrainer scores with a reward model: a conversation (prompt messages and the completion's) rendered by
the reward model's own chat template, text prompt and completion joined; tokenized without special tokens, padded on
the right, in one batch. Loaded whole by the process that scores (rank 0), on its device, frozen, in eval mode."""

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer


class RewardModel:
    def __init__(self, folder: str):
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        if self.tokenizer.pad_token is None:  # many causal LM tokenizers have none (TRL's fix)
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        self.model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).to(self.device)
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.eval().requires_grad_(False)

    def __call__(self, prompts: list, completions: list) -> list[float]:
        texts = [self.tokenizer.apply_chat_template(prompt + completion, tokenize=False)
                 if isinstance(prompt, list) else prompt + completion for prompt, completion in zip(prompts, completions)]
        inputs = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side="right",
                                add_special_tokens=False).to(self.device)
        with torch.no_grad():
            return self.model(**inputs).logits[:, 0].float().tolist()
