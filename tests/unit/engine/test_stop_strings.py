"""Stop strings on a growing text: the same cut as a search of the whole
text, nothing emitted that is later cut, and each token reads only its own
new characters, even with the most and longest stop strings allowed."""

import sys
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.services.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from pdcluster.services.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS


class CharTokenizer:
    """Token id i is the string ``pieces[i]``."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def expected_text(text: str, stops) -> str:
    """The text up to the first stop string to complete (the longest of those
    completing at the same character), by a search of the whole text."""
    hits = [(i + len(s), -len(s)) for s in stops if (i := text.find(s)) != -1]
    if not hits:
        return text
    end, neg_len = min(hits)
    return text[:end + neg_len]


def run(pieces, stops):
    detok = IncrementalDetokenizer(CharTokenizer(pieces), stops)
    out = ""
    for i in range(len(pieces)):
        out += detok.add(i)
        if detok.stopped:
            break
    return out + detok.finish(), detok


@settings(max_examples=300, deadline=None, database=None)
@given(pieces=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=30),
       stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=6), max_size=4))
def test_streamed_cut_equals_a_search_of_the_whole_text(pieces, stops):
    out, _ = run(pieces, stops)
    assert out == expected_text("".join(pieces), stops)


def test_overlapping_and_nested_stop_strings():
    assert run(["xa", "ab", "cd"], ["bc", "abcd"])[0] == "xaa"   # "bc" completes first, though "abcd" starts first
    assert run(["aaa", "ab"], ["aab"])[0] == "aa"                 # a match that needs the KMP fallback
    assert run(["x", "y", "z"], ["yz", "z"])[0] == "x"            # same end: the longer one cuts
    assert run(["he", "llo wor", "ld"], ["wor"])[0] == "hello "
    assert run(["he", "ll"], ["llx"])[0] == "hell"                # held back, then released at the end


def test_each_token_reads_only_its_new_characters():
    reads = []
    original = StopMatcher.feed

    def spy(self, text, start):
        reads.append(len(text) - start)
        return original(self, text, start)

    pieces = ["word "] * 400
    stops = ["x" * MAX_STOP_STRING_CHARS] * (MAX_STOP_STRINGS - 1) + ["never here"]
    StopMatcher.feed = spy
    try:
        out, _ = run(pieces, stops)
    finally:
        StopMatcher.feed = original
    assert out == "word " * 400
    assert reads == [5] * 400  # not the whole text: its length grows to 2000


class _OverBudget(Exception):
    pass


def _lines_run_in(module_file: str, budget: int, fn):
    """Runs ``fn()`` counting the lines executed in ``module_file``; stops it once they pass ``budget``."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count > budget:
                raise _OverBudget(count)
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename == module_file else None

    sys.settrace(tracer)
    try:
        result = fn()
    finally:
        sys.settrace(None)
    return result, count


def test_the_worst_stop_strings_cost_little_per_token():
    """64 stop strings of ~510 characters, none a suffix of the text: the old check tried every prefix
    of each (~32 000 tests per token, 6.8 s for these 3000 tokens).  Counted, not timed: the lines the
    detokenizer runs stay within a few per stop string and character read (the budget stops a
    quadratic matcher early instead of waiting for it)."""
    from pdcluster.services.engine import detokenizer

    stops = ["b" + "a" * (MAX_STOP_STRING_CHARS - 2 - i) for i in range(MAX_STOP_STRINGS)]
    pieces = ["a"] * 3000
    budget = 12 * len(pieces) * len(stops)
    (out, detok), lines = _lines_run_in(detokenizer.__file__, budget, lambda: run(pieces, stops))
    assert out == "a" * 3000 and not detok.stopped
    assert lines <= budget


def test_an_undecodable_run_is_emitted_rather_than_decoded_forever():
    pieces = ["\ufffd"] * 20 + ["ok"]
    out, detok = run(pieces, [])
    assert out == "".join(pieces)
    assert detok._prefix_offset > 0  # the decode window moved on
