"""Scale-out: one job over many engine replicas on Ray (the optional extra `batchgen[ray]`).

`run_distributed(options, ReplicaOptions(replicas=N, ...))` is `batchgen run JOB --replicas N`.
Importing this package does not import Ray; starting a run does.
"""

from batchgen.distributed.driver import run_distributed
from batchgen.distributed.pool import ReplicaOptions

__all__ = ["ReplicaOptions", "run_distributed"]
