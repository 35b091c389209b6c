"""redact_url: a Redis URL is printed with its password masked, and nothing
else of it changes."""

import pytest

from pdcluster.prefix_store.index import make_index
from pdcluster.prefix_store.redis_url import redact_url, url_password

PW = "Zq9-s3cr3t_x"


@pytest.mark.parametrize("url, shown", [
    (f"redis://:{PW}@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    (f"redis://admin:{PW}@db.internal:6380", "redis://admin:***@db.internal:6380"),
    (f"rediss://:{PW}@db:6379/2", "rediss://:***@db:6379/2"),
    (f"redis://{PW}@db:6379", "redis://***@db:6379"),                # a bare user part may be a password
    (f"redis://:p@ss{PW}@db:6379/0", "redis://:***@db:6379/0"),       # an unescaped @ in the password
    (f"redis://db:6379/0?password={PW}&socket_timeout=1", "redis://db:6379/0?password=***&socket_timeout=1"),
    (f"unix://:{PW}@/run/redis.sock?db=1", "unix://:***@/run/redis.sock?db=1"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),         # nothing to hide: unchanged
    ("memory://", "memory://"),
])
def test_redact_url_masks_the_password_and_keeps_the_rest(url, shown):
    assert redact_url(url) == shown
    assert PW not in redact_url(url)


def test_redact_url_of_nothing_is_empty():
    assert redact_url(None) == "" and redact_url("") == ""


def test_url_password_reads_what_redis_py_would_send():
    assert url_password(f"redis://:{PW}@h:1/0") == PW
    assert url_password("redis://:p%40ss@h:1/0") == "p@ss"
    assert url_password(f"redis://h:1/0?password={PW}") == PW
    assert url_password("redis://h:1/0") is None and url_password(None) is None


def test_an_unknown_scheme_error_does_not_echo_the_password():
    with pytest.raises(ValueError, match="unknown scheme") as err:
        make_index(f"reddis://:{PW}@h:1/0", cluster="c", model="m")
    assert PW not in str(err.value)
