"""Layout invariance with a mixture-of-experts model (a tiny Qwen3-MoE from its config, fp32, pt, the router's
load-balancing loss on): the same micro-batches on (2 processes, accumulation 1) and (1 process, accumulation 2)
give the same losses (1e-5 relative) and step-1 gradients (1e-5). This is the invariance the router loss has: each
micro-batch's aux loss enters weighted by its labelled tokens, so spreading the same micro-batches over ranks and
accumulation steps changes nothing (their size would: the aux loss of a batch is not the mean of its parts')."""


import pytest
import torch
import yaml
from transformers import Qwen3MoeConfig

from tests.dist.case_worker import run_case
from tests.helpers import launch_cases, read_metrics


@pytest.fixture(scope="module")
def runs(bare_tokenizer, assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    shapes = dict(vocab_size=len(bare_tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=256, router_aux_loss_coef=0.3, bos_token_id=bare_tokenizer.bos_token_id,
                  eos_token_id=bare_tokenizer.eos_token_id, pad_token_id=bare_tokenizer.pad_token_id)
    Qwen3MoeConfig(num_hidden_layers=2, **shapes).save_pretrained(root / "model")
    # 3 layers, the middle one dense: the per-layer expert load is named by decoder layer.
    Qwen3MoeConfig(num_hidden_layers=3, mlp_only_layers=[1], **shapes).save_pretrained(root / "model_dense_middle")
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"config": str(root / "model"), "tokenizer": str(assets / "tokenizer")},
        "data": {"train_files": [str(assets / "data" / "pt.jsonl")], "max_seq_len": 64},
        "train": {"max_steps": 3, "per_device_train_batch_size": 2, "global_batch_size": 4, "logging_steps": 1,
                  "learning_rate": 5e-3},
        "checkpoint": {"export_hf": False},
        "monitor": {"console": False},
    }))
    out = {name: root / name for name in ("dp2", "dp1", "dp1_without_router_loss", "dense_middle")}
    launch_cases([{"recipe": str(recipe), "task": "pt", "overrides": [f"train.output_dir={out['dp2']}"]}], root,
                 timeout=600)
    run_case(str(recipe), [f"train.output_dir={out['dp1']}"], 1, task="pt")
    run_case(str(recipe), [f"train.output_dir={out['dp1_without_router_loss']}", "train.router_aux_loss_coef=0"], 1,
             task="pt")
    run_case(str(recipe), [f"train.output_dir={out['dense_middle']}", f"model.config={root / 'model_dense_middle'}"],
             1, task="pt")
    return out


def losses(output_dir) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir)]


def test_the_same_micro_batches_on_any_layout_give_the_same_losses_and_gradients(runs):
    assert len(losses(runs["dp2"])) == 3
    assert losses(runs["dp1"]) == pytest.approx(losses(runs["dp2"]), rel=1e-5)
    two, one = torch.load(runs["dp2"] / "grads.pt"), torch.load(runs["dp1"] / "grads.pt")
    assert two.keys() == one.keys()
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-5, msg=name)


def test_the_router_loss_is_in_the_loss(runs):
    with_router, without = losses(runs["dp1"]), losses(runs["dp1_without_router_loss"])
    # Routing is near uniform at initialisation, where the aux loss is the experts per token (2): 0.3 x 2.
    assert with_router[0] - without[0] == pytest.approx(0.3 * 2, rel=0.05)


def test_metrics_have_the_aux_loss_and_the_expert_load(runs):
    """The same on any layout; aux_loss is what the loss adds over 0.3; the load is at least 1 (balanced) and at
    most experts / experts per token (2)."""
    for name in ("dp2", "dp1"):
        records = read_metrics(runs[name])
        assert all(1.0 <= r["expert_load"] <= 2.0 for r in records)
    two, one = read_metrics(runs["dp2"]), read_metrics(runs["dp1"])
    assert [r["aux_loss"] for r in two] == pytest.approx([r["aux_loss"] for r in one], rel=1e-5)
    assert [r["expert_load"] for r in two] == [r["expert_load"] for r in one]
    without = read_metrics(runs["dp1_without_router_loss"])
    assert "aux_loss" not in without[0]
    assert one[0]["loss"] - without[0]["loss"] == pytest.approx(0.3 * one[0]["aux_loss"], rel=1e-5)


def test_the_expert_load_of_each_layer_is_logged_by_its_decoder_layer(runs):
    """expert_load/layer_<i> for each decoder layer with experts, the dense ones left out; expert_load is the
    largest."""
    for name, layers in (("dp1", [0, 1]), ("dense_middle", [0, 2])):
        for record in read_metrics(runs[name]):
            loads = {key: value for key, value in record.items() if key.startswith("expert_load/")}
            assert sorted(loads) == [f"expert_load/layer_{i}" for i in layers], name
            assert all(1.0 <= load <= 2.0 for load in loads.values())
            assert record["expert_load"] == max(loads.values())
