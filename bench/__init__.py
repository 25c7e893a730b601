"""duet's benchmarks. Every script runs from the repository root as a module:

    python -m bench.engine --quick --threads 1
    python -m bench.serving.serve --figure frontend-tax

Scripts (a `main` and `if __name__ == "__main__"`) import only the library packages, never
each other: `bench.common` (what every script shares: RESULTS.md sections, the machine, clocks,
the chat workload, subprocesses), `bench.offline` (engines run in the benchmark's own
process: bench/engine.py's parts, the transformers side, stand-in models) and the library
modules of `bench.serving` (the serving harness and its scripts). Results and the commands
that made them are in bench/RESULTS.md.
"""
