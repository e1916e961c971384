"""pt: documents -> ids with EOS appended -> concatenated and cut into max_seq_len blocks.

Inside a block, position_ids restart at every document and the first token of each document
carries no label, so no label (after the shift) asks one document to predict the next.
"""

import datasets
import pyarrow as pa
import pyarrow.compute as pc

from llmtune.data.packing import PACK_WINDOW, concatenate
from llmtune.errors import UserError


def tokenize_documents(rows: datasets.Dataset, tokenizer, map_kw: dict) -> datasets.Dataset:
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        return {"input_ids": [ids + [eos] for ids in tokenizer(batch["text"])["input_ids"]]}

    return rows.map(tokenize, batched=True, remove_columns=["text"], **map_kw)


def has_text_tokens(docs: datasets.Dataset, tokenizer) -> bool:
    """Whether the tokenizer made anything of the documents besides special tokens (BOS, EOS, unknown); counted
    on the Arrow column, without a pass over the rows in Python."""
    ids = pc.list_flatten(docs.data.column("input_ids"))
    special = pa.array(tokenizer.all_special_ids, type=ids.type)
    return bool(pc.any(pc.invert(pc.is_in(ids, value_set=special))).as_py())


def restart_positions(positions: list[int]) -> list[int]:
    """A document cut by a block boundary goes on in the next block from position 0, as a block of any other
    trainer starts: a position past the model's learned positions (GPT-2's 1,024) would index out of range, and
    the rest of the document is a row of its own anyway (rows do not attend to each other)."""
    first_start = next((i for i, p in enumerate(positions) if p == 0), len(positions))
    return list(range(first_start)) + positions[first_start:]


def pack_documents(docs: datasets.Dataset, max_seq_len: int, remainder: str, map_kw: dict) -> datasets.Dataset:
    """Blocks of max_seq_len tokens; a window's last, shorter block is dropped or kept (the collator pads it)."""

    def pack(batch):
        packed = concatenate((doc, doc) for doc in batch["input_ids"])
        rows = {column: [] for column in packed}
        for start in range(0, len(packed["input_ids"]), max_seq_len):
            if len(packed["input_ids"]) - start < max_seq_len and remainder == "drop":
                break
            for column, values in packed.items():
                rows[column].append(values[start:start + max_seq_len])
            rows["position_ids"][-1] = restart_positions(rows["position_ids"][-1])
        return rows

    return docs.map(pack, batched=True, batch_size=PACK_WINDOW, remove_columns=["input_ids"], **map_kw)


def token_count(rows: datasets.Dataset) -> int:
    """The tokens of rows just tokenized or packed (their table is flat: no indices mapping), on the Arrow column."""
    return int(pc.sum(pc.list_value_length(rows.data.column("input_ids"))).as_py() or 0)


def no_block_error(tokens: int, max_seq_len: int) -> UserError:
    """A corpus of `tokens` of which data.pt_remainder: drop left no block of max_seq_len: the cause, and the fixes."""
    if tokens < max_seq_len:
        cause = f"the corpus holds {tokens} tokens, fewer than one row of data.max_seq_len={max_seq_len}"
        shorter = f"set data.max_seq_len to {tokens} or less"
    else:
        cause = (f"the corpus's {tokens} tokens fill no row of data.max_seq_len={max_seq_len} in any packing window "
                 f"(documents are packed {PACK_WINDOW:,} at a time)")
        shorter = "lower data.max_seq_len"
    return UserError(f"data.train_files: {cause}, and the last, partial row of each window is dropped "
                     f"(data.pt_remainder: drop); {shorter}, add text, or set data.pt_remainder: pad to train on the "
                     "partial row")
