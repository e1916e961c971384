"""Expert parallelism (parallel.expert_parallel): each routed expert layer's experts split over the ep ranks of
ParallelState.expert_mesh, tokens sent to their expert's rank by all-to-all (llmtune/model/expert_parallel.py);
model/build.py then shards each split experts module over the efsdp ranks. A recipe naming a model without experts,
or an expert count the degree does not divide, stops before any process starts.

metrics.jsonl gets expert_all_to_all_mib: the MiB of token states each rank sent to other ranks' experts and back
in a training step's forwards (their mean over ranks; the backward sends as much again, and activation
checkpointing's recomputed forwards are counted, as they send too)."""

import torch

from llmtune.features.base import Feature
from llmtune.model.build import meta_model
from llmtune.model.expert_parallel import expert_parallel_problem, shard_experts, split_experts


class ExpertParallel(Feature):
    name = "expert_parallel"
    on_reference = True  # a reference model's experts are split as the trained model's: the same memory per rank

    def __init__(self, config):
        super().__init__(config)
        # The split experts modules: the trained model's, and a reference model's, whose forwards run without
        # gradients and so count nothing.
        self.modules = []

    @staticmethod
    def enabled(config) -> bool:
        return config.parallel.expert_parallel > 1

    @staticmethod
    def check(config, model_config, world_size: int) -> list[str]:
        degree = config.parallel.expert_parallel
        # The experts modules are found on the model itself (their class and num_experts), so the check builds it
        # on the meta device: no memory, no weights.
        problem = expert_parallel_problem(meta_model(model_config, config.model), degree)
        return [problem] if problem else []

    def build(self, hf_model, state) -> None:
        shard_experts(hf_model, state.expert_mesh["ep"])
        self.modules += split_experts(hf_model)

    def step_metrics(self, state) -> dict[str, float]:
        sent = torch.tensor([float(sum(module.sent_bytes for module in self.modules))], dtype=torch.float64,
                            device=state.device)
        for module in self.modules:
            module.sent_bytes = 0
        return {"expert_all_to_all_mib": state.all_reduce_sum(sent).item() / state.world_size / 2**20}
