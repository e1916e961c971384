"""train.compile captures every family's decoder layer whole and compiles it once (one process, sft on packed rows):
no graph break in any family of tests/model_matrix.py, the mixture-of-experts ones included, one graph per kind of
layer, and no graph compiled after the first step while the packed rows change their lengths and document counts
over 10 steps.

Graph breaks and recompiles are torch._dynamo's decisions, made while it captures a graph and counted in its
counters, before any backend sees the graph: the graphs are handed to the eager backend, which runs them as captured
and spares the test inductor's C++ builds (test_train_options.py compiles with inductor and compares the losses)."""

import pytest
import torch
from torch._dynamo.utils import counters

import llmtune
from tests.helpers import compile_with_backend
from tests.model_matrix import FAMILIES

STEPS = 10
# Graphs per family: one per kind of decoder layer, whose code differs (sliding or full attention, with or without
# RoPE, dense or mixture-of-experts MLP); more would be a layer compiled again for the same code.
TWO_KINDS = {"gemma2", "gemma3_text", "smollm3", "gpt_oss", "deepseek_v3"}


class FirstStepGraphs:
    """Callback: the graphs compiled by the end of step 1, and each micro-batch's (row length, documents)."""

    def __init__(self):
        self.first_step_graphs = None
        self.rows = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.get_decoder().register_forward_pre_hook(self.count_documents, with_kwargs=True)

    def count_documents(self, module, args, kwargs):
        positions = kwargs["position_ids"]
        self.rows.append((positions.shape[1], int((positions == 0).sum())))

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.first_step_graphs = counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("family", FAMILIES, ids=[family.model_type for family in FAMILIES])
def test_each_layer_compiles_whole_and_once(family, bare_tokenizer, assets, sft_file, tmp_path, monkeypatch):
    config = family.hf_config(len(bare_tokenizer), bare_tokenizer.bos_token_id, bare_tokenizer.eos_token_id,
                              bare_tokenizer.pad_token_id)
    config.save_pretrained(tmp_path / "config")
    compile_with_backend(monkeypatch, "eager")
    torch._dynamo.reset()
    counters.clear()
    callback = FirstStepGraphs()
    llmtune.train("sft", {
        "model": {"config": str(tmp_path / "config"), "tokenizer": str(assets / "tokenizer")},
        "data": {"train_files": [str(sft_file)], "chat_template": "basic", "max_seq_len": 128},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": STEPS, "per_device_train_batch_size": 2,
                  "global_batch_size": 2, "logging_steps": STEPS, "learning_rate": 1e-3, "compile": True},
        "checkpoint": {"export_hf": False, "save_steps": 0},
        "monitor": {"console": False, "plots": False},
    }, callbacks=[callback])
    lengths, documents = zip(*callback.rows)
    assert len(set(lengths)) > 1 and len(set(documents)) > 1, callback.rows
    assert dict(counters["graph_break"]) == {}
    assert callback.first_step_graphs == (2 if family.model_type in TWO_KINDS else 1)
    assert counters["stats"]["unique_graphs"] == callback.first_step_graphs
