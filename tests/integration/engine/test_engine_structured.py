"""Structured output on the real model: a JSON schema's output parses and
validates, the grammar ends the request ("stop") the moment it is complete,
and the disaggregated path (prefill samples the first token under the
grammar, the decode engine catches its matcher up) gives the same tokens as
one engine.  Short prompts and small max_tokens: bf16 prefill is slow here."""

from __future__ import annotations

import json

import jsonschema
import torch

from pdcluster.kernels.block_copy import gather_blocks_ref, scatter_blocks_ref
from pdcluster.services.guided_spec import GuidedSpec
from pdcluster.services.engine.request import FinishReason
from pdcluster.services.sampling_params import greedy
from tests.integration.engine.conftest import make_engine

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
    "required": ["name", "age", "pets"]}


def _spec(schema) -> GuidedSpec:
    return GuidedSpec("json_schema", json.dumps(schema))


def _chat(loaded, text: str) -> list[int]:
    return loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _no_leak(engine):
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_schema_output_validates_and_stops_when_complete(smol_bf16):
    engine = make_engine(smol_bf16)
    prompt = _chat(smol_bf16, "Describe a person as JSON.")
    out = engine.generate([prompt], greedy(64, guided=_spec(PERSON)))[0]
    text = smol_bf16.tokenizer.decode(out.new_token_ids)
    assert out.finish_reason is FinishReason.STOP, text
    jsonschema.validate(json.loads(text), PERSON)
    assert out.new_token_ids[-1] not in smol_bf16.tokenizer.eos_token_ids  # ended by the grammar, no EOS step
    _no_leak(engine)


def test_mixed_batch_keeps_free_rows_free(smol_bf16):
    engine = make_engine(smol_bf16)
    prompt = _chat(smol_bf16, "Say hi.")
    free_alone = engine.generate([prompt], greedy(8))[0].new_token_ids
    free, guided = engine.generate([prompt, prompt], [greedy(8), greedy(8, guided=GuidedSpec("regex", "[0-9]+"))])
    assert free.new_token_ids == free_alone
    assert smol_bf16.tokenizer.decode(guided.new_token_ids).isdigit()
    _no_leak(engine)


def test_length_cut_reports_length(smol_bf16):
    engine = make_engine(smol_bf16)
    out = engine.generate([_chat(smol_bf16, "JSON please.")], greedy(3, guided=_spec(PERSON)))[0]
    assert out.finish_reason is FinishReason.LENGTH and len(out.new_token_ids) == 3
    _no_leak(engine)


def test_disaggregated_grammar_equals_one_engine(smol_bf16):
    prompt = _chat(smol_bf16, "A person as JSON:")
    params = greedy(48, guided=_spec(PERSON))
    whole = make_engine(smol_bf16).generate([prompt], params)[0].new_token_ids

    prefill, decode = make_engine(smol_bf16), make_engine(smol_bf16)
    prefill.add_request("r", prompt, params, prefill_only=True)
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step()
    (done,) = [o for o in outs if o.finished]
    assert done.finish_reason is FinishReason.PREFILLED
    alloc = decode.reserve_external("r", prompt, params)
    buf = gather_blocks_ref(prefill.kv.kv_pool, torch.tensor(done.prefill.block_ids[alloc.num_cached_blocks:]))
    scatter_blocks_ref(decode.kv.kv_pool, torch.tensor(alloc.missing_block_ids), buf)
    assert prefill.release_lease("r")
    decode.commit_external("r", done.prefill.first_token_id)
    tokens, finish = [done.prefill.first_token_id], None
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.new_token_ids
            finish = o.finish_reason if o.finished else finish
    assert tokens == whole and finish is FinishReason.STOP
    jsonschema.validate(json.loads(smol_bf16.tokenizer.decode(tokens)), PERSON)
    _no_leak(prefill)
    _no_leak(decode)


def test_prefill_whose_first_token_completes_the_grammar_stops_there(smol_bf16):
    engine = make_engine(smol_bf16)
    tok = smol_bf16.tokenizer
    word = "Yes"
    assert len(tok.encode(word, add_special_tokens=False)) == 1
    spec = GuidedSpec("ebnf", f'root ::= "{word}"')
    engine.add_request("p", _chat(smol_bf16, "Yes or no?"), greedy(8, guided=spec), prefill_only=True)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].prefill is None
    assert tok.decode(outs[-1].new_token_ids) == word
    _no_leak(engine)


async def test_async_engine_compiles_at_admission_and_refuses_a_bad_spec(smol_bf16):
    """The colocated replica's path: AsyncEngine.generate compiles the
    grammar in a worker thread, then the engine thread finds it cached."""
    import pytest

    from pdcluster.services.engine.async_engine import AsyncEngine
    from pdcluster.services.engine_errors import InvalidRequestError

    aengine = AsyncEngine(make_engine(smol_bf16))
    try:
        spec = _spec({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
        outs = [o async for o in aengine.generate("r", _chat(smol_bf16, "ok?"), greedy(16, guided=spec))]
        assert outs[-1].finish_reason is FinishReason.STOP
        text = smol_bf16.tokenizer.decode([t for o in outs for t in o.new_token_ids])
        assert json.loads(text) in ({"ok": True}, {"ok": False})
        grammars = aengine.engine.grammars
        assert grammars.num_compiles == 1
        again = [o async for o in aengine.generate("r2", _chat(smol_bf16, "ok?"), greedy(16, guided=spec))]
        assert again[-1].finish_reason is FinishReason.STOP
        assert grammars.num_compiles == 1 and grammars.num_hits >= 1
        with pytest.raises(InvalidRequestError, match="regex"):
            async for _ in aengine.generate("bad", _chat(smol_bf16, "x"), greedy(4, guided=GuidedSpec("regex", "a("))):
                pass
        assert await aengine.run(lambda e: e.kv.num_free_blocks == e.kv.num_total_blocks)
    finally:
        await aengine.shutdown()


def test_a_grammar_dead_end_fails_only_its_request_as_invalid(smol_bf16):
    from pdcluster.services.engine_errors import InvalidRequestReason
    from pdcluster.services.sampling_params import SamplingParams

    engine = make_engine(smol_bf16)
    prompt = smol_bf16.tokenizer.encode("-")
    dead_end = GuidedSpec("regex", "\u00d5\u00b4r\U0005069a.")   # no byte token continues the 4-byte character
    alone = engine.generate([prompt], greedy(6, ignore_eos=True))[0].new_token_ids
    outs = engine.generate([prompt, prompt, prompt], [greedy(8, guided=dead_end), greedy(6, ignore_eos=True),
                                                      SamplingParams(max_tokens=8, temperature=1.0, guided=dead_end)])
    for out in (outs[0], outs[2]):
        assert out.finish_reason is FinishReason.ABORT and isinstance(out.error, InvalidRequestReason), out.error
        assert "allows no next token" in out.error
    assert outs[1].new_token_ids == alone
    _no_leak(engine)


async def test_the_engine_thread_never_compiles_even_when_the_cache_evicts(smol_bf16):
    """Two requests with different schemas and a one-entry grammar cache:
    the second compile evicts the first grammar before its request is
    stepped.  Each request carries the grammar admission compiled (off the
    engine thread), so no compile ever runs on the engine thread, and both
    outputs validate."""
    import asyncio
    import threading

    from pdcluster.services.engine.async_engine import AsyncEngine

    aengine = AsyncEngine(make_engine(smol_bf16))
    grammars = aengine.engine.grammars
    grammars.max_entries = 1
    compiled_on: list[str] = []
    for name in ("compile", "compile_future"):
        real = getattr(grammars, name, None)
        if real is not None:
            def recording(spec, _real=real):
                compiled_on.append(threading.current_thread().name)
                return _real(spec)
            setattr(grammars, name, recording)
    schemas = [{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
               {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}]

    async def one(i: int) -> str:
        outs = [o async for o in aengine.generate(f"e{i}", _chat(smol_bf16, "JSON please."),
                                                  greedy(16, guided=_spec(schemas[i])))]
        return smol_bf16.tokenizer.decode([t for o in outs for t in o.new_token_ids])

    try:
        texts = await asyncio.gather(one(0), one(1))
        for schema, text in zip(schemas, texts):
            jsonschema.validate(json.loads(text), schema)
        assert compiled_on and "engine-loop" not in compiled_on, compiled_on
        assert len(grammars) == 1      # the cache did evict
        assert await aengine.run(lambda e: e.kv.num_free_blocks == e.kv.num_total_blocks)
    finally:
        await aengine.shutdown()
