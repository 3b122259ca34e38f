"""The engine's sizes as values (`EnginePlan`, `WeightEstimate`), apart from the torch-bound
decisions of `sizing.py` and `weight_memory.py`, so that a process without torch (`batchgen
plan`'s) can hold and check them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class EnginePlan:
    """The engine's sizes, decided once at start (`plan_engine`).

    Attributes:
        num_blocks: device KV blocks.
        num_swap_blocks: CPU swap blocks (0 unless `preemption_mode` is "swap").
        bytes_per_block: one KV block, K and V in every layer (`kv_cache_bytes_per_block`).
        max_model_len: the longest sequence served (prompt + output), in tokens.
        max_num_batched_tokens: the token budget of a step.
        max_model_len_note: said wherever max_model_len is quoted, so a limit the KV cache lowered
            is not mistaken for one the user set ("" when it was not lowered).
        too_long_fix: what a prompt too long for max_model_len can do about it.
    """

    num_blocks: int
    num_swap_blocks: int
    bytes_per_block: int
    max_model_len: int
    max_num_batched_tokens: int
    max_model_len_note: str = ""
    too_long_fix: str = "shorten or truncate the prompt, or raise max_model_len"

    def check_prompt_len(self, num_tokens: int) -> str | None:
        """Why a prompt of `num_tokens` tokens can never run (it leaves no room for one output
        token), or None when it fits."""
        if num_tokens < self.max_model_len:
            return None
        return (
            f"prompt has {num_tokens} tokens but max_model_len is {self.max_model_len}"
            f"{self.max_model_len_note} (room is needed for at least one output token): {self.too_long_fix}"
        )


@dataclass(frozen=True)
class WeightEstimate:
    """The weights' bytes as the engine runs them, under its quantization
    (`weight_memory.estimate_weights`, which says what is counted how).

    Attributes:
        method: the `quantization` option ("auto", "none" or "int8").
        format: what the quantized linears hold: "int8" (a GGUF file's types run as int8 too), or ""
            where none runs quantized.
        dtype: the run dtype's name (the float weights').
        linears / quantized_linears: decoder linears, and how many of them run quantized.
        quantized_bytes / quantized_params: the quantized linears' bytes (values and scales) and
            weights, the LM head's among them where `quantized_head`.
        float_bytes: everything else, at the run dtype: the other linears, a mixture's experts, the
            embedding and a float LM head that is not tied to it.
        tied: the LM head is the embedding in the checkpoint (counted once where both are float).
        quantized_head: the LM head runs quantized ("int8"), the embedding staying float.
        dequantized: a GGUF file's stored types of the linears run dequantized (e.g. ("Q4_1",)).
        device: "cpu" or "cuda" (no GPU kernel runs quantized weights).
    """

    method: str
    format: str
    dtype: str
    linears: int
    quantized_linears: int
    quantized_bytes: int
    quantized_params: int
    float_bytes: int
    tied: bool
    dequantized: tuple[str, ...] = ()
    device: str = "cpu"
    quantized_head: bool = False

    @property
    def total_bytes(self) -> int:
        return self.quantized_bytes + self.float_bytes

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "dequantized": list(self.dequantized), "total_bytes": self.total_bytes}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WeightEstimate:
        fields = {k: v for k, v in data.items() if k != "total_bytes"}
        return cls(**{**fields, "dequantized": tuple(fields.get("dequantized", ()))})

    def describe(self) -> str:
        """What the bytes are, for `batchgen plan`'s line, e.g. "int8: 120 of 120 decoder linears
        and the LM head 160.4 MiB in int8 (10.0 bits a weight, scales included), the rest 54.0 MiB
        bfloat16; the LM head an int8 copy of the tied embedding; not counted: norms, biases, ..."."""
        words = [f"{self.method}: "]
        if self.quantized_linears:
            bits = 8 * self.quantized_bytes / self.quantized_params
            head = " and the LM head" if self.quantized_head else ""
            words.append(
                f"{self.quantized_linears} of {self.linears} decoder linears{head} "
                f"{self.quantized_bytes / 2**20:.1f} MiB in {self.format} ({bits:.1f} bits a weight, "
                "scales included), the rest "
            )
        elif self.method != "none" and self.device != "cpu":
            words.append(f"no {self.device} kernel runs quantized weights: all ")
        else:
            words.append("all ")
        words.append(f"{self.float_bytes / 2**20:.1f} MiB {self.dtype}")
        if self.dequantized:
            words.append(
                f"; GGUF {'/'.join(self.dequantized)} linears dequantized (no kernel runs them as stored)"
            )
        if self.tied:
            words.append(
                f"; the LM head an {self.format} copy of the tied embedding"
                if self.quantized_head
                else "; the LM head tied to the embedding"
            )
        words.append("; not counted: norms, biases, the kernel choice's second weight layouts")
        return "".join(words)
