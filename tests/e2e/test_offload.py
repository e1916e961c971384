"""parallel.cpu_offload (FSDP2's CPUOffloadPolicy) on one process: the same losses and exported weights as without
it. On this CPU-only machine the parameters already live in the CPU's memory, so the run checks that the policy's
path (the copies FSDP2 makes around each layer, the optimizer's step on the offloaded shards, the checkpoint of them)
changes no number; what it saves on a GPU is measured by benchmarks/, on a GPU when one is lent."""

from safetensors.torch import load_file
from torch.distributed.fsdp import CPUOffloadPolicy

import llmtune
from llmtune.model.build import decoder_layers
from llmtune.training.callbacks import Callback
from tests.helpers import read_metrics


class Policies(Callback):
    """The offload policy FSDP2 holds for each decoder layer, seen when training begins."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.offloaded = [isinstance(layer._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)
                          for layer in decoder_layers(model)]


def test_offloaded_training_repeats_the_run_without_offload(tiny_model, sft_file, tmp_path):
    runs = {}
    for offload in (False, True):
        out, policies = tmp_path / f"offload_{offload}", Policies()
        llmtune.train("sft", {"model": {"name_or_path": tiny_model},
                              "data": {"train_files": [sft_file], "chat_template": "basic", "max_seq_len": 64},
                              "train": {"output_dir": out, "max_steps": 3, "per_device_train_batch_size": 4,
                                        "gradient_accumulation_steps": 2, "logging_steps": 1, "learning_rate": 5e-3},
                              "parallel": {"cpu_offload": offload},
                              "checkpoint": {"save_steps": 3, "export_dtype": "fp32"}, "monitor": {"plots": False}},
                      callbacks=[policies])
        assert policies.offloaded and set(policies.offloaded) == {offload}
        runs[offload] = ([r["loss"] for r in read_metrics(out)], load_file(out / "hf" / "model.safetensors"))
    assert len(runs[True][0]) == 3 and runs[True][0] == runs[False][0]
    assert all(runs[True][1][name].equal(value) for name, value in runs[False][1].items())
