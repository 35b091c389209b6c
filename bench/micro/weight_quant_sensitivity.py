"""Where int8 weights' greedy departures come from (issue 35): each part of
the quantization alone, simulated, on the departure measure of
bench.micro.weight_quant (16 chat prompts x 64 greedy tokens; a departure
should happen only where bf16's top-2 gap is under 0.3 nats).

Teacher-forced: bf16 answers each prompt greedily once (the engine); then
one prefill of prompt + answer gives, at every answer position, bf16's
logits (LM head in fp32) and a variant's.  Until the first position where
the variant's argmax leaves bf16's token the two greedy runs share their
prefix, so that position is where a free-running variant departs (up to
the prefill-vs-decode arithmetic: the engine's bench decodes).  Printed:

    departed     prompts whose answer the variant leaves, and bf16's largest top-2 gap at a first departure
    flips        positions (any, not only first) where the argmax differs; how many at a gap >= 0.3
    margin rms   rms over all positions of the error in bf16's own top-2 margin (logit 1st - logit 2nd):
                 the steady figure; departures at gaps up to about 2x it follow

A variant quantizes in fp32 torch (fake quantization: int8 codes times their
scales; per-channel weights and per-token activations with the kernels' own
rounding of the W8A8 kernels this study retired, ``quantize_rows`` below), from the checkpoint's fp32
values, with SmoothQuant factors as bench/micro/weight_smoothing.py derives them (applied inline,
x / s against W * s, not folded into the norms).  The first row measures whatever ``weight_dtype: int8``
loads today: since issue 35's group-32 scheme, the GGUF's own blocks (weight-only), no longer W8A8.

Measured (SmolLM2-135M-Instruct, the default model; 2-vCPU AMD EPYC,
avx512_bf16 build, 1 thread; 4 minutes):

    variant                                  departed  max gap  flips  >=0.3  margin rms
    the int8 model as loaded (W8A8, head)       14      0.786     58     23     0.395
    bf16 op by op (torch linears)                8      0.163      9      0     0.107   the floor
    W8A8 everywhere (simulated)                 15      0.542     57     18     0.446
    W8A8, LM head bf16                          15      0.309     51     15     0.422
    W8A8 qkv_proj only                          15      0.487     36      8     0.205
    W8A8 o_proj only                             7      0.159     15      0     0.145
    W8A8 gate_up_proj only                      10      0.576     22      4     0.199
    W8A8 down_proj only                         13      0.475     34      6     0.278
    W8A8 LM head only                           11      0.205     21      0     0.192
    weight-only per channel, all + head         13      0.415     29      2     0.222
    activations only (per token), all + head    13      1.325     46     10     0.344
    W8A8 alpha 0.65 | 0.8                       16      0.811  70 | 87  19 | 25  0.453 | 0.636
    weight-only, 32-wide weight groups          12      0.163     27      0     0.157
    activations only, 32-wide groups            11      0.235     21      0     0.155
    W8A8, 32-wide weight and act groups         15      0.582     29      2     0.184

The first departure's gap is a noisy maximum (the simulation of the scheme
and the scheme itself: 0.54 and 0.79 at margins 0.45 and 0.40); the margin
is the figure to compare.  Errors add roughly in quadrature over the floor
(0.107^2): to depart only below 0.3 a variant needs a margin near 0.16,
about 0.014 of excess variance, and W8A8 on any one projection type but o
spends 0.025-0.066 of it alone.  Per-token int8 activations are most of
the error (a 576- or 1536-wide row shares one scale: 0.344 with exact
weights), per-channel int8 weights the rest (0.222); the LM head and the
smoothing's alpha move it little.  Also tried, in a scratch copy: weights
clipped per row to their least squared error (no better); the residual
stream turned by a random orthogonal matrix folded into every weight
(QuaRot's R1; activations-only margin 0.35 -> 0.27-0.29); the 32 input
channels of largest calibration maximum kept in bf16, the rest W8A8
(LLM.int8's split; margin 0.26-0.29, activations-only 0.23).  Of int8 weights
only one variant reaches the floor: 32-wide weight groups against bf16
activations (W8A16, 0.157); 32-wide groups on both sides of W8A8 stop at
0.184.  But weight-only runs 2.2x bf16's time at 16 rows and 256
(pdcluster/kernels/int8_linear.py), and c16 and prefill owe their gain to W8A8's
integer products on prompt chunks: with the kernels that existed then, no mix
met the departure goal and the speed goals together.  (What followed:
pdcluster/kernels/int8_linear.py's group-32 scheme with its own kernels.)

    python -m bench.micro.weight_quant_sensitivity [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from bench.fingerprint import print_fingerprint
from bench.micro.weight_quant import CHAT_PROMPTS, forward_logits, fp32_head_logits, greedy_answers
from pdcluster.services.engine.config import EngineConfig, SchedulerConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.engine.model import llama
from pdcluster.services.engine.model.k_smoothing import calibration_token_ids
from pdcluster.services.engine.model.loader import load_model
from bench.micro.weight_smoothing import factors, input_maxima, o_factors
from pdcluster.services.model_meta import safetensors_files

OUT_TOKENS = 64
NEAR_TIE_NATS = 0.3
# Which checkpoint tensors make each fused projection (HF names under model.layers.{i}.)
PARTS = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
         "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "down_proj": ("mlp.down_proj",)}


@dataclass(frozen=True)
class Quant:
    """How one linear is fake-quantized: weight "channel" | "g32" | "g64" | None (kept fp32), activation
    "token" | "g32" | "g64" | None (kept bf16), SmoothQuant ``alpha`` (0: no smoothing)."""
    weight: str | None = "channel"
    act: str | None = "token"
    alpha: float = 0.5


@dataclass(frozen=True)
class Variant:
    name: str
    projections: dict[str, Quant | None] = field(default_factory=dict)  # by PROJECTION_NAMES; absent: bf16
    head: Quant | None = None  # None: the model's bf16 LM head


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (int8 [M, K], fp32 scale [M]), symmetric per row, as the retired W8A8 kernels rounded weights
    (per output channel) and activations (per token): 127 / amax as one fp32 division, round half to even."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(xf * inv[:, None]).clamp(-127, 127).to(torch.int8), amax / 127


def fake_quant(x: torch.Tensor, how: str | None, rows_are_weights: bool) -> torch.Tensor:
    """fp32 [M, K] -> its int8 codes times their scales, one scale per row ("channel" / "token": the kernels'
    rounding) or per 32 or 64 consecutive k of a row ("g32", "g64"); None: unchanged."""
    if how is None:
        return x
    if how in ("channel", "token"):
        q, scale = quantize_rows(x)
        return q.float() * scale[:, None]
    group = int(how[1:])
    m, k = x.shape
    q, scale = quantize_rows(x.reshape(m * k // group, group))
    return (q.float() * scale[:, None]).view(m, k)


class Simulator:
    """A bf16 model run op by op, its projections and LM head replaced by fake-quantized ones per variant."""

    def __init__(self, model_path=None):
        from safetensors.torch import load_file

        self.loaded = load_model(model_path, weight_dtype="auto")
        self.model, cfg = self.loaded.model, self.loaded.config
        self.cfg = cfg
        state = {}
        for f in safetensors_files(self.loaded.path):
            state.update(load_file(str(f)))
        self.weights = {(i, n): torch.cat([state[f"model.layers.{i}.{p}.weight"].float() for p in PARTS[n]])
                        for i in range(cfg.num_layers) for n in PARTS}
        self.weights["head"] = state.get("lm_head.weight", state["model.embed_tokens.weight"]).float()
        self.maxima = input_maxima(self.model, calibration_token_ids(self.loaded.tokenizer))
        self.names = {id(p): (i, n) for i, layer in enumerate(self.model.layers)
                      for n, p in zip(llama.PROJECTION_NAMES, layer.projections())}
        self._prepared: dict = {}

    def _smoothing(self, key, alpha: float) -> torch.Tensor:
        w = self.weights[key]
        if alpha == 0:
            return torch.ones(w.shape[1], dtype=torch.float64)
        if key == "head":
            return factors(self.maxima[self.cfg.num_layers]["lm_head"], w, alpha)
        i, name = key
        if name != "o_proj":
            return factors(self.maxima[i][name], w, alpha)
        cfg = self.cfg
        s = o_factors(self.maxima[i][name], w, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, alpha)
        group = cfg.num_heads // cfg.num_kv_heads
        return s[:, None, :].expand(cfg.num_kv_heads, group, cfg.head_dim).reshape(-1)

    def _linear(self, x: torch.Tensor, key, quant: Quant) -> torch.Tensor:
        if (key, quant) not in self._prepared:
            s = self._smoothing(key, quant.alpha)
            w = fake_quant((self.weights[key].double() * s).float(), quant.weight, rows_are_weights=True)
            self._prepared[(key, quant)] = (s.float(), w)
        s, w = self._prepared[(key, quant)]
        x2 = (x.reshape(-1, x.shape[-1]).float() / s).bfloat16().float()  # as a folded norm's bf16 output
        return fake_quant(x2, quant.act, rows_are_weights=False) @ w.T

    @contextmanager
    def running(self, variant: Variant):
        project, linear, model = llama._project, llama.ops.linear, self.model

        def quantized_project(x, proj):
            i, name = self.names[id(proj)]
            quant = variant.projections.get(name)
            if quant is None:
                return project(x, proj)
            return self._linear(x, (i, name), quant).to(x.dtype).view(*x.shape[:-1], -1)

        def quantized_linear(x, weight, bias=None, w_scales=None):
            head = weight is model.embed_tokens.weight or (model.lm_head is not None and weight is model.lm_head.weight)
            if head and variant.head is not None:
                return self._linear(x, "head", variant.head)
            return linear(x, weight, bias, w_scales)

        llama._project, llama.ops.linear = quantized_project, quantized_linear
        try:
            yield model
        finally:
            llama._project, llama.ops.linear = project, linear


def answer_logits(model, prompts, answers) -> list[torch.Tensor]:
    """fp32 logits at every answer position (the one that predicts answer token j), prompt by prompt."""
    return [forward_logits(model, p + a, True)[len(p) - 1:len(p) + len(a) - 1] for p, a in zip(prompts, answers)]


@dataclass(frozen=True)
class Score:
    departed: int
    max_first_gap: float
    flips: int
    flips_over: int  # flips where bf16's gap >= NEAR_TIE_NATS
    margin_rms: float


def score(logits: list[torch.Tensor], reference: list[torch.Tensor], answers: list[list[int]]) -> Score:
    """``reference``: bf16's fp32-head logits at the same positions; ``answers``: bf16's greedy tokens."""
    first, gaps, errors = [], [], []
    for got, ref, answer in zip(logits, reference, answers):
        top2 = torch.topk(ref, 2)
        gap = top2.values[:, 0] - top2.values[:, 1]
        rows = torch.arange(len(ref))
        margin = got[rows, top2.indices[:, 0]] - got[rows, top2.indices[:, 1]]
        errors.append((margin - gap).abs())
        flips = (got.argmax(-1) != torch.tensor(answer[:len(got)])).nonzero().flatten().tolist()
        gaps += [float(gap[j]) for j in flips]
        if flips:
            first.append(float(gap[flips[0]]))
    e = torch.cat(errors)
    return Score(len(first), max(first, default=0.0), len(gaps), sum(g >= NEAR_TIE_NATS for g in gaps),
                 float(e.pow(2).mean().sqrt()))


def variants() -> list[Variant]:
    w8a8, names = Quant(), llama.PROJECTION_NAMES
    all_of = lambda q: {n: q for n in names}  # noqa: E731
    weight_only, acts_only = Quant(act=None, alpha=0.0), Quant(weight=None)
    return [
        Variant("bf16 op by op (torch linears)"),
        Variant("W8A8 everywhere (simulated)", all_of(w8a8), w8a8),
        Variant("W8A8, LM head bf16", all_of(w8a8)),
        *(Variant(f"W8A8 {n} only", {n: w8a8}) for n in names),
        Variant("W8A8 LM head only", head=w8a8),
        Variant("weight-only per channel, all + head", all_of(weight_only), weight_only),
        Variant("activations only (per token), all + head", all_of(acts_only), acts_only),
        *(Variant(f"W8A8 alpha {a}", all_of(Quant(alpha=a)), Quant(alpha=a)) for a in (0.65, 0.8)),
        Variant("weight-only, 32-wide weight groups", all_of(Quant("g32", None, 0.0)), Quant("g32", None, 0.0)),
        Variant("activations only, 32-wide groups", all_of(Quant(None, "g32")), Quant(None, "g32")),
        Variant("W8A8, 32-wide weight and act groups", all_of(Quant("g32", "g32")), Quant("g32", "g32")),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print_fingerprint()
    print("# reproduce: python -m bench.micro.weight_quant_sensitivity"
          + (f" --threads {args.threads}" if args.threads != 1 else ""))
    print("... bf16 greedy answers", file=sys.stderr, flush=True)
    engine = Engine(EngineConfig(num_threads=args.threads, kv_cache_bytes=128 * 2**20,
                                 scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024)))
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_PROMPTS]
    answers = greedy_answers(engine, prompts, OUT_TOKENS)
    bf16 = engine.loaded.model
    reference = [fp32_head_logits(bf16, p + a, True)[len(p) - 1:len(p) + len(a) - 1] for p, a in zip(prompts, answers)]
    del engine, bf16
    print(f"# {len(prompts)} chat prompts x {OUT_TOKENS} tokens, teacher-forced on bf16's answers; gaps in nats "
          f"(bf16, fp32 LM head)")
    print(f"{'variant':44s} {'departed':>8s} {'max gap':>8s} {'flips':>6s} {'>=0.3':>6s} {'margin rms':>10s}")

    def row(name: str, s: Score, seconds: float) -> None:
        print(f"{name:44s} {s.departed:8d} {s.max_first_gap:8.3f} {s.flips:6d} {s.flips_over:6d} "
              f"{s.margin_rms:10.3f}   ({seconds:.0f} s)", flush=True)

    t = time.perf_counter()
    int8 = load_model(weight_dtype="int8").model
    int8.pack_weights()
    row("the int8 model as loaded", score(answer_logits(int8, prompts, answers), reference, answers),
        time.perf_counter() - t)
    del int8
    sim = Simulator()
    for v in variants():
        t = time.perf_counter()
        with sim.running(v) as model:
            got = answer_logits(model, prompts, answers)
        row(v.name, score(got, reference, answers), time.perf_counter() - t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
