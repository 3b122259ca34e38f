"""Structured outputs in the engine: one grammar compiler per engine, compiled grammars cached by
their constraint's canonical text, compilation on a few worker threads ahead of admission with a
time limit per constraint, and one matcher per request that fills its token bitmask and takes the
tokens it samples.

The grammar work is xgrammar's (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured
Generation Engine for Large Language Models"): `GrammarCompiler` builds, once per constraint, the
token masks of the grammar's states from the model's tokenizer; a `GrammarMatcher` follows one
output, gives the bitmask of the tokens allowed next (int32 words, bit `t % 32` of word `t // 32`
set when token `t` is allowed) and accepts each sampled token. xgrammar releases the GIL while it
compiles, so the worker threads compile while the engine steps.

The engine holds a request whose grammar is not ready outside the scheduler
(`batchgen.engine.llm_engine`), so a slow schema delays its own rows only. A constraint that fails
to compile, or takes longer than the time limit, is an error for each request that asks for it;
the others go on. A compilation past the limit cannot be stopped (the library has no way to): its
worker finishes it and the result is dropped. At exit the process waits for the compilations in
progress (as vLLM's thread pool does): a thread still inside the library when the interpreter
finalizes would abort the process. Compilations queued but not started are dropped then.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from batchgen.engine.structured_check import describe_failure, library_grammar, unsupported_keyword
from batchgen.sampling_params import StructuredOutputsParams

COMPILE_THREADS = 2
_CLOSING = threading.Event()  # set at exit: workers end after their current compilation
_WORKERS: list[threading.Thread] = []
# The cache is bounded in entries and in the bytes xgrammar reports for its compiled grammars; a
# job's look-ahead window (1,024 rows by default) of distinct schemas fits, so none is compiled
# twice before its row runs.
CACHE_MAX_ENTRIES = 4096
CACHE_MAX_BYTES = 1 << 30


class GrammarEntry:
    """One constraint's compilation: pending, ready (`compiled`) or failed (`error`).

    Attributes:
        key: the constraint's canonical text (`StructuredOutputsParams.key`).
        params: the constraint.
        compiled: xgrammar's `CompiledGrammar` once ready.
        error: the message (after the field name) when it failed or took too long.
        started / compile_s: `perf_counter` seconds when a worker took it, and the compilation's
            wall time (None until done).
    """

    def __init__(self, key: str, params: StructuredOutputsParams) -> None:
        self.key = key
        self.params = params
        self.compiled: Any = None
        self.error: str | None = None
        self.started: float | None = None
        self.compile_s: float | None = None
        self.done = threading.Event()
        self.evicted = False  # dropped from the cache (its bytes no longer counted)

    def state(self, timeout_s: float, now: float | None = None) -> str:
        """ "ready", "error" or "pending". A compilation running past `timeout_s` (or that took
        longer) is an error from then on, whatever it gives later."""
        if self.error is None:
            now = time.perf_counter() if now is None else now
            took = self.compile_s if self.done.is_set() else (now - self.started if self.started else 0.0)
            if took is not None and took > timeout_s:
                self.error = (
                    f"did not compile within the time limit of {timeout_s:g} s; simplify it (fewer "
                    "nested or repeated parts, smaller maxLength / maxItems bounds) or raise "
                    "grammar_compile_timeout"
                )
        if self.error is not None:
            return "error"
        return "ready" if self.done.is_set() else "pending"


class GrammarCache:
    """The engine's grammar compiler, its cache and its worker threads.

    Built on the first structured request (a job without one never imports xgrammar).

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's vocabulary (the logits' width, its lm_head rows); may exceed the
            tokenizer's, and the ids beyond it are never allowed.
        stop_token_ids: the ids that end a completed grammar (the model's EOS ids).
        timeout_s: the most seconds one constraint may take to compile.
        threads: worker threads.

    Raises:
        ImportError: xgrammar is not installed (a dependency of batchgen).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        timeout_s: float,
        threads: int = COMPILE_THREADS,
    ) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        # xgrammar's own cache is off: this one is bounded and keeps failures too.
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._entries: OrderedDict[str, GrammarEntry] = OrderedDict()
        self._bytes = 0
        self._queue: queue.SimpleQueue[GrammarEntry | None] = queue.SimpleQueue()
        self.progress = threading.Event()  # set whenever a compilation ends
        self._finished: list[float] = []  # compile seconds not yet taken by `take_compile_times`
        self._lock = threading.Lock()
        for i in range(threads):
            worker = threading.Thread(target=self._work, name=f"batchgen-grammar-{i}", daemon=True)
            worker.start()
            _WORKERS.append(worker)
            _QUEUES.append(self._queue)

    def submit(self, params: StructuredOutputsParams) -> GrammarEntry:
        """The entry of `params`' constraint, its compilation queued when it is new."""
        key = params.key
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry
        entry = GrammarEntry(key, params)
        self._entries[key] = entry
        self._queue.put(entry)
        with self._lock:
            while len(self._entries) > CACHE_MAX_ENTRIES or self._bytes > CACHE_MAX_BYTES:
                _, old = self._entries.popitem(last=False)  # requests that hold it keep it
                old.evicted = True
                self._bytes -= _size(old)
        return entry

    def matcher(self, entry: GrammarEntry) -> RequestGrammar:
        """A new matcher at the start of `entry`'s (ready) grammar."""
        return RequestGrammar(self._xgr.GrammarMatcher(entry.compiled))

    def take_compile_times(self) -> list[float]:
        """Seconds of each compilation that ended since the last call."""
        with self._lock:
            times, self._finished = self._finished, []
        return times

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def _work(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is None or _CLOSING.is_set():
                return
            entry.started = time.perf_counter()
            params = entry.params
            try:
                problem = unsupported_keyword(params.schema) if params.kind == "json" else None
                if problem is not None:
                    entry.error = problem
                else:
                    entry.compiled = self._compile(params)
            except Exception as e:  # the library's errors: this constraint's, never the engine's
                entry.error = describe_failure(entry.params, e)
            finally:
                if entry.compiled is None and entry.error is None:
                    entry.error = "could not be compiled (the compiler thread stopped); run the job again"
                entry.compile_s = time.perf_counter() - entry.started
                with self._lock:
                    self._finished.append(entry.compile_s)
                    if not entry.evicted:
                        self._bytes += _size(entry)
                entry.done.set()
                self.progress.set()

    def _compile(self, params: StructuredOutputsParams) -> Any:
        method, text = library_grammar(params)
        if method == "json_schema":
            # Compact JSON (", " and ": "): with any whitespace allowed, small models run away in
            # newlines and spaces until max_tokens.
            return self.compiler.compile_json_schema(text, any_whitespace=False)
        if method == "regex":
            return self.compiler.compile_regex(text)
        return self.compiler.compile_grammar(text)


_QUEUES: list[queue.SimpleQueue] = []


@atexit.register
def _finish_compilations() -> None:
    """At exit: let each worker end its current compilation, start no other, and end."""
    _CLOSING.set()
    for q in _QUEUES:
        q.put(None)
    for worker in _WORKERS:
        worker.join()


def _size(entry: GrammarEntry) -> int:
    return int(entry.compiled.memory_size_bytes) if entry.compiled is not None else 0


class RequestGrammar:
    """One request's matcher: the tokens it has accepted are the request's output tokens.

    The scheduler's `update` calls `accept` with each sampled token; the model runner calls
    `fill_bitmask` for the next token's mask (`batchgen.model.step.TokenMask`). Preemption keeps a
    request's output tokens, so its matcher stays valid; `sync` brings it back in line with the
    output should they ever differ (tokens rolled back, or replayed from the start).
    """

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.num_accepted = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into `bitmask[row]` (int32 `[rows, ceil(vocab / 32)]` on the
        CPU); False when every token is allowed (the row needs no masking)."""
        return bool(self.matcher.fill_next_token_bitmask(bitmask, row))

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False when the grammar does not allow it."""
        if not self.matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        return True

    @property
    def terminated(self) -> bool:
        """Whether the grammar is complete and its stop token (EOS) was accepted."""
        return bool(self.matcher.is_terminated())

    def sync(self, output_token_ids: list[int]) -> bool:
        """Make the accepted tokens the request's `output_token_ids`: a no-op when as many were
        accepted, else the matcher is reset and replays them all. False when one is not allowed."""
        if len(output_token_ids) == self.num_accepted:
            return True
        self.matcher.reset()
        self.num_accepted = 0
        return all(self.accept(t) for t in output_token_ids)


class StructuredRequests:
    """The engine's structured requests before the scheduler gets them: each waits here until its
    grammar is compiled (then it gets its matcher) or has failed (then it is an error), so no
    request waits on another's grammar. The grammar cache is built on first use.

    Args:
        tokenizer / vocab_size / stop_token_ids / timeout_s: as `GrammarCache` takes them.

    Attributes:
        held: (request, its grammar's entry) of the requests whose grammar is still compiling, in
            arrival order.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int], timeout_s: float
    ) -> None:
        self._args = (tokenizer, vocab_size, list(stop_token_ids), timeout_s)
        self._cache: GrammarCache | None = None
        self.held: list[tuple[Any, GrammarEntry]] = []

    def __len__(self) -> int:
        return len(self.held)

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            self._cache = GrammarCache(*self._args)
        return self._cache

    def prepare(self, params: StructuredOutputsParams) -> None:
        """Start compiling a constraint that a request will soon need (a job's look-ahead window)."""
        self.cache.submit(params)

    def add(self, request: Any) -> None:
        """Hold a `Request` with `structured_outputs` until its grammar is ready."""
        self.held.append((request, self.cache.submit(request.sampling_params.structured_outputs)))

    def release(self) -> tuple[list[Any], list[tuple[Any, str]]]:
        """(the held requests whose grammar is ready, now with their matcher (`Request.grammar`);
        the held requests whose grammar failed, with the error after the field name), each in
        arrival order."""
        ready: list[Any] = []
        failed: list[tuple[Any, str]] = []
        still = []
        if self.held:
            timeout_s, now = self.cache.timeout_s, time.perf_counter()
            for request, entry in self.held:
                state = entry.state(timeout_s, now)
                if state == "ready":
                    request.grammar = self.cache.matcher(entry)
                    ready.append(request)
                elif state == "error":
                    failed.append((request, entry.error or "did not compile"))
                else:
                    still.append((request, entry))
            self.held = still
        return ready, failed

    def wait(self, seconds: float) -> None:
        """Block until a compilation ends or `seconds` pass (an engine with nothing else to run)."""
        cache = self.cache
        cache.progress.clear()
        if any(entry.state(cache.timeout_s) == "pending" for _, entry in self.held):
            cache.progress.wait(seconds)

    def drop(self, request: Any) -> bool:
        """Forget a held request (an abort); False when it is not held."""
        kept = [(r, e) for r, e in self.held if r is not request]
        dropped = len(kept) < len(self.held)
        self.held = kept
        return dropped

    def take_compile_times(self) -> list[float]:
        """Seconds of each compilation that ended since the last call (none before the first
        structured request)."""
        return self._cache.take_compile_times() if self._cache is not None else []
