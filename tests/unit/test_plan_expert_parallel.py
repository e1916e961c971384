"""`llmtune plan` under parallel.expert_parallel: each rank stores the same share of the experts as without it, but
a layer gathers only its rank's E/N experts; the all-to-all buffers of the layer in flight (balanced routing) and
the outputs sent back that each layer keeps are added; the render names the experts and the buffers; the fit advice
offers expert parallelism for a mixture of experts. Every expected number is computed here from the model's shapes.
Predicted against measured: benchmarks/plan_accuracy.py."""

import pytest
import torch
import yaml
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

from llmtune.config import load_config
from llmtune.model.build import load_model_config
from llmtune.model.expert_parallel import shard_experts
from llmtune.run import cli
from llmtune.run.parallel import ParallelState
from llmtune.run.plan import GIB, USABLE_FRACTION, changes, cheapest_fit, gib, plan_memory, shard_bytes
from tests.unit.test_plan import real_saved_bytes

HIDDEN, EXPERTS, MOE_INTERMEDIATE, TOP_K, LAYERS = 128, 8, 64, 2, 2
MOE = dict(vocab_size=256, hidden_size=HIDDEN, intermediate_size=344, num_hidden_layers=LAYERS,
           num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=MOE_INTERMEDIATE,
           num_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=1024)
SEQ_LEN, MICRO_BATCH = 256, 2
# One layer's experts: gate_up_proj [E, 2I, H] and down_proj [E, H, I], bf16.
EXPERTS_BYTES = EXPERTS * 3 * MOE_INTERMEDIATE * HIDDEN * 2
# One layer's (token, expert) pairs' hidden states, bf16.
PAIRS_BYTES = MICRO_BATCH * SEQ_LEN * TOP_K * HIDDEN * 2


@pytest.fixture
def moe_recipe(tmp_path):
    model = tmp_path / "moe"
    Qwen3MoeConfig(**MOE).save_pretrained(model)

    def write(**train):
        recipe = {"model": {"config": str(model), "tokenizer": str(model)},
                  "data": {"train_files": ["not/needed.jsonl"], "max_seq_len": SEQ_LEN},
                  "train": {"output_dir": str(tmp_path / "out"), "bf16": True,
                            "per_device_train_batch_size": MICRO_BATCH, "gradient_accumulation_steps": 2, **train}}
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe))
        return str(path)
    return write


def planned(recipe: str, world_size: int, *overrides: str):
    config = load_config(recipe, list(overrides), "pt", world_size)
    return plan_memory(config, load_model_config(config.model), world_size)


def test_shard_bytes_of_a_split_parameter_shards_one_part():
    # 8 experts split in 2: 4 of them over 2 ranks, 2 rows of 3 x 5 each.
    assert shard_bytes(torch.empty(8, 3, 5, device="meta"), 2, 2, split=2) == 2 * 15 * 2
    # 6 split in 2: 3 over 2 ranks, padded to ceil(3 / 2) = 2 rows.
    assert shard_bytes(torch.empty(6, 4, device="meta"), 2, 4, split=2) == 2 * 4 * 4


@pytest.mark.parametrize("world_size, overrides", [(4, []), (8, ["parallel.dp_replicate=2"])])
def test_each_rank_stores_the_same_share_of_the_experts_but_gathers_only_its_own(moe_recipe, world_size,
                                                                                   overrides):
    """ep 2 over 4 shard ranks: each rank's 4 experts sharded over 2 (efsdp), 1/4 of them as plain FSDP stores; a
    layer gathers 4 of its 8 experts, so half its experts' bytes less, in each of the 3 layers gathered at the
    peak (the one in backward, the one prefetched, one layer's gradient). Under HSDP the same within a copy."""
    plain = planned(moe_recipe(), world_size, *overrides)
    split = planned(moe_recipe(), world_size, *overrides, "parallel.expert_parallel=2")
    assert (split.params, split.grads, split.optimizer) == (plain.params, plain.grads, plain.optimizer)
    assert plain.largest_layer - split.largest_layer == EXPERTS_BYTES // 2
    assert plain.all_layers - split.all_layers == LAYERS * EXPERTS_BYTES // 2
    assert plain.gathered - split.gathered == 3 * EXPERTS_BYTES // 2
    assert (split.experts, split.layout.ep, split.layout.efsdp) == (EXPERTS, 2, 2)


def test_the_dispatch_buffers_are_three_times_the_pairs_hidden_states_with_balanced_routing(moe_recipe):
    """Per rank, the layer in backward holds its pairs sorted to be sent, those received and the outputs sent
    back: 3 x (micro-batch x tokens x k) rows of the hidden size in bf16; a rank that receives all of its ep
    group's pairs, ep times the received and returned rows."""
    plain = planned(moe_recipe(), 4)
    split = planned(moe_recipe(), 4, "parallel.expert_parallel=2")
    quarters = planned(moe_recipe(), 4, "parallel.expert_parallel=4")
    assert plain.dispatch == plain.dispatch_worst == 0
    assert split.dispatch == quarters.dispatch == 3 * PAIRS_BYTES
    assert split.dispatch_worst == (1 + 2 * 2) * PAIRS_BYTES
    assert quarters.dispatch_worst == (1 + 2 * 4) * PAIRS_BYTES
    assert split.peak - plain.peak == 3 * PAIRS_BYTES + LAYERS * PAIRS_BYTES - 3 * EXPERTS_BYTES // 2
    # A layer's 2 experts alone, each whole on its rank (efsdp 1).
    assert plain.largest_layer - quarters.largest_layer == EXPERTS_BYTES * 3 // 4


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_split_forward_also_keeps_the_returned_outputs_of_each_layer(moe_recipe, checkpointing):
    """For the routing weights' gradient each MoE layer keeps the [T x k, hidden] outputs its experts' ranks sent
    back: every layer's until backward, or with checkpointing the one recomputed."""
    plain = planned(moe_recipe(gradient_checkpointing=checkpointing), 4)
    split = planned(moe_recipe(gradient_checkpointing=checkpointing), 4, "parallel.expert_parallel=2")
    assert split.activations - plain.activations == (1 if checkpointing else LAYERS) * PAIRS_BYTES
    other = "none" if checkpointing else "full"
    assert split.activations_by_mode[other] - plain.activations_by_mode[other] == \
        (LAYERS if checkpointing else 1) * PAIRS_BYTES


def test_the_activations_of_a_split_model_are_what_its_forward_saves(moe_recipe):
    """A real forward of the experts split over an ep group of one rank, where every pair stays (balanced), saves
    what the plan counts for the same layers and micro-batch (fp32, the weights left out as the plan leaves them),
    but for the pairs' order (int64) and routing weights each split layer keeps too: 12 bytes a pair, 0.2% here."""
    plan = planned(moe_recipe(bf16=False), 2, "parallel.expert_parallel=2")
    state = ParallelState.initialize()
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**MOE), attn_implementation="sdpa",
                                                 dtype=torch.float32)
        shard_experts(model, init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)))
        saved = real_saved_bytes(model, torch.randint(0, 256, (MICRO_BATCH, SEQ_LEN)))
    finally:
        state.close()
    assert saved - plan.activations == LAYERS * MICRO_BATCH * SEQ_LEN * TOP_K * (8 + 4)


def test_whole_gradients_between_micro_batches_are_the_ranks_own_experts(moe_recipe):
    plain = planned(moe_recipe(), 4, "parallel.reshard_between_micro_batches=false")
    split = planned(moe_recipe(), 4, "parallel.reshard_between_micro_batches=false", "parallel.expert_parallel=2")
    assert plain.kept_whole and split.kept_whole
    # fp32: half of every layer's experts' gradients.
    assert plain.whole_grads - split.whole_grads == LAYERS * EXPERTS_BYTES * 2 // 2


def test_plan_names_the_experts_per_rank_and_the_dispatch_buffers(moe_recipe, capsys):
    assert cli.main(["plan", moe_recipe(), "--nproc", "4", "--task", "pt", "parallel.expert_parallel=2"]) == 0
    out = capsys.readouterr().out
    split = planned(moe_recipe(), 4, "parallel.expert_parallel=2")
    assert "experts per rank: 4 of each layer's 8, each sharded over 2 ranks; a layer gathers only these 4" in out
    assert f"  expert all-to-all buffers, balanced routing          {gib(split.dispatch)}\n" in out
    assert f"    (all pairs to one rank's experts: {gib(split.dispatch_worst)})\n" in out
    assert cli.main(["plan", moe_recipe(), "--nproc", "4", "--task", "pt", "parallel.expert_parallel=4"]) == 0
    assert "experts per rank: 2 of each layer's 8, each whole on the rank; a layer gathers only these 2" in \
        capsys.readouterr().out
    assert cli.main(["plan", moe_recipe(), "--nproc", "4", "--task", "pt"]) == 0
    out = capsys.readouterr().out
    assert "experts per rank" not in out and "all-to-all" not in out


def offered(recipe: str, world_size: int, *overrides: str) -> list[str]:
    config = load_config(recipe, list(overrides), "pt", world_size)
    return [change for change, _, _ in changes(config, world_size, load_model_config(config.model))]


def test_the_fit_advice_offers_expert_parallelism_after_the_free_changes_and_before_smaller_micro_batches(
        moe_recipe):
    """Each degree that divides the shard ranks and the experts (2 and 4 of 4 ranks; 8 would exceed them), after
    the chunked loss and before a smaller micro-batch; none beside context parallelism, whose ranks it cannot
    share yet, and none for a model without experts."""
    names = offered(moe_recipe(chunk_loss_size=0), 4)
    ep = [i for i, name in enumerate(names) if name.startswith("parallel.expert_parallel")]
    assert [names[i] for i in ep] == [
        "parallel.expert_parallel: 2 (each rank gathers 4 of a layer's 8 experts, tokens sent to them by all-to-all)",
        "parallel.expert_parallel: 4 (each rank gathers 2 of a layer's 8 experts, tokens sent to them by all-to-all)"]
    assert names.index("train.chunk_loss_size: 1024") < ep[0]
    assert ep[-1] < names.index(next(n for n in names if n.startswith("train.per_device_train_batch_size")))
    assert [n for n in offered(moe_recipe(), 4, "parallel.expert_parallel=2") if "expert_parallel" in n] == [
        "parallel.expert_parallel: 4 (each rank gathers 2 of a layer's 8 experts, tokens sent to them by all-to-all)"]
    assert not any("expert_parallel" in n for n in offered(moe_recipe(), 4, "parallel.cp_size=2"))


def test_the_cheapest_change_is_expert_parallelism_where_the_gathered_experts_do_not_fit(moe_recipe):
    """Rows of 32 tokens: the dispatch buffers and the outputs the recomputed layer keeps (4 x 2 x 32 x 2 pairs of
    128 bf16 values, 128 KiB) are less than the experts a layer no longer gathers (3 layers x 4 experts, 576 KiB),
    so ep 2 lowers the peak; with checkpointing and the chunked loss already on, it is the first change offered."""
    short = "data.max_seq_len=32"
    config = load_config(moe_recipe(gradient_checkpointing=True), [short], "pt", 4)
    model_config = load_model_config(config.model)
    split = planned(moe_recipe(gradient_checkpointing=True), 4, short, "parallel.expert_parallel=2")
    assert plan_memory(config, model_config, 4).peak - split.peak == 3 * EXPERTS_BYTES // 2 - 4 * 2 * 32 * 2 * 128 * 2
    device = split.peak / GIB / USABLE_FRACTION * 1.001
    assert cheapest_fit(config, model_config, 4, device).startswith("parallel.expert_parallel: 2 ")


def test_no_expert_parallelism_is_offered_for_a_dense_model(moe_recipe, tmp_path):
    dense = tmp_path / "dense"
    LlamaConfig(**{key: MOE[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                             "num_attention_heads", "num_key_value_heads")}).save_pretrained(dense)
    assert not any("expert_parallel" in n for n in offered(moe_recipe(), 4, f"model.config={dense}"))
