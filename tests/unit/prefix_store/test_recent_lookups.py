"""Admission's prefix-index answer, taken once by the router that places the same request
(pdcluster/prefix_store/recent_lookups.py): the rule, with a stepped clock.  The real pair (admission's
cached_tokens and the Serve router on a real redis-server) is in tests/unit/router/test_router_plumbing.py."""

from pdcluster.prefix_store.index import LookupResult
from pdcluster.prefix_store.recent_lookups import RecentLookups

ANSWER = LookupResult({"prefill-a": 2}, 3)


def test_an_answer_is_taken_once_while_fresh_and_only_for_the_same_question():
    now = [0.0]
    recent = RecentLookups(fresh_s=0.25, clock=lambda: now[0])
    recent.put("redis://x|ns", (1, 2, 3), ANSWER)
    assert recent.take("redis://y|ns", (1, 2, 3)) is None      # another index
    assert recent.take("redis://x|ns", (1, 2)) is None          # another prompt
    now[0] = 0.25
    assert recent.take("redis://x|ns", (1, 2, 3)) is ANSWER
    assert recent.take("redis://x|ns", (1, 2, 3)) is None       # once
    recent.put("redis://x|ns", (1, 2, 3), ANSWER)
    now[0] = 0.51
    assert recent.take("redis://x|ns", (1, 2, 3)) is None       # too old: asked again
    assert len(recent) == 0 and recent.num_taken == 1


def test_degraded_answers_unscoped_indexes_and_empty_prompts_are_not_kept():
    recent = RecentLookups()
    recent.put("s", (1,), LookupResult.unavailable(1, "redis down"))
    recent.put(None, (1,), ANSWER)   # an index no other object in the process reads (memory://)
    recent.put("s", (), ANSWER)
    assert len(recent) == 0 and recent.take("s", (1,)) is None and recent.take(None, (1,)) is None


def test_the_oldest_answers_go_past_the_capacity():
    recent = RecentLookups(capacity=2)
    for h in (1, 2, 3):
        recent.put("s", (h,), ANSWER)
    assert recent.take("s", (1,)) is None and recent.take("s", (2,)) is ANSWER and recent.take("s", (3,)) is ANSWER
