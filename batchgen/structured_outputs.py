"""StructuredOutputsParams: the constraint a request's output must match (vLLM's names), a field
of `batchgen.sampling_params.SamplingParams`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The constraints of StructuredOutputsParams, in vLLM's order; a request has exactly one.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """The constraint a request's output must match (vLLM's `StructuredOutputsParams` names); give
    exactly one. The engine compiles it with xgrammar (`batchgen.engine.structured`) and masks every
    token the constraint does not allow before sampling.

    Attributes:
        json: a JSON schema, as a dict or as JSON text: the output is one JSON value matching it.
            Property order in the output is the schema's `properties` order.
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar in GBNF form (`root ::= ...`, as llama.cpp and xgrammar write it).
        json_object: True: the output is any JSON object (OpenAI's `{"type": "json_object"}`).

    Raises:
        ValueError / TypeError: naming the field: none or several constraints, a wrong type, JSON
            text that does not parse or is not an object, an empty regex, choice list or grammar.
            Whether a schema, regex or grammar compiles is checked by the engine (an error row).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check that exactly one constraint is given and that it has the right type.

        Raises:
            ValueError / TypeError: naming the field, what is wrong and the fix.
        """
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = "none" if not given else " and ".join(given)
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KINDS)}; got {what}: "
                "give one constraint per request"
            )
        if self.json is not None:
            self.schema  # noqa: B018 (parses it: the check is the property's)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise TypeError(
                    f"structured_outputs.{name} must be a non-empty string, got {value!r:.80}; give the "
                    f"{'pattern' if name == 'regex' else 'grammar text'} or leave it unset"
                )
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice:
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r:.80}; "
                    'give the allowed outputs, e.g. ["yes", "no"]'
                )
            if not all(isinstance(c, str) and c for c in self.choice):
                raise TypeError(
                    f"structured_outputs.choice must hold non-empty strings only, got {self.choice!r:.80}; "
                    "write each choice as text"
                )
        if self.json_object not in (None, True, False):
            raise TypeError(
                f"structured_outputs.json_object must be True or False, got {self.json_object!r}; set it to true"
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: one of `STRUCTURED_KINDS`."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def schema(self) -> dict:
        """`json` as a dict (JSON text parsed).

        Raises:
            ValueError: JSON text that does not parse, or a schema that is not an object.
        """
        value = self.json
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(
                    f"structured_outputs.json is not valid JSON ({e}); fix the schema text"
                ) from None
        if not isinstance(value, dict):
            raise TypeError(
                f"structured_outputs.json must be a JSON schema object, got {type(value).__name__} "
                f'{value!r:.80}; give an object such as {{"type": "object", "properties": {{...}}}}'
            )
        return value

    @property
    def key(self) -> str:
        """The constraint's canonical text, its identity in caches and row hashes: the kind, then
        the schema as compact JSON (its key order kept: it is the output's property order), the
        choices as a JSON list, or the regex or grammar text as given."""
        kind = self.kind
        if kind == "json":
            text = json.dumps(self.schema, separators=(",", ":"), ensure_ascii=False)
        elif kind == "choice":
            text = json.dumps(list(self.choice or ()), ensure_ascii=False)
        elif kind == "json_object":
            text = "true"
        else:
            text = getattr(self, kind)
        return f"{kind}:{text}"

    def to_dict(self) -> dict[str, Any]:
        """The constraint as {kind: canonical text} (see `key`), for row hashes and reports."""
        kind, _, text = self.key.partition(":")
        return {kind: text}
