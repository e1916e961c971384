"""Expert parallelism (parallel.expert_parallel): each routed expert layer's experts split over ranks, tokens sent
to their expert's rank by all-to-all (llmtune/model/expert_parallel.py). This increment has the check only: a
recipe naming a model without experts, or with an expert count the degree does not divide, stops before any
process starts."""

from llmtune.features.base import Feature
from llmtune.model.build import meta_model
from llmtune.model.expert_parallel import expert_parallel_problem


class ExpertParallel(Feature):
    name = "expert_parallel"

    @staticmethod
    def enabled(config) -> bool:
        return config.parallel.expert_parallel > 1

    @staticmethod
    def check(config, model_config, world_size: int) -> list[str]:
        # The experts modules are found on the model itself (their class and num_experts), so the check builds it
        # on the meta device: no memory, no weights.
        problem = expert_parallel_problem(meta_model(model_config, config.model), config.parallel.expert_parallel)
        return [problem] if problem else []
