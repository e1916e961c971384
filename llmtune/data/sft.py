"""sft: canonical samples -> input_ids and labels, with the over-long policy applied."""

import datasets

from llmtune.data import images
from llmtune.data.templates import LabelRules, encode_sample
from llmtune.model.loss import IGNORE_INDEX

KEPT, TRUNCATED, TOO_LONG, NO_LABELS = 0, 1, 2, 3


def fit_length(input_ids: list[int], labels: list[int], max_seq_len: int, truncation: str) -> tuple[int, list, list]:
    """(status, input_ids, labels). `truncate_prompt` cuts tokens from the left (the oldest context)
    as long as the whole last response survives; otherwise, or with `drop`, the sample is dropped."""
    if len(input_ids) > max_seq_len:
        cut = len(input_ids) - max_seq_len
        if truncation == "drop" or _last_response_start(labels) < cut:
            return TOO_LONG, [], []
        # The cut also drops labels that lived in the removed context: only the kept turns train.
        input_ids, labels, status = input_ids[cut:], labels[cut:], TRUNCATED
    else:
        status = KEPT
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return NO_LABELS, [], []
    return status, input_ids, labels


def _last_response_start(labels: list[int]) -> int:
    """Index where the last run of trained tokens begins (-1 when nothing is trained)."""
    end = max((i for i, label in enumerate(labels) if label != IGNORE_INDEX), default=-1)
    start = end
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return start


def tokenize_examples(rows: datasets.Dataset, tokenizer, data_cfg, map_kw: dict, source: str) -> datasets.Dataset:
    """Canonical rows ({"sample"} or pre-tokenized {"input_ids", "labels"}) of `source` -> input_ids, labels,
    status, and for a vision-language model the images of each sample (images.IMAGES: a blob each, in order)."""
    rules = LabelRules.of(data_cfg, tokenizer)
    image_inputs = images.of(tokenizer)
    columns = ["input_ids", "labels", "status"] + ([images.IMAGES] if image_inputs else [])

    def encode(row, index):
        where = f"{source}: row {index + 1}"
        blobs = []
        if "sample" in row:
            input_ids, labels, blobs = encode_with_images(tokenizer, row["sample"], rules, where)
        else:
            input_ids, labels = row["input_ids"], row["labels"]
        # A sample cut from the left would lose image tokens its images' tensors still hold: it is dropped instead.
        status, input_ids, labels = fit_length(input_ids, labels, data_cfg.max_seq_len,
                                               "drop" if blobs else data_cfg.truncation)
        return {"input_ids": input_ids, "labels": labels, "status": status,
                **({images.IMAGES: blobs if status != TOO_LONG else []} if image_inputs else {})}

    features = None
    if image_inputs:
        features = datasets.Features({**rows.features, "input_ids": datasets.List(datasets.Value("int64")),
                                      "labels": datasets.List(datasets.Value("int64")),
                                      "status": datasets.Value("int64"), **images.column_features()})
    return rows.map(encode, with_indices=True, features=features, **map_kw).select_columns(columns)


def encode_with_images(tokenizer, sample: dict, rules: LabelRules, where: str) -> tuple[list, list, list]:
    """(input_ids, labels, the images' blobs) of a canonical sft sample: encode_sample's, each image's tokens put in
    by the model's image processing (data/images.py)."""
    found = images.sample_images(sample)
    image_inputs = images.of(tokenizer)
    if not found:
        return *encode_sample(tokenizer, sample, rules, where), []
    if image_inputs is None:
        raise images.no_vision_tower(where, "sample")
    sample = {**sample, "messages": image_inputs.placed(sample["messages"])}
    input_ids, labels = encode_sample(tokenizer, sample, rules, where)
    return image_inputs.expand(input_ids, labels, found, where)
