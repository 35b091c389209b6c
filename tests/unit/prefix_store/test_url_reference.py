"""The index URL as Serve's config carries it: a reference, never the
password, and each replica reads the URL back itself."""

from __future__ import annotations

import pytest

from pdcluster.prefix_store.url_reference import IndexUrlError, index_url_reference, resolve_index_url
from pdcluster.services import cluster_secret

URL = "redis://:s3cret-pw@10.0.0.7:6379/0"
SECRET = {"PDCLUSTER_CLUSTER_SECRET": "ab" * 32}


def test_a_url_without_password_is_passed_as_it_is():
    for url in (None, "redis://127.0.0.1:6379/0", "memory://"):
        assert index_url_reference(url, {}) == url == resolve_index_url(url, {})


def test_a_url_from_redis_url_is_passed_by_the_variables_name():
    env = {"REDIS_URL": URL, **SECRET}
    ref = index_url_reference(URL, env)
    assert ref == "env:REDIS_URL"
    assert resolve_index_url(ref, env) == URL
    with pytest.raises(IndexUrlError, match="set REDIS_URL on every node"):
        resolve_index_url(ref, {})


def test_any_other_password_url_is_sealed_with_the_cluster_secret_deterministically():
    ref = index_url_reference(URL, SECRET)
    assert ref.startswith("sealed:") and "s3cret-pw" not in ref and "10.0.0.7" not in ref
    assert index_url_reference(URL, SECRET) == ref  # the same token: deployment versions stay put
    assert resolve_index_url(ref, SECRET) == URL
    assert index_url_reference(ref, SECRET) == ref   # a reference is passed on as it is


def test_a_sealed_url_does_not_open_without_the_same_secret():
    ref = index_url_reference(URL, SECRET)
    with pytest.raises(IndexUrlError, match="lacks"):
        resolve_index_url(ref, {})
    with pytest.raises(IndexUrlError, match="same secret on every node"):
        resolve_index_url(ref, {"PDCLUSTER_CLUSTER_SECRET": "cd" * 32})


def test_a_password_url_without_any_way_to_pass_it_is_refused_naming_the_fix():
    with pytest.raises(IndexUrlError, match="set PDCLUSTER_CLUSTER_SECRET"):
        index_url_reference(URL, {})


def test_the_secret_is_read_under_the_services_name():
    from pdcluster.prefix_store import url_reference
    assert url_reference.CLUSTER_SECRET_ENV == cluster_secret.CLUSTER_SECRET_ENV
