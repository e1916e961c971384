"""The monitor's FLOPs per token are counted on the model itself, for every family of the support matrix
(GPT-2 and GPT-NeoX name their sizes differently; mixtures of experts count the experts a token is routed to):
6 x its matrices plus PaLM's attention term equal what
torch's FlopCounterMode counts for a forward and backward of the eager model, exactly."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from llmtune.monitor import flops_per_token
from tests.model_matrix import FAMILIES

VOCAB, SEQUENCE = 300, 48


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.model_type)
def test_flops_per_token_equal_the_counted_matmuls(family):
    config = family.hf_config(VOCAB)
    # Eager attention: its matmuls are counted (the CPU sdpa kernel is not), over the whole square, as PaLM's
    # estimate counts them. Eager experts likewise: one matmul per expert on its tokens (grouped_mm is not counted).
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    input_ids = torch.randint(0, VOCAB, (1, SEQUENCE), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids).logits.sum().backward()
    assert flops_per_token(model, SEQUENCE) * SEQUENCE == counter.get_total_flops()
