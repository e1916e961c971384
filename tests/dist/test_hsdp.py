"""HSDP and the resharding knobs on 4 processes (gloo, fp32), every case in one launch: replicate 2 x shard 2,
replicate 2 x shard 1 x cp 2 (a 3-D mesh), partial resharding (groups of 2) with no resharding between micro-batches
and a prefetch of 2 layers, and HSDP with every layer kept gathered from forward to backward and no prefetch, each
give the per-step losses and gradient norms of plain FSDP over the 4 ranks (1e-5 relative) on the same global batch
with accumulation. A checkpoint written by replicate 2 x shard 2 loads at shard 4, and that one at replicate 4 x
shard 1, with parameters and AdamW state bitwise equal to what was written; a run resumed from it at shard 4
continues the HSDP run's curve. QLoRA's 4-bit base trains the same losses sharded within replica groups of 2 and
replicated on every rank."""

import math

import pytest
import yaml

from tests.helpers import assert_loads_bitwise, flat, launch_cases, read_metrics, saved_state

SAVED = "checkpoints/global_step_2"
# name: (the case's overrides of the recipe, whether it only resaves the checkpoint it resumes from)
TRAINED = {"plain": [],
           "hsdp": ["parallel.dp_replicate=2"],
           "hsdp_cp": ["parallel.dp_replicate=2", "parallel.cp_size=2"],
           "partial_kept_prefetch2": ["parallel.reshard_after_forward=2",
                                      "parallel.reshard_between_micro_batches=false", "parallel.prefetch_layers=2"],
           "hsdp_gathered_no_prefetch": ["parallel.dp_replicate=2", "parallel.reshard_after_forward=false",
                                         "parallel.prefetch_layers=0"]}

# QLoRA's 4-bit base (whose weights split whole over 2 ranks, not 4) sharded within replica groups of 2, and
# replicated whole on every rank (a copy sharded over one rank: FSDP2 leaves the 4-bit weights alone there).
QLORA = {"qlora_hsdp": ["parallel.dp_replicate=2"], "qlora_replicate4": ["parallel.dp_replicate=4"]}


def recipe(root, tiny_model, sft_file) -> str:
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(sft_file)], "chat_template": "basic", "packing": False, "max_seq_len": 64},
        "train": {"output_dir": str(root / "out"), "max_steps": 4, "per_device_train_batch_size": 1,
                  "global_batch_size": 8, "logging_steps": 1, "learning_rate": 2e-3, "warmup_ratio": 0},
        "checkpoint": {"export_hf": False, "save_steps": 2},
        "monitor": {"plots": False},
    }))
    return str(path)


@pytest.fixture(scope="module")
def runs(tiny_model, nf4_llama, sft_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp")
    path = recipe(root, tiny_model, sft_file)
    out = {name: root / name for name in [*TRAINED, *QLORA, "at_shard4", "at_replicate4", "resumed"]}
    cases = [{"recipe": path, "overrides": [*overrides, f"train.output_dir={out[name]}"]}
             for name, overrides in TRAINED.items()]
    cases += [{"recipe": path, "overrides": [f"model.name_or_path={nf4_llama}", "peft.method=qlora",
                                             "checkpoint.save_steps=0", *overrides, f"train.output_dir={out[name]}"]}
              for name, overrides in QLORA.items()]
    cases += [{"recipe": path, "resave": True, "overrides": [
                  f"train.output_dir={out['at_shard4']}", f"checkpoint.resume_from_checkpoint={out['hsdp'] / SAVED}"]},
              {"recipe": path, "resave": True, "overrides": [
                  f"train.output_dir={out['at_replicate4']}", "parallel.dp_replicate=4",
                  f"checkpoint.resume_from_checkpoint={out['at_shard4'] / SAVED}"]},
              {"recipe": path, "overrides": [
                  f"train.output_dir={out['resumed']}", f"checkpoint.resume_from_checkpoint={out['hsdp'] / SAVED}"]}]
    launch_cases(cases, root, nproc=4)
    return out


def curve(output_dir) -> list[tuple[int, float, float]]:
    return [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(output_dir) if "loss" in m]


@pytest.mark.parametrize("name", [name for name in TRAINED if name != "plain"])
def test_layout_gives_the_losses_of_plain_fsdp(runs, name):
    expected, got = curve(runs["plain"]), curve(runs[name])
    assert [step for step, _, _ in expected] == [1, 2, 3, 4]
    assert [step for step, _, _ in got] == [1, 2, 3, 4]
    assert [loss for _, loss, _ in got] == pytest.approx([loss for _, loss, _ in expected], rel=1e-5)
    assert [norm for _, _, norm in got] == pytest.approx([norm for _, _, norm in expected], rel=1e-5)


def test_qlora_trains_the_same_losses_sharded_within_groups_or_replicated(runs):
    sharded, replicated = curve(runs["qlora_hsdp"]), curve(runs["qlora_replicate4"])
    assert [step for step, _, _ in sharded] == [1, 2, 3, 4]
    assert all(math.isfinite(loss) for _, loss, _ in sharded)
    assert [loss for _, loss, _ in replicated] == pytest.approx([loss for _, loss, _ in sharded], rel=1e-5)
    assert [norm for _, _, norm in replicated] == pytest.approx([norm for _, _, norm in sharded], rel=1e-5)


def test_checkpoint_written_by_hsdp_loads_bitwise_at_other_layouts(runs, tmp_path):
    written = flat(saved_state(runs["hsdp"] / SAVED, tmp_path))
    assert any(key.startswith("optim.state.") for key in written)
    for layout in ("at_shard4", "at_replicate4"):
        assert_loads_bitwise(written, flat(saved_state(runs[layout] / SAVED, tmp_path)), layout)


def test_resume_at_another_layout_continues_the_curve(runs):
    hsdp, resumed = curve(runs["hsdp"]), curve(runs["resumed"])
    assert [step for step, _, _ in resumed] == [3, 4]
    assert [loss for _, loss, _ in resumed] == pytest.approx([loss for _, loss, _ in hsdp[2:]], rel=1e-5)
