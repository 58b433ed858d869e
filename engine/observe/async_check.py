"""Start-up of asynchronous scheduling: on where asked (or, by default, where the device runs
apart from the host), after a few short greedy requests give the same tokens planned ahead as
in order; on any disagreement or failure, log why and run steps in order."""

from __future__ import annotations

import logging
import time

from engine.inputs import GenerationRequest
from engine.sampling_params import RequestError, SamplingParams

logger = logging.getLogger(__name__)

_CHECK_PROMPT_LENGTHS = (5, 3, 9)
_CHECK_NEW_TOKENS = 6
_MAX_CHECK_STEPS = 1000


def choose_async_scheduling(engine) -> bool:
    """Whether `engine` (an LLMEngine) plans each step while the previous one computes."""
    wanted, runner = engine.config.async_scheduling, engine.runner
    if wanted is None:  # auto: on CPU the forward runs on the host thread: nothing to overlap;
        # nor where the forward itself waits for the host (expert routing)
        wanted = (runner.device.type == "cuda" and runner.peers is None
                  and not getattr(runner.model, "syncs_host", False))
    if not wanted:
        return False
    if runner.peers is not None:
        logger.warning("asynchronous scheduling is off under tensor parallelism: the worker "
                       "ranks need each step's input tokens on the host")
        return False
    if engine.speculator is not None:
        logger.warning("asynchronous scheduling is off with speculative decoding: a step's "
                       "accepted proposals decide what the next one computes")
        return False
    try:
        check_async_scheduling(engine)
    except Exception as err:  # noqa: BLE001 - any failure means: run in order
        logger.warning("asynchronous scheduling is off, steps run in order: %s", err)
        return False
    logger.info("asynchronous scheduling on: step n+1 is planned while step n computes "
                "(checked against in-order steps at start-up)")
    return True


def check_async_scheduling(engine) -> None:
    """Raise AssertionError unless greedy requests give the same tokens both ways."""
    vocab = engine.vocab_size
    prompts = [[(31 * i + 7 * j + 1) % vocab for j in range(n)]
               for i, n in enumerate(_CHECK_PROMPT_LENGTHS)]
    params = SamplingParams(max_new_tokens=_CHECK_NEW_TOKENS, ignore_eos=True, seed=0)
    try:
        for prompt in prompts:
            engine.validate(prompt, params)
    except RequestError as err:
        raise AssertionError(f"no room for the start-up check: {err}") from err
    in_order = _generate(engine, prompts, params, ahead=False)
    ahead = _generate(engine, prompts, params, ahead=True)
    assert ahead == in_order, (f"planned-ahead tokens {ahead} differ from in-order tokens "
                               f"{in_order}")


def _generate(engine, prompts: list[list[int]], params: SamplingParams,
              ahead: bool) -> list[list[int]]:
    engine.async_scheduling = ahead
    ids = [f"async-check-{ahead}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    try:
        for rid, prompt in zip(ids, prompts, strict=True):
            engine.add_validated(rid, GenerationRequest(tuple(prompt), params))
        for _ in range(_MAX_CHECK_STEPS):
            if not engine.has_unfinished():
                return [tokens[rid] for rid in ids]
            for out in engine.step_outputs():
                if out.token_id is not None:
                    tokens[out.request_id].append(out.token_id)
            if engine.last_batch is None:  # a dynamic batch still gathering
                time.sleep(engine.scheduler.wait_hint() or 0.001)
        raise AssertionError(f"the check did not finish in {_MAX_CHECK_STEPS} steps")
    finally:
        engine.fail_last_batch("start-up check")  # nothing stays in flight
        engine.async_scheduling = False
        for rid in ids:
            engine.abort(rid)
