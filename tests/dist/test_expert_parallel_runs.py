"""Expert parallelism in real runs on 4 processes (gloo, fp32, one launch for every case), a tiny Qwen3-MoE (4
experts, 2 per token, router loss on) loaded from the per-expert layout save_pretrained writes, pt with a global
batch of 8 rows of 1 (2 micro-batches per rank and step):
- ep 2 x efsdp 2 (each rank holding 2 experts per layer, each expert sharded over the 2 ranks of the other ep
  group's position), ep 4 (one expert per rank) with activation checkpointing (the all-to-alls recomputed in the
  backward) and the layers resharded to groups of 2 after forward, and HSDP (replicate 2) x ep 2 give the per-step losses, gradient norms, router loss and expert load of
  plain FSDP2 over the 4 ranks (1e-5 relative), and ep 2's export is the plain run's;
- a checkpoint written at ep 2 x efsdp 2 loads at ep 4, which saves it again, and that one loads at ep 1, with
  every model and AdamW tensor bitwise what was written; a run resumed from it at ep 1 continues the ep 2 curve."""

import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from tests.helpers import assert_loads_bitwise, flat, launch_cases, read_metrics, saved_state
from tests.model_matrix import FAMILIES

SAVED = "checkpoints/global_step_2"
QWEN3_MOE = next(family for family in FAMILIES if family.model_type == "qwen3_moe")
TRAINED = {"plain": [],
           "ep2": ["parallel.expert_parallel=2", "checkpoint.save_steps=2", "checkpoint.export_hf=true"],
           # Layers resharded to groups of 2 ranks after forward, which the experts' single efsdp rank cannot be:
           # they reshard fully.
           "ep4_recomputed_partial": ["parallel.expert_parallel=4", "train.gradient_checkpointing=true",
                                      "parallel.reshard_after_forward=2"],
           "hsdp_ep2": ["parallel.dp_replicate=2", "parallel.expert_parallel=2"]}
COMPARED = ("loss", "grad_norm", "aux_loss", "expert_load")


@pytest.fixture(scope="module")
def runs(bare_tokenizer, assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_parallel_runs")
    config = QWEN3_MOE.hf_config(len(bare_tokenizer), bare_tokenizer.bos_token_id, bare_tokenizer.eos_token_id,
                                 bare_tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    bare_tokenizer.save_pretrained(root / "model")
    recipe = root / "recipe.yaml"
    # AdamW's epsilon at 1e-6, as tests/dist/test_model_matrix.py's (why there): the exports are compared.
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(root / "model")},
        "data": {"train_files": [str(assets / "data" / "pt.jsonl")], "max_seq_len": 64},
        "train": {"max_steps": 4, "per_device_train_batch_size": 1, "global_batch_size": 8, "logging_steps": 1,
                  "learning_rate": 2e-3, "adam_epsilon": 1e-6},
        "checkpoint": {"export_hf": False, "save_steps": 0, "export_dtype": "fp32"},
        "monitor": {"console": False, "plots": False},
    }))
    out = {name: root / name for name in [*TRAINED, "at_ep4", "at_ep1", "resumed_at_ep1"]}
    cases = [{"recipe": str(recipe), "task": "pt", "overrides": [*overrides, f"train.output_dir={out[name]}"]}
             for name, overrides in TRAINED.items()]
    cases[0]["overrides"].append("checkpoint.export_hf=true")
    cases += [{"recipe": str(recipe), "task": "pt", "resave": True, "overrides": [
                  f"train.output_dir={out['at_ep4']}", "parallel.expert_parallel=4",
                  f"checkpoint.resume_from_checkpoint={out['ep2'] / SAVED}"]},
              {"recipe": str(recipe), "task": "pt", "resave": True, "overrides": [
                  f"train.output_dir={out['at_ep1']}", f"checkpoint.resume_from_checkpoint={out['at_ep4'] / SAVED}"]},
              {"recipe": str(recipe), "task": "pt", "overrides": [
                  f"train.output_dir={out['resumed_at_ep1']}", f"checkpoint.resume_from_checkpoint={out['ep2'] / SAVED}"]}]
    launch_cases(cases, root, nproc=4)
    return out


def records(output_dir) -> list[dict]:
    return [record for record in read_metrics(output_dir) if "loss" in record]


@pytest.mark.parametrize("name", [name for name in TRAINED if name != "plain"])
def test_expert_parallel_layout_gives_the_metrics_of_plain_fsdp(runs, name):
    expected, got = records(runs["plain"]), records(runs[name])
    assert [r["step"] for r in got] == [r["step"] for r in expected] == [1, 2, 3, 4]
    for key in COMPARED:
        assert [r[key] for r in got] == pytest.approx([r[key] for r in expected], rel=1e-5), key
    assert all(r["expert_all_to_all_mib"] > 0 for r in got)


def tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(folder / "hf" / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_expert_parallel_export_is_the_plain_runs(runs):
    exported, expected = tensors(runs["ep2"]), tensors(runs["plain"])
    assert exported.keys() == expected.keys()
    assert any(".experts.3.down_proj." in name for name in exported), "the Hub's per-expert layout"
    for name in expected:
        torch.testing.assert_close(exported[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_checkpoint_written_at_one_expert_parallel_degree_loads_bitwise_at_others(runs, tmp_path):
    written = flat(saved_state(runs["ep2"] / SAVED, tmp_path))
    assert any(".experts.gate_up_proj" in key and key.startswith("optim.state.") for key in written)
    for layout in ("at_ep4", "at_ep1"):
        assert_loads_bitwise(written, flat(saved_state(runs[layout] / SAVED, tmp_path)), layout)


def test_resume_without_expert_parallelism_continues_the_curve(runs):
    split, resumed = records(runs["ep2"]), records(runs["resumed_at_ep1"])
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in split[2:]], rel=1e-5)
