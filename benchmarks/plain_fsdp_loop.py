"""The baseline of benchmarks/throughput.py: a plain hand-written FSDP2 loop.

    torchrun --nproc-per-node N benchmarks/plain_fsdp_loop.py MODEL_CONFIG TOKENIZER DATA.jsonl SEQ BATCH STEPS WARMUP

Same model (from the config, seeded), same data (documents + EOS cut into SEQ-token blocks), same
optimizer; prints one JSON line from rank 0: the wall time of every step after WARMUP, the
tokens of one step (all ranks) and peak RSS. throughput.py also imports it, to run its steps
between llmtune's in the same processes.
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


class PlainLoop:
    """The model sharded per decoder layer and at the root, AdamW, clipping; one step per call."""

    def __init__(self, config_dir: str, tokenizer_dir: str, data: str, seq: int, batch: int, mesh):
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True)
        self.rows = blocks(AutoTokenizer.from_pretrained(tokenizer_dir), data, seq)
        self.batch, self.rank, self.world = batch, dist.get_rank(), dist.get_world_size()
        self.step = 0
        self.tokens_per_step = batch * self.world * seq

    def __call__(self) -> None:
        start = (self.step * self.world + self.rank) * self.batch
        ids = self.rows[torch.arange(start, start + self.batch) % len(self.rows)]
        loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.step += 1


def main() -> None:
    config_dir, tokenizer_dir, data, seq, batch, steps, warmup = sys.argv[1:8]
    dist.init_process_group("gloo")
    loop = PlainLoop(config_dir, tokenizer_dir, data, int(seq), int(batch),
                     init_device_mesh("cpu", (dist.get_world_size(),)))
    step_times = []
    for _ in range(int(steps)):
        started = time.perf_counter()
        loop()
        step_times.append(time.perf_counter() - started)
    if dist.get_rank() == 0:
        print(json.dumps({"step_times_s": step_times[int(warmup):], "tokens_per_step": loop.tokens_per_step,
                          "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
