"""Real-model fixtures: the bundled SmolLM2 GGUF, our engine and Hugging Face
transformers on the same weights, greedy references cached per session."""

from __future__ import annotations

import functools

import pytest
import torch

from services.engine.config import EngineConfig, SchedulerConfig
from services.engine.engine import Engine
from services.engine.model.default import default_model_path
from services.engine.model.loader import load_model

_TOPICS = [
    "The river delta supports thousands of migrating birds every spring.",
    "Engineers measured the bridge's vibration under heavy traffic loads.",
    "A small bakery on the corner sells bread made from ancient grains.",
    "The committee postponed its decision about the new library budget.",
    "Volcanic soil makes the island's vineyards unusually productive.",
    "Her research explores how memory changes as people grow older.",
    "The old lighthouse keeper kept a detailed diary of every storm.",
    "Solar panels on the school roof now cover most of its electricity.",
]


def document(n_sentences: int, offset: int = 0) -> str:
    return " ".join(f"({i}) {_TOPICS[(i + offset) % len(_TOPICS)]}" for i in range(n_sentences))


@pytest.fixture(scope="session")
def smol_fp32():
    return load_model(None, "float32")


@pytest.fixture(scope="session")
def smol_bf16():
    return load_model(None, "bfloat16")


@pytest.fixture(scope="session")
def parity_prompts(smol_fp32) -> list[list[int]]:
    """8 prompts from 5 to about 700 tokens: chats, plain text, long documents."""
    tok = smol_fp32.tokenizer
    chat = lambda text: tok.apply_chat_template([{"role": "user", "content": text}])  # noqa: E731
    prompts = [
        tok.encode("The capital of France is"),
        chat("What is the capital of France?"),
        tok.encode("Once upon a time, in a land far away, there lived"),
        chat("Write a haiku about the sea."),
        chat("Summarise in one sentence: " + document(6)),
        tok.encode(document(14, 3) + " In short,"),
        chat("List three facts from this text: " + document(30, 5)),
        tok.encode(document(50, 1) + " The main theme of these notes is"),
    ]
    lens = [len(p) for p in prompts]
    assert min(lens) >= 5 and 600 <= max(lens) <= 800, lens
    return prompts


@functools.lru_cache(maxsize=4)
def _hf_model(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, GgufConfig

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype,
        quantization_config=GgufConfig(gguf_file=path.name, dequantize=True))
    return hf.eval()


def hf_greedy(hf, prompt: list[int], max_new_tokens: int, eos_ids) -> tuple[list[int], list[torch.Tensor]]:
    """Transformers' greedy tokens (stopping at EOS) and each step's log-probs."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=list(eos_ids), pad_token_id=eos_ids[0],
                          output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1) for s in out.scores]
    return tokens, logprobs


@pytest.fixture(scope="session")
def hf_reference():
    cache: dict = {}

    def get(dtype: torch.dtype, prompt: list[int], max_new_tokens: int, eos_ids):
        key = (dtype, tuple(prompt), max_new_tokens)
        if key not in cache:
            cache[key] = hf_greedy(_hf_model(dtype), prompt, max_new_tokens, eos_ids)
        return cache[key]
    return get


def make_engine(loaded, num_kv_blocks: int = 512, **sched) -> Engine:
    """An engine on already-loaded weights (the KV dtype follows the weights)."""
    return Engine(EngineConfig(num_kv_blocks=num_kv_blocks, scheduler=SchedulerConfig(**sched)), loaded=loaded)


def run_staggered(engine: Engine, prompts: list[list[int]], params, every_steps: int = 3) -> dict[int, list[int]]:
    """Adds prompt i after i*every_steps engine steps (a continuous batch with
    staggered arrivals); returns each prompt's output tokens."""
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        while pending and step >= pending[0][0] * every_steps:
            i, p = pending.pop(0)
            engine.add_request(f"p{i}", p, params)
        for out in engine.step():
            tokens[int(out.request_id[1:])] += out.new_token_ids
        step += 1
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    return tokens
