"""`dsv41 run --nproc-per-node N ...`: torchrun's launcher, run in this process, so that a
failing rank's one `dsv41: error:` line is the whole report.

`torchrun` itself answers any rank's non-zero exit with its own traceback (`ChildFailedError`)
and log lines, after our error. Here the same elastic launcher (`torch.distributed.run`, the
code behind `torchrun --standalone`) starts the N ranks of `python -m dsv41.deploy.cli ...`;
its failure report is caught: the ranks have already printed their error, so only the exit
status is passed on (a rank killed by a signal, which printed nothing, gets one line).
"""

from __future__ import annotations

import os
import sys

OPTION = "--nproc-per-node"


def strip_option(argv: list[str]) -> list[str]:
    """`argv` without `--nproc-per-node N` / `--nproc-per-node=N` (what each rank runs)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == OPTION:
            skip = True
        elif not a.startswith(OPTION + "="):
            out.append(a)
    return out


def launch(nproc: int, argv: list[str]) -> int:
    """Run `dsv41 ARGV` as `nproc` ranks on this host; the exit status of the first failure."""
    # the launcher's own log lines (a rank failed, SIGTERM sent to the others) repeat our error
    os.environ.setdefault("LOGLEVEL", "CRITICAL")
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)
    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}", "--module",
                                         "dsv41.deploy.cli", *strip_option(argv)])
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode > 0:
            return failure.exitcode  # that rank printed its one line
        print(f"dsv41: error: rank {rank} was killed by signal {-failure.exitcode}", file=sys.stderr)
        return 2
    return 0
