"""The serving harness: streamed requests against render-serve in the manner of `vllm bench
serve` (`serve`, its figures, the load generator, the request sets and the servers it starts),
a stand-in worker with no model (`synthetic_worker`), the soak run under attack (`soak`) and
prefix-affinity routing across workers (`routing`).

    python -m bench.serving.serve --figure frontend-tax
    python -m bench.serving.soak --duration 120
    python -m bench.serving.routing
"""
