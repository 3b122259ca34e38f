"""A job row's structured outputs constraint: which fields set one, the `StructuredOutputsParams`
they make, or the error naming the field, what is wrong and the fix.

Plain rows take the columns `json_schema` (a JSON schema object, or its JSON text), `regex`,
`choice` (a list of strings) and `grammar` (EBNF in GBNF form), plus vLLM's `structured_outputs`
(a dict of `StructuredOutputsParams` fields) and OpenAI's `response_format`; OpenAI batch bodies
take the last two. A row's own constraint wins over the job's (`--json-schema`, `--regex`,
`--choice`, `--grammar`); a null field sets none. Whether the library can take the constraint is
checked here, so a bad schema is an error row at once (and `--strict` finds it before any model
work); only the compile time limit is left to the engine, which needs the model's tokenizer.
"""

from __future__ import annotations

from typing import Any

from batchgen.jobs.output.json_lines import to_json
from batchgen.sampling_params import STRUCTURED_KINDS, StructuredOutputsParams

# Plain job columns -> the StructuredOutputsParams field each sets.
CONSTRAINT_COLUMNS = {"json_schema": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
# Fields of both dialects: vLLM's and OpenAI's.
BODY_FIELDS = ("structured_outputs", "response_format")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# `batchgen run`'s flag for each kind of job-wide constraint.
CONSTRAINT_FLAGS = {"json": "--json-schema", "regex": "--regex", "choice": "--choice", "grammar": "--grammar"}


def constraint_flag(default: dict | None) -> str | None:
    """The flag that set a job's default constraint (`SamplingDefaults.structured_outputs`, a dict
    of one `StructuredOutputsParams` field), or None."""
    kind = next(iter(default), None) if isinstance(default, dict) else None
    return CONSTRAINT_FLAGS.get(kind) if isinstance(kind, str) else None


def row_constraint(
    rec: dict, fields: tuple[str, ...], data_columns: frozenset[str] = frozenset(), prefix: str = ""
) -> tuple[StructuredOutputsParams | None, str | None, str | None]:
    """(the constraint `rec` sets or None, how messages name the field that set it ("field
    'json_schema'"), None) or (None, None, error).

    Args:
        rec: the record (a plain row, or an OpenAI batch line's body).
        fields: the fields to read (`CONSTRAINT_COLUMNS`' names and / or `BODY_FIELDS`).
        data_columns: columns the job uses as data (template fields, kept columns): never read.
        prefix: how messages name the record's fields ("body." for an OpenAI batch line).
    """
    found: list[tuple[str, StructuredOutputsParams, str]] = []
    for name in fields:
        if name in data_columns or rec.get(name) is None:
            continue
        params, err = _field_constraint(name, rec[name], f"field '{prefix}{name}'")
        if err is not None:
            return None, None, err
        if params is not None:
            quoted = f"'{prefix}{name}'"
            # a response_format's schema is named where it is
            inner = name == "response_format" and params.json is not None
            found.append(
                (quoted, params, f"field '{prefix}{name}.json_schema.schema'" if inner else f"field {quoted}")
            )
    if not found:
        return None, None, None
    if len(found) > 1:
        names = " and ".join(name for name, _, _ in found)
        return None, None, f"fields {names} both set a structured outputs constraint; give one per row"
    name, params, label = found[0]
    from batchgen.engine.structured_check import constraint_error  # imports xgrammar (and torch)

    err = constraint_error(params, label)
    return (None, None, err) if err is not None else (params, label, None)


def _field_constraint(name: str, value: Any, label: str) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint one field sets (None: none, as `response_format` text), or its error."""
    if name == "response_format":
        return _response_format(value, label)
    if name == "structured_outputs":
        if not isinstance(value, dict):
            return None, (
                f"{label} must be an object with one of {', '.join(STRUCTURED_KINDS)}, got {_shown(value)}; "
                'write e.g. {"choice": ["yes", "no"]}'
            )
        unknown = sorted(set(value) - set(STRUCTURED_KINDS))
        if unknown:
            keys = ", ".join(map(repr, unknown))
            return None, f"{label} has unknown key(s) {keys}; use one of {', '.join(STRUCTURED_KINDS)}"
        return _params(label, **{k: v for k, v in value.items() if v is not None})
    kind = CONSTRAINT_COLUMNS[name]
    if name == "json_schema" and not isinstance(value, dict | str):
        return (
            None,
            f"{label} must be a JSON schema object or its JSON text, got {_shown(value)}; fix the schema",
        )
    if name == "choice" and not isinstance(value, list | tuple):
        return None, f'{label} must be a list of strings, got {_shown(value)}; write e.g. ["yes", "no"]'
    if name in ("regex", "grammar") and not isinstance(value, str):
        return None, f"{label} must be a string, got {_shown(value)}; quote it"
    return _params(label, **{kind: list(value) if name == "choice" else value})


def _response_format(value: Any, label: str) -> tuple[StructuredOutputsParams | None, str | None]:
    """OpenAI's `response_format`: {"type": "text"} (no constraint), {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMAT_TYPES:
        return None, (
            f"{label} must be an object whose 'type' is one of {', '.join(RESPONSE_FORMAT_TYPES)}, got "
            f"{_shown(value)}; use one of those (OpenAI's response_format)"
        )
    if kind == "text":
        return None, None
    if kind == "json_object":
        return _params(label, json_object=True)
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    schema_label = f"{label[:-1]}.json_schema.schema'"
    if schema is None:
        return None, (
            f"{schema_label} is missing; give the schema there, as OpenAI's API takes it: "
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}'
        )
    return _params(schema_label, json=schema)


def _params(label: str, **fields: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    try:
        return StructuredOutputsParams(**fields), None
    except (TypeError, ValueError) as e:
        # The message names structured_outputs' own fields: name the row's instead.
        text = str(e)
        for kind in STRUCTURED_KINDS:
            text = text.replace(f"structured_outputs.{kind}", label)
        return None, f"{text}" if text.startswith(label) else f"{label}: {text}"


def _shown(value: Any) -> str:
    text = to_json(value)
    return text if len(text) <= 80 else text[:77] + "..."
