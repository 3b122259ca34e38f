"""ModelRunner: a scheduler decision in, sampled token ids (and scored prompt rows) out.

Owns the model, the paged KV cache (and its CPU swap space, `kv_cache`) and the sampler. It
flattens a step into one token batch: `input_ids[T]`, `positions[T]`, `slot_mapping[T]`,
`block_tables[B, max_blocks]` and per-sequence query and context lengths (a step of decodes only
padded to a bucket where asked: `decode_buffers`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from batchgen.model.attention import AttentionMetadata, select_backend
from batchgen.model.decode_buffers import DecodeBuffers
from batchgen.model.families import model_class
from batchgen.model.flat_step import DecodeRows
from batchgen.model.kernel_choice.choice import KernelChoice, apply_kernels
from batchgen.model.kv_cache import allocate_kv_caches, allocate_swap_caches
from batchgen.model.layers import attention_heads
from batchgen.model.llama import LlamaForCausalLM
from batchgen.model.quantization import Quantization
from batchgen.model.sampler import SampleLogprobs, Sampler, TokenMasks, sample_logprobs
from batchgen.model.step import StepInput, StepOutput
from batchgen.model.step_rows import StepRows, step_rows

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class ModelRunner:
    """Builds the model on `device`, allocates the KV cache, and runs steps.

    Args:
        config: Hugging Face model config.
        weights: iterable of (Hugging Face name, tensor).
        dtype: activation and weight dtype.
        device: torch device.
        block_size: tokens per KV block.
        num_blocks: device KV blocks (the engine sizes them from its memory budget).
        num_swap_blocks: CPU blocks for swapped-out requests.
        max_positions: rotary table length (>= max_model_len).
        attention_backend: "auto", "torch", "cpu" or "triton" ("auto" is "torch" under
            `kernels="reference"`).
        kernels: "auto", "reference" or "native" (`batchgen.model.kernel_choice.choice`);
            `one_weight_layout` holds one weight copy per linear under "auto".
        max_step_rows / max_logit_rows: the most rows of a step (`max_num_batched_tokens`) and of
            its logits (`max_num_seqs`): the row buckets kernels are chosen for.
        seed: seed of the shared sampling generator.
        quantize: called on the model once its weights are loaded, before the kernels are chosen:
            quantizes its linears (`batchgen.model.quantization.quantize_model`); None: none.
        decode_buckets: batch sizes a step of decodes only is padded to, in persistent input
            buffers (`decode_buffers.DecodeBuffers`; the cache gets one more block, the padding
            rows' scratch block); None: steps run unpadded.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        weights: Iterable[tuple[str, torch.Tensor]],
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        num_blocks: int,
        num_swap_blocks: int,
        max_positions: int,
        attention_backend: str = "auto",
        kernels: str = "auto",
        one_weight_layout: bool = False,
        max_step_rows: int = 2048,
        max_logit_rows: int = 256,
        seed: int = 0,
        quantize: Callable[[LlamaForCausalLM], Quantization] | None = None,
        decode_buckets: tuple[int, ...] | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        if kernels == "reference" and attention_backend == "auto" and device.type == "cpu":
            attention_backend = "torch"
        self.backend = select_backend(attention_backend, device)
        with torch.device("meta"):
            model = model_class(config)(config, self.backend, max_positions)
        model = model.to_empty(device=device).to(dtype)
        if model.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        _, kv_heads, head_dim = attention_heads(config)
        model.rebuild_rotary(max_positions, device)
        model.load_weights(weights)
        self.quantization = quantize(model) if quantize is not None else Quantization()
        # Bytes of the weights a step reads once: the linears (quantized where they are; the LM head's
        # float) as the roofline counts them. Read before the kernels repack the weights.
        self.weight_bytes = sum(
            self.quantization.weights[name].nbytes
            if name in self.quantization.weights
            else module.weight.numel() * module.weight.element_size()
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear)
        )
        self.kernel_choice: KernelChoice = apply_kernels(
            model,
            kernels,
            device,
            max_step_rows,
            max_logit_rows,
            one_layout=one_weight_layout,
            block_size=block_size,
            quantized=self.quantization.weights,
        )
        self.model = model.eval()
        # Padded decodes store their padding rows' K/V in one more block, never handed out.
        scratch = 1 if decode_buckets else 0
        shape = (num_blocks + scratch, block_size, kv_heads, head_dim)
        self.kv_caches = allocate_kv_caches(config.num_hidden_layers, shape, dtype, device)
        self.num_blocks = num_blocks
        self.decode_rows = DecodeRows()  # a decodes-only step's arrays, kept for the next
        self._rows: StepRows | None = None  # the last step's, reused while `decode_rows` keeps its rows
        self.decode_buffers = (
            DecodeBuffers(decode_buckets, -(-max_positions // block_size) + 1, num_blocks, block_size, device)
            if decode_buckets
            else None
        )
        swap_shape = (num_swap_blocks, block_size, kv_heads, head_dim)
        self.swap_caches = allocate_swap_caches(config.num_hidden_layers, swap_shape, dtype, device)
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        self.sampler = Sampler(generator)
        self.token_masks = TokenMasks(int(config.vocab_size), device)

    def describe(self) -> str:
        """The quantization and the kernel choice in a few words, for the start line."""
        kernels = self.kernel_choice.summary()
        return f"quantization {self.quantization.summary()}" + (f"; kernels {kernels}" if kernels else "")

    # ---- swap ----
    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU swap blocks: mapping of (device block, swap block)."""
        if not mapping:
            return
        src = torch.tensor([m[0] for m in mapping], device=self.device)
        dst = torch.tensor([m[1] for m in mapping])
        for (k, v), (sk, sv) in zip(self.kv_caches, self.swap_caches, strict=True):
            sk[dst] = k[src].to("cpu")
            sv[dst] = v[src].to("cpu")

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy CPU swap blocks back to device blocks: mapping of (swap block, device block)."""
        if not mapping:
            return
        src = torch.tensor([m[0] for m in mapping])
        dst = torch.tensor([m[1] for m in mapping], device=self.device)
        for (k, v), (sk, sv) in zip(self.kv_caches, self.swap_caches, strict=True):
            k[dst] = sk[src].to(self.device)
            v[dst] = sv[src].to(self.device)

    # ---- the step ----
    def prepare(
        self, seqs: list[StepInput]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the step (`flat_step.flatten_step`): (input_ids [T], positions [T], metadata,
        logits_indices [B']), B' the sum of the sequences' `num_sampled`. With `decode_buckets`, a
        step of decodes only is padded to its bucket (`DecodeBuffers.pad`): then B' is the bucket,
        and the first `len(seqs)` logits rows are the sequences'."""
        input_ids, positions, meta, logits_indices = self.decode_rows.flatten(
            seqs, self.block_size, self.device
        )
        buffers = self.decode_buffers
        if (
            buffers is not None
            and meta.num_decodes == len(seqs)
            and meta.block_tables.shape[1] <= buffers.block_tables.shape[1]
            and (bucket := buffers.bucket(len(seqs))) is not None
            and all(s.scored is None for s in seqs)
        ):
            return buffers.pad(input_ids, positions, meta, bucket)
        return input_ids, positions, meta, logits_indices

    @torch.inference_mode()
    def execute(self, seqs: list[StepInput]) -> StepOutput:
        """Run one step; returns the tokens sampled for the sequences with `sample` set, in order:
        `num_sampled` tokens each (a sequence with draft tokens gets one per position, each sampled
        with the sequence's settings); and, for each sequence with `scored` rows, their targets'
        log probabilities (`StepOutput.scored`), at no cost to the steps where none asks.

        Sequences must come decodes first (`StepInput.is_decode`), then prefill chunks.

        A sequence's `token_mask` sets the logits of the tokens it does not allow to -inf before
        the sampler sees them (so penalties, temperature and the filters act on the masked logits,
        and log probabilities are those of the masked logits, as in vLLM). The masks are filled
        on the CPU after the forward is launched: on a GPU that work overlaps the forward.

        Raises:
            ValueError: draft tokens on a sequence with a penalty, banned ids or a token mask (their
                values at each draft position would need the drafts in the history; the engine
                never asks).
        """
        began = time.perf_counter()
        input_ids, positions, meta, logits_indices = self.prepare(seqs)
        # The same rows as the last step (`DecodeRows` kept them) ask the same of the sampler.
        rows = self._rows if self.decode_rows.kept and self._rows is not None else step_rows(seqs)
        self._rows = rows
        prepared = time.perf_counter()
        scored_rows = rows.scored_rows
        scored = None
        if scored_rows is None:  # the usual step: logits of the sampled rows only
            logits = self.model(input_ids, positions, self.kv_caches, meta, logits_indices)
        else:
            wanted = torch.cat([logits_indices, torch.from_numpy(scored_rows).to(self.device)])
            hidden = self.model.final_hidden(input_ids, positions, self.kv_caches, meta, wanted)
            # The sampled rows' logits as in a step without scoring (one LM head call of their own).
            logits = self.model.logits(hidden[: len(logits_indices)])
            scored = self._score(hidden[len(logits_indices) :], seqs)
        sampled = rows.sampled
        logits = logits[: len(sampled)]  # a padded step's padding rows (`prepare`) come last
        forwarded = time.perf_counter()
        if not sampled:
            return StepOutput(
                [], [], scored=scored, prepare_s=prepared - began, forward_s=forwarded - prepared
            )
        token_ids, finite_flags, raw, mask_time = self._sample(logits, rows)
        asked = rows.asked
        errors = logit_errors(finite_flags, seqs)
        logprobs: list[SampleLogprobs | None] = [None] * len(token_ids)
        if raw is not None:
            found = sample_logprobs(
                raw, [token_ids[i] for i in asked], [sampled[i].logprobs or 0 for i in asked]
            )
            for i, lp in zip(asked, found, strict=True):
                logprobs[i] = lp
        return StepOutput(
            token_ids,
            logprobs,
            errors,
            scored,
            mask_time,
            prepare_s=prepared - began,
            forward_s=forwarded - prepared,
            sample_s=time.perf_counter() - forwarded - mask_time,
        )

    def _sample(
        self, logits: torch.Tensor, rows: StepRows
    ) -> tuple[list[int], list[int], torch.Tensor | None, float]:
        """Sample `logits` `[len(rows.sampled), vocab]` (modified in place): (token ids, finite
        flags, the raw logits of the rows that asked for log probabilities (`rows.asked`) or None,
        seconds of token masks), the ids and flags read in the step's one copy to the host."""
        batch, asked = rows.batch, rows.asked
        # Greedy rows with nothing to change their logits: argmax and the finite check in one pass.
        stacked = None if rows.masked else self.sampler.greedy_rows(logits, batch)
        mask_time, raw = 0.0, None
        if stacked is None:
            finite = finite_rows(logits)  # before the masks' -inf; read with the sampled ids
            mask_time = self._mask(logits, rows.sampled) if rows.masked else 0.0
            # Log probabilities come from the logits before the sampler, which changes them in
            # place: copied first (indexing with a list copies), for the rows that asked only.
            raw = logits[asked] if asked else None
            stacked = torch.stack([self.sampler(logits, batch), finite.to(torch.int64)])
        elif asked:
            raw = logits[asked]
        # The step's one copy to the host: the sampled ids and each row's finite flag together.
        token_ids, finite_flags = stacked.tolist()
        return token_ids, finite_flags, raw, mask_time

    def _mask(self, logits: torch.Tensor, sampled: list[StepInput]) -> float:
        """Apply the sampled rows' token masks to `logits` `[len(sampled), vocab]` in place;
        returns the seconds it took (fill and apply)."""
        start = time.perf_counter()
        masks = self.token_masks.fill([s.token_mask for s in sampled])
        if masks is not None:
            self.token_masks.apply(logits, masks)
        return time.perf_counter() - start

    def _score(self, hidden: torch.Tensor, seqs: list[StepInput]) -> list[list[SampleLogprobs] | None]:
        """The `SampleLogprobs` of each sequence's `ScoredRows` targets, from `hidden` `[R, hidden]`
        (the final-norm hidden states of every scored row, in `scored_row_indices` order).

        The LM head and the float32 log-softmax run `SCORE_SLICE_ROWS` rows at a time, so a long
        prefill chunk never holds more than a slice of `[rows, vocab]` logits."""
        targets = [t for s in seqs if s.scored is not None for t in s.scored.targets]
        tops = [s.scored.top for s in seqs if s.scored is not None for _ in s.scored.targets]
        found: list[SampleLogprobs] = []
        for lo in range(0, len(targets), SCORE_SLICE_ROWS):
            hi = lo + SCORE_SLICE_ROWS
            found += sample_logprobs(self.model.logits(hidden[lo:hi]), targets[lo:hi], tops[lo:hi])
        out: list[list[SampleLogprobs] | None] = []
        at = 0
        for s in seqs:
            if s.scored is None:
                out.append(None)
                continue
            out.append(found[at : at + len(s.scored.targets)])
            at += len(s.scored.targets)
        return out


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Whether each row of `logits` `[B, vocab]` is free of NaN and infinities: bool `[B]` on the
    logits' device (no copy to the host: the step reads it with the sampled ids).

    A NaN or infinite logit (an overflow in float16, a bad weight) would be sampled as some token
    and the text would go on as if nothing happened: such a row fails instead (`logit_errors`).
    A row sum finds them in one cheap pass (a full isfinite mask, or a float32 accumulation of
    bf16 logits, costs 4-7x more on a CPU: see docs/benchmarks.md): a NaN or infinity makes it NaN
    or infinite, and finite float32 or bfloat16 logits cannot overflow it (their range reaches
    3e38). float16's stops at 65504, which a row of large logits can sum past: it is summed in
    float32.
    """
    if logits.dtype == torch.float16:
        return torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))
    return torch.isfinite(logits.sum(dim=-1))


def logit_errors(finite: list[int], seqs: list[StepInput]) -> list[str | None] | None:
    """Per sampled row, why its logits cannot be sampled (NaN or infinite), from `finite_rows`'
    flags (1 finite, 0 not) on the host, or None when every row is fine."""
    if all(finite):
        return None
    bad_rows = [not ok for ok in finite]
    # The position of each sampled token (a draft row's j-th is d - j before the last).
    ends = [s.start + len(s.token_ids) - s.num_sampled + j + 1 for s in seqs for j in range(s.num_sampled)]
    return [
        f"the model produced NaN or infinite logits at position {end} (a "
        "numerical overflow in this dtype, or damaged weights); try dtype bfloat16 or float32"
        if bad
        else None
        for end, bad in zip(ends, bad_rows, strict=True)
    ]


# Scored rows (prompt log probabilities) whose logits exist at once: 256 rows of a 128k vocabulary
# are 128 MiB of float32 log-probabilities.
SCORE_SLICE_ROWS = 256
