"""The monitor's FLOPs per token are counted on the model itself, for every family of the support matrix
(GPT-2 and GPT-NeoX name their sizes differently; mixtures of experts count the experts a token is routed to):
6 x its matrices plus PaLM's attention term equal what
torch's FlopCounterMode counts for a forward and backward of the eager model, exactly."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from llmtune.monitor.metrics import flops_per_token, peak_tflops
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


# Names as torch.cuda.get_device_name() gives them; the longest key found in a name wins, whatever the table's order.
@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA B200", 2250.0), ("AMD Instinct MI300X", 1307.4), ("AMD Instinct MI300A", 980.6),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0), ("Some Future GPU", None),
])
def test_peak_tflops_of_a_device_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_tflops(None) == peak
    assert peak_tflops(123.0) == 123.0  # monitor.peak_tflops, when set, wins over the table
