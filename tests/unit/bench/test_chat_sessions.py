"""bench.load.chat_sessions: the K/V the conversations in progress hold at once (what a pool
must keep for every next turn to find its history), against the footprint."""

from bench.load.chat_sessions import ChatWorkload, Session, live_tokens_peak, make_sessions

W = ChatWorkload(sessions=2, turns=3, system_tokens=10, user_tokens=4, output_tokens=2)
FRAME = 1  # chat tokens around a user message: each turn adds 4 + 1 + 2 = 7


def session(i: int, start_s: float, think_s: list[float]) -> Session:
    return Session(i, start_s, [[1] * W.user_tokens for _ in range(W.turns)], think_s)


def test_turn_context_grows_by_one_exchange_and_ends_at_the_footprints_share():
    assert [W.turn_context_tokens(t, FRAME) for t in range(3)] == [17, 24, 31]
    assert W.working_set_tokens(FRAME) == 2 * W.turn_context_tokens(W.turns - 1, FRAME)


def test_overlapping_sessions_count_both_contexts_at_their_largest_moment():
    # a: turns at 0, 10, 20; b: turns at 5, 6, 7 -- while b is at its last turn, a holds its first
    a, b = session(0, 0.0, [10.0, 10.0, 0.0]), session(1, 5.0, [1.0, 1.0, 0.0])
    assert live_tokens_peak(W, [a, b], FRAME) == 17 + 31


def test_sessions_one_after_another_hold_one_context_at_a_time():
    a, b = session(0, 0.0, [1.0, 1.0, 0.0]), session(1, 100.0, [1.0, 1.0, 0.0])
    assert live_tokens_peak(W, [a, b], FRAME) == 31


def test_a_session_ending_as_another_starts_is_still_counted_at_its_last_turn():
    a, b = session(0, 0.0, [1.0, 1.0, 0.0]), session(1, 2.0, [1.0, 1.0, 0.0])  # a's last turn and b's first: t=2
    assert live_tokens_peak(W, [a, b], FRAME) == 31 + 17


def test_staggered_sessions_hold_less_than_the_footprint():
    w = ChatWorkload(session_rate_rps=2.0, think_s=15.0)
    peak = live_tokens_peak(w, make_sessions(w)[1], FRAME)
    assert w.turn_context_tokens(w.turns - 1, FRAME) < peak < w.working_set_tokens(FRAME)
