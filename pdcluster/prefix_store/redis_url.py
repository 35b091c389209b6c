"""A Redis URL carries its password (``redis://:PASSWORD@127.0.0.1:6379/0``,
which redis-py's ``from_url`` understands), so it is a secret: clients take
the URL as it is, and everything that prints or logs one prints
``redact_url(url)`` instead:

    redact_url("redis://:s3cr3t@127.0.0.1:6379/0")    -> "redis://:***@127.0.0.1:6379/0"
    redact_url("redis://admin:s3cr3t@db:6379")         -> "redis://admin:***@db:6379"
    redact_url("redis://s3cr3t@db:6379")               -> "redis://***@db:6379"
    redact_url("redis://db:6379/0?password=s3cr3t")    -> "redis://db:6379/0?password=***"

A user part without a colon is masked whole: redis-py reads it as a user
name, but people put passwords there too.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

MASK = "***"
_SECRET_QUERY_VALUE = re.compile(r"(^|[&;])(password|pass|pwd|secret|token|key|api_key|apikey)=[^&;]*",
                                 re.IGNORECASE)


def redact_url(url: str | None) -> str:
    """``url`` with its password (and any password-like query value) replaced by ``***``."""
    if not url:
        return ""
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK  # unparsable: nothing of it is safe to show
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if colon else f"{MASK}@{host}"
    query = _SECRET_QUERY_VALUE.sub(rf"\1\2={MASK}", parts.query)
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # nothing to hide (and urlunsplit would turn "memory://" into "memory:")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def url_password(url: str | None) -> str | None:
    """The password a Redis URL carries (None: none), e.g. to check that it never leaks."""
    if not url:
        return None
    parts = urlsplit(url)
    if parts.password:
        return unquote(parts.password)
    return next((v for k, v in parse_qsl(parts.query) if k.lower() == "password"), None)
