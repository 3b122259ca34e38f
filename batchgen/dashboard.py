"""Job progress: a Rich live view on a terminal, plain periodic lines elsewhere (CI logs).

The dashboard only reads what the engine publishes (`StepStats` of the last step, `EngineTotals`)
and the job's row counts; it never touches requests or the model.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import IO, TYPE_CHECKING

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table

from batchgen.engine.stats import EngineTotals, StepStats

if TYPE_CHECKING:
    from batchgen.jobs.options import JobSummary

_SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    """The last `width` values as a one-line bar plot scaled to their maximum ("" when empty)."""
    values = values[-width:]
    top = max(values, default=0.0)
    if top <= 0:
        return _SPARK[0] * len(values)
    return "".join(_SPARK[min(len(_SPARK) - 1, int(v / top * (len(_SPARK) - 1) + 0.5))] for v in values)


def format_duration(seconds: float | None) -> str:
    """ "1h02m03s" / "2m03s" / "3.4s"; "?" for None."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def counted(count: int, noun: str) -> str:
    """ "1 row" / "2 rows": `count` and the English noun, plural (an added "s") unless it is 1."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


class Dashboard:
    """Shows a job's progress and the engine's state, and prints the final summary.

    Args:
        total_rows: rows in the job (None when unknown: no percentage or ETA).
        live: use a Rich live view when the console is a terminal; otherwise (or False) print a
            plain progress line every `interval` seconds to `stream`.
        console: where the live view and the summary go (default: stdout).
        stream: where plain progress lines go (default: stderr, so they land in CI logs).
        interval: seconds between plain progress lines.
        rate_window_s: span of the rolling token and row rates, in seconds.
    """

    def __init__(
        self,
        total_rows: int | None,
        *,
        live: bool = True,
        console: Console | None = None,
        stream: IO[str] | None = None,
        interval: float = 5.0,
        rate_window_s: float = 10.0,
        history: int = 60,
    ) -> None:
        self.total_rows = total_rows
        self.console = console or Console()
        self.live_mode = live and self.console.is_terminal
        self.stream = stream
        self.interval = interval
        self.rate_window_s = rate_window_s
        self._live: Live | None = None
        self._start = time.perf_counter()
        self._stopped: float | None = None
        self._last_line = self._start
        self._rows_at_last_line: int | None = None
        # (time, gen tokens, prompt tokens, rows); rows is None only in the start baseline.
        self._samples: deque[tuple[float, int, int, int | None]] = deque()
        self._batch_history: deque[float] = deque(maxlen=history)
        self._rate_history: deque[float] = deque(maxlen=history)
        self._last_sample = 0.0
        self.rows_done = 0
        self.rows_error = 0
        self._rows_at_start: int | None = None
        self._updated_at: float | None = None  # perf_counter of the latest update
        self.step: StepStats | None = None
        self.totals = EngineTotals()

    # ----- lifecycle -----

    def start(self) -> None:
        """Begin timing; open the live view when in live mode."""
        self._start = self._last_line = time.perf_counter()
        self._stopped = None
        # A zero baseline at the start: a first step that does all the prefill still shows its rate.
        # Rows are None here and taken from the first update (resumed rows are not this run's work).
        self._samples.clear()
        self._samples.append((self._start, 0, 0, None))
        self._updated_at = None
        if not self.live_mode:
            self._emit("[batchgen] engine ready; first step running (a large first prefill can take a while)")
        if self.live_mode:
            self._live = Live(
                console=self.console, get_renderable=self.render, refresh_per_second=4, transient=False
            )
            self._live.start()

    def stop(self) -> None:
        """Close the live view, or print a last progress line in plain mode."""
        self._stopped = time.perf_counter()
        if self._live is not None:
            self._live.stop()
            self._live = None
        elif not self.live_mode and self.rows_done != self._rows_at_last_line:
            self._emit_progress()  # the last state, unless the line just printed already shows it

    def log(self, message: str) -> None:
        """Print a message without disturbing the live view."""
        if self.live_mode:
            self.console.print(message, highlight=False, markup=False)
        else:
            self._emit(message)

    def _emit(self, line: str) -> None:
        print(line, file=self.stream or sys.stderr, flush=True)

    # ----- data -----

    def update(
        self, rows_done: int, rows_error: int, step: StepStats | None, totals: EngineTotals | None
    ) -> None:
        """Record progress after an engine step (cheap: rendering happens on the view's own clock)."""
        now = time.perf_counter()
        if self._rows_at_start is None:
            self._rows_at_start = rows_done
            if self._samples and self._samples[0][3] is None:
                t0, g0, p0, _ = self._samples[0]
                self._samples[0] = (t0, g0, p0, rows_done)
        self.rows_done, self.rows_error = rows_done, rows_error
        self._updated_at = now
        if step is not None:
            self.step = step
        if totals is not None:
            self.totals = totals
        if now - self._last_sample >= 0.5:
            self._last_sample = now
            t = self.totals
            self._samples.append((now, t.generation_tokens, t.prompt_tokens, rows_done))
            while len(self._samples) > 2 and now - self._samples[0][0] > self.rate_window_s:
                self._samples.popleft()
            self._batch_history.append(float(self.step.num_seqs if self.step else 0))
            self._rate_history.append(self.rates()[0])
        if not self.live_mode and now - self._last_line >= self.interval:
            self._last_line = now
            self._emit_progress()

    def _emit_progress(self) -> None:
        self._rows_at_last_line = self.rows_done
        self._emit(self.progress_line())

    def rates(self) -> tuple[float, float, float]:
        """Rolling (generation tokens/s, prompt tokens/s, rows/s) from the oldest sample of the last
        `rate_window_s` to the latest update (not to the latest sample, which may be up to half a
        second older: rows that finished since would be missed)."""
        if not self._samples or (len(self._samples) < 2 and self._updated_at is None):
            return 0.0, 0.0, 0.0
        t0, g0, p0, r0 = self._samples[0]
        t = self.totals
        t1, g1, p1, r1 = (
            (self._updated_at, t.generation_tokens, t.prompt_tokens, self.rows_done)
            if self._updated_at is not None
            else self._samples[-1]
        )
        r0 = r1 if r0 is None else r0
        dt = t1 - t0
        if dt <= 0 or r0 is None or r1 is None:  # rows are None only in the first sample
            return 0.0, 0.0, 0.0
        return (g1 - g0) / dt, (p1 - p0) / dt, (r1 - r0) / dt

    def eta_s(self) -> float | None:
        """Seconds left at the rolling row rate of the recent steps (`rates`): 0 once every row is
        done; None when the total or the rate is unknown."""
        if self.total_rows is not None and self.rows_done >= self.total_rows:
            return 0.0
        rows_per_s = self.rates()[2]
        if self.total_rows is None or rows_per_s <= 0:
            return None
        return max(self.total_rows - self.rows_done, 0) / rows_per_s

    def fields(self) -> dict[str, str]:
        """Every displayed value, formatted (shared by the live view and the plain line)."""
        gen, prompt, _ = self.rates()
        s, t = self.step, self.totals
        total = "?" if self.total_rows is None else str(self.total_rows)
        pct = f" ({100 * self.rows_done / self.total_rows:.1f}%)" if self.total_rows else ""
        return {
            "rows": f"{self.rows_done}/{total}{pct}",
            "errors": str(self.rows_error),
            # Once stopped there is nothing left to estimate (an interrupted run's rest is unknown).
            "eta": format_duration(self.eta_s()) if self._stopped is None else "-",
            "elapsed": format_duration(time.perf_counter() - self._start),
            "gen tok/s": f"{gen:.0f}",
            "prompt tok/s": f"{prompt:.0f}",
            "batch": f"{s.num_seqs} seqs / {s.num_batched_tokens} tok" if s else "-",
            "queues": f"running {s.num_running} waiting {s.num_waiting} swapped {s.num_swapped}"
            if s
            else "-",
            "kv cache": f"{100 * s.kv_cache_usage:.0f}%" if s else "-",
            "prefix hit": f"{100 * t.prefix_cache_hit_rate:.0f}%",
            "preemptions": str(t.preemptions),
            # Speculative decoding: draft tokens accepted / verified since start ("-" before any).
            "spec decode": f"{t.spec_decode_num_accepted_tokens}/{t.spec_decode_num_draft_tokens} "
            f"drafts accepted ({100 * t.spec_decode_acceptance_rate:.0f}%)"
            if t.spec_decode_num_draft_tokens
            else "-",
            # Structured outputs: requests, distinct constraints compiled and their compile time.
            "structured": f"{counted(t.structured_requests, 'row')}, {counted(t.grammars_compiled, 'grammar')} compiled "
            f"in {t.grammar_compile_s:.2f} s"
            if t.structured_requests
            else "-",
        }

    # ----- views -----

    def progress_line(self) -> str:
        """One plain progress line (what CI logs show); the last one, after `stop()`, has no ETA."""
        f = self.fields()
        eta = f" eta {f['eta']}" if self._stopped is None else ""
        return (
            f"[batchgen] rows {f['rows']} err {f['errors']} | gen {f['gen tok/s']} tok/s "
            f"prompt {f['prompt tok/s']} tok/s | batch {f['batch']} | {f['queues']} | kv {f['kv cache']} "
            f"| prefix hit {f['prefix hit']} | preempt {f['preemptions']} | elapsed {f['elapsed']}{eta}"
            + (f" | spec {f['spec decode']}" if f["spec decode"] != "-" else "")
            + (f" | structured {f['structured']}" if f["structured"] != "-" else "")
        )

    def render(self) -> RenderableType:
        """The live view: progress bar, engine state table, batch-size and tokens/s history."""
        f = self.fields()
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan", justify="right")
        table.add_column()
        table.add_column(style="bold cyan", justify="right")
        table.add_column()
        pairs = [(k, f[k]) for k in f]
        # Two pairs a row need about 110 columns (the queues value is long); an 80-column terminal
        # would crop the rows count, so a narrow one gets one pair a row.
        per_row = 2 if self.console.width >= 110 else 1
        for i in range(0, len(pairs), per_row):
            a, b = pairs[i], pairs[i + 1] if per_row == 2 and i + 1 < len(pairs) else ("", "")
            table.add_row(a[0], a[1], b[0], b[1])
        bar = ProgressBar(
            total=self.total_rows or None,
            completed=self.rows_done,
            width=max(10, min(60, self.console.width - 8)),
        )
        # A ProgressBar ends without a line break, so on its own in a Group the table's first row
        # would continue its line (cropped at the panel's edge); a one-cell grid ends the line.
        bar_line = Table.grid()
        bar_line.add_row(bar)
        history = Table.grid(padding=(0, 1))
        history.add_column(style="dim", justify="right")
        history.add_column(style="green")
        history.add_row("batch size", sparkline(list(self._batch_history)))
        history.add_row("gen tok/s", sparkline(list(self._rate_history)))
        return Panel(Group(bar_line, table, history), title="batchgen run", border_style="blue")

    def print_summary(self, summary: JobSummary) -> None:
        """Print the end-of-run summary to the console (stdout): rows ok / error, tokens, wall time,
        throughput, output path."""
        wall = summary.wall_s or (time.perf_counter() - self._start)
        # Generation: from engine ready to the last commit. The rest of the wall time is loading
        # (a GGUF conversion on first use) and set-up, which would otherwise hide the engine's rate.
        running = min((self._stopped or time.perf_counter()) - self._start, wall)
        # Every token the engine generated: an interrupted run's unfinished rows are not committed
        # (a resume generates them again), but the engine did generate them.
        gen = max(summary.generated_tokens, summary.completion_tokens)
        rows = summary.rows_ok + summary.rows_error
        state = "interrupted" if summary.interrupted else "done"
        tokens = f"tokens: {summary.prompt_tokens} prompt, {summary.completion_tokens} generated"
        if gen > summary.completion_tokens:
            tokens = (
                f"tokens: {summary.prompt_tokens} prompt, {gen} generated: {summary.completion_tokens} in "
                f"committed rows, {gen - summary.completion_tokens} in rows left unfinished (not "
                "committed: a resume generates them again)"
            )
        lines = [
            f"{state}: {summary.rows_done}/{summary.rows_total} rows "
            f"({summary.rows_ok} ok, {summary.rows_error} error this run; {summary.rows_resumed} from earlier runs)",
            tokens,
            f"wall time: {format_duration(wall)} (generation {format_duration(running)}, model load and "
            f"set-up {format_duration(wall - running)})",
            f"throughput: {gen / running if running > 0 else 0.0:.1f} generated tok/s and "
            f"{rows / running if running > 0 else 0.0:.2f} rows/s while generating; "
            f"{gen / wall if wall > 0 else 0.0:.1f} tok/s over the whole run",
            f"output: {summary.output_path}" + ("" if summary.complete else " (not complete yet)"),
        ]
        if summary.structured_rows:
            lines.append(
                f"structured outputs: {counted(summary.structured_rows, 'row')}, "
                f"{counted(summary.grammars_compiled, 'distinct constraint')} compiled in {summary.grammar_compile_s:.2f} s (ahead of admission); token "
                f"masks {summary.mask_time_s:.2f} s of the steps' {summary.step_time_s:.1f} s "
                f"({100 * summary.mask_time_s / summary.step_time_s if summary.step_time_s else 0:.1f}%)"
            )
        if summary.rows_error:
            lines.append(
                f"error rows: {summary.rows_error} this run (their `error` column says why); the first: "
                f"{summary.first_error}"
            )
        for line in lines:
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)
