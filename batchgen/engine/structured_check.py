"""What a structured outputs constraint asks of the grammar library, and why it may not be taken.

`library_grammar` turns a `StructuredOutputsParams` into xgrammar's input (a JSON schema, a regex,
an EBNF grammar); `constraint_error` says, without a tokenizer, whether xgrammar can take it: the
schema parses and every keyword it uses is one xgrammar enforces, the regex and the grammar parse.
xgrammar ignores the JSON Schema keywords it does not implement (`uniqueItems`, `not`, `if`, ...),
so output "matching" such a schema could break it: those are refused here, by name and place.

The keyword table follows xgrammar's own list of what it supports
(docs/xgrammar_features/json_schema.md in mlc-ai/xgrammar, version 0.2).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from typing import Any

from batchgen.engine.request import Request
from batchgen.sampling_params import StructuredOutputsParams

# JSON Schema keywords that constrain a value but that xgrammar does not enforce.
UNSUPPORTED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "uniqueItems",
        "multipleOf",
        "contains",
        "minContains",
        "maxContains",
        "additionalItems",
        "$dynamicRef",
        "$recursiveRef",
    }
)
# String formats xgrammar enforces; any other `format` would be ignored.
SUPPORTED_FORMATS = frozenset(
    {
        "date",
        "time",
        "date-time",
        "duration",
        "email",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
# Keywords whose value is a map of name -> subschema, one subschema, or a list of subschemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_ONE_SCHEMA = ("additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames", "items")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
# xgrammar's C++ messages start with a time stamp and a source location.
_LOG_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")
_CHECKED_MAX = 4096  # constraint checks remembered (by canonical text)
_checked: OrderedDict[bytes, str | None] = OrderedDict()


def library_grammar(params: StructuredOutputsParams) -> tuple[str, str]:
    """(xgrammar's compile method, its input text) for a constraint: ("json_schema", schema JSON)
    for `json` and `json_object` (any object: the schema {"type": "object"}), ("regex", pattern),
    or ("grammar", EBNF) for `grammar` and for `choice` (one alternative a choice, each a JSON
    string literal, which xgrammar's EBNF reads with the same escapes)."""
    kind = params.kind
    if kind == "json":
        return "json_schema", json.dumps(params.schema, ensure_ascii=False)
    if kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if kind == "choice":
        choice = params.choice or []
        return "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)
    if kind == "regex":
        return "regex", params.regex or ""
    return "grammar", params.grammar or ""


def library_message(error: BaseException) -> str:
    """A library exception's text without xgrammar's log prefix, on one line."""
    lines = [_LOG_PREFIX.sub("", line).strip().rstrip(".") for line in str(error).strip().splitlines()]
    return "; ".join(line for line in lines if line) or type(error).__name__


def constraint_error(params: StructuredOutputsParams, field: str | None = None) -> str | None:
    """Why xgrammar cannot take `params`, naming `field` (default `structured_outputs.<kind>`) and
    the fix; None when it can. Needs no tokenizer: the schema, regex or grammar is parsed alone
    (the costly part of compiling, the token masks, is the engine's). Remembered by the
    constraint's canonical text (its digest: the schemas of a job can be large), so a job of a
    million rows with one schema checks it once.

    Imports xgrammar (and so torch) on first use."""
    key = hashlib.blake2b(params.key.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    if key in _checked:
        _checked.move_to_end(key)
        error = _checked[key]
    else:
        error = _check(params)
        _checked[key] = error
        if len(_checked) > _CHECKED_MAX:
            _checked.popitem(last=False)
    if error is None:
        return None
    return f"{field or 'structured_outputs.' + params.kind} {error}"


def _check(params: StructuredOutputsParams) -> str | None:
    """`constraint_error`'s message after the field name, or None. In a process that keeps torch
    out (`batchgen plan`'s), xgrammar cannot be imported: only the keywords are checked there, and
    the plan compiles the constraints in its child process (`batchgen.plan.grammars`)."""
    if params.kind == "json":
        problem = unsupported_keyword(params.schema)
        if problem is not None:
            return problem
    try:
        import xgrammar
    except ImportError:
        return None
    method, text = library_grammar(params)
    try:
        if method == "json_schema":
            xgrammar.Grammar.from_json_schema(text, any_whitespace=False)
        elif method == "regex":
            xgrammar.Grammar.from_regex(text)
        else:
            xgrammar.Grammar.from_ebnf(text)
    except Exception as e:  # the library's parse errors (RuntimeError, its own error types)
        return describe_failure(params, e)
    return None


def describe_failure(params: StructuredOutputsParams, error: BaseException) -> str:
    """The message (after the field name) for a constraint the library refused with `error`."""
    why = library_message(error)
    kind = params.kind
    if kind in ("json", "json_object"):
        return f"is not a JSON schema xgrammar can compile: {why}; fix the schema"
    if kind == "regex":
        return (
            f"is not a regex xgrammar can compile: {why}; fix the pattern (no lookaround, "
            "backreferences or \\p{...} classes)"
        )
    if kind == "choice":
        return f"could not be compiled: {why}; check the choices"
    return f"is not an EBNF grammar xgrammar can compile: {why}; write it in GBNF form, from root ::= ..."


def unsupported_keyword(schema: Any, path: str = "#") -> str | None:
    """The first place in a JSON schema that uses what xgrammar does not enforce (see the module
    docstring), as a message naming the keyword, where it is (a JSON pointer) and the fix; None
    when there is none. Annotations (title, description, examples, ...) and unknown keys are
    ignored, as JSON Schema ignores them."""
    if not isinstance(schema, dict):
        return None
    for keyword in schema:
        if keyword in UNSUPPORTED_KEYWORDS:
            return _refused(f"keyword '{keyword}'", path)
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return _refused(
            f"the remote $ref {ref!r}", path, "inline it under $defs and refer to it as #/$defs/..."
        )
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in SUPPORTED_FORMATS:
        return _refused(
            f"format {fmt!r}", path, f"use one of {', '.join(sorted(SUPPORTED_FORMATS))}, a pattern, or none"
        )
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return _refused("allOf with more than one schema", path, "merge them into one schema")
    for keyword, others in (
        ("patternProperties", ("properties", "required")),
        ("propertyNames", ("properties", "required", "patternProperties")),
    ):
        both = [k for k in others if k in schema]
        if keyword in schema and both:
            return _refused(f"'{keyword}' next to '{both[0]}'", path, f"use '{keyword}' or '{both[0]}'")
    return _unsupported_below(schema, path)


def _unsupported_below(schema: dict, path: str) -> str | None:
    """`unsupported_keyword` over the subschemas of `schema`."""
    for keyword in _SCHEMA_MAPS:
        value = schema.get(keyword)
        if isinstance(value, dict):
            for name, sub in value.items():
                found = unsupported_keyword(sub, f"{path}/{keyword}/{_pointer(name)}")
                if found:
                    return found
    for keyword in _ONE_SCHEMA:
        found = unsupported_keyword(schema.get(keyword), f"{path}/{keyword}")
        if found:
            return found
    for keyword in _SCHEMA_LISTS:
        value = schema.get(keyword)
        for i, sub in enumerate(value if isinstance(value, list) else ()):
            found = unsupported_keyword(sub, f"{path}/{keyword}/{i}")
            if found:
                return found
    return None


def _refused(
    what: str, path: str, fix: str = "remove it, or check that rule in the output after the run"
) -> str:
    return f"uses {what} at {path}, which xgrammar cannot enforce (output could break it); {fix}"


def _pointer(name: str) -> str:
    """A property name as a JSON pointer token (RFC 6901: ~ as ~0, / as ~1)."""
    return str(name).replace("~", "~0").replace("/", "~1")


def grammar_refused(request: Request, token: int) -> str:
    """The error of a structured request whose sampled token its grammar refuses: its mask left no
    token (every allowed one banned, or -inf), so the sampler took a disallowed one."""
    return (
        f"the sampled token {token} is not allowed by the request's structured_outputs constraint at "
        f"output token {request.num_output_tokens}: no allowed token had a finite logit; check that "
        "the model can write what the constraint asks"
    )
