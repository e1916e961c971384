"""Every family of tests/model_matrix.py on 2 processes (fp32, one launch for all): pt from the family's
saved folder (loaded shard by shard) trains, checkpoints and exports; resuming its step-2 checkpoint gives
bitwise the same losses and exported weights (dropout included: GPT-2's); the export loads with
from_pretrained under the names save_pretrained writes and gives the trained logits (1e-5); sft with cp=2
gives the cp=1 (dp=2) losses (1e-5 relative; dropout off) where the family allows cp (not gpt-oss's sinks).
A backend the recipe names that the class cannot run is refused up front; `auto` picks one it can.

Mixture-of-experts families load from the per-expert layout save_pretrained writes and export it back; their pt
runs log aux_loss and expert_load where the model has a router loss. With their experts split over the 2
processes (parallel.expert_parallel 2) they give the plain run's losses, router metrics and export (1e-5), and resume
its checkpoint. The cp comparison runs them with the router loss off: it is computed per cp slice (docs/moe.md),
so it is not cp-invariant."""

import json
import shutil

import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from llmtune.features.ulysses import layout_problems
from llmtune.run.cli import main as cli_main
from tests.helpers import launch_cases, read_metrics
from tests.model_matrix import FAMILIES

IDS = [family.model_type for family in FAMILIES]
CP_IDS = [family.model_type for family in FAMILIES if not layout_problems(family.hf_config(300), 2)]
ROUTER_LOSS_IDS = [family.model_type for family in FAMILIES if family.config.get("router_aux_loss_coef")]
PROBE = "The sum of 12 and 30 is 42. 7 + 8 = 15."


def save_family(family, tokenizer, folder) -> None:
    """The family's tiny config of the real class, random weights, saved by save_pretrained with the tokenizer."""
    config = family.hf_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def without_dropout(folder, copy):
    """The saved model with every dropout off: dropout draws its masks per rank and per micro-batch, so runs of
    different layouts agree only without it (GPT-2 ships with 0.1)."""
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update({key: 0.0 for key in config if "dropout" in key or key.endswith("pdrop")})
    (copy / "config.json").write_text(json.dumps(config))


def write_recipe(path, model, data, task, output_dir) -> str:
    """pt: blocks of 64 tokens; sft: packed rows of 96 (documents and sliding windows inside a row). A global
    batch of 4 rows, 2 per micro-batch: 1 accumulation step on dp=2, 2 on dp=1 x cp=2. AdamW's epsilon at 1e-6:
    an element whose gradient is near 0 (its parts cancelling) has last bits that depend on the order its parts are
    summed in, which the usual 1e-8 would turn into an update differing by a percent of the learning rate between
    layouts, where the runs' weights are compared."""
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(model)},
        "data": {"train_files": [str(data)], "max_seq_len": 64 if task == "pt" else 96,
                 **({"chat_template": "basic"} if task == "sft" else {})},
        "train": {"output_dir": str(output_dir), "max_steps": 4 if task == "pt" else 3,
                  "per_device_train_batch_size": 2, "global_batch_size": 4, "logging_steps": 1,
                  "learning_rate": 2e-3, "adam_epsilon": 1e-6},
        "checkpoint": {"export_dtype": "fp32", "export_hf": task == "pt", "save_steps": 2 if task == "pt" else 0},
        "monitor": {"console": False},
    }))
    return str(path)


@pytest.fixture(scope="module")
def matrix(bare_tokenizer, assets, sft_file, tmp_path_factory):
    """family -> its folders: model, pt, pt_resumed, sft_cp1, sft_cp2, and the pt and sft recipes."""
    probe = bare_tokenizer(PROBE)["input_ids"]
    runs, cases = {}, []
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family.model_type)
        save_family(family, bare_tokenizer, root / "model")
        without_dropout(root / "model", root / "model_without_dropout")
        folders = {"model": root / "model"}
        for name, model, data in (("pt", "model", assets / "data" / "pt.jsonl"),
                                  ("sft", "model_without_dropout", sft_file)):
            folders[f"{name}_recipe"] = write_recipe(root / f"{name}.yaml", root / model, data, name, root / name)
        folders["pt"], folders["pt_resumed"] = root / "pt", root / "pt_resumed"
        # The resumed run saves nothing: no test reads a checkpoint of it, and its saves would add seconds over the
        # families.
        cases += [{"recipe": folders["pt_recipe"], "task": "pt", "overrides": [], "probe": probe},
                  {"recipe": folders["pt_recipe"], "task": "pt", "overrides": [
                      f"train.output_dir={folders['pt_resumed']}", "checkpoint.save_steps=0",
                      f"checkpoint.resume_from_checkpoint={folders['pt'] / 'checkpoints' / 'global_step_2'}"]}]
        if family.mixture_of_experts:
            # Expert parallelism: the same pt run with each layer's 4 experts split 2 and 2 over the ranks, and the
            # plain run's step-2 checkpoint resumed with them split.
            folders["pt_ep2"], folders["pt_ep2_resumed"] = root / "pt_ep2", root / "pt_ep2_resumed"
            cases += [{"recipe": folders["pt_recipe"], "task": "pt", "overrides": [
                          f"train.output_dir={folders['pt_ep2']}", "parallel.expert_parallel=2",
                          "checkpoint.save_steps=0"]},
                      {"recipe": folders["pt_recipe"], "task": "pt", "overrides": [
                          f"train.output_dir={folders['pt_ep2_resumed']}", "parallel.expert_parallel=2",
                          "checkpoint.save_steps=0", "checkpoint.export_hf=false",
                          f"checkpoint.resume_from_checkpoint={folders['pt'] / 'checkpoints' / 'global_step_2'}"]}]
        router_loss_off = ["train.router_aux_loss_coef=0"] if family.model_type in ROUTER_LOSS_IDS else []
        for cp in (1, 2) if family.model_type in CP_IDS else (1,):
            folders[f"sft_cp{cp}"] = root / f"sft_cp{cp}"
            cases.append({"recipe": folders["sft_recipe"], "overrides": [
                f"train.output_dir={folders[f'sft_cp{cp}']}", f"parallel.cp_size={cp}", *router_loss_off]})
        runs[family.model_type] = folders
    launch_cases(cases, tmp_path_factory.mktemp("matrix"), timeout=1200)
    return runs


def losses(output_dir) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir)]


def tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.parametrize("family", IDS)
def test_pt_and_sft_train_on_two_processes(matrix, family):
    runs = matrix[family]
    assert len(losses(runs["pt"])) == 4 and len(losses(runs["sft_cp1"])) == 3
    assert all(torch.isfinite(torch.tensor(losses(runs["pt"]) + losses(runs["sft_cp1"]))))
    assert losses(runs["pt"])[-1] < losses(runs["pt"])[0], "pt learns"


@pytest.mark.parametrize("family", IDS)
def test_resumed_checkpoint_continues_bitwise(matrix, family):
    runs = matrix[family]
    assert [m["step"] for m in read_metrics(runs["pt_resumed"])] == [3, 4]
    assert losses(runs["pt_resumed"]) == losses(runs["pt"])[2:]
    resumed, straight = tensors(runs["pt_resumed"] / "hf"), tensors(runs["pt"] / "hf")
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[name], straight[name]) for name in straight)


@pytest.mark.parametrize("family", IDS)
def test_export_loads_under_saved_names_and_gives_trained_logits(matrix, family, bare_tokenizer):
    runs = matrix[family]
    assert tensors(runs["pt"] / "hf").keys() == tensors(runs["model"]).keys(), "the names save_pretrained writes"
    model = AutoModelForCausalLM.from_pretrained(runs["pt"] / "hf", dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([bare_tokenizer(PROBE)["input_ids"]])).logits
    torch.testing.assert_close(logits, torch.load(runs["pt"] / "logits.pt"), rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", CP_IDS)
def test_context_parallel_gives_the_same_losses(matrix, family):
    runs = matrix[family]
    assert len(losses(runs["sft_cp2"])) == 3
    assert losses(runs["sft_cp2"]) == pytest.approx(losses(runs["sft_cp1"]), rel=1e-5)


@pytest.mark.parametrize("family", [family.model_type for family in FAMILIES if family.mixture_of_experts])
def test_mixture_of_experts_runs_log_the_router_loss_and_expert_load(matrix, family):
    records = read_metrics(matrix[family]["pt"])
    if family in ROUTER_LOSS_IDS:
        assert all(r["aux_loss"] > 0 and 1.0 <= r["expert_load"] <= 2.0 for r in records)
    else:  # DeepSeek-V3: transformers defines no router loss for it
        assert not any("aux_loss" in r for r in records)


MOE_IDS = [family.model_type for family in FAMILIES if family.mixture_of_experts]


@pytest.mark.parametrize("family", MOE_IDS)
def test_expert_parallel_gives_the_losses_metrics_and_export_of_the_plain_run(matrix, family):
    """ep 2 (each rank holding 2 of a layer's 4 experts, its tokens sent to the other's by all-to-all): the plain
    run's losses, gradient norms, router loss and expert load (1e-5 relative), and its export under the same names;
    a plain checkpoint resumed with the experts split continues the plain curve."""
    runs = matrix[family]
    plain, split = read_metrics(runs["pt"]), read_metrics(runs["pt_ep2"])
    assert [r["step"] for r in split] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", *(("aux_loss", "expert_load") if family in ROUTER_LOSS_IDS else ())):
        assert [r[key] for r in split] == pytest.approx([r[key] for r in plain], rel=1e-5), key
    assert all(r["expert_all_to_all_mib"] > 0 for r in split)
    assert not any("expert_all_to_all_mib" in r for r in plain)
    exported, expected = tensors(runs["pt_ep2"] / "hf"), tensors(runs["pt"] / "hf")
    assert exported.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(exported[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    resumed = read_metrics(runs["pt_ep2_resumed"])
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx(losses(runs["pt"])[2:], rel=1e-5)


def test_a_backend_the_class_cannot_run_is_refused_and_auto_picks_one(matrix, tmp_path, capsys):
    """Gemma-2 has no sdpa in transformers: named, it stops the CLI before any process; auto trained above. Through
    the CLI's main in this process, which makes the refusal itself: a bin/llmtune process would add seconds of
    start-up and nothing that this check decides (tests/e2e/test_cli_errors.py checks what the process adds)."""
    recipe = matrix["gemma2"]["pt_recipe"]
    assert cli_main(["pt", recipe, "model.attn_implementation=sdpa", f"train.output_dir={tmp_path / 'out'}",
                     "--nproc", "2"]) == 2
    error = capsys.readouterr().err
    assert error.strip().splitlines() == [error.strip()]
    assert "model.attn_implementation: sdpa cannot run this model" in error
    assert "Gemma2ForCausalLM" in error and "auto" in error
    assert not (tmp_path / "out").exists()
    assert len(read_metrics(matrix["gemma2"]["pt"])) == 4, "auto (eager for Gemma-2) trained every step"
