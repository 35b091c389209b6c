"""JSON schemas that take seconds to compile over SmolLM2's vocabulary (the
grammar-isolation tests' load): every property is an anyOf of a patterned
string, a bounded integer and an enum, all distinct per ``seed``.

Measured on the 2-core test machine (xgrammar 0.2.9, one compile thread):
``slow_schema(seed, 40)`` compiles in about 3 s, 20 properties in about
1.5 s; ``seed`` changes every pattern, bound and enum, so no two seeds share
a compiled grammar."""

from __future__ import annotations

import json


def slow_schema(seed: int, num_properties: int = 40) -> dict:
    props = {}
    for i in range(num_properties):
        props[f"p{seed}_{i}"] = {"anyOf": [
            {"type": "string", "pattern": f"[a-z]{{{1 + i % 5},{20 + i}}}[0-9]{{2,{4 + seed % 7}}}"},
            {"type": "integer", "minimum": -i * 1000 - seed, "maximum": 10**6 + i},
            {"enum": [f"v{seed}_{i}_{k}" for k in range(6)]}]}
    return {"type": "object", "properties": props, "required": list(props)}


def slow_schema_text(seed: int, num_properties: int = 40) -> str:
    return json.dumps(slow_schema(seed, num_properties))
