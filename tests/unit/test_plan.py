"""`llmtune plan`: the meta-device trace counts what a real forward saves, the sizes are those the run shards, and
the command refuses what the run refuses, with the run's messages; train.per_device_train_batch_size: auto takes the
largest micro-batch whose plan fits. Predicted against measured peaks: tests/dist/test_plan_peaks.py."""

import copy
import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import yaml
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen3MoeConfig

from llmtune.config import load_config
from llmtune.errors import UserError
from llmtune.model.build import decoder_layers, load_model_config
from llmtune.run import cli
from llmtune.run.micro_batch import decide_auto
from llmtune.run.plan import (GIB, USABLE_FRACTION, auto_micro_batch, changes, cheapest_fit, device_memory_gib, gib,
                              loss_bytes, plan_memory, render, saved_activations, shard_bytes)
from tests.helpers import run_cli_imports

LLAMA = dict(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def real_saved(hf_model, ids) -> dict[int, int]:
    """{storage address: bytes} of every storage autograd saves in a real forward of the decoder."""
    storages = {}

    def keep(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        hf_model.get_decoder()(input_ids=ids, use_cache=False)
    return storages


def real_saved_bytes(hf_model, ids) -> int:
    """What a real forward saves but the model's weights (which FSDP2 frees after forward; a DTensor's, its rank's
    rows)."""
    weights = {(p.to_local() if isinstance(p, DTensor) else p).data_ptr() for p in hf_model.parameters()}
    return sum(nbytes for address, nbytes in real_saved(hf_model, ids).items() if address not in weights)


@pytest.mark.parametrize("config, dtype", [
    (LlamaConfig(**LLAMA), torch.float32),
    (LlamaConfig(**LLAMA), torch.bfloat16),
    # Mixture of experts: the grouped expert matmuls, in fp32 (whose meta function refuses fp32) and bf16.
    (Qwen3MoeConfig(**LLAMA, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2), torch.float32),
    (Qwen3MoeConfig(**LLAMA, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2), torch.bfloat16),
])
def test_meta_trace_counts_what_a_real_forward_saves(config, dtype):
    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    ids = torch.randint(0, 256, (2, 256))
    outside, per_layer, routed, kept = saved_activations(meta, decoder_layers(meta), 2, 256)
    assert outside + sum(per_layer) == real_saved_bytes(real, ids)
    if not isinstance(config, Qwen3MoeConfig):
        # Selective checkpointing's: the outputs of the first, third, ... matmul (q, v, gate and down projections,
        # of 128, 64, 344 and 128 values a token) and attention's (128 values a token and a logsumexp in fp32 for
        # each of 4 heads).
        tokens = 2 * 256
        assert kept == [tokens * ((128 + 64 + 344 + 128 + 128) * dtype.itemsize + 4 * 4)] * 2
    assert len(per_layer) == 2 and per_layer[0] > 0 and outside > 0
    # The (token, expert) pairs' hidden states of each layer: 2 x 256 tokens, 2 experts each, 128 values of `dtype`.
    pairs = 2 * 256 * 2 if isinstance(config, Qwen3MoeConfig) else 0
    assert routed == [pairs * 128 * dtype.itemsize] * 2
    # What the trace leaves out is every weight of the decoder but the embeddings (a lookup keeps only the ids).
    saved = real_saved(real, ids)
    decoder = real.get_decoder()
    assert sum(saved[p.data_ptr()] for p in decoder.parameters() if p.data_ptr() in saved) == \
        sum(p.nbytes for p in decoder.parameters()) - decoder.embed_tokens.weight.nbytes


def test_a_class_without_sdpa_is_planned_with_the_eager_attention_auto_gives_it(tmp_path):
    """Gemma-2 has no sdpa in transformers: `auto` runs it with eager attention, which saves the [sequence, sequence]
    weights, and the plan traces that forward (asking for sdpa, transformers refuses the class)."""
    config = Gemma2Config(**LLAMA, head_dim=32, query_pre_attn_scalar=32)
    config.save_pretrained(tmp_path)
    recipe = load_config({"model": {"config": str(tmp_path), "tokenizer": str(tmp_path)},
                          "data": {"train_files": ["not/needed.jsonl"], "max_seq_len": 256},
                          "train": {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2}},
                         [], "pt", world_size=1)
    plan = plan_memory(recipe, config, 1)
    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert real.config._attn_implementation == "eager"
    assert plan.activations == real_saved_bytes(real, torch.randint(0, 256, (2, 256)))


def test_shard_bytes_is_fsdp2_dim0_split_padded():
    assert shard_bytes(torch.empty(10, 3, device="meta"), 4, 4) == 3 * 3 * 4  # ceil(10 / 4) rows of 3
    assert shard_bytes(torch.empty(8, device="meta"), 2, 2) == 4 * 2


def test_loss_bytes_by_path():
    # Chunked, fp32, lm_head trained: hidden grads [T, H] + the fp32 head grad [V, H] + one fp32 [chunk, V] block.
    assert loss_bytes(100, 8, 50, 32, 4, True) == 100 * 8 * 4 + 50 * 8 * 4 + 32 * 50 * 4
    # bf16 adds the head grad's bf16 copy and the block's bf16 matmul output; a frozen head has no head grad.
    assert loss_bytes(100, 8, 50, 32, 2, False) == 100 * 8 * 2 + 32 * 50 * 6
    assert loss_bytes(100, 8, 50, 0, 4, True) == 100 * 50 * 12


@pytest.fixture
def four_layers(tmp_path):
    folder = tmp_path / "four_layers"
    LlamaConfig(**{**LLAMA, "num_hidden_layers": 4}, max_position_embeddings=1024).save_pretrained(folder)
    return folder


@pytest.fixture
def plan_recipe(tmp_path):
    model = tmp_path / "model"
    LlamaConfig(**LLAMA, max_position_embeddings=1024).save_pretrained(model)

    def write(**train):
        recipe = {"model": {"config": str(model), "tokenizer": str(model)},
                  "data": {"train_files": ["not/needed.jsonl"], "max_seq_len": 512},
                  "train": {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4,
                            "global_batch_size": 16, **train}}
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe))
        return str(path)
    return write


def test_plan_prints_the_parts_layout_and_tokens(plan_recipe, capsys):
    assert cli.main(["plan", plan_recipe(), "--nproc", "2", "--task", "pt"]) == 0
    out = capsys.readouterr().out
    assert "layout: 2 rank(s) = replicate 1 x shard 2 x cp 1; every parameter sharded over 2 rank(s)" in out
    # 16 rows of 512 tokens per optimizer step; 4 rows per micro-batch on 2 ranks: accumulation 2.
    assert "accumulation 2; 8,192 tokens per optimizer step" in out
    for part in ("parameters", "gradients", "optimizer state", "decoder layers gathered, with one gradient",
                 "activations per micro-batch, checkpointing none", "(selective: ", ", full: ", "loss (chunked, 1024 tokens)",
                 "peak of a training step", "give --device-memory GiB"):
        assert part in out


def test_plan_names_the_cheapest_change_that_fits(plan_recipe, capsys):
    # Peaks of this recipe: 52.7 MiB; 41.2 MiB with selective checkpointing, 34.9 MiB with full; 23 MiB with full
    # and micro-batches of 2. The least recompute that fits 90% of the device comes first.
    assert cli.main(["plan", plan_recipe(), "--device-memory", "0.045"]) == 0
    out = capsys.readouterr().out
    assert "fit: does not fit 0.045 GiB" in out
    assert "cheapest change that fits: train.gradient_checkpointing: selective" in out
    assert cli.main(["plan", plan_recipe(), "--device-memory", "0.04"]) == 0
    assert "cheapest change that fits: train.gradient_checkpointing: full" in capsys.readouterr().out
    assert cli.main(["plan", plan_recipe(gradient_checkpointing=True), "--device-memory", "0.03"]) == 0
    out = capsys.readouterr().out
    assert "cheapest change that fits: train.per_device_train_batch_size: 2 (accumulation 8" in out
    assert cli.main(["plan", plan_recipe(), "--device-memory", "80"]) == 0
    assert "fit: fits 80 GiB" in capsys.readouterr().out


@pytest.mark.parametrize("args, expected", [
    (["--nproc", "3"], "train.global_batch_size: 16 is not a multiple of per_device_train_batch_size x data-parallel "
                       "size = 12"),
    (["--nproc", "2", "parallel.cp_size=4"], "parallel.cp_size: 4 does not divide the world size 2"),
    (["--nproc", "8", "parallel.cp_size=8"], "parallel.cp_size: 8 does not divide the model's 4 attention heads"),
    (["--nproc", "2", "--nnodes", "2"], "give --nproc N (one node) or --nnodes M --nproc-per-node N, not both"),
    (["--device-memory", "lots"], "--device-memory: 'lots' is not a positive number of GiB"),
    (["--nproc", "4", "parallel.dp_replicate=3"], "parallel.dp_replicate: 3 x cp_size 1 does not divide the world "
                                                  "size 4; choose a dp_replicate that divides 4"),
    (["--nproc", "4", "parallel.dp_replicate=2", "parallel.dp_shard=4"],
     "parallel.dp_shard: dp_replicate 2 x dp_shard 4 x cp_size 1 is not the world size 4; set dp_shard: 2, or -1"),
    (["--nproc", "4", "parallel.dp_replicate=2", "parallel.reshard_after_forward=2"],
     "parallel.reshard_after_forward: 2 must divide the 2 ranks a copy of the model is sharded over"),
    (["parallel.reshard_after_forward=1"], "parallel.reshard_after_forward: 1 must be true, false or a number of "
                                           "ranks of at least 2"),
    (["parallel.prefetch_layers=-1"], "parallel.prefetch_layers: -1 must be at least 0"),
])
def test_plan_refuses_what_the_run_refuses(plan_recipe, capsys, args, expected):
    assert cli.main(["plan", plan_recipe(), *args]) == 2
    assert expected in capsys.readouterr().err


def test_a_hub_id_not_in_the_cache_offline_is_refused_before_torch_is_imported(tmp_path):
    """The refusal came after torch and transformers were imported: seconds (half a minute on a cold start) for one
    line."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": "org/uncached"}, "data": {"train_files": ["t.jsonl"]},
                                    "train": {"output_dir": str(tmp_path / "out")}}))
    cache = tmp_path / "hf" / "hub"
    result, imported = run_cli_imports("plan", str(path), env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
                                                               "HF_HUB_CACHE": str(cache)})
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"llmtune: error: model.name_or_path: org/uncached (revision main) is neither a local path nor in the Hub "
        f"cache {cache}, and HF_HUB_OFFLINE=1 forbids a download; fetch it once with network access, name a local "
        "path instead, or correct the name\n")
    assert "llmtune" in imported, "the report lists the imports"
    assert "torch" not in imported


def test_plan_layout_of_nodes(plan_recipe, capsys):
    assert cli.main(["plan", plan_recipe(), "--nnodes", "2", "--nproc-per-node", "2", "parallel.cp_size=2"]) == 0
    out = capsys.readouterr().out
    assert "layout: 4 rank(s) = replicate 1 x shard 2 x cp 2; every parameter sharded over 4 rank(s)" in out
    assert "micro-batch 4 x 512 tokens (256 per rank)" in out


def test_hsdp_shards_each_copy_over_its_group_alone(plan_recipe, capsys):
    """parallel.dp_replicate 2 on 4 ranks: each parameter over 2 ranks, so the sharded state is twice plain FSDP's;
    the activations and the data-parallel batch are the same."""
    plain = load_config(plan_recipe(), [], "pt", 4)
    hsdp = load_config(plan_recipe(), ["parallel.dp_replicate=2"], "pt", 4)
    model_config = load_model_config(plain.model)
    over4, over2 = plan_memory(plain, model_config, 4), plan_memory(hsdp, model_config, 4)
    assert over2.params == pytest.approx(2 * over4.params, rel=0.01)
    assert over2.optimizer == pytest.approx(2 * over4.optimizer, rel=0.01)
    assert (over2.activations, over2.layout.tokens_per_step) == (over4.activations, over4.layout.tokens_per_step)
    assert cli.main(["plan", plan_recipe(), "--nproc", "4", "parallel.dp_replicate=2"]) == 0
    assert ("layout: 4 rank(s) = replicate 2 x shard 2 x cp 1; every parameter sharded over 2 rank(s), its 2 copies' "
            "gradients all-reduced once per step") in capsys.readouterr().out


@pytest.mark.parametrize("knob, gathered", [
    ([], lambda p: 3 * p.largest_layer),
    (["parallel.prefetch_layers=2"], lambda p: 4 * p.largest_layer),
    (["parallel.prefetch_layers=0"], lambda p: 2 * p.largest_layer),
    (["parallel.reshard_after_forward=false"], lambda p: p.all_layers + p.largest_layer),
    # The last layer keeps all of its weights (it is the one in backward), the 3 others half of theirs.
    (["parallel.reshard_after_forward=2"], lambda p: 3 * p.largest_layer // 2 + 3 * p.largest_layer),
])
def test_the_resharding_knobs_set_the_layers_gathered_at_the_peak(plan_recipe, four_layers, knob, gathered):
    config = load_config(plan_recipe(), [f"model.config={four_layers}", *knob], "pt", 4)
    model_config = load_model_config(config.model)
    plain = plan_memory(load_config(plan_recipe(), [f"model.config={four_layers}"], "pt", 4), model_config, 4)
    plan = plan_memory(config, model_config, 4)
    assert plan.all_layers == 4 * plan.largest_layer
    assert plan.gathered == gathered(plan)
    assert plan.peak - plain.peak == plan.gathered - plain.gathered


def test_no_more_layers_are_prefetched_than_the_model_has(plan_recipe):
    two_ahead, one_ahead = (load_config(plan_recipe(), [f"parallel.prefetch_layers={n}"], "pt", 4) for n in (2, 1))
    model_config = load_model_config(two_ahead.model)
    assert model_config.num_hidden_layers == 2
    assert plan_memory(two_ahead, model_config, 4).gathered == plan_memory(one_ahead, model_config, 4).gathered


def test_no_resharding_between_micro_batches_holds_every_layer_and_whole_gradients(plan_recipe, capsys):
    """With accumulation, reshard_between_micro_batches false keeps every layer gathered and the fp32 gradients
    unsharded from one micro-batch to the next: the sharded gradients give way to whole ones. Without accumulation
    nothing is kept."""
    kept = load_config(plan_recipe(), ["parallel.reshard_between_micro_batches=false"], "pt", 2)
    model_config = load_model_config(kept.model)
    plain, plan = plan_memory(load_config(plan_recipe(), [], "pt", 2), model_config, 2), plan_memory(kept, model_config, 2)
    assert plan.layout.accumulation == 2 and plan.kept_whole
    assert plan.whole_grads == 4 * plan.trainable
    assert plan.peak - plain.peak == (plan.whole_grads - plain.grads) + (plan.all_layers - 2 * plain.largest_layer)
    one_micro_batch = replace(kept, train=replace(kept.train, per_device_train_batch_size=8,
                                                  gradient_accumulation_steps=1))
    assert not plan_memory(one_micro_batch, model_config, 2).kept_whole
    assert cli.main(["plan", plan_recipe(), "--nproc", "2", "parallel.reshard_between_micro_batches=false"]) == 0
    assert "gradients (fp32, whole between micro-batches)" in capsys.readouterr().out


def test_moving_averages_add_an_fp32_copy_of_the_trained_parameters_per_decay(plan_recipe):
    plain = load_config(plan_recipe(), [], "pt", 2)
    two = load_config(plan_recipe(ema_decay=[0.99, 0.999]), [], "pt", 2)
    model_config = load_model_config(plain.model)
    without, with_averages = plan_memory(plain, model_config, 2), plan_memory(two, model_config, 2)
    assert without.averages == 0 and with_averages.averages == 2 * with_averages.grads
    assert with_averages.peak - without.peak == 2 * with_averages.grads


def auto_recipe(plan_recipe, world_size: int, global_batch: int, **train):
    """(the loaded recipe with per_device_train_batch_size: auto, its model config)."""
    config = load_config(plan_recipe(per_device_train_batch_size="auto", global_batch_size=global_batch, **train), [],
                         "pt", world_size)
    return config, load_model_config(config.model)


def peak(config, model_config, world_size: int, micro_batch: int) -> int:
    """The plan's peak of the recipe written with this micro-batch."""
    explicit = copy.deepcopy(config)
    explicit.use_micro_batch(micro_batch, world_size)
    return plan_memory(explicit, model_config, world_size).peak


def between(low: int, high: int) -> float:
    """A device's GiB whose usable part lies halfway between two peaks."""
    return (low + high) / 2 / GIB / USABLE_FRACTION


@pytest.mark.parametrize("world_size, global_batch, fitting, expected", [
    (1, 12, (2, 3), 2),  # between the peaks of 2 and 3: 2
    (1, 12, (3, 4), 3),  # 3 divides 12 (accumulation 4); 5 would not, so it is never tried
    (2, 16, (2, 4), 2),  # 8 rows per data-parallel rank: 8, 4, 2 or 1
])
def test_auto_takes_the_largest_micro_batch_that_fits_and_divides_the_batch(plan_recipe, world_size, global_batch,
                                                                            fitting, expected):
    config, model_config = auto_recipe(plan_recipe, world_size, global_batch)
    low, high = (peak(config, model_config, world_size, m) for m in fitting)
    plan = auto_micro_batch(config, model_config, world_size, between(low, high))
    assert plan.layout.micro_batch == expected
    assert plan.layout.accumulation * expected * world_size == global_batch
    assert plan.peak == low
    # A device that holds every micro-batch: the whole share of a rank, no accumulation.
    assert auto_micro_batch(config, model_config, world_size, 80).layout.micro_batch == global_batch // world_size


def test_auto_refuses_when_one_row_does_not_fit_with_the_plans_advice(plan_recipe):
    config, model_config = auto_recipe(plan_recipe, 1, 8)
    checkpointed, _ = auto_recipe(plan_recipe, 1, 8, gradient_checkpointing=True)
    device = between(peak(checkpointed, model_config, 1, 1), peak(config, model_config, 1, 1))
    with pytest.raises(UserError) as err:
        auto_micro_batch(config, model_config, 1, device)
    assert str(err.value).startswith("train.per_device_train_batch_size: auto, but not even a micro-batch of 1 fits: "
                                     f"a step's peak is {gib(peak(config, model_config, 1, 1))} per rank")
    assert str(err.value).endswith("cheapest change that fits: train.gradient_checkpointing: selective")
    with pytest.raises(UserError, match="no single change fits: combine them, or use a device with more memory"):
        auto_micro_batch(config, model_config, 1, 1e-4)


def test_auto_on_cpu_plans_for_the_available_ram_over_the_nodes_processes(plan_recipe, monkeypatch, caplog):
    config, model_config = auto_recipe(plan_recipe, 2, 16)
    low, high = peak(config, model_config, 2, 2), peak(config, model_config, 2, 4)
    available = 2 * between(low, high) * GIB  # two processes share it: each gets what fits 2, not 4
    monkeypatch.setattr("llmtune.run.plan.torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("llmtune.run.plan.psutil.virtual_memory", lambda: SimpleNamespace(available=available))
    assert device_memory_gib(2) == pytest.approx(between(low, high))
    with caplog.at_level(logging.INFO, logger="llmtune"):
        assert decide_auto(config, model_config, 2, 2) == {"train.per_device_train_batch_size": 2}
    assert caplog.messages == [
        f"train.per_device_train_batch_size: auto -> 2 (accumulation 4, global batch 16): the largest micro-batch whose "
        f"planned peak, {gib(low)} per rank, fits 90% of {between(low, high):.2f} GiB, the RAM available over 2 "
        "processes"]


def test_plan_resolves_auto_for_the_device(plan_recipe, capsys):
    config, model_config = auto_recipe(plan_recipe, 2, 16)
    device = between(peak(config, model_config, 2, 2), peak(config, model_config, 2, 4))
    recipe = plan_recipe(per_device_train_batch_size="auto")
    assert cli.main(["plan", recipe, "--nproc", "2", "--task", "pt", "--device-memory", str(device)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("train.per_device_train_batch_size: auto -> 2, the largest micro-batch that fits\n")
    assert "batch: micro-batch 2 x 512 tokens (512 per rank), accumulation 4; 8,192 tokens per optimizer step" in out
    assert "fit: fits" in out


@pytest.mark.parametrize("bf16", [False, True])
def test_a_dpo_reference_copy_adds_the_model_in_the_compute_dtype_unless_precomputed(plan_recipe, bf16):
    """dpo.reference: model holds every parameter once more, frozen (so in the compute dtype), sharded; precomputed
    and adapter_off hold none; sft none."""
    sft = load_config(plan_recipe(bf16=bf16), [], "sft", 2)
    model_config = load_model_config(sft.model)
    plain = plan_memory(sft, model_config, 2)
    fp32_params = plan_memory(load_config(plan_recipe(), [], "sft", 2), model_config, 2).params
    dpo = load_config(plan_recipe(bf16=bf16), [], "dpo", 2)
    with_copy = plan_memory(dpo, model_config, 2)
    precomputed = plan_memory(load_config(plan_recipe(bf16=bf16), ["dpo.reference=precomputed"], "dpo", 2),
                              model_config, 2)
    assert plain.reference == precomputed.reference == 0
    assert with_copy.reference == fp32_params // (2 if bf16 else 1)
    assert with_copy.peak - plain.peak == with_copy.reference
    assert "reference model (dpo.reference: model" in render(with_copy, dpo, model_config, None, None)


def test_cpu_offload_leaves_the_sharded_state_out_of_the_device_peak(plan_recipe):
    """parallel.cpu_offload: the parameters, gradients and optimizer state live in the CPU's memory; the device holds
    the gathered layers, the activations and the loss."""
    plain = load_config(plan_recipe(gradient_accumulation_steps=2, global_batch_size=None), [], "sft", 2)
    offloaded = load_config(plan_recipe(gradient_accumulation_steps=2, global_batch_size=None),
                            ["parallel.cpu_offload=true"], "sft", 2)
    model_config = load_model_config(plain.model)
    on_device, on_cpu = plan_memory(plain, model_config, 2), plan_memory(offloaded, model_config, 2)
    held = on_device.params + on_device.grads + on_device.optimizer
    assert on_device.peak - on_cpu.peak == held == on_cpu.sharded_state(on_cpu.grads)
    text = render(on_cpu, offloaded, model_config, None, None)
    assert "peak of a training step on the device" in text and "sharded state in CPU memory" in text
    assert "optimizer state in CPU memory (parallel.cpu_offload)" in text.splitlines()[1]


def test_the_fit_advice_offers_cpu_offload_after_what_costs_no_speed(plan_recipe):
    """Where neither checkpointing, the chunked loss, a smaller micro-batch nor context parallelism fits, CPU offload
    comes before more ranks."""
    config = load_config(plan_recipe(gradient_checkpointing=True, per_device_train_batch_size=1,
                                     global_batch_size=16), [], "sft", 1)
    model_config = load_model_config(config.model)
    offered = [change for change, _, _ in changes(config, 1, model_config)]
    assert offered.index(next(c for c in offered if c.startswith("parallel.cpu_offload"))) < \
        offered.index(next(c for c in offered if "ranks (--nproc" in c))
    on_cpu = plan_memory(load_config(plan_recipe(gradient_checkpointing=True, per_device_train_batch_size=1,
                                                 global_batch_size=16), ["parallel.cpu_offload=true"], "sft", 1),
                         model_config, 1)
    assert cheapest_fit(config, model_config, 1, on_cpu.peak / GIB / USABLE_FRACTION * 1.001).startswith(
        "parallel.cpu_offload: true")


def test_the_fit_advice_takes_back_memory_spent_on_speed_first_and_fewer_replicas_before_offload(plan_recipe,
                                                                                                 four_layers):
    """Layers kept gathered and deeper prefetch are undone before anything else; fewer HSDP replicas (each copy
    sharded over more ranks) come after context parallelism, before CPU offload (4 layers, accumulation 4)."""
    knobs = ["parallel.reshard_after_forward=false", "parallel.reshard_between_micro_batches=false",
             "parallel.prefetch_layers=2", "parallel.dp_replicate=2", f"model.config={four_layers}"]
    config = load_config(plan_recipe(gradient_checkpointing=True, per_device_train_batch_size=1), knobs, "pt", 4)
    model_config = load_model_config(config.model)
    offered = list(changes(config, 4, model_config))
    names = [change for change, _, _ in offered]
    assert names[:3] == ["parallel.reshard_after_forward: true", "parallel.reshard_between_micro_batches: true",
                         "parallel.prefetch_layers: 1"]
    replicas = [i for i, name in enumerate(names) if name.startswith("parallel.dp_replicate")]
    assert [names[i] for i in replicas] == ["parallel.dp_replicate: 1 (each parameter sharded over 4 ranks)"]
    assert max(i for i, name in enumerate(names) if name.startswith("parallel.cp_size")) < replicas[0]
    assert replicas[-1] < names.index(next(n for n in names if n.startswith("parallel.cpu_offload")))
    before = plan_memory(config, model_config, 4).peak
    # Each change is offered alone: while the layers stay gathered between micro-batches, or after forward, neither
    # reshard_after_forward nor the prefetch changes what is gathered.
    assert [plan_memory(changed, model_config, ranks).peak < before for _, changed, ranks in offered[:3]] == \
        [False, True, False]
    assert all(plan_memory(offered[i][1], model_config, 4).peak < before for i in replicas)


def test_a_generation_phase_gathers_every_layer_once_and_holds_a_kv_cache(plan_recipe, capsys):
    """eval_generation: the plan's generation phase holds the sharded state, every layer and the root gathered (once a
    phase: one all-gather per sharded module, none per token) and the keys and values of a batch of completions."""
    args = ["eval_generation.files=[prompts.jsonl]", "eval_generation.batch_size=8", "eval_generation.max_new_tokens=64"]
    config = load_config(plan_recipe(), args, "pt", 2)
    model_config = LlamaConfig.from_pretrained(config.model.config)
    plan, without = plan_memory(config, model_config, 2), plan_memory(load_config(plan_recipe(), [], "pt", 2),
                                                                        model_config, 2)
    head_dim = LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
    assert plan.kv_cache == 8 * (512 + 64) * LLAMA["num_hidden_layers"] * 2 * LLAMA["num_key_value_heads"] * head_dim * 4
    assert plan.generation_peak == plan.params + plan.optimizer + plan.all_layers + plan.root + plan.kv_cache
    assert (without.kv_cache, plan.peak) == (0, without.peak), "a training step is planned as without generation"
    assert cli.main(["plan", plan_recipe(), "--nproc", "2", "--task", "pt", *args]) == 0
    out = capsys.readouterr().out
    assert f"{LLAMA['num_hidden_layers'] + 1} all-gathers a phase (one per sharded module), none per token" in out
    assert "peak of a generation phase" in out


def test_grpo_plans_its_rows_of_completions_its_reference_and_its_rounds_generation(plan_recipe, capsys):
    """grpo: a micro-batch is one packed row of its completions, each after a prompt of up to data.max_seq_len; with
    beta > 0 the reference copy is sharded beside the policy; a generation phase holds the keys and values of the
    rank's completions of a round (2 of 4 prompts on 2 ranks, 8 completions each)."""
    args = ["grpo.num_generations=8", "grpo.max_completion_length=128", "grpo.reward_funcs=[accuracy]",
            "grpo.generation_batch_size=32", "grpo.beta=0.04"]
    config = load_config(plan_recipe(), args, "grpo", 2)
    model_config = LlamaConfig.from_pretrained(config.model.config)
    plan = plan_memory(config, model_config, 2)
    assert (plan.layout.micro_batch, plan.layout.seq_len) == (1, 4 * (512 + 128))
    assert plan.reference == plan.params, "a frozen fp32 copy, sharded as the policy's fp32 weights"
    head_dim = LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
    assert plan.kv_cache == 2 * 8 * (512 + 128) * LLAMA["num_hidden_layers"] * 2 * LLAMA["num_key_value_heads"] \
        * head_dim * 4
    assert cli.main(["plan", plan_recipe(), "--nproc", "2", "--task", "grpo", *args]) == 0
    out = capsys.readouterr().out
    assert "reference model (grpo.reference: model; frozen, fp32, sharded)" in out
    assert "generation (grpo's rounds, 16 completions a batch), per rank:" in out


def test_tensor_parallelism_plans_a_tp_ranks_share_and_is_offered(plan_recipe, capsys):
    """parallel.tp_size 2 on 4 ranks: a rank's weights of a layer, its root (embeddings, lm_head) and its loss's
    vocabulary-sized buffers are half of FSDP alone's, the sharded state the same (split over 2 tp x 2 shard ranks,
    as over 4), the tokens per step the global batch's; the whole model is still counted in
    its parameters; and the advice offers tp where the micro-batch cannot shrink."""
    plain = load_config(plan_recipe(), [], "pt", 4)
    split = load_config(plan_recipe(), ["parallel.tp_size=2"], "pt", 4)
    model_config = load_model_config(plain.model)
    fsdp, tp = plan_memory(plain, model_config, 4), plan_memory(split, model_config, 4)
    assert tp.largest_layer == pytest.approx(fsdp.largest_layer / 2, rel=0.02)
    assert tp.root == pytest.approx(fsdp.root / 2, rel=0.02)
    assert tp.params == pytest.approx(fsdp.params, rel=0.02)
    assert tp.activations < fsdp.activations
    # Loss parallel: every token of the micro-batch against half the vocabulary.
    assert tp.loss == loss_bytes(4 * 512, 128, 128, split.train.chunk_loss_size, 4, True)
    # train.global_batch_size kept: half the data-parallel ranks accumulate twice the micro-batches.
    assert (tp.layout.tokens_per_step, tp.layout.accumulation) == (fsdp.layout.tokens_per_step,
                                                                   2 * fsdp.layout.accumulation)
    assert (tp.total_params, tp.trainable) == (fsdp.total_params, fsdp.trainable)
    one_row = plan_recipe(per_device_train_batch_size=1)
    offered = [change for change, _, _ in changes(load_config(one_row, [], "pt", 4), 4, model_config)]
    assert any(change.startswith("parallel.tp_size: 2 (each rank holds 1/2") for change in offered)
    assert cli.main(["plan", plan_recipe(), "--nproc", "4", "parallel.tp_size=2"]) == 0
    assert "layout: 4 rank(s) = replicate 1 x shard 2 x cp 1 x tp 2; every parameter sharded over 2 rank(s); tp 2:" \
        in capsys.readouterr().out
