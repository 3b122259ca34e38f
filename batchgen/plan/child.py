"""`batchgen plan` without torch in its own process: what needs torch runs in a short-lived child.

Why: importing torch maps a few hundred MiB into a process, and transformers imports it whenever it
is installed, even to load a tokenizer or a config. A plan reads and tokenizes a job and never runs
the model, so without this most of its memory goes to a library it does not call (measured:
docs/benchmarks.md).

With `torch_free`, the plan's process hides torch from itself (`hide_torch`: a None in
`sys.modules`, Python's own way to block an import; transformers then loads tokenizers and configs
without it) and asks a child process, one after the other, for:
- `sizes`: the device, the dtype, the converted model's folder and the KV-cache sizes
  (`EnginePlan`), as `LLMEngine` would decide them: before the rows are read;
- `measure`: the wall-time calibration (cached or measured now) and the machine's load before it:
  after the rows are read;
- `grammars`: the job's structured outputs constraints compiled (`batchgen.plan.grammars`).
The child's own peak (torch, and the model during a calibration) is gone when it exits. Its
stderr is the user's (warnings such as a lowered max_model_len); its last stdout line is the
answer, as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from batchgen.config import EngineConfig


class ChildError(Exception):
    """The child refused the options or the model (`kind` "options" or "model"), with its message."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def can_hide_torch() -> bool:
    """Whether this process has not imported torch (nor transformers, which would hold it) yet."""
    return sys.modules.get("torch", "absent") in ("absent", None) and "transformers" not in sys.modules


def hide_torch() -> None:
    """Make torch unimportable in this process for good, and import transformers without it.

    For a process that ends after the plan (the CLI's): transformers decides once, at import,
    whether torch is there, so neither can be undone here.

    Raises:
        RuntimeError: torch or transformers is imported already (`can_hide_torch` is False).
    """
    if sys.modules.get("torch", "absent") is None:
        return
    if not can_hide_torch():
        raise RuntimeError("torch or transformers is imported already: a plan cannot keep torch out")
    sys.modules["torch"] = None  # type: ignore[assignment]
    quiet = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # its "PyTorch was not found" note is not for users
    try:
        import transformers  # noqa: F401
    finally:
        if quiet is None:
            del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
        else:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = quiet


def ask_child(task: str, config: EngineConfig, **args: Any) -> dict[str, Any]:
    """Run `task` ("sizes", "measure" or "grammars") in a child interpreter and return its answer.

    Raises:
        ChildError: the child refused the options or the model, or died (its messages are on
            stderr, above).
    """
    request = {"task": task, "engine": dataclasses.asdict(config), "parent": os.getpid(), **args}
    proc = subprocess.run(
        [sys.executable, "-m", "batchgen.plan.child", task],  # the task in argv: `ps` tells them apart
        input=json.dumps(request),
        stdout=subprocess.PIPE,
        text=True,
        check=False,
        # Out of the terminal's process group: Ctrl-C reaches this process alone, whose
        # KeyboardInterrupt kills the child (subprocess.run does) with no traceback of the child's.
        start_new_session=True,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ChildError(
            "model",
            f"batchgen plan's {task} process exited with code {proc.returncode} (its messages are above)",
        )
    answer = json.loads(lines[-1])
    if "error" in answer:
        raise ChildError(answer["kind"], answer["error"])
    return answer


def sizes(config: EngineConfig) -> dict[str, Any]:
    """What `TokenizerEngine` needs that takes torch: device, dtype, model folder, the engine's
    sizes (`engine.sizing.plan_engine`) and its weights' bytes under the quantization
    (`engine.weight_memory.estimate_weights`), JSON-ready.

    Raises:
        ChildError: "options" (the device cannot be used) or "model" (the model cannot be found,
            converted or sized with these options).
    """
    import torch

    from batchgen.config import resolve_device
    from batchgen.engine.sizing import plan_engine, resolve_dtype
    from batchgen.engine.weight_memory import estimate_weights
    from batchgen.jobs.options import flag_hint
    from batchgen.model.loading import loader
    from batchgen.model.loading.architectures import ModelNotFoundError

    try:
        device = torch.device(resolve_device(config.device))
    except ValueError as e:  # as check_run_options words it
        raise ChildError("options", f"invalid engine option: {e}{flag_hint(str(e))}") from e
    try:
        files = loader.resolve_model(config.model)
        dtype = resolve_dtype(config.dtype, files.config, device)
        plan = plan_engine(config, files.config, device, dtype)
        weights = estimate_weights(files.config, dtype, config.quantization, device, files.gguf, files.path)
    except (ModelNotFoundError, ValueError) as e:
        raise ChildError("model", str(e)) from e
    return {
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "model_dir": str(files.path),
        "model_name": files.name,
        "vocab_size": int(files.config.vocab_size),
        "plan": dataclasses.asdict(plan),
        "weights": weights.to_json(),
        "kernels_cached": kernels_cached(config, dtype, device),
    }


def kernels_cached(config: EngineConfig, dtype: Any, device: Any) -> bool:
    """Whether a run's start finds this machine's kernel table (`kernels="auto"` on a CPU) measured:
    a table under the run's key holds entries (a model of other shapes still measures those). Other
    devices and modes measure nothing on the CPU: True."""
    from batchgen.engine.cpu_threads import CpuThreads
    from batchgen.kernels.cpu.linear import can_prepack
    from batchgen.kernels.registry import TuningTable
    from batchgen.model.kernel_choice.choice import tuning_key

    if device.type != "cpu" or config.kernels != "auto" or not can_prepack(dtype, device):
        return True
    threads = CpuThreads(config.num_threads).threads
    return bool(TuningTable.load(tuning_key(dtype, threads)).entries)


def measure(config: EngineConfig, request: dict[str, Any]) -> dict[str, Any]:
    """The calibration `wall_time.measure_machine` gives in this process, JSON-ready."""
    import torch

    from batchgen.model.loading.architectures import ModelNotFoundError
    from batchgen.plan.wall_time import WallTimeOptions, measure_machine

    options = WallTimeOptions(
        calibrate=request["calibrate"],
        use_cache=request["use_cache"],
        cache_dir=Path(request["cache_dir"]) if request["cache_dir"] else None,
        log=(lambda line: print(line, file=sys.stderr, flush=True)) if request["log"] else None,
    )
    try:
        calibration, load = measure_machine(
            config, getattr(torch, request["dtype"]), request["device"], request["lengths"], options
        )
    except (ModelNotFoundError, ValueError) as e:
        raise ChildError("model", str(e)) from e
    return {
        "calibration": None if calibration is None else calibration.to_json(),
        "cached": bool(calibration is not None and calibration.cached),
        "load": load,
    }


def ask_measure(
    config: EngineConfig, dtype: str, device: str, lengths: dict[str, int], options: Any
) -> tuple[Any, tuple[float, int] | None]:
    """`wall_time.measure_machine` in a child: (the calibration or None, the load before it).

    Raises:
        ValueError: the calibration's engine cannot be built (the child's message).
    """
    from batchgen.plan.calibrate import Calibration

    try:
        answer = ask_child(
            "measure",
            config,
            dtype=dtype,
            device=device,
            lengths=lengths,
            calibrate=options.calibrate,
            use_cache=options.use_cache,
            cache_dir=str(options.cache_dir) if options.cache_dir else None,
            log=options.log is not None,
        )
    except ChildError as e:
        raise ValueError(str(e)) from e
    if answer["calibration"] is None:
        return None, None
    calibration = Calibration.from_json(answer["calibration"])
    calibration.cached = answer["cached"]
    load = answer["load"]
    return calibration, (None if load is None else (float(load[0]), int(load[1])))


def _follow_parent(parent: int) -> None:
    """End with the plan's process, however it ends: SIGTERM here when it dies (Linux's
    PR_SET_PDEATHSIG; subprocess.run kills this process only when the parent unwinds)."""
    import ctypes
    import signal

    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the line above
        sys.exit(1)


def _main() -> None:
    request = json.loads(sys.stdin.read())
    _follow_parent(request["parent"])
    config = EngineConfig(**request["engine"])
    answer: dict[str, Any]
    try:
        if request["task"] == "grammars":
            from batchgen.plan.grammars import in_this_process

            answer = {"results": in_this_process(config, request["constraints"])}
        else:
            answer = sizes(config) if request["task"] == "sizes" else measure(config, request)
    except ChildError as e:
        answer = {"error": str(e), "kind": e.kind}
    except Exception as e:  # damaged weights and the like: one line for the user, as run's errors
        answer = {"error": f"{type(e).__name__}: {e}", "kind": "model"}
    sys.stdout.write("\n" + json.dumps(answer) + "\n")


if __name__ == "__main__":
    _main()
