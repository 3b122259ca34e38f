"""The run header: what identifies a run's job (input content, model files, options), and how two
headers differ, named for the user. A run resumes only the parts written under an equal header.
"""

from __future__ import annotations

from typing import Any

from batchgen.jobs.output.header_options import canonical_options

# 2: the input is identified by the SHA-256 of its whole content (1: of its first and last MiB).
HEADER_VERSION = 2


def make_header(
    input_identity: dict[str, Any],
    model: str,
    options: dict[str, Any],
    model_fingerprint: str | None = None,
) -> dict[str, Any]:
    """The run header: input identity, model (its name or path, and the digest of its files from
    `batchgen.model.loading.fingerprint`), and every option that changes the output rows."""
    return {
        "version": HEADER_VERSION,
        "input": input_identity,
        "model": model,
        "model_fingerprint": model_fingerprint,
        "options": options,
    }


def _same_input(old: dict[str, Any] | None, new: dict[str, Any] | None) -> bool:
    """Whether two input identities name the same rows. A file is its size and content hash
    wherever it lies, so a job file moved or mounted elsewhere (a job restarted on another node)
    resumes; a dataset directory or hub reference, identified by less than its content, must also
    keep its path."""
    if old and new and old.get("sha256") and "path" in old and "path" in new:
        return {k: v for k, v in old.items() if k != "path"} == {k: v for k, v in new.items() if k != "path"}
    return old == new


def _same_model(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether two headers name the same model: the same content digest (a local model, wherever
    it lies now), else the same name or path (a hub id, whose files are not hashed)."""
    if old.get("model_fingerprint") and new.get("model_fingerprint"):
        return old["model_fingerprint"] == new["model_fingerprint"]
    return old.get("model") == new.get("model") and old.get("model_fingerprint") == new.get(
        "model_fingerprint"
    )


def _input_difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What differs between two inputs that name other rows: another input (job30.jsonl and
    job30.parquet share the default output job30.out.parquet), or the same one changed since."""
    where_old = old.get("path") or old.get("hub")
    where_new = new.get("path") or new.get("hub")
    if where_old and where_new and where_old != where_new:
        return (
            f"it was written from another input, {where_old} (this run reads {where_new}); give this "
            "run its own --output"
        )
    return "the input file changed (its size or content)"


def header_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable list of what changed between two headers (empty when equal). The input and
    model are compared by content where their content is hashed, not by path (`_same_input`,
    `_same_model`); the options by meaning, not wording (`canonical_options`)."""
    diffs = []
    if old.get("version") != new.get("version"):
        diffs.append(f"header version {old.get('version')} -> {new.get('version')}")
    if not _same_input(old.get("input"), new.get("input")):
        diffs.append(_input_difference(old.get("input") or {}, new.get("input") or {}))
    if _same_model(old, new):
        pass
    elif old.get("model") != new.get("model"):
        diffs.append(f"model {old.get('model')!r} -> {new.get('model')!r}")
    elif old.get("model_fingerprint") != new.get("model_fingerprint"):
        diffs.append(
            f"the files of model {new.get('model')!r} changed (weights, configs, tokenizer or chat template)"
        )
    # Both in one form per meaning: a header written before a form was chosen still compares.
    model = new.get("model")
    diffs += _option_differences(
        canonical_options(old.get("options", {}), model), canonical_options(new.get("options", {}), model)
    )
    return diffs


# How an option the canonical header leaves out reads in a difference: its default, as typed.
_ABSENT_AS = {"quantization": "auto"}


def _option_differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """'max_tokens 48 -> 40' for each option that differs; a dict of options (the job's sampling
    defaults) is compared key by key, so only what changed is named. An option left out of a
    canonical header reads as its default where it has a name (`_ABSENT_AS`: quantization 'auto')."""
    diffs = []
    for k in sorted(set(old) | set(new)):
        o, n = old.get(k), new.get(k)
        if o == n:
            continue
        if isinstance(o, dict) and isinstance(n, dict):
            diffs += _option_differences(o, n, f"{prefix}{k}.")
        else:
            absent = _ABSENT_AS.get(f"{prefix}{k}")
            o, n = (absent if v is None and absent else v for v in (o, n))
            diffs.append(f"{prefix}{k} {o!r} -> {n!r}")
    return diffs
