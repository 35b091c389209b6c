"""pdcluster: a disaggregated prefill/decode LLM serving cluster.

One import root for the product, so that installing it claims no generic
top-level name (transformers itself imports a package called ``kernels``):

    pdcluster.services       the serving layer: gateway, pools, engine, CLI
    pdcluster.planning       the speed model and the capacity planner (pure: no services, no I/O)
    pdcluster.router         where a request goes (cache-aware routing)
    pdcluster.prefix_store   the global prefix index and its KV events
    pdcluster.transfer       KV block transfer between replicas (NIXL, socket)
    pdcluster.kernels        attention, linear and KV kernels (native CPU, Triton)
    pdcluster.observability  traces and metrics

``bench/`` (profiling runs, accuracy checks, load generation) stays beside it in the checkout, run as
``python -m bench.<room>.<x>``; the wheel does not ship it, and nothing under pdcluster/ imports it
(commands that run it load it through pdcluster/services/cli/checkout.py).
"""
