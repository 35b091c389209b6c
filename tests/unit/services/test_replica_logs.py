"""Our loggers routed into a Serve replica's log (pdcluster/services/replica_logs.py): the
decision around Ray's logger, with the replica context faked; the real replicas' log files
are checked by tests/integration/cluster/test_cluster_replica_logs.py."""

from __future__ import annotations

import logging

import pytest

from pdcluster.services import replica_logs


@pytest.fixture
def loggers():
    """The two loggers as they were, put back after the test."""
    ours, serve = logging.getLogger("pdcluster"), logging.getLogger("ray.serve")
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in (ours, serve)]
    yield ours, serve
    for lg, handlers, level, propagate in saved:
        lg.handlers, lg.level, lg.propagate = handlers, level, propagate


def test_outside_a_replica_nothing_changes(loggers):
    ours, serve = loggers
    serve.handlers = [logging.NullHandler()]
    before = (list(ours.handlers), ours.level, ours.propagate)
    assert replica_logs.in_serve_replica() is False  # a test process is no replica
    assert replica_logs.into_replica_log() is False
    assert (list(ours.handlers), ours.level, ours.propagate) == before


def test_in_a_replica_ours_write_where_serve_writes_at_info(loggers, monkeypatch):
    ours, serve = loggers
    monkeypatch.setattr(replica_logs, "in_serve_replica", lambda: True)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    serve.handlers = [Keep()]
    assert replica_logs.into_replica_log() is True
    assert replica_logs.into_replica_log() is True  # again: the same handlers, not twice
    assert ours.handlers == serve.handlers and ours.propagate is False
    logging.getLogger("pdcluster.services.pools.worker").info("frozen %d", 3)
    logging.getLogger("pdcluster.services.pools.worker").debug("not at debug")
    assert [(r.name, r.levelno, r.getMessage()) for r in records] == [
        ("pdcluster.services.pools.worker", logging.INFO, "frozen 3")]


def test_before_serve_configured_its_logger_nothing_changes(loggers, monkeypatch):
    ours, serve = loggers
    monkeypatch.setattr(replica_logs, "in_serve_replica", lambda: True)
    serve.handlers = []
    assert replica_logs.into_replica_log() is False


def test_a_later_dict_config_leaves_the_replica_log_writing(loggers, monkeypatch, tmp_path):
    """uvicorn and nixl call logging.config.dictConfig after Serve set up its logger; it closes
    every registered handler, and a closed MemoryHandler drops its target and writes nothing."""
    import logging.config
    import logging.handlers

    ours, serve = loggers
    monkeypatch.setattr(replica_logs, "in_serve_replica", lambda: True)
    target = logging.FileHandler(tmp_path / "replica.log")
    serve.handlers = [logging.handlers.MemoryHandler(capacity=1, target=target)]
    try:
        assert replica_logs.into_replica_log() is True
        logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})  # what uvicorn's config does
        logging.getLogger("pdcluster.gateway").warning("still written")
        assert serve.handlers[0].target is target
        assert "still written" in (tmp_path / "replica.log").read_text()
    finally:
        target.close()
