"""Peak memory and time of the loss with full logits (as HF models compute it) vs chunked (and, on CUDA, Liger's fused
linear cross-entropy), and the peak RSS of one training step of a small Qwen2-shaped model with chunking off and on.

Each case runs in a fresh subprocess, so the peak it reports is its own. On CPU: the peak resident memory above the
resident memory once the inputs (and model, optimizer) exist; Linux only (/proc/self/status, clear_refs). On CUDA
(--device cuda, the loss benchmark alone): torch.cuda.max_memory_allocated above what the inputs hold, and the time
of a second call, after one that warms up the kernels (Liger's Triton kernels compile on their first). From the
repository root, with llmtune installed (pip install -e .); full size needs ~15 GB for the plain case:

    python -m benchmarks.chunk_loss
    OMP_NUM_THREADS=1 python -m benchmarks.chunk_loss --tokens 1024 --chunks 256 512 --train-seq 256
    python -m benchmarks.chunk_loss --device cuda --dtype bfloat16 --chunks 1024 --fused

(as a module: run as a file, its folder would come first on sys.path, where benchmarks/peft.py stands in for peft)
"""

import argparse
import gc
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from llmtune.model.loss import LossOptions, cross_entropy_sum, shift_labels

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="Tokens of the loss benchmark.")
    parser.add_argument("--hidden", type=int, default=896, help="Hidden size of the loss benchmark.")
    parser.add_argument("--vocab", type=int, default=151936, help="Vocabulary size (both benchmarks).")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="Loss benchmark dtype.")
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 2048, 4096], help="Chunk sizes.")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="Where the loss benchmark runs; cuda runs it alone (no training step).")
    parser.add_argument("--fused", action="store_true", help="Also Liger's fused linear cross-entropy (CUDA only).")
    parser.add_argument("--train-seq", type=int, default=2048, help="Sequence length of the training step.")
    parser.add_argument("--train-hidden", type=int, default=256, help="Hidden size of the training model.")
    parser.add_argument("--train-layers", type=int, default=2, help="Decoder layers of the training model.")
    parser.add_argument("--train-chunk", type=int, default=1024, help="Chunk size of the chunked training step.")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # "loss:<chunk>", "fused:0" or "train:<chunk>", in a child
    args = parser.parse_args(argv)
    if args.fused and args.device != "cuda":
        parser.error("--fused: Liger's kernels run on CUDA only; add --device cuda")
    return args


def status_mib(key: str) -> float:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) / 1024


def reset_peak() -> float:
    """Reset the peak RSS (VmHWM) to the current RSS and return that, in MiB.

    Without the reset the peak would include whatever creating the inputs needed transiently.
    """
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return status_mib("VmRSS")


def loss_case(args, chunk_size: int, fused: bool = False) -> dict:
    """Loss forward+backward from hidden states [T, H] and an lm_head weight [V, H]; chunk_size 0 = full logits;
    fused: Liger's fused linear cross-entropy."""
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, dtype=dtype, device=args.device, requires_grad=True)
    weight = (torch.randn(args.vocab, args.hidden, device=args.device) * 0.02).to(dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), device=args.device)
    options = LossOptions(chunk_size=chunk_size, fused=fused)

    def forward_backward() -> tuple[float, float]:
        start = time.perf_counter()
        loss = cross_entropy_sum(hidden, weight, None, labels, options)
        loss.backward()
        value = loss.item()  # on CUDA it waits for the backward's kernels, queued before it
        return time.perf_counter() - start, value

    if args.device == "cpu":
        baseline = reset_peak()
        seconds, loss = forward_backward()
        return dict(peak_mib=status_mib("VmHWM") - baseline, seconds=seconds, loss=loss)
    forward_backward()
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    seconds, loss = forward_backward()
    return dict(peak_mib=(torch.cuda.max_memory_allocated() - baseline) / 2**20, seconds=seconds, loss=loss)


def train_case(args, chunk_size: int) -> dict:
    """One AdamW step of a Qwen2-shaped model (tied embeddings, as the small Qwen2 models) in CausalLMForTraining."""
    # Imported here, not with the loss: a loss case's process (the GPU proof's memory stage runs three) then spends
    # its seconds on the loss rather than on importing transformers' models.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from llmtune.features.base import Features
    from llmtune.model.build import CausalLMForTraining

    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.train_hidden, intermediate_size=4 * args.train_hidden,
                         num_hidden_layers=args.train_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.train_seq, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = CausalLMForTraining(Qwen2ForCausalLM(config), LossOptions(chunk_size=chunk_size), Features([]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    input_ids = torch.randint(0, args.vocab, (1, args.train_seq))
    baseline = reset_peak()
    start = time.perf_counter()
    loss = model(input_ids, shift_labels=shift_labels(input_ids))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    seconds = time.perf_counter() - start
    return dict(peak_mib=status_mib("VmHWM") - baseline, peak_rss_mib=status_mib("VmHWM"), seconds=seconds,
                loss=loss.item())


def run_child(case: str, argv: list[str]) -> dict:
    """The case in a fresh interpreter with the arguments `argv`; its result as a dict, or RuntimeError with the last
    lines the child wrote."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.chunk_loss", *argv, "--case", case], cwd=REPO,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"chunk_loss --case {case} exited {done.returncode}:\n"
                           + "\n".join(done.stderr.strip().splitlines()[-12:]))
    return json.loads(done.stdout.splitlines()[-1])


def print_table(title: str, rows: list[tuple[str, dict]], extra: tuple[str, ...] = ()) -> None:
    """Rows of (name, result); ratios against the first row (the full-logits case of this run)."""
    plain = rows[0][1]
    print(f"\n{title}")
    header = f"{'case':<16}{'peak MiB':>10}{'plain/peak':>11}{'time s':>9}{'time/plain':>12}" + \
        "".join(f"{key:>14}" for key in extra) + f"{'loss':>16}"
    print(header)
    for name, r in rows:
        print(f"{name:<16}{r['peak_mib']:>10.0f}{plain['peak_mib'] / r['peak_mib']:>10.1f}x{r['seconds']:>9.1f}"
              f"{r['seconds'] / plain['seconds']:>11.2f}x" + "".join(f"{r[key]:>14.0f}" for key in extra)
              + f"{r['loss']:>16.4f}")


def main() -> None:
    args = parse_args()
    if args.case:
        kind, chunk = args.case.split(":")
        result = train_case(args, int(chunk)) if kind == "train" else loss_case(args, int(chunk), kind == "fused")
        print(json.dumps(dict(result, threads=torch.get_num_threads())))
        return
    argv = sys.argv[1:]
    loss_rows = [("full logits", run_child("loss:0", argv))]
    loss_rows += [(f"chunk {c}", run_child(f"loss:{c}", argv)) for c in args.chunks]
    if args.fused:
        loss_rows.append(("Liger fused", run_child("fused:0", argv)))
    peak = "peak = CUDA memory allocated above the inputs, time of a second call" if args.device == "cuda" else \
        f"{loss_rows[0][1]['threads']} threads; peak = RSS above the inputs"
    print_table(f"loss forward+backward: T={args.tokens} H={args.hidden} V={args.vocab} {args.dtype} on "
                f"{args.device}; {peak}", loss_rows)
    if args.device == "cuda":
        return
    train_rows = [("chunking off", run_child("train:0", argv)),
                  (f"chunk {args.train_chunk}", run_child(f"train:{args.train_chunk}", argv))]
    print_table(f"one AdamW step, Qwen2-shaped: hidden {args.train_hidden}, {args.train_layers} layers, "
                f"V={args.vocab}, seq {args.train_seq}, fp32; peak = RSS above model+optimizer+inputs",
                train_rows, extra=("peak_rss_mib",))


if __name__ == "__main__":
    main()
