"""CPU threads per stage process, and the warning when the machine has more work than cores.

torch starts one thread per core in every process, so N processes on one node (DDP, several precompute workers)
ask for N times the cores; and on a machine shared with other jobs a stage runs slower than its numbers suggest.
Each stage sets its threads when it starts (``set_threads``) and, as its long work begins, says in one line when
the load is already above its cores (``warn_if_oversubscribed``).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping

# The signals a stage acts on in its main thread (a stop request, an interrupt): helper threads never take them.
MAIN_THREAD_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def leave_signals_to_main_thread() -> None:
    """Block ``MAIN_THREAD_SIGNALS`` in the calling helper thread (an initializer of the project's loading and
    writing threads). The kernel then hands such a signal to the main thread, whose handler runs before its next
    line: a stop asked for while the process is stopped or busy is seen at the first check after it resumes,
    not whenever a helper thread happens to be scheduled."""
    signal.pthread_sigmask(signal.SIG_BLOCK, MAIN_THREAD_SIGNALS)


def cores_available() -> int:
    """The cores this process may run on (its CPU affinity, which SLURM and containers narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def local_processes(env: Mapping[str, str] = os.environ) -> int:
    """Processes a launcher started on this node: ``LOCAL_WORLD_SIZE`` (torchrun, accelerate), else
    ``WORLD_SIZE``, else 1."""
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        if env.get(name, "").isdigit() and int(env[name]) > 0:
            return int(env[name])
    return 1


def default_threads(env: Mapping[str, str] = os.environ, cores: int | None = None) -> int:
    """The cores divided among the node's processes, at least 1. A single process honours ``OMP_NUM_THREADS``
    when it is set; launchers of several processes set it to 1 themselves, so there it is not the user's choice."""
    local = local_processes(env)
    omp = env.get("OMP_NUM_THREADS", "")
    if local == 1 and omp.isdigit() and int(omp) > 0:
        return int(omp)
    return max(1, (cores if cores is not None else cores_available()) // local)


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads to the recipe's ``threads``, or the default; returns the number."""
    import torch

    n = threads if threads is not None else default_threads()
    torch.set_num_threads(n)
    return n


def running_others() -> int | None:
    """Threads runnable right now besides the one asking (``/proc/loadavg``'s ``running/total``), if known."""
    try:
        with open("/proc/loadavg") as f:
            return max(0, int(f.read().split()[3].split("/")[0]) - 1)
    except (OSError, IndexError, ValueError):
        return None


def load_warning(stage: str, load: float | None = None, cores: int | None = None,
                 others: int | None = None) -> str | None:
    """One line when the 1-minute load average is above the cores available and other threads are running now,
    else None. The second condition keeps a stage that follows another in the same run (whose work the average
    still remembers for a minute) from warning about its own predecessor."""
    cores = cores if cores is not None else cores_available()
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # not available here
            return None
        others = running_others()
    if load <= cores or others == 0:
        return None
    return (f"{stage}: warning: the machine is oversubscribed (1-minute load average {load:.1f} on the {cores} "
            f"core(s) available); this stage will run slower than it would alone")


def warn_if_oversubscribed(stage: str, show: bool = True) -> None:
    """Print ``load_warning`` on stderr (only where ``show``: the leader rank)."""
    line = load_warning(stage) if show else None
    if line:
        print(line, file=sys.stderr, flush=True)
