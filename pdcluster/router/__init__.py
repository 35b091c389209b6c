"""Routing policies (pure functions of a snapshot) and the Ray Serve request router.

    snapshot       ReplicaLoad, RequestShape, RoutingSnapshot, RoutingDecision
    policy_base    RoutingPolicy ABC (what every policy implements)
    policy         the table of policies by name (make_policy, policy_names)
    round_robin, least_loaded, cache_aware, decode_policy   the policies
    serve_router   PrefixAwareRequestRouter (+ request_router_config) for Serve
    routing_header how the gateway passes block hashes; replica_stats: what replicas report
"""
