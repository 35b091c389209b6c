"""The grammar layer with the real SmolLM2 tokenizer (from the GGUF, no
weights): compile cache, the batched mask in the sampler, matcher catch-up
(the decode replica's path), completion, and that unguided batches are
untouched."""

from __future__ import annotations

import json
import time

import pytest
import torch

from pdcluster.services.engine_errors import InvalidRequestError
from pdcluster.services.engine.grammar import GrammarCache
from pdcluster.services.engine.grammar_guide import GrammarGuide, allowed_token_ids
from pdcluster.services.guided_spec import MAX_GUIDED_SOURCE_CHARS, GuidedSpec
from pdcluster.services.engine.sampler import Sampler
from pdcluster.services.sampling_params import SamplingParams
from pdcluster.services.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("grammar_clocks_off")  # no wall-clock guard decides here
VOCAB = 49152
EOS = 2
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"]}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from transformers import AutoTokenizer

    from pdcluster.services.default_model import default_model_path

    path = default_model_path()
    return Tokenizer(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name), eos_token_ids=(EOS,))


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer) -> GrammarCache:
    cache = GrammarCache(tokenizer, VOCAB)
    yield cache
    cache.close()


class _History:
    """What the grammar guide reads of a request: its output so far."""

    def __init__(self, output_token_ids=(), prompt_token_ids=()):
        self.output_token_ids = list(output_token_ids)
        self.prompt_token_ids = list(prompt_token_ids)


def _sampler(grammars: GrammarCache, histories: dict | None = None) -> Sampler:
    sampler = Sampler((EOS,), histories if histories is not None else {})
    sampler.grammar.bind(grammars)
    return sampler


def _json(schema) -> GuidedSpec:
    return GuidedSpec("json_schema", json.dumps(schema))


def _generate(sampler: Sampler, tokenizer: Tokenizer, spec: GuidedSpec, steps: int, seed: int = 0,
              histories: dict | None = None, rid: str = "r") -> list[int]:
    """Samples from random logits under ``spec`` (compiled first, as admission
    does: the sampler never compiles) until the grammar is done."""
    sampler.grammar.grammars.compile(spec)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps, guided=spec)
    out: list[int] = []
    for _ in range(steps):
        logits = torch.randn(1, VOCAB, generator=gen)
        result = sampler.sample_batch(logits, [rid], [params])
        assert not result.failed, result.failed
        token = result.token_ids[rid]
        out.append(token)
        if histories is not None:
            histories[rid].output_token_ids.append(token)
        if sampler.grammar.is_done(rid) or token == EOS:
            break
    return out


def test_compile_is_cached_per_spec_and_bounded(tokenizer: Tokenizer):
    cache = GrammarCache(tokenizer, VOCAB, max_entries=2)
    first = cache.compile(_json(SCHEMA))
    assert cache.compile(_json(SCHEMA)) is first and cache.num_compiles == 1  # a hit compiles nothing
    for pattern in ("a+", "b+", "c+"):
        cache.compile(GuidedSpec("regex", pattern))
    assert len(cache) == 2 and cache.get(_json(SCHEMA)) is None  # the oldest went first
    assert cache.num_compiles == 4
    cache.close()


@pytest.mark.parametrize("spec, fragment", [
    (GuidedSpec("json_schema", '{"type": "nope"}'), "json_schema"),
    (GuidedSpec("json_schema", "{not json"), "json_schema"),
    (GuidedSpec("regex", "a(b"), "regex"),
    (GuidedSpec("ebnf", "root ::= missing_rule"), "ebnf"),
])
def test_a_spec_that_does_not_compile_is_an_invalid_request(grammars: GrammarCache, spec, fragment):
    with pytest.raises(InvalidRequestError, match=fragment):
        grammars.compile(spec)


def test_spec_shape_is_checked():
    with pytest.raises(InvalidRequestError, match="kind"):
        GuidedSpec("yaml", "x")
    with pytest.raises(InvalidRequestError, match="limit"):
        GuidedSpec("regex", "a" * (MAX_GUIDED_SOURCE_CHARS + 1))
    with pytest.raises(InvalidRequestError, match="guided"):
        SamplingParams(guided="{}")


@pytest.mark.parametrize("seed", range(4))
def test_random_logits_under_a_schema_give_valid_json(grammars, tokenizer, seed):
    sampler = _sampler(grammars)
    tokens = _generate(sampler, tokenizer, _json(SCHEMA), steps=64, seed=seed)
    assert sampler.grammar.is_done("r")
    value = json.loads(tokenizer.decode(tokens))
    assert isinstance(value["ok"], bool) and value["n"] in (1, 2, 3) and set(value) == {"ok", "n"}
    assert EOS not in tokens  # complete before a step was spent on EOS


def test_choice_and_regex(grammars, tokenizer):
    choice = GuidedSpec("ebnf", 'root ::= "alpha" | "beta gamma"')
    for seed in range(3):
        text = tokenizer.decode(_generate(_sampler(grammars), tokenizer, choice, 16, seed))
        assert text in ("alpha", "beta gamma")
    digits = GuidedSpec("regex", r"[0-9]{3}-[a-z]{2}")
    import re
    text = tokenizer.decode(_generate(_sampler(grammars), tokenizer, digits, 16, 5))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)


def test_only_guided_rows_are_masked_and_unguided_batches_untouched(grammars, tokenizer):
    sampler = _sampler(grammars)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    free = SamplingParams(temperature=0.0)
    guided = SamplingParams(temperature=0.0, guided=GuidedSpec("regex", "x"))
    grammars.compile(guided.guided)   # admission's part
    result = sampler.sample_batch(logits.clone(), ["a", "b", "c"], [free, guided, free])
    assert result.token_ids["a"] == int(logits[0].argmax()) and result.token_ids["c"] == int(logits[2].argmax())
    assert result.token_ids["b"] == tokenizer.encode("x", add_special_tokens=False)[0]
    before = sampler.grammar.num_masked_rows
    sampler.sample_batch(logits.clone(), ["a", "c"], [free, free])
    assert sampler.grammar.num_masked_rows == before


def test_sampled_rows_stay_inside_the_grammar(grammars, tokenizer):
    spec = GuidedSpec("ebnf", 'root ::= "yes" | "no"')
    grammars.compile(spec)
    sampler = _sampler(grammars)
    params = SamplingParams(temperature=1.5, seed=3, guided=spec)
    result = sampler.sample_batch(torch.randn(1, VOCAB), ["s"], [params])
    assert tokenizer.decode([result.token_ids["s"]]) in ("yes", "no", "y", "n", "ye")


def test_decode_side_catches_up_on_the_first_token(grammars, tokenizer):
    """The prefill replica sampled the first token under the grammar; the
    decode replica's matcher starts from it."""
    spec = _json(SCHEMA)
    histories = {"r": _History()}
    prefill = _sampler(grammars, histories)
    first = _generate(prefill, tokenizer, spec, steps=1, histories=histories)
    prefill.forget("r")                       # the prefill-only request ends there
    decode = _sampler(grammars, histories)    # another replica, same request table contents
    rest = _generate(decode, tokenizer, spec, steps=64, seed=9, histories=histories)
    json.loads(tokenizer.decode(first + rest))


def test_history_that_breaks_the_grammar_fails_that_row_only(grammars, tokenizer):
    histories = {"bad": _History(tokenizer.encode("oops", add_special_tokens=False)), "ok": _History()}
    sampler = _sampler(grammars, histories)
    p = SamplingParams(temperature=0.0, guided=_json(SCHEMA))
    grammars.compile(p.guided)
    result = sampler.sample_batch(torch.randn(2, VOCAB), ["bad", "ok"], [p, p])
    assert "grammar" in result.failed["bad"] and "ok" in result.token_ids


def test_min_tokens_never_leaves_a_guided_row_empty(grammars, tokenizer):
    spec = GuidedSpec("ebnf", 'root ::= "done"')
    grammars.compile(spec)
    histories = {"r": _History(tokenizer.encode("done", add_special_tokens=False))}
    sampler = Sampler((EOS,), histories)
    sampler.grammar.bind(grammars)
    p = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=5, guided=spec)
    result = sampler.sample_batch(torch.randn(1, VOCAB), ["r"], [p])
    assert result.token_ids == {"r": EOS} and sampler.grammar.is_done("r")


def test_allowed_token_ids_reads_bits_little_endian():
    row = torch.zeros(3, dtype=torch.int32)
    row[0], row[2] = 1 | (1 << 5), 1 << 1
    assert allowed_token_ids(row) == [0, 5, 65]


def test_unbound_sampler_fails_guided_rows_with_a_reason():
    sampler = Sampler((EOS,), {})
    p = SamplingParams(temperature=0.0, guided=GuidedSpec("regex", "a"))
    result = sampler.sample_batch(torch.randn(1, VOCAB), ["r"], [p])
    assert "no grammar compiler" in result.failed["r"]


def test_sixteen_rows_inside_a_json_string_stay_guided_step_after_step(grammars, tokenizer):
    """A 16-row greedy batch, every row inside a JSON string (the common
    case), 30 steps of mask + argmax + accept: no row fails, none is done,
    each keeps the word the logits favour.  Prints the per-step cost for
    reading (the figure itself is bench/load/structured.py's, not a test's)."""
    spec = GuidedSpec("json_schema", json.dumps({"type": "object", "properties": {"s": {"type": "string"}},
                                                 "required": ["s"]}))
    grammars.compile(spec)
    prefix = tokenizer.encode('{"s": "ab', add_special_tokens=False)
    histories = {f"r{i}": _History(prefix) for i in range(16)}
    sampler = _sampler(grammars, histories)
    rids, params = list(histories), [SamplingParams(temperature=0.0, max_tokens=512, guided=spec)] * 16
    logits = torch.randn(16, VOCAB)
    word = tokenizer.encode(" hello", add_special_tokens=False)[0]
    logits[:, word] += 100  # every row stays inside the string
    guide = sampler.grammar
    grammar_s, argmax_s = [], []
    for _ in range(30):
        started = time.perf_counter()
        masked = guide.mask(logits, rids, params)
        best = masked.argmax(dim=-1).tolist()
        result = guide.accept(SampleResultLike(dict(zip(rids, best))))
        ended = time.perf_counter()
        assert result.failed == {} and result.token_ids == {r: word for r in rids}
        assert not any(guide.is_done(r) for r in rids)
        logits.argmax(dim=-1).tolist()
        argmax_s.append(time.perf_counter() - ended)
        grammar_s.append(ended - started - argmax_s[-1])
    grammar_ms = sorted(grammar_s)[len(grammar_s) // 2] * 1e3
    print(f"grammar mask+apply+accept, 16 rows: {grammar_ms:.3f} ms per step, "
          f"{grammar_ms / 16 * 1e3:.1f} us per token (argmax alone {sorted(argmax_s)[15] * 1e3:.3f} ms)")


def SampleResultLike(tokens: dict[str, int]):
    from pdcluster.services.engine.sampler import SampleResult

    return SampleResult(tokens, {})
