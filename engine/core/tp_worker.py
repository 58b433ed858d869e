"""A tensor-parallel worker rank: `python -m engine.core.tp_worker`, started by WorkerGroup.

It reads WorkerArgs from stdin, joins the ranks, builds its shard (engine/runner/setup.py), then
runs each StepPlan it reads, until its stdin closes. It samples nothing: rank 0 does. It reports
to rank 0 as it joins and once its shard is loaded (WorkerGroup.wait_for)."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time

from engine.config import is_config_error
from engine.heap import freeze_start_up_heap
from engine.parallel.comm import init_group, leave_group
from engine.parallel.shard import Shard
from engine.runner.tp_workers import WorkerArgs, report_stage

logger = logging.getLogger("engine.core.tp_worker")

PARENT_POLL_SECONDS = 1.0


def _exit_with_parent(parent: int) -> None:
    """Rank 0 killed outright leaves its pipe open in no one: exit when it is gone."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_SECONDS)
    os._exit(1)


def main() -> int:
    stdin = sys.stdin.buffer
    args: WorkerArgs = pickle.load(stdin)
    logging.basicConfig(level=args.log_level, format=(
        f"%(asctime)s %(levelname)s tp-rank-{args.rank} %(name)s: %(message)s"))
    for signum in (signal.SIGINT, signal.SIGTERM):  # rank 0 stops us by closing the pipe
        signal.signal(signum, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    from engine.runner.attention_check import refresh_warm_up
    from engine.runner.setup import build_rank, rank_device

    shard = Shard(args.rank, args.size)
    device = rank_device(args.config, shard)
    report_stage(args.status_fd, "joining")
    comm = init_group(shard, device, args.store_path)
    try:
        runner = build_rank(args.config, device, shard, comm,
                            loaded=lambda: report_stage(args.status_fd, "loaded")).runner
    except ValueError as err:
        if not is_config_error(err):
            raise
        logger.error("tensor-parallel rank %d: %s", args.rank, err)  # one line, no traceback
        leave_group()
        return 1
    os.close(args.status_fd)  # the last report: nothing forked later holds the pipe open
    comm.serving_timeout(args.config.collective_timeout_s)
    refresh_warm_up(runner)
    freeze_start_up_heap()
    steps = 0
    try:
        while True:
            try:
                plan = pickle.load(stdin)
            except EOFError:
                break
            if plan is None:
                break
            runner.execute(plan, None)
            steps += 1
    finally:
        logger.info("tensor-parallel rank %d stops after %d steps", args.rank, steps)
        leave_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
