"""pt: documents -> token ids with EOS appended -> concatenated and cut into max_seq_len blocks."""

import datasets

from llmtune.data.sources import require_columns

# Documents are packed within batches of this many; the tail of each batch that does not fill
# a block is dropped (as transformers' run_clm does), so it is a small fraction of the corpus.
PACK_BATCH = 2000


def pack_documents(rows: datasets.Dataset, tokenizer, max_seq_len: int, files: list[str]) -> datasets.Dataset:
    require_columns(rows, ("text",), "pre-training (data.format: text)", files)
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        return {"input_ids": [ids + [eos] for ids in tokenizer(batch["text"])["input_ids"]]}

    def pack(batch):
        flat = [token for ids in batch["input_ids"] for token in ids]
        usable = len(flat) - len(flat) % max_seq_len
        return {"input_ids": [flat[i:i + max_seq_len] for i in range(0, usable, max_seq_len)]}

    tokenized = rows.map(tokenize, batched=True, remove_columns=rows.column_names, desc="tokenize")
    return tokenized.map(pack, batched=True, batch_size=PACK_BATCH, desc="pack")
