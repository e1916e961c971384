"""pt: documents -> ids with EOS appended -> concatenated and cut into max_seq_len blocks.

Inside a block, position_ids restart at every document and the first token of each document
carries no label, so no label (after the shift) asks one document to predict the next.
"""

import datasets

from llmtune.loss import IGNORE_INDEX

# Documents are packed within windows of this many; what is left at the end of a window is
# dropped or kept as a shorter block (data.pt_remainder), a small fraction of the corpus.
PACK_WINDOW = 2000


def tokenize_documents(rows: datasets.Dataset, tokenizer, map_kw: dict) -> datasets.Dataset:
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        return {"input_ids": [ids + [eos] for ids in tokenizer(batch["text"])["input_ids"]]}

    return rows.map(tokenize, batched=True, remove_columns=["text"], **map_kw)


def pack_documents(docs: datasets.Dataset, max_seq_len: int, remainder: str, map_kw: dict) -> datasets.Dataset:
    """Blocks of max_seq_len tokens; a window's last, shorter block is dropped or kept (the collator pads it)."""

    def pack(batch):
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for doc in batch["input_ids"]:
            ids += doc
            labels += [IGNORE_INDEX] + doc[1:]
            positions += range(len(doc))
        rows = {"input_ids": [], "labels": [], "position_ids": []}
        for start in range(0, len(ids), max_seq_len):
            block = slice(start, start + max_seq_len)
            if len(ids) - start < max_seq_len and remainder == "drop":
                break
            rows["input_ids"].append(ids[block])
            rows["labels"].append(labels[block])
            rows["position_ids"].append(positions[block])
        return rows

    return docs.map(pack, batched=True, batch_size=PACK_WINDOW, remove_columns=["input_ids"], **map_kw)
