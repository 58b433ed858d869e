"""Rewrites engine/core.py in place so that the core process logs, every 20,000 loop turns, the
CPU (time.thread_time_ns) each part of a turn took on average, in µs: receiving and applying
messages, the step itself (LLMEngine.step_outputs), its stats, and building and publishing the
update. A measuring aid, never committed: `git checkout engine/core.py` undoes it.

    python docs/benchmark/cpu-2026-11-27-core-overhead/instrument_core.py
"""

from __future__ import annotations

from pathlib import Path

PATH = Path("engine/core.py")

LOOP = """            while not self._stopping:
                self._apply(self._receive(timeout))
                self._expire()
                self.engine.check_health()
                timeout = self._step_once()"""

TIMED_LOOP = """            turns = 0
            while not self._stopping:
                a = time.thread_time_ns()
                messages = self._receive(timeout)
                a = self._mark("recv", a)
                self._apply(messages)
                a = self._mark("apply", a)
                self._expire()
                self.engine.check_health()
                a = self._mark("expire+health", a)
                timeout = self._step_once()
                a = self._mark("step_once", a)
                turns += 1
                if turns % 20000 == 0:
                    logger.warning("PROF per loop us: %s", " ".join(
                        f"{k} {v / turns / 1e3:.1f}" for k, v in self._spent.items()))"""

STEP = """        self.watch.start()
        start = time.perf_counter()
        outputs = self._step()"""

TIMED_STEP = """        a = time.thread_time_ns()
        self.watch.start()
        start = time.perf_counter()
        a = self._mark(".watch", a)
        outputs = self._step()
        a = self._mark(".step_outputs", a)"""

AFTER = """        stats = engine.last_step_stats(time.perf_counter() - start)
        self.watch.finish(stats)
        self._send(outputs, stats)"""

TIMED_AFTER = """        stats = engine.last_step_stats(time.perf_counter() - start)
        a = self._mark(".stats", a)
        self.watch.finish(stats)
        a = self._mark(".watch", a)
        self._send(outputs, stats)
        a = self._mark(".send", a)"""

PUBLISH = """        self._publish(CoreUpdate(outputs, self.engine.gauges(), stats))"""

TIMED_PUBLISH = """        a = time.thread_time_ns()
        gauges = self.engine.gauges()
        a = self._mark("..gauges", a)
        update = CoreUpdate(outputs, gauges, stats)
        a = self._mark("..update", a)
        self._publish(update)
        a = self._mark("..publish", a)"""

MARK = '''
    def _mark(self, part: str, since: int) -> int:
        now = time.thread_time_ns()
        self._spent[part] = self._spent.get(part, 0) + now - since
        return now

    def run(self) -> None:'''


def main() -> None:
    text = PATH.read_text()
    deadlines = "        self._deadlines: dict[str, float] = {}\n"
    spent = "        self._spent: dict[str, int] = {}\n"
    for old, new in ((LOOP, TIMED_LOOP), (STEP, TIMED_STEP), (AFTER, TIMED_AFTER),
                     (PUBLISH, TIMED_PUBLISH), ("\n    def run(self) -> None:", MARK),
                     (deadlines, deadlines + spent)):
        assert text.count(old) == 1, f"engine/core.py changed: {old.splitlines()[0]!r}"
        text = text.replace(old, new)
    PATH.write_text(text)


if __name__ == "__main__":
    main()
