"""The replicas of a job on Ray: the Ray instance, one actor per replica, and their failures.

`ReplicaPool` starts (or joins) Ray, creates `replicas` actors of `batchgen.distributed.replica.Replica`
with the CPUs and GPUs each asks for, and waits until every one has loaded its model: a replica that
cannot (a bad model path, too little memory) fails the job at once, with one error naming it. A
replica whose process dies later is restarted by Ray (`max_restarts`) and the shard it was running is
run again there (`max_task_retries`); the driver commits a shard's rows once, whichever try returns.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from batchgen.config import EngineConfig
from batchgen.distributed.replica import Replica, ReplicaInfo, Shard, ShardResult
from batchgen.jobs.errors import JobInputError
from batchgen.jobs.options import JobOptions

# The object store of a Ray instance started for one run: shards and their output rows only (the
# model weights never travel through it), so a small one; Ray spills to disk beyond it.
LOCAL_OBJECT_STORE_BYTES = 512 * 1024**2
LOCAL_ADDRESS = "127.0.0.1"
# Ray's switch for clusters of several nodes ("0": one node, every address 127.0.0.1).
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@dataclass
class ReplicaOptions:
    """How a job runs on Ray (`batchgen run --replicas N ...`).

    Attributes:
        replicas: engine replicas (Ray actors), each holding one model.
        address: a running Ray cluster to join ("auto", "HOST:PORT", "ray://..."); None (or
            "local", Ray's name for it) starts a Ray instance on this machine (on 127.0.0.1) for the
            run and stops it after.
        num_cpus: CPUs each replica holds (its engine's threads when --num-threads is not given).
        num_gpus: GPUs each replica holds (0 on CPU machines).
        max_restarts: times Ray restarts a replica whose process died (then the job fails).
        max_task_retries: times a shard is run again after its replica died running it.
        shards_in_flight: shards queued on each replica at once (2: the next waits while one runs).
        shard_rows: rows a shard (None: about a quarter of a replica's share, at most `--commit-every`,
            so the last wave is short and a long row holds up only its own shard).
    """

    replicas: int = 2
    address: str | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_restarts: int = 3
    max_task_retries: int = 3
    shards_in_flight: int = 2
    shard_rows: int | None = None

    def __post_init__(self) -> None:
        if self.address == "local":  # `--ray-address local`: Ray even for one replica, started here
            self.address = None
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be an integer >= 1, got {self.replicas!r} (flag --replicas)")
        if not self.num_cpus > 0:
            raise ValueError(f"num_cpus must be > 0, got {self.num_cpus} (flag --cpus-per-replica)")
        if not self.num_gpus >= 0:
            raise ValueError(f"num_gpus must be >= 0, got {self.num_gpus} (flag --gpus-per-replica)")
        for name in ("max_restarts", "max_task_retries"):
            if getattr(self, name) < -1:
                raise ValueError(f"{name} must be >= -1 (-1: without limit), got {getattr(self, name)}")
        if self.shards_in_flight < 1:
            raise ValueError(f"shards_in_flight must be >= 1, got {self.shards_in_flight}")
        if self.shard_rows is not None and self.shard_rows < 1:
            raise ValueError(f"shard_rows must be >= 1, got {self.shard_rows}")


def import_ray() -> Any:
    """The `ray` module.

    Raises:
        JobInputError: Ray is not installed, naming the extra that installs it.
    """
    try:
        import ray
    except ImportError as e:
        raise JobInputError(
            "--replicas above 1 and --ray-address run the job on Ray, which is not installed: "
            'pip install "batchgen[ray]"'
        ) from e
    return ray


def _log(message: str) -> None:
    print(f"[batchgen] {message}", file=sys.stderr, flush=True)


class ReplicaPool:
    """The engine replicas of one run, ready to take shards.

    It stands where `run_job` expects an engine: `model_name` (for OpenAI output) and `start_line`
    (what the engine settled on, logged once) come from the first replica.

    Args:
        options: how many replicas, and where and with what resources they run.
        job: the job's options (each replica renders and tokenizes its rows as the local path does).
        config: the engine configuration (a local model path is made absolute for the actors).

    Raises:
        JobInputError: Ray is missing, no node can hold a replica, or a replica cannot start (the
            message names it and the cause); Ray is shut down again when this pool started it.
    """

    def __init__(self, options: ReplicaOptions, job: JobOptions, config: EngineConfig) -> None:
        self.options = options
        if options.address is None:
            # A Ray instance of this run only, on the loopback address: Ray's single-node mode (read
            # when Ray is imported), which otherwise swaps 127.0.0.1 for the machine's own address.
            os.environ.setdefault(LOOPBACK_ONLY_ENV, "0")
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # an offline job reports nothing
        self.ray = import_ray()
        self.started_ray = False
        self.actors: list[Any] = []
        self.infos: list[ReplicaInfo] = []
        if config.model and os.path.exists(config.model):  # the actors' working directory differs
            config = _with_model(config, os.path.abspath(config.model))
        try:
            self._start_ray()
            self._check_resources()
            self._start_replicas(job, config)
        except BaseException:
            self.shutdown()
            raise
        first = self.infos[0]
        self.model_name = first.model_name
        self.start_line = f"replica 0: {first.start_line}" if first.start_line else ""
        self.max_model_len = min(i.max_model_len or 0 for i in self.infos)

    # ----- start -----

    def _start_ray(self) -> None:
        ray = self.ray
        if ray.is_initialized():  # the caller's own Ray session (a notebook, a test): use it
            return
        kwargs: dict[str, Any] = {
            "include_dashboard": False,
            "log_to_driver": False,
            "logging_level": "warning",
        }
        if self.options.address is None:
            need = math.ceil(self.options.replicas * self.options.num_cpus)
            kwargs.update(
                address="local",
                num_cpus=max(os.cpu_count() or 1, need),
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                _node_ip_address=LOCAL_ADDRESS,
            )
        else:
            kwargs["address"] = self.options.address
        # ray.init replaces the SIGTERM handler; the job's own handling (commit, then stop) stays.
        main = threading.current_thread() is threading.main_thread()
        handler = signal.getsignal(signal.SIGTERM) if main else None
        try:
            ray.init(**kwargs)
        except (ConnectionError, RuntimeError, ValueError) as e:
            where = (
                f"the Ray cluster at {self.options.address}"
                if self.options.address
                else "a local Ray instance"
            )
            raise JobInputError(f"cannot start {where}: {e} (flag --ray-address)") from e
        finally:
            if main and handler is not None:
                signal.signal(signal.SIGTERM, handler)
        self.started_ray = True

    def _check_resources(self) -> None:
        """Fail at once when not even one replica fits the cluster (a wait would never end)."""
        total = self.ray.cluster_resources()
        o = self.options
        for name, flag, need in (
            ("CPU", "--cpus-per-replica", o.num_cpus),
            ("GPU", "--gpus-per-replica", o.num_gpus),
        ):
            have = total.get(name, 0.0)
            if need > have:
                raise JobInputError(
                    f"a replica asks for {need:g} {name}s ({flag}) but the Ray cluster has {have:g}; "
                    f"lower {flag} or add nodes"
                )
            if need * o.replicas > have:
                _log(
                    f"{o.replicas} replicas x {need:g} {name}s exceed the cluster's {have:g}: some start later"
                )

    def _start_replicas(self, job: JobOptions, config: EngineConfig) -> None:
        ray, o = self.ray, self.options
        actor_class = ray.remote(Replica).options(
            num_cpus=o.num_cpus,
            num_gpus=o.num_gpus,
            max_restarts=o.max_restarts,
            max_task_retries=o.max_task_retries,
        )
        self.actors = [actor_class.remote(i, job, config, o.num_cpus) for i in range(o.replicas)]
        pending = {actor.info.remote(): i for i, actor in enumerate(self.actors)}
        infos: dict[int, ReplicaInfo] = {}
        last_note = time.monotonic()
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in ready:
                i = pending.pop(ref)
                try:
                    info = ray.get(ref)
                except ray.exceptions.RayError as e:
                    raise JobInputError(
                        f"replica {i} of {o.replicas} died while starting: {_cause(e)}; "
                        "committed rows are kept, fix the cause and rerun to resume"
                    ) from None
                if info.error is not None:
                    raise JobInputError(
                        f"replica {i} of {o.replicas} (pid {info.pid} on {info.host}) cannot start: {info.error}"
                    )
                infos[i] = info
            if pending and time.monotonic() - last_note > 30:
                last_note = time.monotonic()
                _log(
                    f"waiting for replica(s) {', '.join(map(str, sorted(pending.values())))} to load the model"
                )
        self.infos = [infos[i] for i in range(o.replicas)]

    # ----- run -----

    def submit(self, replica: int, shard: Shard) -> Any:
        """Queue `shard` on replica `replica`; returns the ObjectRef of its `ShardResult`."""
        return self.actors[replica].run_shard.remote(shard)

    def wait(self, refs: list[Any], timeout: float) -> list[Any]:
        """The refs among `refs` whose shards are done (at most `timeout` seconds of waiting)."""
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=True)
        return ready

    def result(self, ref: Any, replica: int, shard: tuple[int, int]) -> ShardResult:
        """The `ShardResult` of a finished shard.

        Raises:
            JobInputError: the replica died more often than Ray restarts it, or raised; naming the
                replica, the shard's rows and the cause (committed rows are kept).
        """
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayError as e:
            raise JobInputError(
                f"replica {replica} of {self.options.replicas} failed on rows {shard[0]}..{shard[1]} "
                f"(restarts allowed: {self.options.max_restarts}): {_cause(e)}; committed rows are kept, "
                "rerun the same command to resume"
            ) from None

    def shutdown(self) -> None:
        """Stop the replicas, and disconnect from Ray (stopping the instance this pool started).

        In a Ray session this pool joined, the replicas are killed; in its own, disconnecting ends
        them (Ray ends a driver's actors with it) without Ray's notes on their unfinished shards."""
        if not self.started_ray:
            for actor in self.actors:
                with contextlib.suppress(Exception):
                    self.ray.kill(actor, no_restart=True)
        self.actors = []
        if self.started_ray:
            with contextlib.suppress(Exception):
                self.ray.shutdown()
            self.started_ray = False


def _with_model(config: EngineConfig, model: str) -> EngineConfig:
    import dataclasses

    return dataclasses.replace(config, model=model)


def _cause(error: BaseException) -> str:
    """A Ray error's message without its traceback lines (the first line, and the last one that
    names the exception)."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if len(lines) == 1:
        return lines[0]
    return f"{lines[0].strip()} ... {lines[-1].strip()}"
