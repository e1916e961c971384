"""A feature is one class plus one registry entry, and acts at every point docs/architecture.md names (one
process): its check refuses a recipe before anything is written; its build sees the model before sharding;
its pretrained names are asked for every parameter, and its weights_ready sees the loaded weights; its
transform runs on every micro-batch before the labels are counted; its loss terms are added to the
summed loss; its state travels in every checkpoint and comes back on resume; its export files are in the
end-of-training and the offline export."""

import json
import logging

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from llmtune.checkpoint.hf_export import export_trained
from llmtune.config import load_config
from llmtune.features import registry
from llmtune.features.base import Feature
from llmtune.model.loss import IGNORE_INDEX
from llmtune.model.state import whole
from llmtune.run.cli import main as cli_main
from llmtune.run.parallel import ParallelState
from llmtune.run.worker import build_trainer
from tests.helpers import read_metrics

STEPS, ACCUMULATION = 3, 2


class Toy(Feature):
    name = "toy"
    term = 0.0

    def __init__(self, config):
        super().__init__(config)
        self.micro_batches, self.given, self.kept, self.restored, self.built_unsharded = 0, [], [], None, None
        self.asked, self.ready_embeddings = [], None

    @staticmethod
    def enabled(config) -> bool:
        return True

    @staticmethod
    def check(config, model_config, world_size):
        return ["toy: refused for train.seed 13; choose another seed"] if config.train.seed == 13 else []

    def build(self, hf_model, state):
        self.built_unsharded = not any(isinstance(p, DTensor) for p in hf_model.parameters())

    def pretrained_name(self, name):
        self.asked.append(name)
        return name

    def weights_ready(self, hf_model):
        self.ready_embeddings = whole(hf_model.get_input_embeddings().weight).clone()

    def transform(self, inputs):
        labels = inputs["shift_labels"].clone()
        self.given.append(int((labels != IGNORE_INDEX).sum()))
        labels[:, ::2] = IGNORE_INDEX
        self.micro_batches += 1
        self.kept.append(int((labels != IGNORE_INDEX).sum()))
        return {**inputs, "shift_labels": labels}

    def loss_terms(self, outputs, inputs):
        return outputs.last_hidden_state.new_tensor(self.term)

    def state_dict(self):
        return {"micro_batches": self.micro_batches}

    def load_state_dict(self, state):
        self.restored = state

    def export(self, folder, names):
        (folder / "toy.json").write_text(json.dumps(sorted(names)))


@pytest.fixture
def recipe(tmp_path, tiny_model, sft_file, monkeypatch):
    monkeypatch.setattr(registry, "FEATURES", (*registry.FEATURES, Toy))
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(sft_file)], "chat_template": "basic", "max_seq_len": 64},
        "train": {"output_dir": str(tmp_path / "out"), "max_steps": STEPS, "per_device_train_batch_size": 2,
                  "gradient_accumulation_steps": ACCUMULATION, "logging_steps": 1, "learning_rate": 1e-3},
        "checkpoint": {"save_steps": 2, "export_dtype": "fp32"},
    }))
    return str(path)


def train(recipe: str, *overrides: str) -> Toy:
    config = load_config(recipe, list(overrides), "sft", world_size=1)
    state = ParallelState.initialize()
    try:
        trainer, tokenizer = build_trainer(config, state)
        trainer.train()
        export_trained(trainer.model, tokenizer, trainer.checkpoints.output_dir, config.checkpoint,
                       state, trainer.features)
    finally:
        state.close()
    return trainer.features.features[-1]


def test_check_refuses_the_recipe_before_anything_is_written(recipe, tmp_path, capsys):
    assert cli_main(["sft", recipe, "train.seed=13"]) == 2
    assert "llmtune: error: toy: refused for train.seed 13; choose another seed" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_build_transform_loss_terms_state_and_export(recipe, tmp_path, monkeypatch, tiny_model):
    toy = train(recipe, f"train.output_dir={tmp_path / 'plain'}")
    plain = read_metrics(tmp_path / "plain")
    monkeypatch.setattr(Toy, "term", 0.5)
    toy = train(recipe)
    out = tmp_path / "out"
    metrics = read_metrics(out)

    assert toy.built_unsharded
    assert sorted(toy.asked) == sorted(load_file(tiny_model / "model.safetensors")), "every parameter, once"
    assert torch.equal(toy.ready_embeddings, load_file(tiny_model / "model.safetensors")["model.embed_tokens.weight"])
    assert toy.micro_batches == STEPS * ACCUMULATION
    assert [m["tokens"] for m in metrics] == [sum(toy.kept[i:i + ACCUMULATION])
                                               for i in range(0, len(toy.kept), ACCUMULATION)], \
        "the transformed labels are the ones counted"
    assert all(kept < given for kept, given in zip(toy.kept, toy.given)), "the transform dropped labels"
    # Each micro-batch adds the term to its summed loss; the step's loss is the sum over the step's labels.
    assert metrics[0]["loss"] - plain[0]["loss"] == pytest.approx(ACCUMULATION * 0.5 / metrics[0]["tokens"], rel=1e-5)

    saved = json.loads((out / "checkpoints" / "global_step_2" / "trainer_state.json").read_text())
    assert saved["features"]["toy"] == {"micro_batches": 2 * ACCUMULATION}
    resumed = train(recipe, f"checkpoint.resume_from_checkpoint={out / 'checkpoints' / 'global_step_2'}",
                    f"train.output_dir={tmp_path / 'resumed'}")
    assert resumed.restored == {"micro_batches": 2 * ACCUMULATION}

    assert json.loads((out / "hf" / "toy.json").read_text()) == sorted(load_file(out / "hf" / "model.safetensors"))
    assert cli_main(["export", str(out / "checkpoints" / "global_step_3"), str(tmp_path / "offline")]) == 0
    assert (tmp_path / "offline" / "toy.json").read_text() == (out / "hf" / "toy.json").read_text()



def test_the_banners_plan_is_made_before_a_feature_patches_the_models_family(recipe, monkeypatch, caplog):
    """A feature may patch the family's modeling module for the whole process (train.fused_kernels: Liger replaces
    Llama's RoPE by a Triton kernel). The banner's plan traces the family on meta tensors, where such a kernel
    launched by the GPU crashed CUDA: the plan is made before the features build the run's model."""
    from transformers.models.llama import modeling_llama

    class PatchesTheFamily(Feature):
        name = "patches_the_family"

        @staticmethod
        def enabled(config) -> bool:
            return True

        def build(self, hf_model, state):
            rope = modeling_llama.apply_rotary_pos_emb

            def kernel(q, k, *args, **kwargs):
                if q.is_meta:
                    raise RuntimeError("a kernel launched on meta tensors")
                return rope(q, k, *args, **kwargs)

            monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", kernel)

    monkeypatch.setattr(registry, "FEATURES", (*registry.FEATURES, PatchesTheFamily))
    caplog.set_level(logging.INFO, logger="llmtune")
    train(recipe, "train.max_steps=1", "checkpoint.save_steps=0", "checkpoint.export_hf=false")
    peak = next(line for line in caplog.messages if line.startswith("start: planned peak memory"))
    assert "per rank (llmtune plan's estimate" in peak, peak
    assert modeling_llama.apply_rotary_pos_emb.__name__ == "kernel", "the feature patched the family"
