"""SamplingParams: how one request is decoded and when it stops (vLLM's field names), with
StructuredOutputsParams (`batchgen.structured_outputs`), the constraint its output must match; and
SamplingDefaults, a job's sampling flags, which every row's own columns override."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Any

from batchgen.structured_outputs import STRUCTURED_KINDS, StructuredOutputsParams

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "STRUCTURED_KINDS",
    "SamplingDefaults",
    "SamplingParams",
    "StructuredOutputsParams",
]

_GREEDY_EPS = 1e-5
# What `torch.Generator.manual_seed` takes: a signed or an unsigned 64-bit value.
_SEED_RANGE = (-(2**63), 2**64)
# Fields added after job rows were first hashed, with the values that leave a row's hash unchanged.
_LATER_FIELDS = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logprobs": None,
    "n": 1,
    "include_stop_str_in_output": False,
    "prompt_logprobs": None,
    "structured_outputs": None,
}
# Most top log probabilities a generated token may ask for (vLLM's default `max_logprobs`).
MAX_LOGPROBS = 20
# Most completions per prompt (OpenAI's API limit for `n`).
MAX_N = 128


@dataclass
class SamplingParams:
    """Per-request decoding options, named and defaulted as in vLLM.

    Attributes:
        temperature: 0 means greedy (argmax); higher flattens the distribution.
        top_p: keep the smallest set of tokens whose probability sums to at least `top_p` (0, 1].
        top_k: keep the `top_k` most likely tokens; 0 or -1 turns it off.
        min_p: drop tokens whose probability is below `min_p` x the top token's probability.
        seed: per-request seed; the request's samples then do not depend on its batch neighbours.
        max_tokens: most tokens to generate (None: up to `max_model_len`).
        min_tokens: EOS and stop token ids are ignored until this many tokens exist.
        ignore_eos: keep generating past EOS (benchmarks).
        stop: strings that end generation; the output text is cut before the match.
        stop_token_ids: token ids that end generation (besides the model's EOS ids).
        include_stop_str_in_output: keep what stopped the request in its text: the stop string
            (else the text ends before it), or the stop token's text (else, as in vLLM, a request
            that a stop token or EOS ended has that token in `token_ids` but not in `text`).
        skip_special_tokens: drop special tokens when detokenizing.
        priority: used by the "priority" policy; lower value is served first (as in vLLM).
        presence_penalty: subtracted from the logit of every token already generated, in [-2, 2]
            (OpenAI's and vLLM's definition; > 0 favours new tokens).
        frequency_penalty: subtracted from a token's logit once per time it was generated, in [-2, 2].
        repetition_penalty: divides the positive logits and multiplies the negative ones of every
            token in the prompt or the output so far, > 0 (Keskar et al. 2019, "CTRL"; as in
            Hugging Face `generate` and vLLM; 1 = off).
        n: how many completions to sample for the prompt (vLLM's `n`), 1 to `MAX_N`; each is its
            own sequence, and a seeded request's i-th completion uses `seed + i`, so they differ.
        logprobs: None, or the number (0 to `MAX_LOGPROBS`) of most likely tokens whose log
            probabilities come back for every generated token, besides the sampled token's own
            (vLLM's meaning; the log-softmax of the model's raw logits, before penalties,
            temperature and filters, as vLLM's default "raw_logprobs"; of the masked logits for a
            structured request, as in vLLM).
        prompt_logprobs: None, or the number (0 to `MAX_LOGPROBS`) of most likely tokens whose log
            probabilities come back for every prompt position after the first, besides the prompt
            token's own (vLLM's meaning; `RequestOutput.prompt_logprobs`). Such a request takes no
            prefix-cache hits over positions whose log probabilities it has not received yet.
        structured_outputs: the constraint the output must match (`StructuredOutputsParams`, or a
            dict of its fields), or None. Its matcher ends the request ("stop") when the constraint
            is complete; EOS is the only token it then allows.

    Raises:
        ValueError / TypeError: naming the field and the allowed range, at construction, and again
            from `validate()` when the engine takes a request (fields may be changed in between,
            as vLLM users do).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    priority: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    n: int = 1
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            unknown = sorted(set(self.structured_outputs) - set(STRUCTURED_KINDS))
            if unknown:
                raise TypeError(
                    f"structured_outputs has unknown field(s) {', '.join(map(repr, unknown))}; "
                    f"use one of {', '.join(STRUCTURED_KINDS)}"
                )
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        # NumPy's scalars (values read from a pandas or Arrow column) as Python's: they pass the type
        # checks below and serialize as JSON.
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, numbers.Integral) and not isinstance(value, int):
                setattr(self, f.name, int(value))
            elif isinstance(value, numbers.Real) and not isinstance(value, int | float):
                setattr(self, f.name, float(value))
        self.validate()
        self.top_k = canonical_top_k(self.top_k)

    def validate(self) -> None:
        """Check every field (types and ranges).

        Raises:
            TypeError: a field of the wrong type, named.
            ValueError: a value out of range, named with the allowed range.
        """

        def number(name: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            return float(value)

        def integer(name: str, value: object) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an integer, got {value!r}")
            return value

        if number("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < number("top_p", self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if integer("top_k", self.top_k) < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}")
        if not 0.0 <= number("min_p", self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not _SEED_RANGE[0] <= integer("seed", self.seed) < _SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64) (a 64-bit seed), got {self.seed}")
        if self.max_tokens is not None and integer("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if integer("min_tokens", self.min_tokens) < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.stop is not None and not isinstance(self.stop, str):
            if not isinstance(self.stop, list | tuple) or not all(isinstance(s, str) for s in self.stop):
                raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in ([self.stop] if isinstance(self.stop, str) else self.stop or [])):
            raise ValueError("stop strings must not be empty")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list | tuple):
                raise TypeError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
            for t in self.stop_token_ids:
                if integer("stop_token_ids[]", t) < 0:
                    raise ValueError(f"stop_token_ids must be token ids (>= 0), got {t}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        integer("priority", self.priority)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= number(name, getattr(self, name)) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if number("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if not 1 <= integer("n", self.n) <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}] (completions per prompt), got {self.n}")
        if self.logprobs is not None and not 0 <= integer("logprobs", self.logprobs) <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if (
            self.prompt_logprobs is not None
            and not 0 <= integer("prompt_logprobs", self.prompt_logprobs) <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        self._validate_structured()

    def _validate_structured(self) -> None:
        so = self.structured_outputs
        if so is None:
            return
        if not isinstance(so, StructuredOutputsParams):
            raise TypeError(
                f"structured_outputs must be a StructuredOutputsParams (or a dict of its fields), "
                f"got {type(so).__name__}"
            )
        so.validate()
        if self.min_tokens:
            # The constraint decides where the output ends: once it is complete EOS is the only
            # token allowed, and min_tokens would ban it.
            raise ValueError(
                f"min_tokens ({self.min_tokens}) cannot be combined with structured_outputs (the "
                "constraint decides where the output ends); set min_tokens to 0"
            )

    @property
    def penalized(self) -> bool:
        """Whether any of the three penalties changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        """True when the request decodes by argmax (temperature ~ 0, or top_k == 1)."""
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        """`stop` normalised to a list (read from the field each time, so a change is seen)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def to_dict(self) -> dict:
        """The public fields as a plain dict (for hashing job rows and for reports).

        The penalties, logprobs, n, include_stop_str_in_output, prompt_logprobs and
        structured_outputs came later: at their neutral values they are left out, so a job row's
        hash (its identity on resume) is what it was before they existed."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        for name, neutral in _LATER_FIELDS.items():
            if out[name] == neutral:
                del out[name]
        if self.structured_outputs is not None:
            out["structured_outputs"] = self.structured_outputs.to_dict()
        return out


# Marks the SamplingDefaults fields added after the run header first held the sampling defaults.
_ADDED_LATER = {"added_later": True}


@dataclass(kw_only=True)
class SamplingDefaults:
    """A job's sampling defaults: `batchgen run`'s sampling flags, which a row's columns override.

    Declared once, here: `batchgen run` takes each field as the flag of its name
    (`batchgen.cli_types.sampling_options` collects them) and `batchgen.jobs.options.JobOptions`
    carries them as its own fields. Names and meanings are `SamplingParams`'; the defaults are
    vLLM's but for `max_tokens` (256, not 16: a job's rows are whole answers) and `temperature`
    (0, greedy: a job's output is reproducible unless asked otherwise). `stop` and
    `stop_token_ids` are tuples here (lists, or None when empty, in `sampling_defaults()`).
    """

    max_tokens: int | None = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = field(default=None, metadata=_ADDED_LATER)
    min_p: float = field(default=0.0, metadata=_ADDED_LATER)
    min_tokens: int = field(default=0, metadata=_ADDED_LATER)
    ignore_eos: bool = field(default=False, metadata=_ADDED_LATER)
    stop_token_ids: tuple[int, ...] = field(default=(), metadata=_ADDED_LATER)
    n: int = field(default=1, metadata=_ADDED_LATER)
    prompt_logprobs: int | None = field(default=None, metadata=_ADDED_LATER)
    # The job's constraint (`--json-schema`, `--regex`, `--choice`, `--grammar`): a dict of one
    # StructuredOutputsParams field, as the run header stores it.
    structured_outputs: dict[str, Any] | None = field(default=None, metadata=_ADDED_LATER)

    def sampling_defaults(self) -> dict[str, Any]:
        """The defaults as SamplingParams keyword arguments. The fields added after the first ones
        only when set, so the resume header of a job that uses none of them is what it was before
        they existed."""
        defaults = {}
        for f in fields(SamplingDefaults):
            value, unset = _as_keyword(getattr(self, f.name)), _as_keyword(f.default)
            if f.name == "top_k":
                value = canonical_top_k(value)
            if not f.metadata.get("added_later") or value != unset:
                defaults[f.name] = value
        return defaults


def canonical_top_k(top_k: Any) -> Any:
    """`top_k` in one form: -1 as 0, vLLM's two words for "off", so requests and job options that
    mean the same hash (and resume) alike; any other value as given."""
    return 0 if top_k == -1 else top_k


def _as_keyword(value: Any) -> Any:
    """A SamplingDefaults value as SamplingParams takes it: a tuple as a list, an empty one as None."""
    return (list(value) or None) if isinstance(value, tuple) else value
