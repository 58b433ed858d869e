"""Measuring aids behind the published runs in docs/benchmark/, one command each, run from the
repository root as `python -m benchmark.tools.NAME --help`. Each module's docstring names the
run it was written for. Unlike `batchyard bench`, they measure one question of one run (a
served / offline ratio, the CPU per token of a process, a burst's timeline) and are kept so that
the run can be repeated:

    raw_client      a closed loop of light asyncio streaming clients (the served side)
    measure         raw_client against a running server, with the server's CPU per token
    offline         the offline engine on raw_client's workload (the ratio's other side)
    request_cpu     a server's CPU per request, one client at a time
    output_thread   the serving process's output thread alone, per streamed row
    mixed_steps     what prefilling a prompt costs the step it runs in, offline
    stream_n        streams of n sampled choices on /v1/completions
    wrk_script      a wrk Lua script posting raw_client's workload
    ratios          served / offline per round from a rounds.sh output
    timeline        one line per request of a served run, from its server log
    waves           the offline engine, three waves of 32 LMI requests, each step timed
    build_families  random Phi-3, Gemma 3 and Mixtral folders for `bench model-impl`
"""
