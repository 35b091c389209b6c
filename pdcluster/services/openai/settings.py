"""What the host (the gateway deployment) tells the HTTP layer about the
model it serves.  Set as ``app.state.openai_settings``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdcluster.services.config import is_api_key_digest


@dataclass(frozen=True)
class OpenAISettings:
    """``block_hash_seed`` and ``block_size`` must be the engine's own
    (``Engine.hash_seed``, ``EngineConfig.block_size``), or the router's
    prefix lookups never hit.  ``api_key_digests``: ``sha256:<hex>`` of each
    accepted API key (``pdcluster.services.config.api_key_digest``); empty, no key is
    asked for (see auth.py)."""
    served_model_names: tuple[str, ...]
    block_hash_seed: int
    block_size: int = 16
    max_body_bytes: int = 1 * 2**20
    default_completion_max_tokens: int = 16       # OpenAI's default for /v1/completions
    default_chat_max_tokens: int | None = None    # None: whatever context the prompt leaves
    owned_by: str = "pdcluster"
    api_key_digests: tuple[str, ...] = field(default=(), repr=False)
    tenant_of_digest: Mapping[str, str] = field(default_factory=dict, repr=False)  # key digest -> tenant name
    trust_tenant_header: bool = False  # x-pdcluster-tenant names the tenant (behind a gateway that sets it)
    tenant_names: tuple[str, ...] = ()  # the configured tenants (metrics label only these by name)
    tenant_min_priority: Mapping[str, int] = field(default_factory=dict)  # tenant -> most urgent priority allowed
    fault_injection: bool | None = None  # x-pdcluster-fault honoured (faults.py); None: PDCLUSTER_FAULTS decides

    def __post_init__(self) -> None:
        names = self.served_model_names
        if isinstance(names, str):
            object.__setattr__(self, "served_model_names", names := (names,))
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"served_model_names must be one or more non-empty names, got {names!r}")
        object.__setattr__(self, "served_model_names", tuple(names))
        if not 0 <= self.block_hash_seed < 2**64:
            raise ValueError(f"block_hash_seed must be an unsigned 64-bit int (Engine.hash_seed), got {self.block_hash_seed}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 (the engine's block size), got {self.block_size}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.default_completion_max_tokens < 1:
            raise ValueError("default_completion_max_tokens must be >= 1")
        if self.default_chat_max_tokens is not None and self.default_chat_max_tokens < 1:
            raise ValueError("default_chat_max_tokens must be >= 1, or None for the rest of the context")
        object.__setattr__(self, "api_key_digests", tuple(self.api_key_digests))
        if not all(is_api_key_digest(d) for d in self.api_key_digests):
            raise ValueError("api_key_digests must be `sha256:<64 hex digits>` each (pdcluster.services.config.api_key_digest)")
