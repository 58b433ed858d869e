"""Polling describe_endpoint with a bound, and undoing what a failed run created."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from deploy.aws import Aws, DeployError, is_not_found, translate

logger = logging.getLogger(__name__)

TRANSITIONAL = {"Creating", "Updating", "SystemUpdating", "RollingBack", "Deleting"}
Verdict = Callable[[dict[str, Any]], str | None]  # "ok", "failed" or None (keep waiting)


@dataclass(frozen=True)
class Waiting:
    timeout: float = 3600.0  # seconds before giving up waiting (the endpoint is left as it is)
    interval: float = 30.0  # seconds between two describe_endpoint calls


def clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def describe_endpoint(aws: Aws, name: str) -> dict[str, Any] | None:
    """describe_endpoint, or None when there is no endpoint of that name."""
    try:
        return aws.client("sagemaker").describe_endpoint(EndpointName=name)
    except ClientError as err:
        if is_not_found(err):
            return None
        raise translate(err, f"describing endpoint {name}") from err


def wait_for(aws: Aws, name: str, waiting: Waiting, verdict: Verdict
             ) -> tuple[dict[str, Any], str]:
    """Poll until verdict says "ok" or "failed"; ("timeout") after waiting.timeout seconds."""
    start = time.monotonic()
    try:
        while True:
            desc = describe_endpoint(aws, name)
            if desc is None:
                raise DeployError(f"endpoint {name} disappeared while waiting for it")
            elapsed = time.monotonic() - start
            logger.info("[%7s] endpoint %s: %s", clock(elapsed), name, desc["EndpointStatus"])
            result = verdict(desc)
            if result is not None:
                return desc, result
            if elapsed + waiting.interval > waiting.timeout:
                return desc, "timeout"
            time.sleep(waiting.interval)
    except KeyboardInterrupt as err:
        raise DeployError(f"interrupted while waiting; endpoint {name} and what this run made "
                          f"were left as they are: check with `aws sagemaker describe-endpoint "
                          f"--endpoint-name {name}`, remove with `batchyard deploy delete --name "
                          f"{name}`") from err


def wait_gone(aws: Aws, name: str, waiting: Waiting) -> bool:
    """Poll until the endpoint no longer exists; False on timeout."""
    start = time.monotonic()
    while (desc := describe_endpoint(aws, name)) is not None:
        elapsed = time.monotonic() - start
        logger.info("[%7s] endpoint %s: %s", clock(elapsed), name, desc["EndpointStatus"])
        if elapsed + waiting.interval > waiting.timeout:
            return False
        time.sleep(waiting.interval)
    return True


class Ledger:
    """What this run created, undone newest first when the run fails."""

    def __init__(self) -> None:
        self._items: list[tuple[str, Callable[[], object]]] = []

    def add(self, what: str, undo: Callable[[], object]) -> None:
        self._items.append((what, undo))

    def rollback(self) -> tuple[list[str], list[str]]:
        """(undone, left): each undo is tried once; failures are kept to be reported."""
        undone: list[str] = []
        left: list[str] = []
        for what, undo in reversed(self._items):
            try:
                undo()
                undone.append(what)
            except (DeployError, ClientError, BotoCoreError) as err:
                logger.warning("could not delete %s: %s", what, err)
                left.append(what)
        self._items.clear()
        return undone, left

    def describe_rollback(self, name: str) -> str:
        """Roll back and say what happened, in one sentence."""
        undone, left = self.rollback()
        text = f"rolled back: deleted {', '.join(undone)}" if undone else "nothing to roll back"
        if left:
            text += (f"; still there: {', '.join(left)} (remove with `batchyard deploy delete "
                     f"--name {name} --purge-artifacts`)")
        return text
