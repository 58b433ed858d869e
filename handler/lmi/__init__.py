"""LMI migration: run a model folder's djl_python handler (model.py) unchanged, or apply its
formatters around the built-in engine. See docs/migrating.md."""
