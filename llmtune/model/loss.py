"""The language-model loss, as a SUM over the labelled tokens (the trainer divides by the step's global count).

Two paths give the same losses and gradients: the full [tokens, vocab] logits (chunk_size 0, the
reference, as HF models compute them), and the default chunked path below, which never holds them.

A third path, on CUDA with train.fused_kernels, is Liger's fused linear cross-entropy: the same sum
in Triton kernels (_fused_cross_entropy_sum); the two paths above stay the reference.

Chunked path: cross-entropy from the final hidden states and the lm_head weight, one [chunk, vocab]
block at a time.

With a large vocabulary (Qwen 151,936, Llama-3 128,256) the [tokens, vocab] logits, their fp32
copy and their gradient dominate peak memory; here at most one chunk of them exists at a time.

Design, chosen by measurement (see benchmarks/chunk_loss.py): the gradients are computed in the
forward pass, chunk by chunk, and backward only scales them by grad_output (as Liger's fused
linear cross-entropy does). That needs the plain path's three matmuls; recomputing each chunk's
logits in backward instead needs a fourth. Loss forward+backward, T=2048, H=896, V=151,936, fp32,
chunk 1024, one CPU thread (three runs on a shared machine): full logits 33-46 s, gradients in
forward 26-33 s, recomputation 43 s. The price is holding a [V, H] and a [T, H] gradient from
forward to backward, which the weight's and the hidden states' gradients need anyway.

A custom autograd.Function rather than torch ops under checkpointing: autograd would sum the
chunks' weight gradients in the weight's dtype, where bf16 loses the small contributions of
many chunks; here they are summed in fp32. Tokens whose label is ignored are dropped before
chunking, so masked prompt tokens cost nothing. Without grad mode (evaluation) only the loss is
computed.

Per-token log-probabilities (token_logps, for preference training) take the same two paths, the chunked one
with the same blocks, capping and softmax, but recompute each chunk's logits in backward (see
_ChunkedTokenLogps).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100
# Values of a row given per token, in line with its tokens: grpo's old policy's log-probabilities (at position t,
# that of the label of t, token t + 1), rm's marks of the tokens its sequences are scored at (collate.score_marks).
# They travel with the labels (a context-parallel rank gets its slice) and are the objective's, never the model's.
TOKEN_VALUES = ("old_logps", "scored")


def model_inputs(inputs: dict) -> dict:
    """A micro-batch's inputs without the objective's own per-token values."""
    return {key: value for key, value in inputs.items() if key not in TOKEN_VALUES}


@dataclass(frozen=True)
class LossOptions:
    """chunk_size 0 computes the full [tokens, vocab] logits (the reference, as HF models do);
    > 0 computes them that many tokens at a time. logit_softcap is the model config's
    final_logit_softcapping (Gemma); z_loss adds z_loss * logsumexp(logits)**2 per token;
    label_smoothing is F.cross_entropy's; fused computes the loss with Liger's CUDA kernels, whatever
    chunk_size says. The recipe's values are checked in config.py."""

    chunk_size: int = 0
    logit_softcap: float | None = None
    z_loss: float = 0.0
    label_smoothing: float = 0.0
    fused: bool = False
    # Divides the (capped) logits of the log-probabilities token_logps gives (grpo's, at its sampling temperature);
    # the loss never reads it.
    temperature: float = 1.0

    @classmethod
    def of_run(cls, train_cfg, model_config) -> "LossOptions":
        """The recipe's loss settings, with the soft-capping the model's own config asks for."""
        return cls(chunk_size=train_cfg.chunk_loss_size, z_loss=train_cfg.z_loss,
                   label_smoothing=train_cfg.label_smoothing, fused=train_cfg.fused_kernels,
                   logit_softcap=getattr(model_config, "final_logit_softcapping", None))


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Label of position t is the token at t+1; the last position has none.

    Shifting once, in the collator, lets token counting, the loss (and later sequence slicing)
    all see the same labels.
    """
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def labelled_positions(shifted_labels: torch.Tensor) -> torch.Tensor:
    """The flat indices of the labelled tokens of shifted labels [...]: the tokens the chunked paths compute, so that
    ignored tokens cost no matmul.
    Their number sizes the chunks, so computing them from device labels makes the host wait for the device; the
    trainer takes them from the host copy of the labels instead (Trainer.prepare) and passes them as `labelled`."""
    return (shifted_labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


def cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      shifted_labels: torch.Tensor, options: LossOptions = LossOptions(),
                      labelled: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 sum of the per-token losses over the labels != IGNORE_INDEX; hidden [..., H], labels [...]; labelled:
    labelled_positions(shifted_labels), if known (None: computed here)."""
    shifted_labels = shifted_labels.reshape(-1)
    hidden, weight, bias, shard, tokens = _split_inputs(hidden, weight, bias, options.chunk_size and not options.fused)
    if options.fused:
        return _fused_cross_entropy_sum(hidden, weight, bias, shifted_labels, options)
    if options.chunk_size:
        labelled = labelled_positions(shifted_labels) if labelled is None else labelled
        return _chunked_cross_entropy_sum(hidden, weight, bias, shifted_labels, labelled, options, shard, tokens)
    return _full_logits_cross_entropy_sum(hidden, weight, bias, shifted_labels, options)


def _split_inputs(hidden, weight, bias, chunked: bool):
    """(the hidden states the loss computes on, [tokens, H]: this rank's under sequence parallelism, `tokens`; the
    head's weight and bias: this rank's vocabulary shard under loss parallel, `shard`; shard; tokens). The chunked
    paths take the shards as they are; the reference and fused paths, which compute every token and vocabulary id in
    one block, take them gathered whole."""
    shard = VocabShard.of(weight, bias) if chunked else None
    tokens = TokenShard.of(hidden) if shard else None
    if tokens:
        hidden = hidden.to_local().reshape(-1, hidden.size(-1))
    else:
        hidden = _whole(hidden).reshape(-1, hidden.size(-1))
    weight, bias = (shard.weight, shard.bias) if shard else (_whole(weight), _whole(bias))
    return hidden, weight, bias, shard, tokens


@dataclass(frozen=True)
class VocabShard:
    """Loss parallel: this tensor-parallel rank's rows of a head split over the vocabulary (model/tensor_parallel.py),
    which the chunked paths compute on alone; the logsumexp, the labels' logits and the sums over the vocabulary are
    reduced over the tp ranks (two all-reduces of [chunk] values a chunk), and the hidden states' gradient, to which
    each shard adds its part, once per call. No rank holds a [chunk, vocab] block of the whole vocabulary."""

    weight: torch.Tensor  # [V / tp, H], this rank's rows
    bias: torch.Tensor | None
    group: object  # the tp ranks' process group
    start: int  # the first vocabulary id of this rank's rows
    vocab: int  # the whole vocabulary

    @classmethod
    def of(cls, weight, bias) -> "VocabShard | None":
        from llmtune.model.tensor_parallel import vocabulary_shard

        found = vocabulary_shard(weight)
        if found is None:
            return None
        local, group, start = found
        local_bias = None if bias is None else vocabulary_shard(bias)[0]
        return cls(local, local_bias, group, start, weight.shape[0])

    def picked(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each row's logit at its label where this rank holds it, else 0 (summed over the ranks: the label's)."""
        local = labels - self.start
        here = (local >= 0) & (local < logits.shape[1])
        return logits.gather(1, local.where(here, 0)[:, None]).squeeze(1).where(here, 0.0)

    def add_at_labels(self, grad: torch.Tensor, labels: torch.Tensor, value) -> None:
        """grad[i, label_i] += value (a number or [n]) where this rank holds the label."""
        local = labels - self.start
        here = (local >= 0) & (local < grad.shape[1])
        rows = torch.arange(grad.shape[0], device=grad.device)
        added = torch.as_tensor(value, dtype=grad.dtype, device=grad.device).expand(len(rows))
        grad.index_put_((rows[here], local[here]), added[here], accumulate=True)

    def softmax_and_lse_(self, logits: torch.Tensor, sums: torch.Tensor):
        """(the softmax over the whole vocabulary of this rank's fp32 logits [n, V / tp], written over them; the
        logsumexp of each row, [n]; `sums` [k, n], summed over the ranks in the same collective)."""
        row_max = logits.amax(dim=-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=self.group)
        logits.sub_(row_max[:, None]).exp_()
        totals = torch.cat([logits.sum(dim=-1)[None], sums])
        dist.all_reduce(totals, group=self.group)
        return logits.div_(totals[0][:, None]), row_max + totals[0].log(), totals[1:]

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(values, group=self.group)
        return values


@dataclass(frozen=True)
class TokenShard:
    """Sequence parallelism: the decoder's last hidden states as this tensor-parallel rank holds them, each row's
    tokens [rank x S / tp, (rank + 1) x S / tp) (the stream's split, model/tensor_parallel.py), which the chunked paths
    compute on without gathering them: each chunk's rows are put together on every tp rank (each fills the rows it
    holds, one all-reduce of [chunk, H]), and their gradient, summed over the vocabulary shards in a second one, is
    kept by the rank holding each row. A rank's gradient of the hidden states is then [its tokens, H], 1/tp of the
    whole one, and each chunk is chunk_size / tp tokens (chunk_rows), so that every buffer of the loss is 1/tp of a
    whole model's (benchmarks/tensor_parallel.py measures it)."""

    group: object  # the tp ranks' process group
    rank: int
    ranks: int
    length: int  # the rows' whole length S, which the ranks split evenly

    @classmethod
    def of(cls, hidden) -> "TokenShard | None":
        from llmtune.model.tensor_parallel import sequence_shard

        found = sequence_shard(hidden)
        return None if found is None else cls(*found, hidden.shape[1])

    def chunk_rows(self, chunk_size: int) -> int:
        return max(1, chunk_size // self.ranks)

    def rows(self, hidden: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        """The hidden states [len(chunk), H] of the flat positions `chunk` of the whole rows, from this rank's
        `hidden` [its tokens, H] and its peers'."""
        held, index = self._held(chunk)
        rows = hidden.index_select(0, index).masked_fill_(~held[:, None], 0)
        dist.all_reduce(rows, group=self.group)
        return rows

    def add_grad(self, grad: torch.Tensor, chunk: torch.Tensor, parts: torch.Tensor) -> None:
        """grad [its tokens, H] += the rows it holds of the gradient of `chunk`'s rows, `parts` (this vocabulary
        shard's part of it, summed over the shards here, in place)."""
        dist.all_reduce(parts, group=self.group)
        held, index = self._held(chunk)
        grad.index_add_(0, index, parts.masked_fill_(~held[:, None], 0))

    def _held(self, chunk: torch.Tensor):
        """(whether this rank holds each flat position of `chunk`, its row in the rank's tokens there, else 0)."""
        share = self.length // self.ranks
        row, offset = chunk // self.length, chunk % self.length - self.rank * share
        held = (offset >= 0) & (offset < share)
        return held, (row * share + offset).where(held, 0)


def _whole(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor split over the tp ranks (a head over the vocabulary, hidden states over the sequence), gathered whole;
    a whole one (or None) as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _full_logits(hidden, weight, bias, options: LossOptions) -> torch.Tensor:
    """fp32 (soft-capped) logits of every token: the reference paths' [T, V]."""
    logits = F.linear(hidden, weight, bias).float()
    if options.logit_softcap is not None:
        logits = options.logit_softcap * torch.tanh(logits / options.logit_softcap)
    return logits


def _full_logits_cross_entropy_sum(hidden, weight, bias, labels, options: LossOptions) -> torch.Tensor:
    logits = _full_logits(hidden, weight, bias, options)
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum",
                           label_smoothing=options.label_smoothing)
    if options.z_loss:
        loss = loss + options.z_loss * torch.logsumexp(logits[labels != IGNORE_INDEX], dim=-1).square().sum()
    return loss


def _fused_cross_entropy_sum(hidden, weight, bias, labels, options: LossOptions) -> torch.Tensor:
    """Liger's fused linear cross-entropy (CUDA only; features/fused_kernels.py checks for it up front).

    Its per-token loss is that of _cross_entropy_and_grad with every option, so no combination is
    refused (liger_kernel.ops.cross_entropy.liger_cross_entropy_kernel): the logits are tanh-capped as
    here, the smoothed loss is lse - (1 - eps) * s[label] - eps * mean(s) as F.cross_entropy's, and
    z_loss * lse**2 of the capped logits is added into the returned loss. Ignored tokens add 0 and no
    gradient, and the "sum" reduction divides by nothing, so a micro-batch without a labelled token
    gives 0, as here. Unlike the chunked path, the ignored tokens' matmuls still run.
    """
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    # Liger computes the weight's and bias's gradients only when hidden needs one: with every layer
    # below lm_head frozen, hidden is made to need one, which is then dropped. Without grad mode
    # (evaluation) hidden needs none and Liger computes the loss alone.
    head_needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (weight, bias))
    if head_needs_grad and not hidden.requires_grad:
        hidden = hidden.detach().requires_grad_()
    loss = LigerFusedLinearCrossEntropyLoss(
        ignore_index=IGNORE_INDEX, lse_square_scale=options.z_loss, label_smoothing=options.label_smoothing,
        reduction="sum", softcap=options.logit_softcap,
        # fp32 accumulators of the weight's and bias's gradients, as in the chunked path: by default Liger
        # sums the chunks' contributions in the weight's dtype, where bf16 rounds the small ones away.
        accum_dtype=torch.float32)
    return loss(weight, hidden, labels, bias)


def _chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               labels: torch.Tensor, labelled: torch.Tensor, options: LossOptions,
                               shard: VocabShard | None = None, tokens: TokenShard | None = None) -> torch.Tensor:
    """fp32 sum of the per-token losses over labels != IGNORE_INDEX, whose flat indices are `labelled`; hidden
    [T, H] (this rank's tokens under sequence parallelism, `tokens`), weight [V, H] (this rank's [V / tp, H] under
    loss parallel, `shard`), labels [T]."""
    # Decided here, not in forward: there grad mode is always off, and ctx.needs_input_grad
    # ignores torch.no_grad().
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        return _ChunkedCrossEntropy.apply(hidden, weight, bias, labels, labelled, options, shard, tokens)
    loss, *_ = _loss_and_grads(hidden, weight, bias, labels, labelled, options, (False, False, False), shard, tokens)
    return loss


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, labelled, options, shard, tokens):
        loss, *grads = _loss_and_grads(hidden, weight, bias, labels, labelled, options, ctx.needs_input_grad[:3],
                                       shard, tokens)
        ctx.grads = grads
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.grads is None:
            raise RuntimeError("the chunked loss keeps its gradients for one backward only; "
                               "use LossOptions(chunk_size=0) to backward through the loss more than once")
        grads, ctx.grads = ctx.grads, None
        # Scaled in place: a scaled copy would add a second [V, H] buffer at the peak.
        return *(None if g is None else g.mul_(grad_output) for g in grads), None, None, None, None, None


def _loss_and_grads(hidden, weight, bias, labels, labelled, options, needs, shard: VocabShard | None,
                    tokens: TokenShard | None):
    """The summed loss and the gradients of it w.r.t. (hidden, weight, bias) flagged in `needs` (else None)."""
    grads = _grad_accumulators(hidden, weight, bias, needs)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    chunks = _chunks(labelled, options, tokens)
    blocks = _Blocks.for_chunks(chunks, weight)
    for chunk in chunks:
        loss += _add_chunk(hidden, weight, bias, labels, chunk, options, grads, blocks, shard, tokens)
    _hidden_grad_summed(grads, shard, tokens)
    return loss, *_in_input_dtypes(grads, weight, bias)


def _chunks(labelled: torch.Tensor, options: LossOptions, tokens: TokenShard | None) -> tuple[torch.Tensor, ...]:
    return labelled.split(tokens.chunk_rows(options.chunk_size) if tokens else options.chunk_size)


def _chunk_hidden(hidden, chunk, tokens: TokenShard | None) -> torch.Tensor:
    """The hidden states of the flat positions `chunk`, a tensor of their own."""
    return tokens.rows(hidden, chunk) if tokens else hidden.index_select(0, chunk)


def _hidden_grad_summed(grads, shard: VocabShard | None, tokens: TokenShard | None) -> None:
    """Under loss parallel with whole hidden states, their gradient summed over the vocabulary shards: each rank's
    holds the part of its own logits (with this rank's tokens, each chunk's is summed as it is made: TokenShard)."""
    if shard is not None and tokens is None and grads[0] is not None:
        shard.sum(grads[0])


def _grad_accumulators(hidden, weight, bias, needs):
    """Zeroed gradients of (hidden, weight, bias) where `needs` flags them (else None)."""
    need_hidden, need_weight, need_bias = needs
    return (torch.zeros_like(hidden) if need_hidden else None,
            # fp32 accumulators: summed in bf16, each chunk's small contribution would be rounded away
            torch.zeros_like(weight, dtype=torch.float32) if need_weight else None,
            torch.zeros_like(bias, dtype=torch.float32) if need_bias else None)


def _in_input_dtypes(grads, weight, bias):
    grad_hidden, grad_weight, grad_bias = grads
    return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype))


class _Blocks:
    """The [chunk, vocab] blocks of one loss call, allocated once and reused by every chunk: a freshly allocated
    block of this size is memory the kernel must fault in and zero, which on CPU cost more than the softmax over
    it. The logits go to `fp32`; with bf16 weights the matmuls read and write `low`, in the weights' dtype."""

    def __init__(self, rows: int, weight: torch.Tensor):
        self.fp32 = weight.new_empty((rows, weight.shape[0]), dtype=torch.float32)
        self.low = None if weight.dtype == torch.float32 else weight.new_empty((rows, weight.shape[0]))

    @classmethod
    def for_chunks(cls, chunks: tuple[torch.Tensor, ...], weight: torch.Tensor) -> "_Blocks":
        return cls(max((len(chunk) for chunk in chunks), default=0), weight)

    def logits(self, chunk_hidden, weight, bias) -> torch.Tensor:
        """fp32 logits of the chunk, from a matmul in the inputs' dtype (as the plain path's)."""
        rows = len(chunk_hidden)
        out = (self.fp32 if self.low is None else self.low)[:rows]
        if bias is None:
            torch.mm(chunk_hidden, weight.T, out=out)
        else:
            torch.addmm(bias, chunk_hidden, weight.T, out=out)
        return out if self.low is None else self.fp32[:rows].copy_(out)

    def in_weight_dtype(self, grad_logits: torch.Tensor) -> torch.Tensor:
        return grad_logits if self.low is None else self.low[:len(grad_logits)].copy_(grad_logits)


def _add_chunk(hidden, weight, bias, labels, chunk, options, grads, blocks: _Blocks,
               shard: VocabShard | None, tokens: TokenShard | None) -> torch.Tensor:
    """Loss of the tokens at flat positions `chunk`; their gradients are added to `grads` (None: not needed)."""
    chunk_hidden = _chunk_hidden(hidden, chunk, tokens)
    logits = blocks.logits(chunk_hidden, weight, bias)
    loss, grad_logits = _cross_entropy_and_grad(logits, labels.index_select(0, chunk), options,
                                                need_grad=any(g is not None for g in grads), shard=shard)
    if grad_logits is not None:
        _add_grads(grads, grad_logits, chunk, chunk_hidden, weight, blocks, tokens)
    return loss


def _add_grads(grads, grad_logits, chunk, chunk_hidden, weight, blocks: _Blocks, tokens: TokenShard | None) -> None:
    """Back from the fp32 gradient of the chunk's logits (in a block) through the lm_head: into the rows `chunk` of
    the hidden states' gradient (those this rank holds, with `tokens`), and added to the weight's and bias's (None:
    not needed). The chunk's hidden states are written over by their gradient: no second [chunk, H] buffer."""
    grad_hidden, grad_weight, grad_bias = grads
    if grad_bias is not None:
        grad_bias += grad_logits.sum(0)
    grad_logits = blocks.in_weight_dtype(grad_logits)
    if grad_weight is not None:
        _add_matmul(grad_weight, grad_logits.T, chunk_hidden)
    if grad_hidden is None:
        return
    parts = torch.mm(grad_logits, weight, out=chunk_hidden)
    if tokens:
        tokens.add_grad(grad_hidden, chunk, parts)
    else:
        grad_hidden.index_copy_(0, chunk, parts)


def _add_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc in fp32 and the matmul in the inputs' dtype."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)  # in place: no [V, H] temporary
    else:
        acc += a @ b


def _cross_entropy_and_grad(logits: torch.Tensor, labels: torch.Tensor, options: LossOptions, need_grad: bool,
                            shard: VocabShard | None = None):
    """Summed loss of fp32 logits [n, V] (this rank's [n, V / tp] under loss parallel, `shard`) and, if need_grad,
    d(loss)/d(logits), computed in the logits' storage.

    Per token, with s the (soft-capped) logits, lse = logsumexp(s) and eps the label smoothing:
    loss = lse - (1 - eps) * s[label] - eps * mean(s) + z_loss * lse**2, the definition of
    F.cross_entropy(label_smoothing=eps) plus the z-loss.
    """
    eps, z_loss = options.label_smoothing, options.z_loss
    logits, tanh_slope = _softcap_(logits, options.logit_softcap, need_grad)
    if shard is None:
        per_token = -(1 - eps) * logits.gather(1, labels[:, None]).squeeze(1)
        if eps:
            per_token -= eps * logits.mean(dim=-1)
        probs, lse = _softmax_and_lse_(logits)
    else:
        # The label's logit and the row's sum, from the rank holding it and from every rank's part: summed with
        # the softmax's normalizer.
        parts = torch.stack([shard.picked(logits, labels), logits.sum(dim=-1) if eps else logits.new_zeros(len(labels))])
        probs, lse, (picked, total) = shard.softmax_and_lse_(logits, parts)
        per_token = -(1 - eps) * picked - eps * total / shard.vocab
    per_token += lse
    if z_loss:
        per_token += z_loss * lse.square()
    if not need_grad:
        return per_token.sum(), None
    grad = probs
    if z_loss:
        grad *= 1 + 2 * z_loss * lse[:, None]
    if eps:
        grad -= eps / (shard.vocab if shard else grad.size(1))
    if shard is None:
        grad[torch.arange(grad.size(0), device=grad.device), labels] -= 1 - eps
    else:
        shard.add_at_labels(grad, labels, -(1 - eps))
    if tanh_slope is not None:
        grad *= tanh_slope
    return per_token.sum(), grad


def _softcap_(logits: torch.Tensor, cap: float | None, need_slope: bool):
    """(cap * tanh(logits / cap), computed in the logits' storage; if need_slope, its derivative 1 - tanh**2 for the
    gradient, else None). No cap: the logits as they are and no slope."""
    if cap is None:
        return logits, None
    logits = logits.div_(cap).tanh_()
    slope = 1 - logits.square() if need_slope else None
    return logits.mul_(cap), slope


def _softmax_and_lse_(logits: torch.Tensor):
    """(softmax of fp32 logits [n, V], written over them; logsumexp of each row, [n])."""
    row_max = logits.amax(dim=-1)
    # Softmax in place, in one fused kernel that finishes each row while it is in cache: five separate passes over
    # the [n, V] block (max, subtract, exp, sum, divide) took twice as long on CPU, and torch.logsumexp allocates a
    # second block. Writing through out= into the input is safe because the kernel reads a row before writing it;
    # tests/unit/test_chunk_loss.py holds this against F.cross_entropy. The largest probability, the top logit's,
    # is exactly 1 / sum(exp(s - row_max)) and at least 1 / V, so it gives the log-normalizer without underflow.
    probs = torch.softmax(logits, dim=-1, out=logits)
    return probs, row_max - probs.amax(dim=-1).log()


def token_logps(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shifted_labels: torch.Tensor,
                options: LossOptions = LossOptions(), labelled: torch.Tensor | None = None,
                with_entropy: bool = False):
    """fp32 log p(label) of every token, in the shape of shifted_labels, 0.0 (and no gradient) where the label is
    IGNORE_INDEX; hidden [..., H], weight [V, H], bias [V] or None. with_entropy: (those, the entropy of each labelled
    token's distribution, 0.0 elsewhere, with no gradient).

    These are the model's log-probabilities: options.logit_softcap applies, since the capping is part of the model
    (Gemma), and z_loss and label_smoothing do not, since they are terms of the training loss, not of the model's
    distribution; options.temperature divides the capped logits (1: the model's own distribution). options.fused is
    not used: Liger's fused op returns the reduced loss, never a value per token, so the chunked path serves
    (options.chunk_size; 0 computes the full [tokens, vocab] logits, the reference). labelled:
    labelled_positions(shifted_labels), if known (None: computed here).
    """
    labels = shifted_labels.reshape(-1)
    hidden, weight, bias, shard, tokens = _split_inputs(hidden, weight, bias, bool(options.chunk_size))
    if options.chunk_size:
        labelled = labelled_positions(labels) if labelled is None else labelled
    if not options.chunk_size:
        logps, entropy = _full_logits_token_logps(hidden, weight, bias, labels, options, with_entropy)
    # Decided here, not in forward: there grad mode is always off (as in _chunked_cross_entropy_sum).
    elif torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        logps, entropy = _ChunkedTokenLogps.apply(hidden, weight, bias, labels, labelled, options, with_entropy,
                                                  shard, tokens)
    else:
        logps, _, entropy = _chunked_token_logps(hidden, weight, bias, labels, labelled, options, with_entropy,
                                                 shard, tokens)
    logps = logps.view(shifted_labels.shape)
    return (logps, entropy.view(shifted_labels.shape)) if with_entropy else logps


def _full_logits_token_logps(hidden, weight, bias, labels, options: LossOptions, with_entropy: bool):
    labelled = labels != IGNORE_INDEX
    logps = (_full_logits(hidden, weight, bias, options) / options.temperature).log_softmax(dim=-1)
    picked = logps.gather(1, labels.where(labelled, 0)[:, None]).squeeze(1)
    entropy = torch.special.entr(logps.detach().exp()).sum(dim=-1).where(labelled, 0.0) if with_entropy else None
    return picked.where(labelled, 0.0), entropy


def _chunked_token_logps(hidden, weight, bias, labels, labelled, options: LossOptions, with_entropy: bool = False,
                         shard: VocabShard | None = None, tokens: TokenShard | None = None):
    """(fp32 log-probs [T], 0 where ignored; the logsumexp of each labelled token's (tempered) logits, in the order
    of `labelled`; with_entropy: each labelled token's entropy [T], 0 elsewhere, else None), one [chunk, V] block at a
    time (of this rank's [chunk, V / tp] under loss parallel, `shard`; of every tp rank's tokens, `tokens`)."""
    logps = torch.zeros(len(labels), dtype=torch.float32, device=hidden.device)
    entropy = torch.zeros_like(logps) if with_entropy else None
    chunks = _chunks(labelled, options, tokens)
    blocks = _Blocks.for_chunks(chunks, weight)
    lse = []
    for chunk in chunks:
        logits = blocks.logits(_chunk_hidden(hidden, chunk, tokens), weight, bias)
        logits, _ = _softcap_(logits, options.logit_softcap, need_slope=False)
        if options.temperature != 1.0:
            logits.div_(options.temperature)
        chunk_labels = labels.index_select(0, chunk)
        if shard is None:
            picked = logits.gather(1, chunk_labels[:, None]).squeeze(1)
            probs, chunk_lse = _softmax_and_lse_(logits)
        else:
            probs, chunk_lse, (picked,) = shard.softmax_and_lse_(logits, shard.picked(logits, chunk_labels)[None])
        logps.index_copy_(0, chunk, picked - chunk_lse)
        if with_entropy:
            # -sum p log p, from the probabilities the block now holds: entr(0) is 0 where p underflowed.
            chunk_entropy = torch.special.entr(probs).sum(dim=-1)
            entropy.index_copy_(0, chunk, chunk_entropy if shard is None else shard.sum(chunk_entropy))
        lse.append(chunk_lse)
    return logps, torch.cat(lse) if lse else logps.new_empty(0), entropy


class _ChunkedTokenLogps(torch.autograd.Function):
    """Unlike the loss, whose gradients are computed in forward, this backward recomputes each chunk's logits (one
    more matmul): the weight of each token's log-probability in the loss is known only once the per-sequence sums
    have gone through the objective (DPO's), so forward cannot compute the gradients. It keeps the logsumexp per
    labelled token, so that the recomputed logits become probabilities without another reduction over the
    vocabulary."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, labelled, options, with_entropy, shard, tokens):
        logps, lse, entropy = _chunked_token_logps(hidden, weight, bias, labels, labelled, options, with_entropy,
                                                   shard, tokens)
        ctx.save_for_backward(hidden, weight, bias, labels, labelled, lse)
        ctx.options, ctx.shard, ctx.tokens = options, shard, tokens
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, _):
        hidden, weight, bias, labels, labelled, lse = ctx.saved_tensors
        options, shard, tokens = ctx.options, ctx.shard, ctx.tokens
        grads = _grad_accumulators(hidden, weight, bias, ctx.needs_input_grad[:3])
        chunks = _chunks(labelled, options, tokens)
        blocks = _Blocks.for_chunks(chunks, weight)
        for chunk, chunk_lse in zip(chunks, lse.split([len(chunk) for chunk in chunks])):
            chunk_hidden = _chunk_hidden(hidden, chunk, tokens)
            logits = blocks.logits(chunk_hidden, weight, bias)
            logits, tanh_slope = _softcap_(logits, options.logit_softcap, need_slope=True)
            if options.temperature != 1.0:
                logits.div_(options.temperature)
            grad = grad_logps.index_select(0, chunk)
            # d log p(label) / d s = onehot(label) - p, with p = exp(s - lse), scaled per token by its grad_output;
            # all in the block, which holds the logits.
            grad_logits = logits.sub_(chunk_lse[:, None]).exp_().mul_(-grad[:, None])
            if shard is None:
                grad_logits[torch.arange(len(chunk), device=chunk.device), labels.index_select(0, chunk)] += grad
            else:
                shard.add_at_labels(grad_logits, labels.index_select(0, chunk), grad)
            if options.temperature != 1.0:  # through s / T
                grad_logits /= options.temperature
            if tanh_slope is not None:
                grad_logits *= tanh_slope
            _add_grads(grads, grad_logits, chunk, chunk_hidden, weight, blocks, tokens)
        _hidden_grad_summed(grads, shard, tokens)
        return *_in_input_dtypes(grads, weight, bias), None, None, None, None, None, None
