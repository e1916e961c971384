"""Build the model: load (or initialise) the HF model, wrap it for training, shard it with FSDP2."""

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from llmtune.errors import UserError
from llmtune.loss import cross_entropy_sum


class CausalLMForTraining(nn.Module):
    """The FSDP root around an unmodified HF causal LM.

    Its forward runs the decoder and then the loss from the last hidden states and the lm_head
    weight. Being the root, FSDP has unsharded the embeddings and lm_head exactly where the loss
    needs them, and the HF model class is never edited.
    """

    def __init__(self, hf_model: PreTrainedModel):
        super().__init__()
        self.hf_model = hf_model

    def forward(self, input_ids, attention_mask=None, position_ids=None, shift_labels=None):
        """Summed cross-entropy over the labelled tokens, or the logits when no labels are given."""
        hidden = self.hf_model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        head = self.hf_model.get_output_embeddings()
        if shift_labels is None:
            return head(hidden)
        return cross_entropy_sum(hidden, head.weight, head.bias, shift_labels)


def load_tokenizer(model_cfg):
    return AutoTokenizer.from_pretrained(model_cfg.tokenizer or model_cfg.name_or_path,
                                         trust_remote_code=model_cfg.trust_remote_code)


def load_hf_model(model_cfg, seed: int) -> PreTrainedModel:
    """fp32 weights on CPU, identical on every rank (random init is seeded by `seed`)."""
    kwargs = dict(attn_implementation=model_cfg.attn_implementation, trust_remote_code=model_cfg.trust_remote_code)
    if model_cfg.name_or_path:
        return AutoModelForCausalLM.from_pretrained(model_cfg.name_or_path, dtype=torch.float32, **kwargs)
    config = AutoConfig.from_pretrained(model_cfg.config, trust_remote_code=model_cfg.trust_remote_code)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)


def check_vocab(hf_model: PreTrainedModel, tokenizer, where: str) -> None:
    if len(tokenizer) > hf_model.get_input_embeddings().num_embeddings:
        raise UserError(f"{where}: the model's vocabulary ({hf_model.get_input_embeddings().num_embeddings}) is "
                        f"smaller than the tokenizer's ({len(tokenizer)}); use a matching model config or tokenizer")


def shard_model(module: CausalLMForTraining, mesh, bf16: bool) -> CausalLMForTraining:
    """fully_shard every decoder layer, then the root (which keeps embeddings and lm_head)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    layer_names = set(module.hf_model._no_split_modules or ())
    layers = [m for m in module.hf_model.modules() if type(m).__name__ in layer_names]
    if not layers:
        raise UserError(f"model: {type(module.hf_model).__name__} declares no decoder layer class "
                        "(_no_split_modules), so it cannot be sharded layer by layer")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    return module
