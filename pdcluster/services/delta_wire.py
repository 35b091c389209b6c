"""A TokenDelta as bytes on the token channel (replica -> gateway, see
pdcluster/services/gateway/token_inbox.py): one msgpack list, never a pickle,
so a frame can carry nothing but a delta's fields, each type-checked on the
way in.

    [key, token_ids, text, finish_reason, num_prompt_tokens, num_cached_tokens,
     logprobs, prompt_logprobs, worker_name, streamed_by, waiting]

``key`` names the attempt the delta belongs to (the gateway's mailbox);
``logprobs`` entries are [token_id, logprob, [[token_id, logprob], ...]]."""

from __future__ import annotations

from typing import Any

import msgpack

from pdcluster.services.token_logprob import TokenLogprob
from pdcluster.services.messages import TokenDelta

MAX_FRAME_BYTES = 64 * 2**20  # a long prompt's prompt_logprobs with top-20 alternatives fits


class BadFrame(ValueError):
    """A frame that is not a well-formed delta (the connection that sent it is closed)."""


def pack_delta(key: str, d: TokenDelta) -> bytes:
    return msgpack.packb([key, d.token_ids, d.text, d.finish_reason, d.num_prompt_tokens, d.num_cached_tokens,
                          _pack_logprobs(d.logprobs), _pack_logprobs(d.prompt_logprobs), d.worker_name,
                          d.streamed_by, d.waiting], use_bin_type=True)


def unpack_delta(frame: bytes) -> tuple[str, TokenDelta]:
    """The attempt key and its delta; BadFrame names what was wrong."""
    try:
        fields = msgpack.unpackb(frame, raw=False, use_list=True, max_ext_len=0,
                                 max_str_len=MAX_FRAME_BYTES, max_bin_len=0, max_array_len=MAX_FRAME_BYTES,
                                 max_map_len=0)
    except Exception as exc:  # msgpack raises several unrelated types
        raise BadFrame(f"not msgpack ({type(exc).__name__}: {exc})") from exc
    if not isinstance(fields, list) or len(fields) != 11:
        raise BadFrame("a delta frame is a list of 11 fields")
    key, ids, text, finish, n_prompt, n_cached, lps, plps, worker, by, waiting = fields
    _expect(isinstance(key, str), "key")
    _expect(isinstance(ids, list) and all(type(t) is int for t in ids), "token_ids")
    _expect(isinstance(text, str), "text")
    _expect(finish is None or isinstance(finish, str), "finish_reason")
    _expect(type(n_prompt) is int and type(n_cached) is int, "token counts")
    _expect(isinstance(worker, str) and isinstance(by, str) and isinstance(waiting, bool), "names")
    return key, TokenDelta.decoded(ids, text, finish, num_prompt_tokens=n_prompt, num_cached_tokens=n_cached,
                                   logprobs=_unpack_logprobs(lps, "logprobs"),
                                   prompt_logprobs=_unpack_logprobs(plps, "prompt_logprobs"),
                                   worker_name=worker, streamed_by=by, waiting=waiting)


def _pack_logprobs(lps: list[TokenLogprob] | None) -> list | None:
    if lps is None:
        return None
    return [[lp.token_id, lp.logprob, [list(alt) for alt in lp.top]] for lp in lps]


def _unpack_logprobs(raw: Any, what: str) -> list[TokenLogprob] | None:
    if raw is None:
        return None
    _expect(isinstance(raw, list), what)
    out = []
    for entry in raw:
        _expect(isinstance(entry, list) and len(entry) == 3 and type(entry[0]) is int
                and isinstance(entry[1], float) and isinstance(entry[2], list), what)
        top = []
        for alt in entry[2]:
            _expect(isinstance(alt, list) and len(alt) == 2 and type(alt[0]) is int and isinstance(alt[1], float),
                    what)
            top.append((alt[0], alt[1]))
        out.append(TokenLogprob(entry[0], entry[1], tuple(top)))
    return out


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise BadFrame(f"a delta frame's {what} has the wrong type")
