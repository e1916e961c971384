"""The router load-balancing loss of a mixture-of-experts model (a tiny Qwen3-MoE, fp32, one process): on one
micro-batch llmtune's loss and gradients equal those of the HF model's own forward with labels and router logits on
(to 1e-5), the coefficient taken from the model config; train.router_aux_loss_coef: 0 leaves the cross-entropy
alone. With a router loss, rows do not share their sequences' beginnings (data/collate.share_prefix)."""

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from llmtune.config import load_config
from llmtune.model.loss import IGNORE_INDEX
from llmtune.run.parallel import ParallelState
from llmtune.run.worker import build_trainer


@pytest.fixture(scope="module")
def moe(bare_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_moe")
    Qwen3MoeConfig(vocab_size=len(bare_tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                   num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=256, router_aux_loss_coef=0.3,
                   bos_token_id=bare_tokenizer.bos_token_id, eos_token_id=bare_tokenizer.eos_token_id,
                   pad_token_id=bare_tokenizer.pad_token_id).save_pretrained(folder)
    return folder


def step_of_one_batch(moe, assets, tmp_path, overrides):
    """(loss, gradients by name, weights by name) of llmtune's model on one batch of 2 rows, and the batch."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"config": str(moe), "tokenizer": str(assets / "tokenizer")},
        "data": {"train_files": [str(assets / "data" / "pt.jsonl")], "max_seq_len": 64},
        "train": {"output_dir": str(tmp_path / "out"), "max_steps": 1},
        "checkpoint": {"export_hf": False},
    }))
    state = ParallelState.initialize()
    try:
        trainer, tokenizer = build_trainer(load_config(str(recipe), overrides, "pt", 1), state)
        torch.manual_seed(0)
        input_ids = torch.randint(3, len(tokenizer), (2, 24))
        labels = input_ids.clone()
        labels[0, :5] = IGNORE_INDEX
        shift_labels = torch.cat([labels[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
        inputs = trainer.features.transform({"input_ids": input_ids, "shift_labels": shift_labels})
        loss = trainer.model(**inputs) / (shift_labels != IGNORE_INDEX).sum()
        loss.backward()
        named = list(trainer.model.hf_model.named_parameters())
        grads = {name: param.grad.full_tensor() for name, param in named}
        weights = {name: param.full_tensor().detach() for name, param in named}
        shares = trainer.features.keep_shared_prefixes()
    finally:
        state.close()
    return loss.item(), grads, weights, input_ids, labels, shares


@pytest.mark.parametrize("overrides, router_logits", [([], True), (["train.router_aux_loss_coef=0"], False)])
def test_loss_and_gradients_are_the_hf_models_own(moe, assets, tmp_path, overrides, router_logits):
    loss, grads, weights, input_ids, labels, shares = step_of_one_batch(moe, assets, tmp_path, overrides)
    # A router's loss would count a prefix shared by two sequences (an rm pair's prompt) once: rows keep it twice.
    assert shares is not router_logits
    reference = AutoModelForCausalLM.from_config(Qwen3MoeConfig.from_pretrained(moe), dtype=torch.float32)
    reference.load_state_dict(weights, strict=False)
    output = reference(input_ids=input_ids, labels=labels, output_router_logits=router_logits)
    output.loss.backward()
    if router_logits:
        assert output.aux_loss.item() > 0
    assert loss == pytest.approx(output.loss.item(), rel=1e-5)
    for name, param in reference.named_parameters():
        # An entry near 0 keeps the rounding of the terms it sums, on the scale of the tensor's largest entries: up to
        # 7e-7 of that seen (the embedding's; AVX-512 and plain SSE kernels), so 1e-5 of it, as
        # tests/dist/test_context_parallel.py allows (1e-7 absolute left a factor of 3).
        scale = param.grad.abs().max().item()
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-5 * scale, msg=name)
