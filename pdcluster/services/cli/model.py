"""`pdcluster model`: where the default model is, and its shape."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="show (and check) the model the cluster serves")
    p.add_argument("--model", default=None, help="a .gguf file or HF safetensors dir (default: bundled SmolLM2)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdcluster.services.default_model import ModelNotFoundError, resolve_model_path
    from pdcluster.services.model_meta import read_model_config

    try:
        path = resolve_model_path(args.model)
    except ModelNotFoundError as exc:
        print(f"error: {exc}")
        return 1
    print(f"model: {path}")
    if path.suffix == ".gguf" or (path / "config.json").is_file():
        cfg = read_model_config(path)
        print(f"  {cfg.arch}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
              f"{cfg.num_kv_heads} kv, head dim {cfg.head_dim}, vocab {cfg.vocab_size}, "
              f"context {cfg.max_position_embeddings}, ~{cfg.num_parameters() / 1e6:.0f}M parameters")
    if path.suffix == ".gguf":
        from pdcluster.services.model_cache import converted

        print(f"  converted copy (what every load reads): {converted(path)}")
    return 0
