"""Job-file formats: detection, line-by-line JSONL, chat-message checks, dataset references.

Small pure helpers under the streaming reader (`batchgen.jobs.input.reader`), which turns their records
into `JobRow`s.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

from batchgen.engine.tokenize import content_text, role_error
from batchgen.jobs.errors import JobInputError

FORMATS_HELP = (
    "supported inputs: .jsonl (one JSON object a line), OpenAI batch .jsonl, .parquet, "
    "a Hugging Face dataset directory (save_to_disk), or hf://NAME[:CONFIG]:SPLIT"
)
# File name endings of JSON-lines inputs and outputs, and of every job file batchgen reads or writes.
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
JOB_FILE_SUFFIXES = (*JSONL_SUFFIXES, ".parquet")
SNIFF_LINES = 1000  # JSONL lines looked at to learn the columns
# Why a string cannot be stored or tokenized: JSON allows "\\ud800" escapes that UTF-8 does not.
LONE_SURROGATE = "holds a lone surrogate (an unpaired \\ud800-\\udfff escape)"


def detect_format(source: str) -> str:
    """Return "hf_hub", "hf_dir", "parquet", "openai" or "jsonl" for `source`.

    Raises:
        JobInputError: the path does not exist or its format is not one of FORMATS_HELP.
    """
    if source.startswith("hf://"):
        return "hf_hub"
    if not os.path.exists(source):
        raise JobInputError(f"input not found: {source}; check the path ({FORMATS_HELP})")
    if os.path.isdir(source):
        markers = ("state.json", "dataset_info.json", "dataset_dict.json")
        if any(os.path.exists(os.path.join(source, m)) for m in markers):
            return "hf_dir"
        raise JobInputError(
            f"{source} is a directory but not a dataset saved with save_to_disk; {FORMATS_HELP}"
        )
    with open(source, "rb") as f:
        head = f.read(4)
    if head == b"PAR1":
        return "parquet"
    is_jsonl = source.lower().endswith(JSONL_SUFFIXES)
    first = _first_line(source) if is_jsonl else b""
    if first.startswith(b"[") and not _is_json(first):
        # A pretty-printed array: read as JSON lines, its one-line objects would run as rows and
        # every other line as an error row.
        raise JobInputError(f"{source} is one JSON array, not JSON lines{ARRAY_HINT}")
    lines = 0
    for _, rec, _ in sniff_jsonl(source):
        lines += 1
        if rec is not None:
            return "openai" if "custom_id" in rec and "body" in rec else "jsonl"
    if lines == 0 and is_jsonl:
        raise JobInputError(f"{source} is empty (no JSON lines): there is nothing to run; check the file")
    if is_jsonl:
        hint = f"; it looks like one JSON array{ARRAY_HINT}" if first.startswith(b"[") else ""
        if _not_utf8(source):
            hint = "; it is not UTF-8 text (UTF-16 or another encoding?): re-save the file as UTF-8"
        raise JobInputError(f"{source} has no valid JSON object line in its first {SNIFF_LINES} lines{hint}")
    if source.lower().endswith(".parquet"):
        raise JobInputError(
            f"{source} is not a Parquet file (it does not start with the PAR1 magic bytes): "
            "the file is damaged or was not written as Parquet"
        )
    raise JobInputError(f"unknown input format: {source}; {FORMATS_HELP}")


ARRAY_HINT = ": write one object per line (JSON lines), e.g. `jq -c '.[]' in.json > in.jsonl`"


def _not_utf8(path: str) -> bool:
    """Whether the file's first 64 KiB read as another encoding: a UTF-16 or UTF-32 byte-order mark,
    NUL bytes (UTF-16 text), or bytes that are not UTF-8 (a cut multi-byte character at the end aside)."""
    with open(path, "rb") as f:
        head = f.read(65536)
    if head.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start < len(head) - 3
    return False


def _first_line(path: str) -> bytes:
    """The file's first non-blank line, stripped of a UTF-8 byte-order mark and whitespace (b"" if none)."""
    with open(path, "rb") as f:
        for raw in f:
            line = raw.lstrip(b"\xef\xbb\xbf").strip()
            if line:
                return line
    return b""


# Deepest nesting of lists and objects a JSON line may have (real jobs use a handful of levels).
MAX_JSON_DEPTH = 100


def _nesting_depth(value: object) -> int:
    """Levels of lists and dicts in a parsed JSON value, walked with an explicit stack (no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item)
    return deepest


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except (ValueError, RecursionError):
        return False
    return True


def sniff_jsonl(path: str) -> Iterator[tuple[int, dict | None, str | None]]:
    """(line_number, record or None, error or None) for the first non-blank lines of a JSONL file."""
    seen = 0
    for line_number, rec, err in iter_jsonl(path):
        yield line_number, rec, err
        seen += 1
        if seen >= SNIFF_LINES:
            return


class DuplicateKeyError(ValueError):
    """A JSON object names a key twice (Python's json, like most parsers, would keep the last)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _object_once_per_key(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads` object hook: the object as a dict, or DuplicateKeyError for a key named twice."""
    record = dict(pairs)
    if len(record) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return record


def iter_jsonl(path: str) -> Iterator[tuple[int, dict | None, str | None]]:
    """Yield (line_number, record, error) for each non-blank line; one bad line is one error.

    A line that is a JSON object but for bytes that are not UTF-8, or for a key it names twice
    (`{"prompt": "a", "prompt": "b"}`: which one did the user mean?), comes with its error and its
    record as best read (bad bytes replaced by U+FFFD, the last value of a repeated key), so its row
    can still be named by its id; any other bad line comes with None."""
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.rstrip(b"\r\n"), object_pairs_hook=_object_once_per_key)
            except DuplicateKeyError as e:
                salvaged = json.loads(raw.rstrip(b"\r\n"))
                yield (
                    line_number,
                    salvaged if isinstance(salvaged, dict) else None,
                    f"key {e.key!r} appears twice in one object of the line (only one value can apply); "
                    "keep one of them",
                )
                continue
            except UnicodeDecodeError as e:
                salvaged = None
                with contextlib.suppress(ValueError):
                    salvaged = json.loads(raw.rstrip(b"\r\n").decode("utf-8", "replace"))
                yield (
                    line_number,
                    salvaged if isinstance(salvaged, dict) else None,
                    f"the line is not valid UTF-8 ({e}); re-save the file as UTF-8",
                )
                continue
            except ValueError as e:
                yield line_number, None, f"malformed JSON ({e}); fix the line so it is one JSON object"
                continue
            except RecursionError:  # Python's parser gives up on deep nesting: this line's problem only
                yield line_number, None, "the line nests JSON too deeply to read; flatten it"
                continue
            # Later steps (hashing, kept columns) walk values recursively: a line that parses but
            # nests deeper than any real job would is refused here rather than crash them.
            if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _nesting_depth(rec) > MAX_JSON_DEPTH:
                yield (
                    line_number,
                    None,
                    f"the line nests JSON more than {MAX_JSON_DEPTH} levels deep; flatten it",
                )
                continue
            if not isinstance(rec, dict):
                yield (
                    line_number,
                    None,
                    f"line is a JSON {_json_kind(rec)}, not an object; write one {{...}} per line",
                )
                continue
            yield line_number, rec, None


def file_sha256(path: str, chunk: int = 1 << 22) -> str:
    """SHA-256 hex of a whole file, read in `chunk`-byte pieces: the input's identity for resume.

    The whole content, not a sample of it: an edit anywhere in the file (even one that keeps its
    size) must make a finished job's rerun start over rather than report "already complete"
    (its cost a start: docs/benchmarks.md).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def is_utf8(text: str) -> bool:
    """Whether `text` can be written as UTF-8 (it holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def text_error(text: str, field: str) -> str | None:
    """The error for prompt text in `field` that no tokenizer can encode (a lone surrogate); None
    when it is valid Unicode."""
    if is_utf8(text):
        return None
    return f"field '{field}' {LONE_SURROGATE}, which is not valid Unicode; fix or remove that escape"


def check_messages(value: Any, col: str) -> tuple[list[dict] | None, str | None]:
    """Validate chat messages: a non-empty list of {"role": str, "content": str or text parts}.

    Content given as OpenAI content parts (`[{"type": "text", "text": ...}, ...]`) becomes one
    string; other part types (images, audio) are refused, as this is a text-only engine.

    Returns:
        (messages with string contents, None) when valid, (None, message naming the field and the
        fix) otherwise: also for a content that is not valid Unicode (`text_error`).
    """
    if value is None or (isinstance(value, list) and not value):
        return None, f'field \'{col}\' is null or empty; give a list of {{"role", "content"}} messages'
    if not isinstance(value, list):
        shown = "a string (JSON text, not a list)" if isinstance(value, str) else type(value).__name__
        return None, (
            f"field '{col}' must be a list of messages, got {shown}; give a list of "
            '{"role", "content"} objects (in Parquet a list column, not a string column)'
        )
    if all(isinstance(m, str) for m in value):  # several prompts in one row, not chat messages
        return None, (
            f"field '{col}' is a list of strings; give one prompt string per row, or chat messages as "
            '[{"role": "user", "content": "..."}]'
        )
    out = []
    for i, m in enumerate(value):
        text = content_text(m.get("content")) if isinstance(m, dict) else None
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or text is None:
            return None, (
                f"field '{col}[{i}]' must be an object with a string 'role' and a 'content' that is a "
                'string or a list of {"type": "text", "text": ...} parts (text only)'
            )
        if err := role_error(m["role"], f"{col}[{i}].role"):
            return None, err
        if err := text_error(text, f"{col}[{i}]"):
            return None, err
        out.append({"role": m["role"], "content": text})
    if not any(m["content"].strip() for m in out):
        return None, f"field '{col}' has only empty message contents; put the prompt in a message"
    return out, None


def parse_hf_reference(source: str) -> tuple[str, str | None, str]:
    """Split "hf://NAME[:CONFIG]:SPLIT" into (name, config or None, split).

    Raises:
        JobInputError: when the split is missing.
    """
    parts = source[len("hf://") :].split(":")
    if len(parts) == 2 and all(parts):
        return parts[0], None, parts[1]
    if len(parts) == 3 and all(parts):
        return parts[0], parts[1], parts[2]
    raise JobInputError(f"bad dataset reference {source!r}; write hf://NAME:SPLIT or hf://NAME:CONFIG:SPLIT")


_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """Whether Hugging Face's offline switch is on (`HF_HUB_OFFLINE` or `HF_DATASETS_OFFLINE`)."""
    return any(
        os.environ.get(name, "").upper() in _TRUE for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def check_hub_reachable(source: str, timeout_s: float = 3.0) -> None:
    """Fail at once when the hub (`HF_ENDPOINT`, default https://huggingface.co) does not answer,
    instead of the half a minute of retries `datasets.load_dataset` spends offline. Any HTTP answer
    counts; proxies come from the usual environment variables.

    Raises:
        JobInputError: naming `source`, the endpoint and the fixes (HF_HUB_OFFLINE=1 for a cached
            copy, or a local file or dataset directory).
    """
    import urllib.error
    import urllib.request

    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s).close()
        return
    except urllib.error.HTTPError:
        return  # it answered
    except (OSError, ValueError) as e:  # URLError, timeouts, refused connections, a bad endpoint
        why = getattr(e, "reason", None) or e
    raise JobInputError(
        f"cannot reach the Hugging Face hub at {endpoint} to stream {source} ({why}). Without a network, "
        "set HF_HUB_OFFLINE=1 to read the copy in the local Hugging Face cache (a dataset loaded "
        "before), or pass a local job file or dataset directory (save_to_disk)"
    )


def _json_kind(value: Any) -> str:
    """JSON's own name for a parsed value's kind ("null", "array", "string", ...), for messages."""
    kinds = {
        type(None): "null",
        bool: "boolean",
        int: "number",
        float: "number",
        str: "string",
        list: "array",
    }
    return kinds.get(type(value), type(value).__name__)
