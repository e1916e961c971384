"""The baseline of benchmarks/throughput.py: a plain hand-written FSDP2 loop, run under torchrun.

    torchrun --nproc-per-node N benchmarks/plain_fsdp_loop.py MODEL_CONFIG TOKENIZER DATA.jsonl SEQ BATCH STEPS WARMUP

Same model (from the config, seeded), same data (documents + EOS cut into SEQ-token blocks), same
optimizer; prints one JSON line from rank 0: tokens/s after WARMUP steps and peak RSS.
"""

import json
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def blocks(tokenizer, path: str, seq: int) -> torch.Tensor:
    stream = []
    with open(path) as f:
        for line in f:
            stream += tokenizer(json.loads(line)["text"])["input_ids"] + [tokenizer.eos_token_id]
    usable = len(stream) - len(stream) % seq
    return torch.tensor(stream[:usable]).view(-1, seq)


def main() -> None:
    config_dir, tokenizer_dir, data, seq, batch, steps, warmup = sys.argv[1:8]
    seq, batch, steps, warmup = int(seq), int(batch), int(steps), int(warmup)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    rows = blocks(AutoTokenizer.from_pretrained(tokenizer_dir), data, seq)
    started = None
    for step in range(steps):
        if step == warmup:
            started = time.perf_counter()
        index = torch.arange(step * batch * world + rank * batch, step * batch * world + (rank + 1) * batch)
        ids = rows[index % len(rows)]
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    elapsed = time.perf_counter() - started
    if rank == 0:
        tokens = (steps - warmup) * batch * world * seq
        print(json.dumps({"tokens_per_s": tokens / elapsed,
                          "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
