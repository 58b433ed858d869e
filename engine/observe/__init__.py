"""Watching the engine run: phases.py (where a step's host time goes), step_watch.py (a warning
that names what made a step slow), async_check.py (the start-up check that turns asynchronous
scheduling on or off)."""
