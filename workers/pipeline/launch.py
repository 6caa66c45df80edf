"""How a run's ranks are started on a machine: ``accelerate launch`` of the rank program
(:mod:`workers.pipeline.ranks`) with one of configs/accelerate/, by the worker itself or, on a
Ray cluster, by an actor on each node (:mod:`workers.pipeline.ray_ranks`)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

ACCELERATE_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "accelerate"
# The process a rank stops without: the worker's pid (in the job), or where the worker is on
# another machine, the pid of what started the rank's launcher on its node (a Ray actor).
OWNER_PID = "TRAINYARD_RANKS_OWNER_PID"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_command(
    job: Path,
    *,
    num_processes: int,
    config: str,
    port: int,
    machines: int = 1,
    machine_rank: int = 0,
    main_ip: str = "127.0.0.1",
) -> list[str]:
    """``accelerate launch`` of the ranks with one of configs/accelerate/ (its
    ``num_processes``, all machines together, set by the run). On a machine without GPUs the
    DDP config gives ``num_processes`` CPU processes on gloo. On several machines (Ray), each
    runs this with its ``machine_rank``, rank 0's machine at ``main_ip``:``port``."""
    several = ["--machine_rank", str(machine_rank), "--main_process_ip", main_ip]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ACCELERATE_CONFIGS / f"{config}.yaml"),
        "--num_processes",
        str(num_processes),
        "--num_machines",
        str(machines),
        *(several if machines > 1 else []),
        "--main_process_port",
        str(port),
        "--module",
        "workers.pipeline.ranks",
        str(job),
    ]
