"""A multi-turn chat workload in token ids: sessions that start at Poisson
times, each a shared system prompt then turns whose prompt is the whole
conversation so far (every earlier user message and the model's own
replies) plus a new user message::

    turn 0   [ system | <user> u0 </user><assistant> ]                    -> r0
    turn 1   [ system | <user> u0 ... r0 | <user> u1 </user><assistant> ] -> r1
    turn t   prompt(t-1) + r(t-1) + user(t)          a growing, reusable prefix

A turn arrives a think time (exponential) after the previous turn's last
token.  User messages are random vocabulary ids from the seed, so two runs
with one seed send the same first turns; later turns carry the model's
greedy replies, the same in every run on one machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ChatWorkload:
    sessions: int = 64
    turns: int = 6
    system_tokens: int = 96
    user_tokens: int = 48
    output_tokens: int = 32
    session_rate_rps: float = 1.0   # Poisson session starts
    think_s: float = 2.0            # mean time between a reply's end and the next turn
    seed: int = 0

    def final_prompt_tokens(self, frame_tokens: int) -> int:
        """The longest prompt: the last turn's (frame: chat tokens around one user message)."""
        return self.system_tokens + self.turns * (self.user_tokens + frame_tokens) + \
            (self.turns - 1) * self.output_tokens

    def working_set_tokens(self, frame_tokens: int) -> int:
        """Tokens of K/V every session's last turn holds: what a pool would need to keep them all
        (the footprint: more than is ever live at once, since sessions start and end at different times)."""
        return self.sessions * (self.final_prompt_tokens(frame_tokens) + self.output_tokens)

    def turn_context_tokens(self, turn: int, frame_tokens: int) -> int:
        """Tokens of K/V a session holds once turn ``turn`` (0-based) is answered."""
        return self.system_tokens + (turn + 1) * (self.user_tokens + frame_tokens + self.output_tokens)


@dataclass
class Session:
    index: int
    start_s: float
    users: list[list[int]]
    think_s: list[float]
    history: list[int] = field(default_factory=list)
    turn: int = 0

    @property
    def done(self) -> bool:
        return self.turn >= len(self.users)


@dataclass(frozen=True)
class ChatFrame:
    """The chat-template tokens around a user message (the tokenizer's own)."""
    user_open: tuple[int, ...]
    user_close: tuple[int, ...]   # ... and the assistant's opening

    @classmethod
    def of(cls, tokenizer) -> "ChatFrame":
        encode = tokenizer.encode
        return cls(tuple(encode("<|im_start|>user\n")), tuple(encode("<|im_end|>\n<|im_start|>assistant\n")))

    @property
    def num_tokens(self) -> int:
        return len(self.user_open) + len(self.user_close)


def make_sessions(w: ChatWorkload, vocab_lo: int = 1000, vocab_hi: int = 40000) -> tuple[list[int], list[Session]]:
    """(the shared system prompt, the sessions), all from ``w.seed``."""
    rng = np.random.default_rng(w.seed)
    system = rng.integers(vocab_lo, vocab_hi, size=w.system_tokens).tolist()
    starts = np.cumsum(rng.exponential(1.0 / w.session_rate_rps, size=w.sessions))
    sessions = [Session(i, float(starts[i]), [rng.integers(vocab_lo, vocab_hi, size=w.user_tokens).tolist()
                                              for _ in range(w.turns)],
                        rng.exponential(w.think_s, size=w.turns).tolist())
                for i in range(w.sessions)]
    return system, sessions


def live_tokens_peak(w: ChatWorkload, sessions: list[Session], frame_tokens: int) -> int:
    """The most K/V the conversations in progress hold at one moment of the schedule: each session
    from its first turn to its last counts its context so far (what its next turn reuses), turns
    answered the moment they arrive (replies take no time; the real schedule runs a little longer).
    Sessions that have not started or have ended hold nothing a later turn reuses."""
    events: list[tuple[float, int]] = []  # (when, change in live tokens)
    for s in sessions:
        at, held = s.start_s, 0
        for turn in range(len(s.users)):
            context = w.turn_context_tokens(turn, frame_tokens)
            events.append((at, context - held))
            held = context
            if turn + 1 < len(s.users):
                at += s.think_s[turn]
        events.append((at, -held))  # ends with its last turn (sorted after that turn's own arrival)
    live = peak = 0
    for _, change in sorted(events, key=lambda e: (e[0], e[1] < 0)):
        live += change
        peak = max(peak, live)
    return peak


def next_prompt(system: list[int], frame: ChatFrame, s: Session) -> list[int]:
    history = s.history or list(system)
    return history + list(frame.user_open) + s.users[s.turn] + list(frame.user_close)
