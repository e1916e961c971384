"""The router load-balancing loss of mixture-of-experts models, which their *MoeForCausalLM.forward adds to the
token loss (coefficient router_aux_loss_coef of the model config) and which llmtune's own loss, computed from the
decoder's hidden states, would otherwise drop.

The term is the model's own: its modeling module's load_balancing_loss_func on the router logits the decoder
records, with the model's number of experts and experts per token. In llmtune's units (a micro-batch's summed loss,
divided by the step's labelled tokens T) a micro-batch with T_i labelled tokens adds coef x aux_i x T_i: the step's
loss is the mean cross-entropy plus coef times the token-weighted mean of its micro-batches' aux losses. On one
micro-batch that is exactly the HF model's loss; it does not depend on how the same micro-batches are spread over
ranks and accumulation steps, but it does on their size (the load-balancing loss of a batch is not the mean of its
parts' losses), and under context parallelism each rank's slice is one part.

metrics.jsonl gets, for every training step: aux_loss, that token-weighted mean before the coefficient;
expert_load/layer_<i>, for each mixture-of-experts decoder layer i the tokens routed to its busiest expert over the
mean per expert (1: balanced; at worst experts / experts per token); and expert_load, that of the least balanced
layer. The loss and the loads leave out the pads where the rows say which they are (an attention mask, a preference
task's sequence ids), those a layout adds among them (packed sft rows say nothing: their pads count). Under tensor
parallelism each tp rank routes 1/tp of a micro-batch's tokens (model/tensor_parallel.py): both read every token's
router logits, gathered over the tp ranks.

The router logits are recorded by hooks of this feature on the modules the model's own recorder names
(`_can_record_outputs["router_logits"]`), not by asking the model for them (output_router_logits): transformers'
recording hooks read a ContextVar, which torch.compile cannot trace, so each would break a compiled decoder layer
in two (train.compile), where these set an attribute.
"""

import sys
from functools import partial

import torch
from transformers.utils.output_capturing import OutputRecorder

from llmtune.features.base import Feature
from llmtune.model.build import decoder_layers
from llmtune.model.expert_parallel import experts_modules
from llmtune.model.loss import IGNORE_INDEX
from llmtune.model.tensor_parallel import gathered_tokens


class RouterLoss(Feature):
    """On for every run; it acts once build has found a model with a router loss and a coefficient that is not 0."""

    name = "router_loss"

    def __init__(self, config):
        super().__init__(config)
        self.loss_function = None  # with the model's experts and top-k, once build found them
        # One per router, in the model's order: its logits in the forward under way (see _record).
        self.routers: list[RouterOutput] = []
        self._reset()

    def _reset(self) -> None:
        # Of the training step under way: sum of aux_i x T_i, sum of T_i, tokens routed per layer and expert.
        self.weighted_aux, self.tokens, self.routed = 0.0, 0.0, 0.0

    @staticmethod
    def enabled(config) -> bool:
        return True

    def build(self, hf_model, state) -> None:
        function = getattr(sys.modules[type(hf_model).__module__], "load_balancing_loss_func", None)
        model_coef = getattr(hf_model, "router_aux_loss_coef", None)
        if function is None or model_coef is None:
            return
        recipe_coef = self.config.train.router_aux_loss_coef
        self.coef = model_coef if recipe_coef is None else recipe_coef
        if self.coef:
            # Its load-balancing loss would count a shared prefix's tokens once, where each sequence alone counts them.
            self.keeps_shared_prefixes = False
            self.experts, self.top_k = hf_model.num_experts, hf_model.num_experts_per_tok
            # The decoder layers with routed experts, in order: those whose routers record the router logits (a
            # family may keep dense layers among them, as Qwen3-MoE's mlp_only_layers).
            self.moe_layers = [i for i, layer in enumerate(decoder_layers(hf_model)) if experts_modules(layer)]
            self.loss_function = lambda logits, mask: function(logits, self.experts, self.top_k, mask)
            # Under tensor parallelism each rank routes 1/tp of the tokens: the loss reads every token's logits.
            self.tp_mesh = state.tp_mesh if state.tp_size > 1 else None
            self._record(hf_model)

    def _record(self, hf_model) -> None:
        """Hooks that keep each router's logits of the forward under way in self.routers. Each router writes its own
        attribute, which torch.compile turns into a graph output, where appending to a shared list would be guarded
        on the list's length, another compile per layer. Emptied when the decoder starts, not when the loss has read
        them: activation checkpointing runs the layers' forwards again in the backward, whose logits are not read."""
        spec = hf_model._can_record_outputs["router_logits"]
        # transformers' own default for a recorder given as a bare class: the module's output 1.
        router, index = (spec.target_class, spec.index) if isinstance(spec, OutputRecorder) else (spec, 1)
        for module in hf_model.modules():
            if isinstance(module, router):
                record = RouterOutput()
                module.register_forward_hook(partial(_keep, record, index))
                self.routers.append(record)
        hf_model.get_decoder().register_forward_pre_hook(self._forget)

    def _forget(self, *_) -> None:
        for record in self.routers:
            record.logits = None

    def loss_terms(self, outputs, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        if not self.loss_function:
            return None
        logits, mask = self._logits(inputs["shift_labels"].shape), _real_tokens(inputs)
        aux = self.loss_function(logits, mask)
        tokens = (inputs["shift_labels"] != IGNORE_INDEX).sum()
        if torch.is_grad_enabled():  # a training micro-batch; evaluation runs without gradients
            with torch.no_grad():
                self.weighted_aux += aux.detach().double() * tokens
                self.tokens += tokens.double()
                # The experts each token goes to, as the model routes it: top-k of the router's logits; of the
                # rows' tokens, not of their pads where the micro-batch says which are pads (a layout's among them).
                real = slice(None) if mask is None else mask.flatten().bool()
                self.routed += torch.stack([torch.bincount(each.topk(self.top_k, dim=-1).indices[real].flatten(),
                                                           minlength=self.experts)
                                            for each in logits]).double()
        return self.coef * aux * tokens

    def _logits(self, rows: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        """Every router's logits [rows' tokens, experts] of the forward under way."""
        logits = tuple(record.logits for record in self.routers)
        return tuple(gathered_tokens(each, rows, self.tp_mesh) for each in logits) if self.tp_mesh else logits

    def step_metrics(self, state) -> dict[str, float]:
        if not self.loss_function:
            return {}
        totals = state.all_reduce_sum(torch.cat([torch.stack([self.weighted_aux, self.tokens]), self.routed.flatten()]))
        routed = totals[2:].view(-1, self.experts)
        self._reset()
        loads = (routed.max(dim=1).values / routed.mean(dim=1).clamp(min=1e-9)).tolist()
        return {"aux_loss": (totals[0] / totals[1].clamp(min=1)).item(), "expert_load": max(loads),
                **{f"expert_load/layer_{layer}": load for layer, load in zip(self.moe_layers, loads, strict=True)}}


def _real_tokens(inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Which tokens of the rows are not pads, where the micro-batch says: its attention mask, or a preference task's
    sequence ids (-1: a pad, of the batch or of a layout); None where neither is there (packed sft rows)."""
    if inputs.get("attention_mask") is not None:
        return inputs["attention_mask"]
    sequences = inputs.get("sequence_ids")
    return None if sequences is None else (sequences >= 0).long()


class RouterOutput:
    """One router's logits in the forward under way (a plain class: torch.compile traces setting its attribute,
    not a SimpleNamespace's)."""
    logits: torch.Tensor | None = None


def _keep(record: RouterOutput, index: int, module, args, output) -> None:
    record.logits = output[index] if isinstance(output, tuple) else output
