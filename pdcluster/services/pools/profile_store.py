"""Start-up profiles saved with the model cache: a replica's prefill and decode
step lines (startup_profile.py) measured on this machine are kept, so a
replica that starts later on the same machine, weights and settings reads
them instead of spending its own ~1.3 s (two threads) on them.

    <model cache root>/profiles/<key>.json     (model_cache.cache_root())

    key   blake2b of what sets the speed: the weights (weights_id) and their model config,
          dtype, weight and KV dtypes, block size, threads, the scheduler's step sizes, and
          the machine (CPU model, flags, logical CPUs, torch, the native kernels' build), and
          the code that runs a step (a digest of the engine's and the kernels' Python sources):
          after an upgrade or an edit a replica measures again instead of reusing the old
          code's speed as admission's prior

A measurement is noisy on a shared machine -- two replicas of one cluster
start together and each measures while the other takes the cores -- so a
line is reused only after SAMPLES measurements, and what is kept is the
fastest of them (the engine's own speed; the gateway's calibration maps the
line onto what its first tokens measure, under whatever load).  A file that
cannot be read or parsed counts as absent (the replica measures); one that
cannot be written costs only the reuse (logged).

The decisions (``fold``, ``reusable``) are pure; ``ProfileStore`` reads and
writes one file, atomically (a temporary file renamed into place), so a
replica never reads half a file.  Two replicas folding at once can lose one
sample: the next start measures again."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pdcluster.planning.speed import PrefillModel, StepModel

log = logging.getLogger(__name__)

SAMPLES = 3         # measurements folded before a line is reused
FORMAT_VERSION = 2  # bump when the file's meaning changes (2: step lines timed with every stream decoding)
SAVED_SOURCE = "saved start-up profile"
PREFILL_REFERENCE_TOKENS = (256, 1536)  # a prefill line is judged by its time at these prompt lengths
STEP_REFERENCE_BATCH = 16               # a step line by its time at this batch
MIN_PER_TOKEN_S = 1e-8  # no replica prefills 100M tokens a second: a smaller figure is no measurement
MIN_STEP_S = 1e-4       # measure_step's own floor for a step's base


@dataclass(frozen=True)
class SavedProfiles:
    """What the file holds: the fastest line measured so far of each kind, and how many
    measurements were folded into it."""
    prefill: PrefillModel | None = None
    step: StepModel | None = None
    prefill_samples: int = 0
    step_samples: int = 0


def reusable(saved: SavedProfiles | None, kind: str) -> PrefillModel | StepModel | None:
    """The saved ``kind`` ("prefill" | "step") line when SAMPLES measurements went into it (pure)."""
    if saved is None:
        return None
    line, samples = (saved.prefill, saved.prefill_samples) if kind == "prefill" else (saved.step, saved.step_samples)
    if line is None or samples < SAMPLES:
        return None
    return dataclasses.replace(line, source=f"{SAVED_SOURCE} (fastest of {samples})")


def fold(saved: SavedProfiles | None, prefill: PrefillModel | None, step: StepModel | None) -> SavedProfiles:
    """``saved`` with these new measurements folded in (None: not measured): each kind keeps the
    faster line and counts one more sample (pure)."""
    saved = saved or SavedProfiles()
    if prefill is not None:
        best = prefill if saved.prefill is None or _prefill_s(prefill) < _prefill_s(saved.prefill) else saved.prefill
        saved = dataclasses.replace(saved, prefill=best, prefill_samples=saved.prefill_samples + 1)
    if step is not None:
        best = step if saved.step is None or _step_s(step) < _step_s(saved.step) else saved.step
        saved = dataclasses.replace(saved, step=best, step_samples=saved.step_samples + 1)
    return saved


def _prefill_s(line: PrefillModel) -> float:
    return sum(line.time_s(n) for n in PREFILL_REFERENCE_TOKENS)


def _step_s(line: StepModel) -> float:
    return line.step_s(STEP_REFERENCE_BATCH)


def implausible(saved: SavedProfiles) -> str:
    """Why ``saved`` cannot be a measurement ("" when it can), pure: a damaged or hand-edited file
    must not become admission's prior (a negative or infinite line would admit or refuse anything)."""
    numbers = []
    if saved.prefill is not None:
        p = saved.prefill
        numbers += [p.overhead_s, p.per_token_s, p.per_token2_s]
        if not p.per_token_s >= MIN_PER_TOKEN_S:
            return f"prefill per_token_s {p.per_token_s!r} is under {MIN_PER_TOKEN_S:g} s"
    if saved.step is not None:
        numbers += [saved.step.base_s, saved.step.per_seq_s, saved.step.compute_per_seq_s]
        if not saved.step.base_s >= MIN_STEP_S:
            return f"step base_s {saved.step.base_s!r} is under {MIN_STEP_S:g} s"
    if not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in numbers):
        return f"a line holds a negative, infinite or non-numeric figure: {numbers!r}"
    if saved.prefill_samples < 0 or saved.step_samples < 0:
        return "a negative sample count"
    return ""


def profile_key(settings: dict, machine: dict) -> str:
    """The file name's key for these speed-setting ``settings`` on ``machine`` (pure)."""
    text = json.dumps({"format": FORMAT_VERSION, "settings": settings, "machine": machine}, sort_keys=True,
                      default=str)
    return hashlib.blake2b(text.encode(), digest_size=10).hexdigest()


def engine_settings(engine) -> dict:
    """What of ``engine`` (a loaded Engine) sets how fast it prefills and decodes."""
    cfg, sched = engine.config, engine.config.scheduler
    return {"weights": engine.loaded.weights_id, "model_config": repr(engine.loaded.config), "dtype": cfg.dtype,
            "weight_dtype": cfg.weight_dtype, "kv_cache_dtype": cfg.kv_cache_dtype, "device": cfg.device,
            "block_size": cfg.block_size, "max_model_len": engine.max_model_len, "num_threads": cfg.num_threads,
            "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "prefill_chunk_size": sched.prefill_chunk_size}


PACKAGE_ROOT = Path(__file__).resolve().parents[2]   # pdcluster/
STEP_CODE = ("services/engine", "kernels")           # the Python that runs a step, under PACKAGE_ROOT


@functools.lru_cache(maxsize=4)
def code_digest(root: Path = PACKAGE_ROOT, folders: tuple[str, ...] = STEP_CODE) -> str:
    """A digest of the ``*.py`` files under ``folders`` of ``root``: their paths and bytes."""
    h = hashlib.blake2b(digest_size=8)
    for path in sorted(f for folder in folders for f in (root / folder).rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        try:
            h.update(path.read_bytes())
        except OSError:
            h.update(b"(unreadable)")
    return h.hexdigest()


def machine_identity() -> dict:
    """This machine as far as speed goes: CPU model and flags, logical CPUs it may use, torch,
    and the native kernels' build (its file name carries a hash of their source)."""
    import torch

    from pdcluster.kernels import ops

    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = hashlib.blake2b(" ".join(sorted(value.split())).encode(), digest_size=8).hexdigest()
    except OSError:
        pass
    return {"cpu": model, "flags": flags, "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "native": ops.native_build(), "code": code_digest()}


class ProfileStore:
    """One key's file under ``root``."""

    def __init__(self, root: Path, key: str) -> None:
        self.path = Path(root) / "profiles" / f"{key}.json"

    def load(self) -> SavedProfiles | None:
        try:
            raw = json.loads(self.path.read_text())
            saved = SavedProfiles(
                prefill=PrefillModel(**raw["prefill"]) if raw.get("prefill") else None,
                step=StepModel(**raw["step"]) if raw.get("step") else None,
                prefill_samples=int(raw.get("prefill_samples", 0)), step_samples=int(raw.get("step_samples", 0)))
            why = implausible(saved)
            if why:
                raise ValueError(why)
            return saved
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("start-up profile %s unreadable (%s): measuring again", self.path, exc)
            return None

    def save(self, saved: SavedProfiles) -> bool:
        """Writes ``saved`` atomically; False (logged) when it cannot."""
        data = {"prefill": dataclasses.asdict(saved.prefill) if saved.prefill else None,
                "step": dataclasses.asdict(saved.step) if saved.step else None,
                "prefill_samples": saved.prefill_samples, "step_samples": saved.step_samples}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.stem, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f)
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            log.warning("start-up profile not saved to %s (%s): the next replica measures again", self.path, exc)
            return False
        return True


def profile_store_for(engine) -> ProfileStore | None:
    """The store of ``engine``'s speed on this machine, under the model cache; None (logged)
    when the machine cannot be identified."""
    from pdcluster.services import model_cache

    try:
        return ProfileStore(model_cache.cache_root(), profile_key(engine_settings(engine), machine_identity()))
    except Exception as exc:  # noqa: BLE001 - the replica measures, as without a store
        log.warning("start-up profiles not saved on this machine (%s)", exc)
        return None
