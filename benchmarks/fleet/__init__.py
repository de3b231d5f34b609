"""A fleet of radixserve replicas behind existing routers: does prefix-aware routing keep
the radix tree paying when one replica becomes several?

`python -m benchmarks.fleet` starts N replicas at once on loopback (`replicas.py`), then
sends the serving benchmark's shared-prefix and multi-turn workloads as text through each
way of routing them (`run.py`): straight to one replica (the baseline), SGLang's gateway
`smg` in `cache_aware` and in `round_robin` mode (`gateway.py`), and a simulation of
precise prefix routing by the replicas' published KV-cache events (`precise.py`). Each
mode reports the fleet hit rate (Σ hit / Σ query tokens over every replica's counters),
TTFT, the prefill tokens computed, throughput, requests per replica, lost requests, and
whether every replica's KV came back to idle.
"""
