"""Real-model fixtures: the bundled SmolLM2 GGUF, our engine and Hugging Face
transformers on the same weights (loaded once per session)."""

from __future__ import annotations

import copy
import functools
import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pdcluster.services import model_cache
from pdcluster.services.engine.config import EngineConfig, SchedulerConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.default_model import default_model_path
from pdcluster.services.engine.model.loader import load_model

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


@functools.lru_cache(maxsize=1)
def _hf_fp32():
    """Transformers' own fp32 read of the bundled GGUF (its dequantization, its
    q/k row order).  That read takes about half a minute, so the first
    session saves the model it produced (save_pretrained: safetensors, the
    same tensors bit for bit) and later sessions load that copy in seconds."""
    from transformers import AutoModelForCausalLM

    saved = _hf_reference_copy(default_model_path())
    return AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32).eval()


def _hf_reference_copy(gguf: Path) -> Path:
    """``<model cache root>/transformers-reference/<stem>-<content hash>-<transformers version>``,
    made from transformers' GGUF read if absent (written aside, then renamed
    into place: a directory there is always complete).  Keyed by the file's
    bytes, not its mtime, so a fresh clone's reinstalled wheel finds it."""
    import transformers
    from transformers import AutoModelForCausalLM, GgufConfig

    digest = hashlib.blake2b(gguf.read_bytes(), digest_size=8).hexdigest()
    root = model_cache.cache_root() / "transformers-reference"
    saved = root / f"{gguf.stem}-{digest}-{transformers.__version__}"
    if (saved / "config.json").exists():
        return saved
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True))
    root.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=saved.name + ".", dir=root))
    hf.save_pretrained(str(partial))
    try:
        partial.rename(saved)
    except OSError:  # another session saved it first
        shutil.rmtree(partial, ignore_errors=True)
    return saved


@functools.lru_cache(maxsize=4)
def _hf_model(dtype: torch.dtype):
    """Transformers' model of the bundled GGUF in `dtype`, loaded once.  Other
    dtypes cast the fp32 load's parameters (buffers such as RoPE's inv_freq stay
    fp32): the same tensors and logits as `from_pretrained(dtype=...)`, checked
    bit for bit, without a second minute-long GGUF dequantization."""
    fp32 = _hf_fp32()
    if dtype == torch.float32:
        return fp32
    hf = copy.deepcopy(fp32)
    for param in hf.parameters():
        param.data = param.data.to(dtype)
    hf.config.dtype = dtype
    return hf


def hf_greedy(hf, prompt: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    """Transformers' own greedy generation (stopping at EOS)."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=list(eos_ids), pad_token_id=eos_ids[0])
    return out[0, len(prompt):].tolist()


def hf_next_token_logprobs(dtype: torch.dtype, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Transformers' log-probs, teacher-forced on `tokens`: row i scores the
    token after prompt + tokens[:i] (rows len(tokens) + 1), from one forward
    pass instead of one per generated token."""
    with torch.inference_mode():
        logits = _hf_model(dtype)(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:].float()
    return torch.log_softmax(logits, dim=-1)


@dataclass(frozen=True)
class Divergence:
    position: int      # the first output position where transformers' greedy choice differs
    margin: float      # transformers' top-1 minus top-2 log-prob there, in nats


def divergence_from_transformers(dtype: torch.dtype, prompt: list[int], tokens: list[int], max_new_tokens: int,
                                 eos_ids) -> Divergence | None:
    """Where `tokens` stops being transformers' greedy continuation of `prompt`,
    or None when they are the same sequence: each token is transformers'
    argmax given everything before it, and the output ends where greedy
    generation would (EOS, or max_new_tokens).  Remembered per session: the
    parity scenarios often produce the same tokens, and transformers'
    verdict on the same inputs is the same (its forward pass is the cost)."""
    return _divergence(dtype, tuple(prompt), tuple(tokens), max_new_tokens, tuple(eos_ids))


@functools.lru_cache(maxsize=256)
def _divergence(dtype: torch.dtype, prompt: tuple[int, ...], tokens: tuple[int, ...], max_new_tokens: int,
                eos_ids: tuple[int, ...]) -> Divergence | None:
    prompt, tokens = list(prompt), list(tokens)
    rows = hf_next_token_logprobs(dtype, prompt, tokens)
    stopped = len(tokens) == max_new_tokens or (tokens and tokens[-1] in eos_ids)
    for j in range(len(tokens) + (0 if stopped else 1)):
        top2 = torch.topk(rows[j], 2)
        if j == len(tokens) or int(top2.indices[0]) != tokens[j]:
            return Divergence(j, float(top2.values[0] - top2.values[1]))
    return None


_MADE: list[Engine] = []  # make_engine's engines, closed when their test ends


@pytest.fixture(autouse=True)
def _close_made_engines():
    """Each engine make_engine made in the test is closed after it: its grammar
    compile processes (some 300 MB each) end with the test, not with the run.
    Engines of wider-scoped fixtures, made before this fixture starts, stay.
    The tests import make_engine as tests.integration.engine.conftest, a
    module apart from the one pytest loads this file as: its list is theirs."""
    from tests.integration.engine import conftest as imported

    made = imported._MADE
    first = len(made)
    yield
    while len(made) > first:
        made.pop().close()


def make_engine(loaded, num_kv_blocks: int = 512, **sched) -> Engine:
    """An engine on already-loaded weights (the KV dtype follows the weights)."""
    engine = Engine(EngineConfig(num_kv_blocks=num_kv_blocks, scheduler=SchedulerConfig(**sched)), loaded=loaded)
    _MADE.append(engine)
    return engine


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
