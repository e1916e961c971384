"""The baseline of benchmarks/throughput.py (CPU) and benchmarks/device/proof.py (GPU): a plain hand-written FSDP2 loop.

    torchrun --nproc-per-node N benchmarks/plain_fsdp_loop.py MODEL_CONFIG TOKENIZER DATA.jsonl SEQ BATCH STEPS WARMUP
                                                              [--bf16] [--checkpointing]

Same model (from the config, seeded), same data (documents + EOS cut into SEQ-token blocks), same
optimizer; prints one JSON line from rank 0: the wall time of every step after WARMUP, the
tokens of one step (all ranks), peak RSS and, on CUDA, rank 0's torch.cuda.max_memory_allocated. On a machine with
CUDA each process takes its GPU (nccl), else the CPU (gloo). --bf16: FSDP2's mixed precision (bf16 compute, fp32
gradient reduction), as llmtune's train.bf16; --checkpointing: transformers' activation checkpointing of each decoder
layer. throughput.py also imports it, to run its steps between llmtune's in the same processes, and the proof's
profile stage, to profile its steps in the process that profiled llmtune's.
"""

import argparse
import json
import os
import resource
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
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

    def __init__(self, config_dir: str, tokenizer_dir: str, data: str, seq: int, batch: int, mesh,
                 bf16: bool = False, checkpointing: bool = False):
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
        if checkpointing:
            self.model.gradient_checkpointing_enable()
        precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
            MixedPrecisionPolicy()
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=precision)
        fully_shard(self.model, mesh=mesh, mp_policy=precision)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True)
        self.rows = blocks(AutoTokenizer.from_pretrained(tokenizer_dir), data, seq)
        self.device = torch.device(mesh.device_type)
        self.batch, self.rank, self.world = batch, dist.get_rank(), dist.get_world_size()
        self.step = 0
        self.tokens_per_step = batch * self.world * seq

    def __call__(self) -> None:
        start = (self.step * self.world + self.rank) * self.batch
        ids = self.rows[torch.arange(start, start + self.batch) % len(self.rows)].to(self.device)
        loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.step += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("model_config", "tokenizer", "data"):
        parser.add_argument(name)
    for name in ("seq", "batch", "steps", "warmup"):
        parser.add_argument(name, type=int)
    parser.add_argument("--bf16", action="store_true", help="bf16 compute (FSDP2 mixed precision)")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing of each layer")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    loop = PlainLoop(args.model_config, args.tokenizer, args.data, args.seq, args.batch,
                     init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),)), args.bf16,
                     args.checkpointing)
    step_times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        loop()
        if cuda:
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - started)
    if dist.get_rank() == 0:
        print(json.dumps({"step_times_s": step_times[args.warmup:], "tokens_per_step": loop.tokens_per_step,
                          "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                          "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
