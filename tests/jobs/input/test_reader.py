"""jobs.reader: format and schema detection, row parsing, overrides, errors naming row and line."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.jobs.errors import JobInputError
from batchgen.jobs.input.formats import detect_format, parse_hf_reference
from batchgen.jobs.input.reader import JobReader, ReaderOptions


def write_jsonl(path: Path, rows: list, raw_lines: dict[int, str] | None = None) -> Path:
    """Write rows as JSONL; raw_lines maps a line position to literal text inserted there."""
    lines = [json.dumps(r) for r in rows]
    for pos, text in sorted((raw_lines or {}).items()):
        lines.insert(pos, text)
    path.write_text("\n".join(lines) + "\n")
    return path


def read(path, **kw) -> list:
    return list(JobReader(str(path), ReaderOptions(**kw)))


def test_jsonl_prompt_id_line_numbers_and_blank_lines(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"id": "x", "prompt": "hi"}, {"id": "y", "prompt": "yo"}], {1: ""})
    reader = JobReader(str(p))
    assert reader.format == "jsonl" and reader.prompt_column == "prompt" and reader.id_column == "id"
    rows = list(reader)
    assert [(r.row_index, r.id, r.prompt, r.line_number) for r in rows] == [
        (0, "x", "hi", 1),
        (1, "y", "yo", 3),
    ]
    assert reader.count_rows() == 2
    assert all(r.error is None and r.sampling_params is not None for r in rows)


def test_malformed_line_is_one_error_row_with_its_line_number(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a"}, {"prompt": "b"}], {1: '{"prompt": "oops'})
    rows = read(p)
    assert len(rows) == 3
    assert rows[1].error.startswith("row 1 (line 2): malformed JSON")
    assert rows[0].error is None and rows[2].error is None and rows[2].line_number == 3


def test_a_line_that_is_not_utf8_keeps_its_id_when_the_id_is_whole(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_bytes(
        b'{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": "caf\xe9"}\n{"id": "c\xff", "prompt": "x"}\n'
    )
    good, bad, bad_id = read(p)
    assert good.error is None
    assert (bad.id, bad.line_number) == ("b", 2) and bad.error.startswith(
        "row 1 (line 2): the line is not valid UTF-8 ("
    )
    assert bad.error.endswith("re-save the file as UTF-8")
    assert bad_id.id is None and "not valid UTF-8" in bad_id.error  # a damaged id names no input row


def test_a_key_named_twice_fails_its_row_and_keeps_its_id(tmp_path):
    """`{"prompt": "a", "prompt": "b"}` would run "b" silently (JSON parsers keep the last value):
    the row fails naming the key, at any depth (a chat message with two contents too); the id is
    kept for the error row, and the other rows run."""
    p = write_jsonl(
        tmp_path / "a.jsonl",
        [{"id": "ok", "prompt": "fine"}],
        {
            1: '{"id": "twice", "prompt": "a", "prompt": "b"}',
            2: '{"id": "nested", "messages": [{"role": "user", "content": "x", "content": "y"}]}',
        },
    )
    ok, twice, nested = read(p)
    assert ok.error is None
    assert twice.id == "twice" and twice.error == (
        "row 1 (line 2): key 'prompt' appears twice in one object of the line (only one value can apply); "
        "keep one of them"
    )
    assert nested.id == "nested" and "key 'content' appears twice" in nested.error
    lines = [
        '{"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p", "max_tokens": 2, "max_tokens": 9}}',
        '{"custom_id": "c2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}}',
    ]
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n")
    dup, good = read(tmp_path / "b.jsonl")
    assert dup.id == "c1" and "key 'max_tokens' appears twice" in dup.error and good.error is None


def test_row_index_as_id_when_no_id_column(tmp_path):
    rows = read(write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a"}, {"prompt": "b"}]))
    assert [r.id for r in rows] == ["0", "1"]


def test_sampling_overrides_on_top_of_defaults(tmp_path):
    p = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"prompt": "a"},
            {"prompt": "b", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "seed": 7},
            {"prompt": "c", "stop": ["\n"], "priority": 2, "max_tokens": 4.0},
        ],
    )
    rows = read(p, defaults={"max_tokens": 32, "temperature": 0.0})
    a, b, c = (r.sampling_params for r in rows)
    assert (a.max_tokens, a.temperature) == (32, 0.0)
    assert (b.max_tokens, b.temperature, b.top_p, b.top_k, b.seed) == (5, 0.5, 0.9, 3, 7)
    assert (c.stop, c.priority, c.max_tokens) == (["\n"], 2, 4)


def test_vllm_sampling_columns_and_max_completion_tokens(tmp_path):
    p = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"prompt": "a", "min_p": 0.1, "min_tokens": 2.0, "ignore_eos": True, "stop_token_ids": [7, 9]},
            {"prompt": "b", "max_completion_tokens": 5},
            {"prompt": "c", "max_completion_tokens": 5, "max_tokens": 3},
        ],
    )
    a, b, c = (r.sampling_params for r in read(p, defaults={"max_tokens": 32}))
    assert (a.min_p, a.min_tokens, a.ignore_eos, a.stop_token_ids) == (0.1, 2, True, [7, 9])
    assert (b.max_tokens, c.max_tokens) == (5, 5)  # max_completion_tokens wins, as in OpenAI batch lines


def test_a_set_parameter_that_batchgen_does_not_apply_fails_the_row(tmp_path):
    rows = [
        {"prompt": "a", "best_of": 1, "presence_penalty": 0.0, "repetition_penalty": 1.0, "logprobs": None},
        {"prompt": "b", "best_of": 3},
        {"prompt": "c", "top_logprobs": 2},
        {"prompt": "d", "use_beam_search": True},
        {"prompt": "e", "n": 3},  # `n` is as likely a data column as a parameter in a plain job
    ]
    a, b, c, d, e = read(write_jsonl(tmp_path / "a.jsonl", rows))
    assert a.error is None and e.error is None  # neutral values change nothing
    assert b.error == (
        "row 1 (line 2): field 'best_of' is 3, but batchgen does not apply best_of (the output would "
        "not be what the row asks for); remove the column, set it to null or 1, or pass --keep-columns "
        "best_of if it is data, not a parameter"
    )
    assert "field 'top_logprobs' is 2 but field 'logprobs' is not true" in c.error
    assert "field 'use_beam_search' is true, but batchgen does not apply use_beam_search" in d.error
    # NaN is named as NaN (JSON has no NaN: it would read "is null"); a logit_bias of zeros is neutral.
    pq.write_table(pa.table({"prompt": ["f", "g"], "best_of": [float("nan"), None]}), tmp_path / "n.parquet")
    f, g = read(str(tmp_path / "n.parquet"))
    assert "field 'best_of' is nan, but" in f.error and g.error is None
    (h,) = read(write_jsonl(tmp_path / "z.jsonl", [{"prompt": "h", "logit_bias": {"50": 0, "7": 0.0}}]))
    assert h.error is None
    # A column the job uses as data (a template field, a kept column) is not a parameter.
    p = write_jsonl(tmp_path / "b.jsonl", [{"q": "x", "logprobs": 4, "logit_bias": {"1": 2}}])
    (r,) = read(p, template="{q} ({logprobs})", keep_columns=("logit_bias",))
    assert r.error is None and r.prompt == "x (4)"


@pytest.mark.parametrize(
    "row, field",
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 2}, "top_p"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_invalid_sampling_value_names_row_line_and_field(tmp_path, row, field):
    (r,) = read(write_jsonl(tmp_path / "a.jsonl", [row]))
    assert r.error.startswith("row 0 (line 1): invalid sampling value")
    assert f"'{field}'" in r.error and "fix the value" in r.error
    assert r.sampling_params is None and r.prompt is None


def test_every_bad_sampling_value_of_a_row_is_named_at_once(tmp_path):
    rows = [
        {"prompt": "x", "temperature": -1, "max_tokens": "ten"},
        {"prompt": "x", "min_tokens": 50, "max_tokens": 5},  # a rule between two fields: named once
    ]
    both, pair = read(write_jsonl(tmp_path / "a.jsonl", rows), defaults={"max_tokens": 16})
    assert both.error == (
        "row 0 (line 1): invalid sampling value in field 'temperature': temperature must be >= 0, got -1; "
        "and in field 'max_tokens': max_tokens must be an integer, got 'ten'; fix the value or remove it "
        "to use the default"
    )
    assert pair.error.count("must be <=") == 1 and "min_tokens (50) must be <= max_tokens (5)" in pair.error
    assert "invalid sampling value in field 'min_tokens'" in pair.error  # the field the rule is about


@pytest.mark.parametrize("value, state", [(None, "null"), ("", "empty"), ("   ", "only whitespace")])
def test_null_or_empty_prompt_is_an_error_row(tmp_path, value, state):
    (r,) = read(write_jsonl(tmp_path / "a.jsonl", [{"prompt": value}]))
    assert f"field 'prompt' is {state};" in r.error and r.error.startswith("row 0 (line 1)")


def test_missing_or_non_text_prompt_is_named_as_such(tmp_path):
    good, missing, number = read(
        write_jsonl(tmp_path / "a.jsonl", [{"prompt": "hi"}, {"id": 1}, {"prompt": 7}])
    )
    assert good.error is None
    assert (
        missing.error
        == "row 1 (line 2): field 'prompt' is missing; add the prompt text under 'prompt' or drop the row"
    )
    assert number.error == (
        "row 2 (line 3): field 'prompt' must be a string, got int; quote the prompt in JSONL, "
        "or store the column as strings in Parquet"
    )


def test_missing_prompt_column_lists_available_columns(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"question": "a", "doc": "b"}])
    with pytest.raises(JobInputError, match="available columns: question, doc.*--prompt-column"):
        JobReader(str(p))
    with pytest.raises(JobInputError, match="prompt column 'text' not found.*question, doc"):
        JobReader(str(p), ReaderOptions(prompt_column="text"))
    with pytest.raises(JobInputError, match="keep column 'nope'"):
        JobReader(str(p), ReaderOptions(prompt_column="question", keep_columns=("nope",)))
    rows = read(p, prompt_column="question", keep_columns=("doc",))
    assert rows[0].prompt == "a" and rows[0].keep == {"doc": "b"}


def test_template_fills_columns_and_checks_them(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"document": "Cats sleep.", "n": 1}, {"document": None, "n": 2}])
    rows = read(p, template="Summarize in one sentence.\n\n{document}")
    assert rows[0].prompt == "Summarize in one sentence.\n\nCats sleep."
    assert "field 'document' (used by --template) is null" in rows[1].error
    with pytest.raises(JobInputError, match="template column 'body' not found") as missing:
        JobReader(str(p), ReaderOptions(template="{body}"))
    assert "literal brace" not in str(missing.value)
    # JSON in the template's text: the braces were meant literally (found by a new user).
    with pytest.raises(
        JobInputError, match=r"for a literal brace in the template, double it \(\{\{ or \}\}\)"
    ):
        JobReader(str(p), ReaderOptions(template='Return {"a": 1} for {document}'))
    with pytest.raises(JobInputError, match=r"placeholders must name columns, e.g. \{document\}; got \{\}$"):
        JobReader(str(p), ReaderOptions(template="{}"))
    with pytest.raises(JobInputError, match=r"must name columns, e.g. \{document\}; got \{0\}$"):
        JobReader(str(p), ReaderOptions(template="Say {0}"))
    with pytest.raises(JobInputError, match=r"placeholder \{document.upper\} reads an attribute"):
        JobReader(str(p), ReaderOptions(template="{document.upper}"))


def test_a_template_that_fails_on_one_row_fails_that_row(tmp_path):
    """Indexing a number or formatting an object is that row's error, not the job's."""
    p = write_jsonl(tmp_path / "a.jsonl", [{"tags": ["fruit"], "q": "x"}, {"tags": 5, "q": {"a": 1}}])
    ok, bad = read(p, template="About {tags[0]}.")
    assert ok.prompt == "About fruit." and ok.error is None
    assert "--template could not be filled from this row" in bad.error and "subscriptable" in bad.error
    first, second = read(p, template="{q:x}")
    assert "could not be filled" in first.error and "could not be filled" in second.error


def test_messages_column(tmp_path):
    msgs = [{"role": "user", "content": "Hello"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "yo"}]}]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    p = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"messages": msgs},
            {"messages": [{"role": "user"}]},
            {"messages": []},
            {"messages": parts},
            {"messages": image},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "usr", "content": "Hi"}]},
            {"prompt": ["a", "b"]},
        ],
    )
    a, b, c, d, e, typo, strings = read(p)
    assert strings.error == (
        "row 6 (line 7): field 'prompt' is a list of strings; give one prompt string per row, or chat "
        'messages as [{"role": "user", "content": "..."}]'
    )
    assert a.prompt == msgs
    assert "'messages[0]' must be an object with a string 'role' and a 'content'" in b.error
    assert "null or empty" in c.error
    # OpenAI content parts: text parts become one string (joined by newlines, as vLLM does).
    assert d.error is None and d.prompt == [{"role": "user", "content": "Say\nyo"}]
    assert "(text only)" in e.error
    # A chat template renders any role it is given: a typo would make a malformed prompt, not an error.
    assert typo.error == (
        "row 5 (line 6): field 'messages[1].role' is 'usr', not a chat role; use one of system, developer, "
        "user, assistant, tool, function, ipython"
    )


def test_row_hash_is_stable_and_tracks_parameters(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"id": "q", "prompt": "same"}, {"id": "q", "prompt": "same"}])
    h1 = [r.row_hash for r in read(p)]
    assert h1 == [r.row_hash for r in read(p)]
    assert h1[0] == h1[1]  # identical rows hash alike; the row index tells them apart
    h2 = [r.row_hash for r in read(p, defaults={"max_tokens": 9})]
    assert h2[0] != h1[0]


def test_parquet_reads_by_batches_and_only_needed_columns(tmp_path):
    n = 2500
    table = pa.table(
        {
            "id": [f"r{i}" for i in range(n)],
            "prompt": [f"p{i}" for i in range(n)],
            "max_tokens": [i % 5 + 1 for i in range(n)],
            "unused": ["x" * 10] * n,
        }
    )
    path = tmp_path / "a.parquet"
    pq.write_table(table, path, row_group_size=1000)
    reader = JobReader(str(path), ReaderOptions(batch_size=300))
    assert reader.format == "parquet" and reader.count_rows() == n
    assert "unused" not in reader.needed_columns
    rows = list(reader)
    assert [r.row_index for r in rows] == list(range(n))
    assert rows[1234].id == "r1234" and rows[1234].prompt == "p1234" and rows[1234].line_number is None
    assert rows[7].sampling_params.max_tokens == 3


def test_openai_batch_chat_and_completion(tmp_path):
    lines = [
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7},
        },
        {
            "custom_id": "b",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "Once", "temperature": 0.3},
        },
        {"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "dup"}},
        {"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": {"prompt": "n", "n": 2}},
        {
            "custom_id": "e",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3, "top_p": 5},
        },
        {
            "custom_id": "f",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "p", "logit_bias": {"7": 3}, "presence_penalty": 0},
        },
        {  # vLLM's extra sampling fields are honoured, as its OpenAI server does
            "custom_id": "g",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "p", "min_p": 0.2, "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [5]},
        },
    ]
    p = write_jsonl(tmp_path / "batch.jsonl", lines)
    assert detect_format(str(p)) == "openai"
    a, b, c, dup, n2, bad, biased, extra = read(p)
    sp = extra.sampling_params
    assert (sp.min_p, sp.min_tokens, sp.ignore_eos, sp.stop_token_ids) == (0.2, 2, True, [5])
    assert (a.id, a.endpoint, a.prompt, a.sampling_params.max_tokens) == (
        "a",
        "chat",
        lines[0]["body"]["messages"],
        7,
    )
    assert (b.id, b.endpoint, b.prompt, b.sampling_params.temperature) == ("b", "completion", "Once", 0.3)
    assert "field 'url'" in c.error and "/v1/chat/completions" in c.error
    assert (
        dup.error
        == "row 3 (line 4): duplicate custom_id 'a' (first used on line 1); make each custom_id unique"
    )
    assert dup.id == "a"
    assert n2.error is None and n2.sampling_params.n == 2  # n completions in the line's choices
    assert "field 'body.top_p'" in bad.error
    # A set field that would change the output is refused; an unset one (penalty 0) is harmless.
    assert "field 'body.logit_bias' is not supported" in biased.error


def test_openai_batch_refuses_column_options(tmp_path):
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}}
    p = write_jsonl(tmp_path / "batch.jsonl", [line])
    with pytest.raises(JobInputError) as e:
        JobReader(str(p), ReaderOptions(keep_columns=("custom_id",), id_column="custom_id"))
    assert str(e.value) == (
        f"{p} is an OpenAI batch file (prompt in 'body', id in 'custom_id'), so --id-column, "
        "--keep-columns do not apply to it; drop them"
    )
    with pytest.raises(JobInputError, match="so --template does not apply to it; drop it"):
        JobReader(str(p), ReaderOptions(template="{body}"))


def test_hf_dataset_dir(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": ["one", "two", "three"], "label": [1, 2, 3]})
    ds.save_to_disk(str(tmp_path / "ds"))
    reader = JobReader(str(tmp_path / "ds"), ReaderOptions(prompt_column="text", keep_columns=("label",)))
    assert reader.format == "hf_dir" and reader.count_rows() == 3
    rows = list(reader)
    assert [r.prompt for r in rows] == ["one", "two", "three"] and rows[2].keep == {"label": 3}
    assert reader.identity()["files"]
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(JobInputError, match="several splits"):
        JobReader(str(tmp_path / "dd"))
    assert len(read(tmp_path / "dd" / "test", prompt_column="text")) == 3


def test_bad_sources(tmp_path):
    with pytest.raises(JobInputError, match="input not found"):
        JobReader(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.bin").write_bytes(b"\x00\x01garbage")
    with pytest.raises(JobInputError, match="unknown input format"):
        JobReader(str(tmp_path / "x.bin"))
    for name, text in [("e.jsonl", ""), ("blank.jsonl", "\n \n")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(JobInputError, match=r"is empty \(no JSON lines\): there is nothing to run"):
            JobReader(str(tmp_path / name))
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "e.parquet")
    with pytest.raises(JobInputError, match=r"e.parquet is empty \(no rows\): there is nothing to run"):
        JobReader(str(tmp_path / "e.parquet"))
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(JobInputError, match="has no valid JSON object line in its first") as plain:
        JobReader(str(tmp_path / "bad.jsonl"))
    assert "UTF-8" not in str(plain.value)
    # Text saved as UTF-16 where no line parses: the message names the encoding (a file where some
    # lines parse runs, and its other lines get per-row "not valid UTF-8" errors).
    (tmp_path / "u16.jsonl").write_bytes("prompt: café\nprompt: tea\n".encode("utf-16"))
    with pytest.raises(JobInputError, match="it is not UTF-8 text .*re-save the file as UTF-8"):
        JobReader(str(tmp_path / "u16.jsonl"))
    (tmp_path / "d").mkdir()
    with pytest.raises(JobInputError, match="not a dataset"):
        JobReader(str(tmp_path / "d"))
    assert parse_hf_reference("hf://org/name:sub:test") == ("org/name", "sub", "test")
    assert parse_hf_reference("hf://name:train") == ("name", None, "train")
    with pytest.raises(JobInputError, match="hf://NAME:SPLIT"):
        parse_hf_reference("hf://name")


def test_identity_changes_with_content(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a"}])
    before = JobReader(str(p)).identity()
    write_jsonl(p, [{"prompt": "b"}])
    assert JobReader(str(p)).identity() != before


def test_mixed_prompt_and_messages_rows(tmp_path):
    msgs = [{"role": "user", "content": "Hi"}]
    p = write_jsonl(
        tmp_path / "a.jsonl", [{"prompt": "plain"}, {"messages": msgs}, {"prompt": None, "messages": None}]
    )
    a, b, c = read(p)
    assert a.prompt == "plain" and b.prompt == msgs and "field 'prompt' is null" in c.error


def test_row_without_id_gets_its_index_only_when_the_input_has_no_ids(tmp_path):
    """A made-up id could equal another row's real one ("1" here), so it is only made up when the
    input has no id column at all."""
    with_ids = write_jsonl(
        tmp_path / "a.jsonl", [{"id": "1", "prompt": "a"}, {"prompt": "b"}, {"id": None, "prompt": ""}]
    )
    assert [(r.id, r.error is None) for r in read(with_ids)] == [("1", True), (None, True), (None, False)]
    without = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "a"}, {"prompt": ""}])
    assert [(r.id, r.error is None) for r in read(without)] == [("0", True), ("1", False)]


def test_ids_that_are_not_text_are_written_as_json(tmp_path):
    p = write_jsonl(
        tmp_path / "a.jsonl",
        [{"id": {"x": 1}, "prompt": "a"}, {"id": True, "prompt": "b"}, {"id": 3, "prompt": "c"}, {"id": 2.5}],
    )
    assert [r.id for r in read(p)] == ['{"x": 1}', "true", "3", "2.5"]


def test_an_openai_batch_line_in_a_plain_file_is_named_as_one(tmp_path):
    batch_line = {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}}
    p = write_jsonl(tmp_path / "a.jsonl", [{"custom_id": "a", "prompt": "hi"}, batch_line])
    good, mixed = read(p)
    assert good.error is None and good.id == "a"
    assert mixed.error == (
        "row 1 (line 2): this line is an OpenAI batch request (custom_id, body), but the file's first "
        "line is not; a file holds one format, so put OpenAI batch lines in a file of their own"
    )
    assert mixed.id == "b"


def test_a_plain_line_in_an_openai_batch_file_is_named_as_one(tmp_path):
    batch_line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}}
    p = write_jsonl(tmp_path / "a.jsonl", [batch_line, {"prompt": "plain"}, {"custom_id": "c"}])
    good, plain, broken = read(p)
    assert good.error is None
    assert plain.error.startswith(
        "row 1 (line 2): this line is a plain request (prompt or messages), but the file's first line is "
        "an OpenAI batch request; a file holds one format"
    )
    assert (
        broken.error
        == "row 2 (line 3): field 'url' is None; use one of /v1/chat/completions, /v1/completions"
    )


def test_a_json_array_file_gets_a_hint(tmp_path):
    p = tmp_path / "a.jsonl"
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    p.write_text(json.dumps(rows))  # one line
    with pytest.raises(JobInputError, match=r"it looks like one JSON array: write one object per line"):
        JobReader(str(p))
    # Pretty-printed, with one object a line: its last object parses as a JSON line, so the file
    # used to run as that one row and an error row for every other line.
    for text in (json.dumps(rows, indent=2), "[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n"):
        p.write_text(text)
        with pytest.raises(JobInputError, match=r"is one JSON array, not JSON lines: write one object per"):
            JobReader(str(p))
    # A line that is a whole array is one error row of a JSON lines file, not a reason to refuse it.
    p.write_text('[1, 2]\n{"prompt": "c"}\n')
    bad, good = read(str(p))
    assert "line is a JSON array, not an object" in bad.error and good.prompt == "c"


def test_row_with_both_prompt_and_messages_fails_that_row(tmp_path):
    msgs = [{"role": "user", "content": "Hi"}]
    p = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "plain", "messages": msgs}, {"prompt": "ok"}])
    both, ok = read(p)
    assert both.prompt is None and ok.prompt == "ok"
    assert both.error == (
        "row 0 (line 1): fields 'prompt' and 'messages' are both set; keep one of them "
        "(or pass --prompt-column / --messages-column to choose one for the whole file)"
    )
    # Naming one column for the whole file settles it.
    only = read(p, messages_column="messages")[0]
    assert only.prompt == msgs and only.error is None


def test_example_job_parses():
    rows = list(JobReader(str(Path(__file__).parents[3] / "jobs" / "example.jsonl")))
    assert len(rows) >= 30 and all(r.error is None for r in rows)
    assert any(isinstance(r.prompt, list) for r in rows) and any(isinstance(r.prompt, str) for r in rows)


def test_limit_reads_only_the_first_rows(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"prompt": str(i)} for i in range(10)])
    reader = JobReader(str(p), ReaderOptions(limit=3))
    assert [r.prompt for r in reader] == ["0", "1", "2"] and reader.count_rows() == 3


def test_hf_reference_streams_with_datasets(tmp_path):
    """hf://NAME:SPLIT goes through datasets.load_dataset(streaming=True); a local data dir stands in
    for a hub name so the test needs no network."""
    pytest.importorskip("datasets")
    data = tmp_path / "hubish"
    data.mkdir()
    pq.write_table(pa.table({"question": ["a?", "b?"], "id": ["x", "y"]}), data / "train.parquet")
    reader = JobReader(f"hf://{data}:train", ReaderOptions(prompt_column="question"))
    assert reader.format == "hf_hub" and reader.identity() == {"hub": f"hf://{data}:train"}
    assert [(r.id, r.prompt) for r in reader] == [("x", "a?"), ("y", "b?")]


def test_a_lone_surrogate_is_named_in_the_field_it_came_from(tmp_path):
    """Checked where text enters (messages validation, the prompt column), so a job with both a
    prompt and a messages column names the one the row used."""
    p = tmp_path / "a.jsonl"
    p.write_text(
        '{"prompt": null, "messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\\ud800"}]}\n'
        '{"prompt": "bad \\udfff", "messages": null}\n'
    )
    a, b = read(str(p))
    assert "field 'messages[1]' holds a lone surrogate" in a.error
    assert "field 'prompt' holds a lone surrogate" in b.error


def test_penalty_columns_and_body_fields_apply(tmp_path):
    """Penalties are columns (plain jobs) and body fields (OpenAI batch) like the other sampling
    fields: applied on top of the defaults, a bad value an error row naming it."""
    rows = [
        {"prompt": "a", "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2},
        {"prompt": "b", "repetition_penalty": 0},
        {"prompt": "c"},
    ]
    a, b, c = read(write_jsonl(tmp_path / "a.jsonl", rows), defaults={"repetition_penalty": 1.1})
    sp = a.sampling_params
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1, 1.2)
    assert "field 'repetition_penalty'" in b.error and "> 0" in b.error
    assert c.sampling_params.repetition_penalty == 1.1
    line = {
        "custom_id": "x",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "p", "presence_penalty": 0.3, "frequency_penalty": 0.2},
    }
    (x,) = read(write_jsonl(tmp_path / "batch.jsonl", [line]))
    assert (x.sampling_params.presence_penalty, x.sampling_params.frequency_penalty) == (0.3, 0.2)


def test_misplaced_chat_fields_name_the_fix(tmp_path):
    """messages stored as JSON text, and OpenAI bodies sent to the other endpoint, say what to change."""
    (a,) = read(write_jsonl(tmp_path / "a.jsonl", [{"messages": '[{"role": "user", "content": "hi"}]'}]))
    assert "got a string (JSON text, not a list)" in a.error and '{"role", "content"} objects' in a.error
    lines = [
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"prompt": "hi"}},
        {
            "custom_id": "d",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}]},
        },
    ]
    c, d = read(write_jsonl(tmp_path / "b.jsonl", lines))
    assert c.error.endswith("a body with a 'prompt' goes to url /v1/completions")
    assert d.error.endswith("a body with 'messages' goes to url /v1/chat/completions")


def test_vllm_and_openai_fields_batchgen_does_not_apply_fail_the_row(tmp_path):
    """Beam search would give another output than the row asks for, and vLLM's old guided_* fields
    have other names here: error rows saying so; their neutral values run, and OpenAI's
    response_format applies (`batchgen.jobs.input.row_structured`)."""
    rows = [
        {"prompt": "a", "use_beam_search": True},
        {"prompt": "e", "guided_choice": ["yes", "no"]},
        {
            "prompt": "f",
            "use_beam_search": False,
            "response_format": {"type": "text"},
            "guided_json": None,
        },
        {"prompt": "g", "use_beam_search": 0},  # JSON writers' booleans
        {"prompt": "d", "response_format": {"type": "json_object"}},
    ]
    beam, guided, neutral, numbers, json_object = read(write_jsonl(tmp_path / "a.jsonl", rows))
    assert neutral.error is None and numbers.error is None
    assert neutral.sampling_params.structured_outputs is None
    assert "field 'use_beam_search' is true, but batchgen does not apply use_beam_search" in beam.error
    assert "set it to null or false," in beam.error  # the neutral value, as JSON
    assert (
        "field 'guided_choice' is [\"yes\", \"no\"], but vLLM's old guided_choice is column 'choice' here"
        in guided.error
    ), guided.error
    assert json_object.error is None and json_object.sampling_params.structured_outputs.json_object is True


def test_include_stop_str_in_output_applies_per_row(tmp_path):
    rows = [
        {"prompt": "a", "include_stop_str_in_output": True},
        {"prompt": "b", "include_stop_str_in_output": 0},
    ]
    a, b = read(write_jsonl(tmp_path / "a.jsonl", rows))
    assert a.error is None and b.error is None
    assert (a.sampling_params.include_stop_str_in_output, b.sampling_params.include_stop_str_in_output) == (
        True,
        False,
    )
    assert a.sampling_params.to_dict() != b.sampling_params.to_dict() == read_one_default(tmp_path)


def read_one_default(tmp_path) -> dict:
    (row,) = read(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "b"}]))
    return row.sampling_params.to_dict()


def test_skip_special_tokens_applies_per_row(tmp_path):
    """The engine applies `skip_special_tokens` (its detokenizer), so a row's value is a sampling
    override like any other; 0 / 1 read as false / true, anything else fails the row by its name."""
    rows = [
        {"prompt": "a", "skip_special_tokens": False},
        {"prompt": "b", "skip_special_tokens": 0},
        {"prompt": "c", "skip_special_tokens": 1},
        {"prompt": "d"},
        {"prompt": "e", "skip_special_tokens": "no"},
    ]
    a, b, c, d, e = read(write_jsonl(tmp_path / "a.jsonl", rows))
    assert [r.sampling_params.skip_special_tokens for r in (a, b, c, d)] == [False, False, True, True]
    assert "invalid sampling value in field 'skip_special_tokens'" in e.error
    # the value is part of the row's hashed parameters (its identity on resume)
    assert a.sampling_params.to_dict() != d.sampling_params.to_dict() == c.sampling_params.to_dict()


def test_a_row_opting_out_of_logprobs_does_not_add_to_another_fields_error(tmp_path):
    rows = [{"prompt": "a", "logprobs": False, "temperature": -1}]
    (row,) = read(write_jsonl(tmp_path / "a.jsonl", rows), defaults={"logprobs": 2})
    assert row.error == (
        "row 0 (line 1): invalid sampling value in field 'temperature': temperature must be >= 0, got -1; "
        "fix the value or remove it to use the default"
    )


def test_prompt_logprobs_fields_set_sampling_params(tmp_path):
    """A row's `prompt_logprobs` (vLLM's K, 0 asks for the prompt tokens' own) is its
    SamplingParams'; null takes the flag's, false none whatever the flag, and a bad value is an
    error row naming the field; an OpenAI body's `prompt_logprobs` (vLLM's extra field) too."""
    rows = [
        {"prompt": "a", "prompt_logprobs": 0},
        {"prompt": "b", "prompt_logprobs": None},
        {"prompt": "c", "prompt_logprobs": False},
        {"prompt": "d", "prompt_logprobs": 3.0},
        {"prompt": "e", "prompt_logprobs": 21},
        {"prompt": "f", "prompt_logprobs": True},
    ]
    a, b, c, d, e, f = read(write_jsonl(tmp_path / "a.jsonl", rows), defaults={"prompt_logprobs": 2})
    got = [r.sampling_params.prompt_logprobs for r in (a, b, c, d)]
    assert got == [0, 2, None, 3] and all(r.error is None for r in (a, b, c, d))
    assert e.error == (
        "row 4 (line 5): invalid sampling value in field 'prompt_logprobs': prompt_logprobs must be None "
        "or in [0, 20], got 21; fix the value or remove it to use the default"
    )
    assert "prompt_logprobs must be an integer, got True" in f.error
    # A template field or kept column of that name is data.
    p = write_jsonl(tmp_path / "k.jsonl", [{"q": "x", "prompt_logprobs": "a note"}])
    (k,) = read(p, template="{q}", keep_columns=("prompt_logprobs",))
    assert k.error is None and k.sampling_params.prompt_logprobs is None
    lines = [
        {
            "custom_id": "x",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "p", "prompt_logprobs": 0},
        },
        {
            "custom_id": "y",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": False, "top_logprobs": 0},
        },
    ]
    x, y = read(write_jsonl(tmp_path / "batch.jsonl", lines))
    assert x.error is None and x.sampling_params.prompt_logprobs == 0
    assert (
        y.error is None and y.sampling_params.logprobs is None and y.sampling_params.prompt_logprobs is None
    )


def test_an_unreachable_hub_fails_at_once_with_the_offline_hint(tmp_path, monkeypatch):
    """Offline, datasets.load_dataset retried for about 25 s before failing; the reader asks the hub
    once (3 s at most) and names HF_HUB_OFFLINE=1. With the switch on it does not ask, and a
    dataset missing from the cache says the switch is on."""
    import time

    pytest.importorskip("datasets")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: refused at once
    start = time.perf_counter()
    with pytest.raises(JobInputError) as e:
        JobReader("hf://someone/some-dataset:train")
    assert time.perf_counter() - start < 10
    message = str(e.value)
    assert (
        "cannot reach the Hugging Face hub at http://127.0.0.1:9 to stream hf://someone/some-dataset:train"
        in message
    )
    assert "set HF_HUB_OFFLINE=1" in message

    import batchgen.jobs.input.formats as formats

    def no_network(*args, **kwargs):
        raise AssertionError("the hub was asked with HF_HUB_OFFLINE=1")

    monkeypatch.setattr(formats, "check_hub_reachable", no_network)
    monkeypatch.setattr("batchgen.jobs.input.reader.check_hub_reachable", no_network)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets

    def missing(*args, **kwargs):
        raise FileNotFoundError("Couldn't find cache for someone/some-dataset")

    monkeypatch.setattr(datasets, "load_dataset", missing)
    with pytest.raises(
        JobInputError, match=r"HF_HUB_OFFLINE is set: only a copy in the local Hugging Face cache"
    ):
        JobReader("hf://someone/some-dataset:train")


def test_n_completions_under_greedy_sampling_get_one_note(tmp_path):
    """n > 1 with the greedy default gives n copies of one text (a new user's find): one note, not one
    per row; rows that sample, or ask for one completion, get none."""
    rows = [{"prompt": "a", "n": 2}, {"prompt": "b", "n": 3}, {"prompt": "c", "n": 2, "temperature": 0.8}]
    greedy = ReaderOptions(defaults={"temperature": 0.0})  # batchgen run's default
    reader = JobReader(str(write_jsonl(tmp_path / "a.jsonl", rows)), greedy)
    assert [r.sampling_params.n for r in reader] == [2, 3, 2]
    (note,) = reader.parser.notices
    assert note.startswith("note: rows ask for n=2 completions with greedy sampling (temperature 0")
    sampled = JobReader(str(write_jsonl(tmp_path / "b.jsonl", [rows[2], {"prompt": "d"}])), greedy)
    assert len(list(sampled)) == 2 and sampled.parser.notices == []


def test_a_line_that_is_not_an_object_is_named_by_its_json_kind(tmp_path: Path) -> None:
    """JSON's names in the error row ("null", not Python's "NoneType")."""
    src = tmp_path / "j.jsonl"
    src.write_text('null\n"text"\n3\ntrue\n{"prompt": "ok"}\n')
    rows = list(JobReader(str(src)))
    kinds = [row.error.split("line is a JSON ")[1].split(",")[0] for row in rows[:4]]
    assert kinds == ["null", "string", "number", "boolean"] and rows[4].prompt == "ok"
