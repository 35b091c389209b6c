"""What a request asks its output to match: a JSON schema, a regular
expression, or an EBNF grammar (xgrammar's dialect).

A ``GuidedSpec`` is plain text plus a kind, so it travels inside
``SamplingParams`` (pickled by Ray) from the gateway to the prefill and the
decode replica unchanged, and is the key of each replica's compiled-grammar
cache (grammar.py).  The gateway turns every OpenAI / vLLM form into one of
these three kinds (pdcluster/services/openai/structured.py): ``json_object`` is the
schema ``{"type": "object"}``, ``guided_choice`` and the tool-call grammars
are EBNF.  Nothing here imports the grammar library: the gateway and the
engine's hot loop only carry the spec."""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.services.engine_errors import InvalidRequestError

GUIDED_KINDS = ("json_schema", "regex", "ebnf")
# A schema or grammar bigger than this is not a response format but an
# attack on the compiler (compile time grows with the source).
MAX_GUIDED_SOURCE_CHARS = 64 * 1024


@dataclass(frozen=True)
class GuidedSpec:
    """``kind``: one of GUIDED_KINDS; ``source``: the schema as JSON text,
    the regex, or the EBNF grammar (its start rule is ``root``)."""
    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise InvalidRequestError(f"guided kind must be one of {GUIDED_KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str) or not self.source:
            raise InvalidRequestError(f"guided {self.kind} must be a non-empty string")
        if len(self.source) > MAX_GUIDED_SOURCE_CHARS:
            raise InvalidRequestError(f"guided {self.kind} has {len(self.source)} characters; the limit is "
                                      f"{MAX_GUIDED_SOURCE_CHARS}: simplify the schema or grammar")

    def describe(self) -> str:
        """For logs and errors: the kind and size, never the text (it may hold user data)."""
        return f"{self.kind} ({len(self.source)} chars)"
