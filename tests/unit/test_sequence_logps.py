"""CausalLMForTraining.sequence_logps on a tiny Llama built by build_model (the FSDP2 root, in a one-process gloo
world) with the run's features (packed documents): each sequence packed in a row, beside others and padding, has the
log-probability sum, labelled-token count and gradient it has alone (fp32, 1e-5), whatever its neighbours hold."""

from contextlib import nullcontext

import pytest
import torch

from llmtune.config import load_config
from llmtune.data.collate import collate
from llmtune.features.documents import PackedDocuments
from llmtune.features.registry import enabled_features
from llmtune.model.build import build_model, load_model_config
from llmtune.model.loss import IGNORE_INDEX
from llmtune.run.parallel import ParallelState

PAD = 0
# (length, prompt tokens) of each sequence, by row: A, B, C packed in row 0; D, E and padding in row 1.
ROWS = [[(9, 3), (12, 4), (6, 2)], [(10, 5), (7, 1)]]
NAMES = "ABCDE"
# flex attention runs forward only on CPU (torch has no backward there), after a compile of ~15 s
FLEX = pytest.param("flex_attention", marks=pytest.mark.slow)


@pytest.fixture(scope="module")
def state():
    state = ParallelState.initialize()
    yield state
    state.close()


@pytest.fixture(scope="module", params=["sdpa", "eager", FLEX])
def built(request, state, tiny_model, tmp_path_factory):
    """(model, features, backend): build_model's FSDP root with the run's features. One backend at a time: the
    packed-documents feature registers its attention under one name for the whole process."""
    backend = request.param
    recipe = {"model": {"name_or_path": str(tiny_model), "attn_implementation": backend},
              "data": {"train_files": ["unused.jsonl"]},
              # chunks of 5: the chunked path over several chunks, most sequences' last one short
              "train": {"output_dir": str(tmp_path_factory.mktemp("out")), "chunk_loss_size": 5}}
    config = load_config(recipe, [], "sft", world_size=1)
    features = enabled_features(config)
    assert features.find(PackedDocuments), "the tests keep packed documents apart as a run with cp_size 1 does"
    model = build_model(load_model_config(config.model), config.model, config.train, state, features)
    return model, features, backend


def sample(ids: list[int], prompt: int) -> dict:
    """A sequence whose first `prompt` tokens are not trained on, so no label crosses into the next sequence of a
    packed row."""
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]}


def sequences(seed: int) -> dict[str, dict]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [shape for row in ROWS for shape in row]
    return {name: sample(torch.randint(3, 90, (length,), generator=gen).tolist(), prompt)
            for name, (length, prompt) in zip(NAMES, shapes)}


def packed_batch(samples: dict[str, dict]) -> dict:
    """ROWS packed as data/collate.py makes packed rows (positions restarting per sequence, pads after), with the
    sequence_ids the DPO collator is to give them: each token's sequence index in the micro-batch, -1 on the pads."""
    rows, owners, first = [], [], 0
    for row in ROWS:
        parts = [(index, samples[NAMES[index]]) for index in range(first, first + len(row))]
        first += len(row)
        rows.append({"input_ids": [t for _, part in parts for t in part["input_ids"]],
                     "labels": [t for _, part in parts for t in part["labels"]],
                     "position_ids": [p for _, part in parts for p in range(len(part["input_ids"]))]})
        owners.append([index for index, part in parts for _ in part["input_ids"]])
    batch = collate(rows, pad_id=PAD).inputs
    length = batch["input_ids"].shape[1]
    sequence_ids = torch.tensor([row + [-1] * (length - len(row)) for row in owners])
    return batch | {"sequence_ids": sequence_ids, "sequences": len(samples)}


def run(model, features, inputs: dict):
    """sequence_logps of a micro-batch as the trainer gives it: after the features' transform."""
    return model.sequence_logps(**features.transform(inputs))


def alone(model, features, one: dict):
    """(sum, count) of one sequence run by itself, one unpadded row, sequence_ids left to their default."""
    sums, counts, _ = run(model, features, collate([one], pad_id=PAD).inputs)
    return sums[0], counts[0]


def grad_mode(backend: str):
    return torch.no_grad() if backend == "flex_attention" else nullcontext()


def test_packed_sequences_sum_as_each_alone(built):
    model, features, backend = built
    samples = sequences(seed=0)
    with grad_mode(backend):
        sums, counts, terms = run(model, features, packed_batch(samples))
        for i, (name, one) in enumerate(samples.items()):
            expected_sum, expected_count = alone(model, features, one)
            assert sums[i].item() == pytest.approx(expected_sum.item(), rel=1e-5), name
            labelled = sum(label != IGNORE_INDEX for label in one["labels"])
            assert counts[i].item() == expected_count.item() == labelled, name
    assert sums.dtype == counts.dtype == torch.float32 and sums.shape == counts.shape == (5,)
    assert (sums < 0).all()
    assert terms.shape == () and terms.item() == 0.0


def test_neighbours_tokens_leave_a_sequence_unchanged(built):
    model, features, backend = built
    samples = sequences(seed=0)
    changed = dict(samples)
    for name in "BE":
        ids = [(t + 17) % 87 + 3 for t in samples[name]["input_ids"]]
        changed[name] = sample(ids, samples[name]["labels"].count(IGNORE_INDEX))
    with grad_mode(backend):
        before = run(model, features, packed_batch(samples))[0]
        after = run(model, features, packed_batch(changed))[0]
    assert not torch.isclose(before[1], after[1]) and not torch.isclose(before[4], after[4])
    kept = [0, 2, 3]  # A and C beside B, D beside E
    assert torch.equal(before[kept], after[kept])


def parameter_grads(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("built", ["sdpa", "eager"], indirect=True)
@pytest.mark.parametrize("name", ["B", "E"])  # between two sequences; before the padding
def test_one_sequences_gradient_is_its_gradient_alone(built, name):
    model, features, _ = built
    samples = sequences(seed=0)
    model.zero_grad()
    sums, _, _ = run(model, features, packed_batch(samples))
    sums[NAMES.index(name)].backward()
    packed = parameter_grads(model)
    alone(model, features, samples[name])[0].backward()
    expected = parameter_grads(model)
    for param, grad in packed.items():
        err = (grad - expected[param]).norm() / expected[param].norm()
        assert err <= 1e-5, f"{param}: relative error {err:.3g}"
