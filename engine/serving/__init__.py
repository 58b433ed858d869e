"""The serving side of the engine, on the callers' threads: client.py (EngineClient, the one
boundary the HTTP edge uses: encode, submit, abort, gauges, adapters), loop.py (EngineLoop:
request handles, and the output thread that turns the core's token ids into text events) and
adapters.py (the core's LoRA adapter list mirrored, adapter calls awaiting their reply)."""
