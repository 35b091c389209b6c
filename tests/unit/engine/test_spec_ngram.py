"""N-gram prompt lookup: exact proposals on tiny token lists."""

from pdcluster.services.engine.spec_ngram import propose_ngram


def test_proposes_what_followed_the_latest_earlier_occurrence():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    # the suffix 1 2 3 occurred at 0..2 (then 4 5) and at 6..8 (then 7 8): the latest wins
    assert propose_ngram(tokens, 2, 2, 3) == [7, 8]
    assert propose_ngram(tokens, 5, 2, 3) == [7, 8, 1, 2, 3]


def test_a_longer_match_beats_a_later_shorter_one():
    tokens = [5, 1, 2, 3, 4, 0, 2, 3, 6, 1, 2, 3]
    # "2 3" last occurred at 6..7 (then 6), but "1 2 3" only at 1..3 (then 4): n runs from max down
    assert propose_ngram(tokens, 1, 2, 3) == [4]
    assert propose_ngram(tokens, 1, 2, 2) == [6]


def test_no_match_of_at_least_ngram_min_tokens_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4, 5], 4, 1, 3) == []
    assert propose_ngram([1, 2, 9, 2], 4, 2, 3) == []      # only "2" repeats: shorter than ngram_min
    assert propose_ngram([1, 2, 9, 2], 4, 1, 3) == [9, 2]  # with n = 1 it counts
    assert propose_ngram([], 4, 1, 3) == [] and propose_ngram([7], 4, 1, 3) == []
    assert propose_ngram([1, 2, 1, 2], 0, 1, 3) == []


def test_a_period_shorter_than_k_proposes_what_exists_up_to_the_end():
    # "a b a b a b": the suffix "a b" (n = 2; "b a b" at 1..3 too) -> the continuation reaches the end
    assert propose_ngram([1, 2, 1, 2, 1, 2], 8, 2, 3) == [1, 2]
    assert propose_ngram([4, 4, 4, 4], 3, 1, 2) == [4]


def test_ngram_max_longer_than_the_sequence_is_capped():
    assert propose_ngram([3, 1, 3], 2, 1, 10) == [1, 3]
