"""pdcluster: a disaggregated prefill/decode LLM serving cluster.

One import root for the product, so that installing it claims no generic
top-level name (transformers itself imports a package called ``kernels``):

    pdcluster.services       the serving layer: gateway, pools, engine, CLI
    pdcluster.router         where a request goes (cache-aware routing)
    pdcluster.prefix_store   the global prefix index and its KV events
    pdcluster.transfer       KV block transfer between replicas (NIXL, socket)
    pdcluster.kernels        attention, linear and KV kernels (native CPU, Triton)
    pdcluster.observability  traces and metrics

``bench/`` (benchmarks and the planner) stays beside it, run as ``python -m bench.<room>.<x>``.
"""
