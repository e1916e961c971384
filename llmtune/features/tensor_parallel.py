"""Tensor parallelism (parallel.tp_size; llmtune/model/tensor_parallel.py lays it): a feature acting at four points.
- check: the family has a plan llmtune lays, and tp divides its heads, key/value heads, intermediate size and
  vocabulary; what does not run with it yet is refused, one line each.
- distribute: the model split over the tp ranks once every feature has built (peft's adapters are made on the
  whole layers, so that their initial values do not depend on the layout, then split as their base layers are),
  before checkpointing, compile and FSDP2 over the data-parallel ranks.
- build: how many tokens its rows are padded to a multiple of.
- transform: under sequence parallelism, every micro-batch's rows padded to a multiple of cp x tp tokens, so that the
  stream splits evenly over the tp ranks of each cp slice (the pads carry no label: the losses are those of the rows
  unpadded).
"""

import torch

from llmtune.features.base import Feature
from llmtune.features.ulysses import padded_rows
from llmtune.model.build import decoder_layers
from llmtune.model.multimodal import is_multimodal
from llmtune.model.tensor_parallel import apply_tensor_parallel, plan_problems

# What does not run with tp_size > 1 yet: (what the recipe sets, whether it is set, the other setting that runs).
NOT_YET = (
    ("model.quantize", lambda config: config.model.quantize != "none", "model.quantize: none"),
    ("peft.method: dora", lambda config: config.peft.method == "dora", "peft.method: lora"),
    ("train.fp8", lambda config: config.train.float8_scaling() is not None, "train.fp8: false"),
    # Compiled layers of a whole (replicated) stream fail to trace with symbolic sizes (a recursion in AOT autograd).
    ("train.compile without parallel.sequence_parallel",
     lambda config: config.train.compile and not config.parallel.sequence_parallel, "parallel.sequence_parallel: true"),
)


class TensorParallel(Feature):
    name = "tensor_parallel"
    on_reference = True  # a reference model is split as the policy is: its log-probabilities from the same shards

    @staticmethod
    def enabled(config) -> bool:
        return config.parallel.tp_size > 1

    @staticmethod
    def check(config, model_config, world_size: int) -> list[str]:
        tp = config.parallel.tp_size
        problems = plan_problems(model_config, tp)
        if is_multimodal(model_config):
            problems.append(f"parallel.tp_size: {model_config.model_type} is a vision-language model, which llmtune "
                            "does not split over tp ranks yet; set parallel.tp_size 1")
        problems += [f"parallel.tp_size: {tp} with {what} is not supported yet; set parallel.tp_size 1, or {fix}"
                     for what, on, fix in NOT_YET if on(config)]
        return problems

    def build(self, hf_model, state) -> None:
        self.multiple = state.cp_size * state.tp_size if state.parallel.sequence_parallel else 1

    def distribute(self, hf_model, state) -> None:
        apply_tensor_parallel(hf_model, decoder_layers(hf_model), state.tp_mesh, state.parallel.sequence_parallel)

    def transform(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return padded_rows(inputs, self.multiple) if self.multiple > 1 else inputs
