"""pt and sft: the summed cross-entropy of the labelled tokens (and the features' terms, a router's load-balancing
loss), divided by the step's labelled tokens: the mean over every labelled token of the step on every rank."""

from llmtune.tasks.objective import Objective, Terms


class LanguageModel(Objective):
    @classmethod
    def build(cls, config, **parts) -> "LanguageModel":
        return cls()

    def terms(self, model, inputs: dict, batch) -> Terms:
        loss = model(**inputs)
        return Terms(loss.reshape(1), loss.new_zeros(0))
