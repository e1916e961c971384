"""dpo.reference: precomputed. The reference model's log-probabilities of every sequence of every split, computed
once before training and read from the micro-batches (tasks/reference.py's PrecomputedReference), so that no
reference model is held while training.

They are computed by the reference model of dpo.reference: model (the starting weights, sharded like the policy, in
the run's compute dtype), which is freed afterwards, on every rank (each data-parallel rank its share of the rows, in
micro-batches of per_device_eval_batch_size), and kept in the data cache's folder (data.cache_dir) under a key of
what decides them: the split's tokens (every row's input_ids, labels and positions: the data, its template and its
lengths), the reference's weights (their fingerprint, model/build.base_fingerprint) and the compute dtype. A later
run with the same data and reference, and a resume, read them instead.
"""

import hashlib
import logging
import math
import os
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch

from llmtune.data.build import cache_root
from llmtune.model.build import base_fingerprint
from llmtune.tasks.reference import reference_model, reference_source

log = logging.getLogger(__name__)


def tokens_fingerprint(dataset) -> str:
    """A hash of every token of a split (whole: a reference's values must never be read for other rows)."""
    digest = hashlib.sha256(str(len(dataset)).encode())
    table = dataset.with_format("arrow")[:]
    for column in ("input_ids", "labels", "position_ids"):
        digest.update(np.asarray(pc.list_value_length(table[column])).tobytes())
        digest.update(np.asarray(pc.list_flatten(table[column])).tobytes())
    return digest.hexdigest()[:20]


def sequences_per_row(dataset) -> np.ndarray:
    """How many sequences each row holds: its positions that restart at 0."""
    positions = dataset.with_format("arrow")[:]["position_ids"]
    starts = np.asarray(pc.equal(pc.list_flatten(positions), 0))
    return np.bincount(np.asarray(pc.list_parent_indices(positions)), weights=starts,
                       minlength=len(dataset)).astype(np.int64)


class Precompute:
    """The objective's annotate hook for dpo.reference: precomputed (data/manager.build_data calls it with the built
    splits). The reference model is built only if a split's values are not in the cache, and freed once they are
    computed."""

    def __init__(self, config, local, model_config, features, state):
        self.config, self.local, self.model_config, self.features, self.state = config, local, model_config, features, \
            state
        model_cfg, ref_config = reference_source(config, local, model_config)
        # The weights' fingerprint and the dtype they compute in.
        self.reference_id = f"{base_fingerprint(model_cfg, ref_config, config.train.seed)}-" \
                            f"{config.train.half_precision() or 'fp32'}"

    def __call__(self, splits: dict, collate) -> dict:
        reference = None
        done = {}
        for name, dataset in splits.items():
            if dataset is None:
                done[name] = None
                continue
            path = cache_root(self.config.data) / "reference" / f"{self.reference_id}-{tokens_fingerprint(dataset)}.npy"
            counts = sequences_per_row(dataset)
            # Every rank or none computes (FSDP's forwards are collective), e.g. nodes with caches of their own.
            if self.state.all_agree(path.is_file()):
                values = np.load(path)
                if self.state.is_main:
                    log.info("dpo.reference precomputed: the %s split's log-probabilities read from %s", name, path)
            else:
                reference = reference or reference_model(self.config, self.local, self.model_config, self.features,
                                                         self.state)
                values = computed(dataset, counts, reference, self.features, collate, self.state,
                                  self.config.train.per_device_eval_batch_size)
                if self.state.local_rank == 0:
                    save(path, values)
                if self.state.is_main:
                    log.info("dpo.reference precomputed: the %s split's log-probabilities computed (%d sequences), "
                             "kept in %s", name, len(values), path)
            offsets = np.concatenate([[0], np.cumsum(counts)])
            done[name] = dataset.add_column("ref_logps", [values[offsets[i]:offsets[i + 1]].tolist()
                                                          for i in range(len(dataset))])
        return done


def computed(dataset, counts: np.ndarray, reference, features, collate, state, batch_size: int) -> np.ndarray:
    """Every sequence's reference log-probs, in row order: each data-parallel rank computes every dp_size-th row, cp
    peers together, then one all-reduce gives every rank all of them. Every rank runs the same number of forwards (FSDP
    gathers weights on all of them): one whose share has run out runs the first row again and keeps nothing."""
    offsets = np.concatenate([[0], np.cumsum(counts)])
    values = torch.zeros(int(offsets[-1]), dtype=torch.float64, device=state.device)
    rows = list(range(state.dp_rank, len(dataset), state.dp_size))
    for start in range(0, math.ceil(math.ceil(len(dataset) / state.dp_size) / batch_size) * batch_size, batch_size):
        chunk = rows[start:start + batch_size]
        batch = collate([dataset[i] for i in chunk or [0]]).to(state.device)
        logps = reference.logps(features.transform(batch.inputs), batch)
        if chunk and state.cp_rank == 0:
            at = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in chunk]).to(state.device)
            values[at] = logps.double()
    return state.all_reduce_sum(values).cpu().numpy()


def save(path: Path, values: np.ndarray) -> None:
    """Written under a temporary name, then renamed: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.partial-{os.getpid()}.npy")
    np.save(partial, values)
    os.replace(partial, path)
