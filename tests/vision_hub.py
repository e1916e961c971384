"""A Hub dataset of image pairs in the huggingface_hub cache, laid out offline: what LLaMA-Factory's rlhf_v entry
names (llamafactory/RLHF-V: conversations, chosen, rejected and an images column of datasets' Image feature), for
tests and benchmarks that run its dpo recipe with no network."""

import hashlib
from pathlib import Path

from tests.helpers import add_to_hub_cache

RLHF_V = "llamafactory/RLHF-V"
RLHF_V_ENTRY = {"hf_hub_url": RLHF_V, "ranking": True, "formatting": "sharegpt",
                "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected",
                            "images": "images"}}  # as LLaMA-Factory's dataset_info.json has it


def rlhf_v_cache(hf_home: Path, images: list[Path], pairs: int = 0) -> list[dict]:
    """`pairs` pairs (0: twice the images) in RLHF-V's columns with `images` (one a pair, in turn; the second pair
    without an image), as one parquet
    file of a dataset snapshot (main; its commit the file's hash, as a push of other rows makes another) under
    hf_home; returns the rows, their images as the paths whose
    bytes the file holds."""
    import datasets

    answers = ["A tool.", "The sum is five.", "The numbers 2 and 3.", "It is 6."]
    rows = []
    for number in range(pairs or 2 * len(images)):
        image = [str(images[number % len(images)])] if number != 1 else []
        rows.append({"conversations": [{"from": "human", "value": ("<image>" if image else "") + "What is it?"}],
                     "chosen": {"from": "gpt", "value": answers[number % 4]},
                     "rejected": {"from": "gpt", "value": answers[(number + 1) % 4]}, "images": image})
    turn = {"from": datasets.Value("string"), "value": datasets.Value("string")}
    features = datasets.Features({"conversations": [turn], "chosen": turn, "rejected": turn,
                                  "images": datasets.Sequence(datasets.Image())})
    files = hf_home / "rlhf_v_files"
    (files / "data").mkdir(parents=True)
    # The images' bytes in the file, as push_to_hub embeds them: the cache holds no path to another file.
    embedded = [{**row, "images": [{"bytes": Path(image).read_bytes(), "path": None} for image in row["images"]]}
                for row in rows]
    parquet = files / "data" / "train-00000-of-00001.parquet"
    datasets.Dataset.from_list(embedded, features=features).to_parquet(parquet)
    add_to_hub_cache(hf_home, RLHF_V, "dataset", files, hashlib.sha1(parquet.read_bytes()).hexdigest(), refs=("main",))
    return rows
