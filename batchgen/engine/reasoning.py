"""Reasoning parsers: a reasoning model's thinking kept apart from its answer.

Reasoning models write their thinking between `<think>` and `</think>`, then the answer. The
parsers carry vLLM's names (`--reasoning-parser qwen3|deepseek_r1`) and split a row's text the way
vLLM's `extract_reasoning` does:

- `deepseek_r1`: DeepSeek-R1's chat template opens `<think>` in the prompt, so the output may start
  inside the thinking: everything before `</think>` is reasoning (a `<think>` the model writes
  itself is dropped), everything after it the answer; an output with no `</think>` is all
  reasoning.
- `qwen3`: Qwen3 writes `<think>` itself: the text between `<think>` and `</think>` is reasoning,
  the rest the answer; an output that does not start with `<think>` is all answer (vLLM's qwen3
  parser before Qwen3.5; its current one reads such an output as reasoning unless
  `enable_thinking` is false, for templates that open `<think>` in the prompt, which here are
  recognised by the prompt's last tag, below). An output cut inside the thinking (no `</think>`)
  is all reasoning, as vLLM's current Qwen3 parser has it.

One rule decides both the split and what the engine does while a row runs, so the text the stop
strings see and the tokens the structured outputs grammar sees are exactly the answer's
(`ReasoningState`): where the row starts is read from its prompt, as vLLM's structured outputs read
`is_reasoning_end(prompt_token_ids)` (the last think tag of the prompt: `<think>` means the output
starts inside the thinking, `</think>` that the thinking is over, as after Qwen3's
`enable_thinking=False` template; no tag leaves the parser's default above). Stop strings are looked
for in the answer only, and a row's grammar matcher takes its first token after the one that ends
the thinking (`ReasoningGrammar`).

Where the tokenizer has both tags as single tokens (Qwen3's, DeepSeek-R1's), the state follows the
token ids and the split is made on them; otherwise on the text (the tags spelled in several
tokens): the answer's grammar then starts at the token after the one that completes `</think>`.
The one difference from vLLM on texts: vLLM's qwen3 parser also splits at a `<think>` written
after some answer text (dropping that text); here a row's thinking starts only at its first token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchgen.config import REASONING_PARSERS
from batchgen.engine.detokenizer import detokenize_incrementally
from batchgen.model.loading.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from batchgen.engine.request import Request
    from batchgen.engine.structured import RequestGrammar

logger = logging.getLogger(__name__)

THINK_START, THINK_END = "<think>", "</think>"
# Where a row's output starts: inside the thinking, in the answer, or (qwen3 with no think tag in
# the prompt) undecided until its first token: thinking when that is `<think>`.
THINKING, ANSWER, OPEN = "thinking", "answer", "open"


def split_text(text: str, start: str) -> tuple[str | None, str]:
    """(reasoning or None, answer) of an output text, given where the output starts.

    Args:
        text: the whole output text, think tags included.
        start: THINKING, ANSWER or OPEN (see `ReasoningParser.start_phase`).

    Returns:
        The reasoning (None when the output has no thinking; "" for an empty one) and the answer
        ("" for an output cut inside its thinking).
    """
    if start == ANSWER:
        return None, text
    if start == OPEN:
        if not text.startswith(THINK_START):
            return None, text
        text = text[len(THINK_START) :]
    else:  # a <think> written inside an already open thinking is a tag, not reasoning
        before, tag, after = text.partition(THINK_START)
        text = after if tag and THINK_END not in before else text
    reasoning, tag, answer = text.partition(THINK_END)
    return reasoning, answer if tag else ""


class ReasoningParser:
    """One model family's think tags, looked up in its tokenizer.

    Args:
        name: "qwen3" or "deepseek_r1".
        tokenizer: the model's Hugging Face tokenizer.

    Attributes:
        start_id / end_id: the ids of `<think>` and `</think>` when the tokenizer has both as
            single tokens (then the split follows token ids), else None (it follows the text,
            and a warning is logged: such a model is most likely not a reasoning model, and under
            deepseek_r1 its every answer would be empty).

    Raises:
        ValueError: an unknown name, listing the known ones.
    """

    def __init__(self, name: str, tokenizer: Tokenizer) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; got {name!r}")
        self.name = name
        self.tokenizer = tokenizer
        start, end = _single_token(tokenizer, THINK_START), _single_token(tokenizer, THINK_END)
        both = start is not None and end is not None
        self.start_id: int | None = start if both else None
        self.end_id: int | None = end if both else None
        if not both:
            _warn_missing_tags(name, [t for t, i in ((THINK_START, start), (THINK_END, end)) if i is None])

    @property
    def by_tokens(self) -> bool:
        return self.start_id is not None

    def start_phase(self, prompt_token_ids: list[int]) -> str:
        """Where an output after this prompt starts: THINKING when the prompt's last think tag is
        `<think>`, ANSWER when it is `</think>`, else THINKING for deepseek_r1 and OPEN for qwen3."""
        if self.by_tokens:
            for t in reversed(prompt_token_ids):
                if t == self.start_id:
                    return THINKING
                if t == self.end_id:
                    return ANSWER
        else:
            text = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
            start, end = text.rfind(THINK_START), text.rfind(THINK_END)
            if start != end:  # both -1 when neither is there
                return THINKING if start > end else ANSWER
        return THINKING if self.name == "deepseek_r1" else OPEN

    def state(self, prompt_token_ids: list[int]) -> ReasoningState:
        """A new request's state."""
        phase = self.start_phase(prompt_token_ids)
        return ReasoningState(self, phase, start=phase, answer_start=0 if phase == ANSWER else None)


def _warn_missing_tags(name: str, missing: list[str]) -> None:
    """Log once per parser that the model's tokenizer lacks think tags as tokens: such a model was
    most likely not trained to think, and the parser's default then decides every row."""
    consequence = (
        "an output with no '</think>' is all reasoning: its text (the answer) is empty"
        if name == "deepseek_r1"
        else "an output that does not start with '<think>' is all answer (nothing is split off)"
    )
    logger.warning(
        "reasoning_parser %r: the tokenizer has no %s token (is this a reasoning model?); the tags "
        "are looked for in the text, and %s",
        name,
        " / ".join(repr(t) for t in missing),
        consequence,
    )


def _single_token(tokenizer: Tokenizer, text: str) -> int | None:
    """The id of `text` when the tokenizer writes it as one token, else None."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:  # a tokenizer that cannot encode it has no such token
        return None
    return ids[0] if len(ids) == 1 else None


@dataclass
class ReasoningState:
    """Where one request's output is: in its thinking or its answer, and where each begins.

    Attributes:
        parser: the engine's parser.
        phase: THINKING, ANSWER or OPEN (qwen3 before the first token).
        start: the phase the output started in (`split_text`'s `start`).
        thinks: whether the output has a thinking part (it started in one, or opened one).
        think_start: output token index of the first reasoning token (after a `<think>` token).
        think_end: output token index of the `</think>` token (None before it; by tokens only).
        answer_start: output token index of the first answer token (None while thinking): the
            first token the grammar matcher takes.
        answer_char: offset in `Request.output_text` where the answer's text begins, once the row
            is detokenized there (the stop strings are looked for from it).
        num_seen: output tokens observed so far.
    """

    parser: ReasoningParser
    phase: str
    start: str
    thinks: bool = False
    think_start: int = 0
    think_end: int | None = None
    answer_start: int | None = None
    answer_char: int | None = None
    num_seen: int = 0
    _saw_start: bool = False  # a <think> opened the thinking (a later one is reasoning text)
    _searched: int = 0  # text offset up to which no </think> can start (by text)

    def __post_init__(self) -> None:
        self.thinks = self.phase == THINKING
        if self.phase == ANSWER:
            self.answer_start, self.answer_char = 0, 0

    @property
    def in_answer(self) -> bool:
        return self.phase == ANSWER

    def observe(self, request: Request) -> None:
        """Move on over the request's newest output token (appended just before)."""
        self.num_seen = request.num_output_tokens
        if self.phase == ANSWER:
            return
        index = self.num_seen - 1
        if self.parser.by_tokens:
            token = request.token_ids[-1]
            if token == self.parser.start_id and not self._saw_start:
                # Qwen3's opening tag, or a <think> written inside a thinking the prompt opened
                # (dropped with what came before it, as vLLM's parsers do).
                self.phase, self.thinks, self._saw_start, self.think_start = THINKING, True, True, index + 1
            elif self.phase == OPEN:
                self._answer(request, 0, 0)
            elif token == self.parser.end_id:
                self.think_end = index
                self._answer(request, index + 1, None)
            return
        self._observe_text(request, index)

    def _observe_text(self, request: Request, index: int) -> None:
        """`observe` where the tags are several tokens: their text in the detokenized output."""
        detokenize_incrementally(self.parser.tokenizer, request)
        text = request.output_text
        if self.phase == OPEN:
            if text.startswith(THINK_START):
                self.phase, self.thinks, self._searched = THINKING, True, len(THINK_START)
            elif not THINK_START.startswith(text):  # no longer the beginning of a <think>
                self._answer(request, 0, 0)
                return
            else:
                return
        end = text.find(THINK_END, self._searched)
        if end == -1:
            self._searched = max(self._searched, len(text) - len(THINK_END) + 1)
            return
        self._answer(request, index + 1, end + len(THINK_END))

    def _answer(self, request: Request, answer_start: int, answer_char: int | None) -> None:
        """The answer begins at output token `answer_start` (at `answer_char` in the text; None:
        after the text detokenized so far, taken now when the row has stop strings)."""
        self.phase, self.answer_start = ANSWER, answer_start
        if answer_char is None and request.sampling_params.stop_strings:
            detokenize_incrementally(self.parser.tokenizer, request)
            answer_char = len(request.output_text)
        self.answer_char = answer_char

    def split(self, request: Request, text: str, drop_last: bool) -> tuple[str | None, str]:
        """(reasoning or None, answer) of a finished request.

        Args:
            request: the request.
            text: its output text as `detokenizer.final_text` gives it (cut at a stop string, or a
                one-shot decode without the EOS / stop token).
            drop_last: whether `text` leaves out the last output token (EOS or a stop token id).
        """
        if not self.parser.by_tokens:
            return split_text(text, self.start)
        if not self.thinks:
            return None, text
        ids = request.output_token_ids
        end = len(ids) - (1 if drop_last else 0)
        skip = request.sampling_params.skip_special_tokens
        decode = self.parser.tokenizer.decode
        stop = end if self.think_end is None else min(end, self.think_end)
        reasoning = decode(ids[self.think_start : stop], skip_special_tokens=skip)
        if self.answer_start is None:  # cut inside its thinking
            return reasoning, ""
        if isinstance(request.stop_reason, str) and self.answer_char is not None:
            return reasoning, request.output_text[self.answer_char :]  # cut at its stop string
        return reasoning, decode(ids[self.answer_start : end], skip_special_tokens=skip)


class ReasoningGrammar:
    """A structured request's grammar matcher that starts after the thinking (vLLM's
    `should_fill_bitmask` / `should_advance` with a reasoning parser): no mask while the row
    thinks; the matcher takes the answer's tokens only, the first one being the token after the
    one that ends the thinking. Before a qwen3 row's first token (OPEN), the mask is the grammar's
    with `<think>` allowed too, so the row may start thinking or answer within its grammar (where
    the tags are several tokens, such a row answers from its first token, under its grammar).

    Args:
        grammar: the request's matcher (`structured.RequestGrammar`).
        state: the request's `ReasoningState`, moved on by the scheduler before `accept`.
    """

    def __init__(self, grammar: RequestGrammar, state: ReasoningState) -> None:
        self.grammar = grammar
        self.state = state
        if state.phase == OPEN and not state.parser.by_tokens and state.num_seen == 0:
            # A <think> of several tokens cannot be allowed beside the grammar's first token.
            state.phase = state.start = ANSWER
            state.answer_start, state.answer_char = 0, 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """`RequestGrammar.fill_bitmask` in the answer; False (no mask) while thinking."""
        state = self.state
        if state.phase == THINKING:
            return False
        if not self.grammar.fill_bitmask(bitmask, row):
            return False
        start_id = state.parser.start_id
        if state.phase == OPEN and start_id is not None:
            word, bit = divmod(start_id, 32)
            bitmask[row, word] |= (1 << bit) if bit < 31 else -(1 << 31)  # int32: bit 31 is the sign
        return True

    def accept(self, token_id: int) -> bool:
        """Take a sampled token (after `ReasoningState.observe`): the matcher's when it is an
        answer token, else True."""
        start = self.state.answer_start
        if start is None or start >= self.state.num_seen:
            return True
        return self.grammar.accept(token_id)

    @property
    def terminated(self) -> bool:
        """Whether the answer's grammar is complete and its stop token (EOS) was accepted."""
        return self.state.in_answer and self.grammar.terminated

    def sync(self, output_token_ids: list[int]) -> bool:
        """`RequestGrammar.sync` over the answer's tokens."""
        start = self.state.answer_start
        return True if start is None else self.grammar.sync(output_token_ids[start:])
