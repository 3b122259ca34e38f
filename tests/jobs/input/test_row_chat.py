"""A row's chat_template_kwargs: the job's flag with the row's own merged over it key by key, bad
values as the row's error naming the field, and the flag's parser naming the flag."""

from __future__ import annotations

import pytest

from batchgen.jobs.input.reader import JobReader, ReaderOptions
from batchgen.jobs.input.row_chat import own_kwargs, parse_chat_template_kwargs, row_kwargs

LABEL = "field 'chat_template_kwargs'"


def test_the_rows_own_values_win_key_by_key():
    flag = {"enable_thinking": False, "lang": "en"}
    assert row_kwargs({}, flag, LABEL) == (flag, None)
    assert row_kwargs({"chat_template_kwargs": {"enable_thinking": True}}, flag, LABEL) == (
        {"enable_thinking": True, "lang": "en"},
        None,
    )
    assert row_kwargs({"chat_template_kwargs": None}, None, LABEL) == (None, None)
    assert row_kwargs({"chat_template_kwargs": {}}, None, LABEL) == (None, None)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("enable_thinking=false", "field 'chat_template_kwargs' must be a JSON object"),
        ([{"enable_thinking": False}], "must be a JSON object"),
        ({"add_generation_prompt": False}, "may not set add_generation_prompt"),
    ],
)
def test_a_bad_value_is_an_error_naming_the_field(value, message):
    kwargs, err = row_kwargs({"chat_template_kwargs": value}, {"x": 1}, LABEL)
    assert kwargs is None and message in err


def test_the_flag_parser_names_the_flag():
    assert parse_chat_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    with pytest.raises(ValueError, match=r"--chat-template-kwargs .* is not JSON"):
        parse_chat_template_kwargs("{enable_thinking: false}")
    with pytest.raises(ValueError, match="--chat-template-kwargs must be a JSON object"):
        parse_chat_template_kwargs("true")


def test_rows_without_the_field_keep_their_resume_hash(tmp_path):
    """The field joins a row's hash only when the row sets it: jobs written before it resume."""
    assert own_kwargs({"prompt": "x"}) == []
    assert own_kwargs({"chat_template_kwargs": {"a": 1}}) == [{"a": 1}]
    assert own_kwargs({"chat_template_kwargs": {"a": 1}}, frozenset({"chat_template_kwargs"})) == []
    src = tmp_path / "job.jsonl"
    src.write_text(
        '{"messages": [{"role": "user", "content": "a"}]}\n'
        '{"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"x": 1}}\n'
        '{"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": 5}\n'
    )
    reader = JobReader(str(src), ReaderOptions(chat_template_kwargs={"enable_thinking": False}))
    plain, own, bad = list(reader)
    assert plain.chat_template_kwargs == {"enable_thinking": False}
    assert own.chat_template_kwargs == {"enable_thinking": False, "x": 1}
    assert plain.row_hash != own.row_hash
    assert bad.error is not None and "row 2 (line 3): field 'chat_template_kwargs'" in bad.error
