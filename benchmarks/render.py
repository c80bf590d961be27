"""Measure the model layer's schema rendering and output truncation against plain baselines.

Run as ``python benchmarks/render.py``. Prints one table:

* schema rendering: ``render_json_schema`` over 100 MCP-like tool schemas (nested objects, enums,
  arrays, ``$ref``/``$defs``, descriptions), beside ``json.dumps`` of the same schemas;
* truncation: ``truncate_items`` of 1, 10 and 64 MB single-item outputs (ASCII lines, and a
  multibyte variant) under the default 10 000-token budget, beside plain string slicing of the
  same data to the same head/tail sizes.

Each figure is the best of several repetitions measured in this run; "ratio" = ours / baseline.
Finishes well under a minute.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from codemode.model.render import truncate_items
from codemode.model.typescript import render_json_schema
from codemode.protocol.types import InputText

BUDGET_TOKENS = 10_000
SCHEMA_COUNT = 100
MB = 1024 * 1024

WORDS = [
    *("account", "project", "issue", "label", "owner", "status", "priority", "region"),
    *("cursor", "limit", "page", "query", "filter", "user", "team", "channel", "message"),
    *("thread", "file", "folder", "branch", "commit", "repository", "deadline", "comment"),
]


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array", "nullable"])
    schema: dict[str, Any]
    if kind == "enum":
        schema = {"type": "string", "enum": rng.sample(WORDS, rng.randint(2, 6))}
    elif kind == "array":
        schema = {"type": "array", "items": {"type": rng.choice(["string", "integer"])}}
    elif kind == "nullable":
        schema = {"type": ["string", "null"]}
    else:
        schema = {"type": kind}
    if rng.random() < 0.6:
        schema["description"] = sentence(rng, rng.randint(3, 10))
    return schema


def obj(rng: random.Random, depth: int, refs: list[str]) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for _ in range(rng.randint(2, 5)):
        name = "_".join(rng.sample(WORDS, 2))
        roll = rng.random()
        if depth > 0 and roll < 0.25:
            properties[name] = obj(rng, depth - 1, refs)
        elif depth > 0 and roll < 0.4:
            properties[name] = {"type": "array", "items": obj(rng, depth - 1, refs)}
        elif refs and roll < 0.55:
            properties[name] = {"$ref": f"#/$defs/{rng.choice(refs)}"}
        else:
            properties[name] = leaf(rng)
    required = rng.sample(sorted(properties), rng.randint(0, len(properties)))
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    if rng.random() < 0.4:
        schema["description"] = sentence(rng, 8)
    return schema


def tool_schema(rng: random.Random, index: int) -> dict[str, Any]:
    """One MCP-like input schema: nested objects, arrays of objects, shared `$defs`."""
    defs = {
        "Pagination": {
            "type": "object",
            "properties": {
                "cursor": {"type": "string", "description": "Opaque cursor from a previous page."},
                "limit": {"type": "integer", "description": "Items per page (1-100)."},
            },
        },
        "Filter": {
            "anyOf": [
                {"type": "object", "properties": {"field": {"type": "string"}}},
                {"type": "array", "items": {"$ref": "#/$defs/Filter"}},
            ]
        },
        f"Entity{index}": obj(rng, 1, []),
    }
    schema = obj(rng, 2, sorted(defs))
    schema["$defs"] = defs
    return schema


def best_of(repeats: int, work: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def slice_head_and_tail(data: str, keep: int) -> str:
    return data[:keep] + "…" + data[-keep:]


def text_output(megabytes: int, multibyte: bool) -> str:
    line = "résumé, ünïcödé payload line ✓\n" if multibyte else "log line 000123: payload data\n"
    size = len(line.encode())
    return line * (megabytes * MB // size)


def main() -> None:
    rng = random.Random(7)
    schemas = [tool_schema(rng, index) for index in range(SCHEMA_COUNT)]
    rows: list[tuple[str, float, float]] = []

    ours = best_of(5, lambda: [render_json_schema(schema) for schema in schemas])
    base = best_of(5, lambda: [json.dumps(schema) for schema in schemas])
    rows.append((f"render {SCHEMA_COUNT} tool schemas", ours, base))
    rendered_bytes = sum(len(render_json_schema(schema)) for schema in schemas)
    unknown = sum(render_json_schema(schema) == "unknown" for schema in schemas)

    head = BUDGET_TOKENS * 4 // 2
    for megabytes, multibyte in ((1, False), (10, False), (64, False), (64, True)):
        data = text_output(megabytes, multibyte)
        items = [InputText(data)]
        repeats = 3 if megabytes == 64 else 5
        ours = best_of(repeats, partial(truncate_items, items, BUDGET_TOKENS))
        base = best_of(repeats, partial(slice_head_and_tail, data, head))
        label = f"truncate {megabytes} MB {'multibyte' if multibyte else 'ASCII'} text"
        rows.append((label, ours, base))

    head_row = ("case", "ours (ms)", "baseline (ms)", "ratio")
    body = [
        (label, f"{ours * 1e3:.3f}", f"{base * 1e3:.3f}", f"{ours / base:.1f}x")
        for label, ours, base in rows
    ]
    widths = [max(len(row[column]) for row in [head_row, *body]) for column in range(4)]
    print(" | ".join(cell.ljust(width) for cell, width in zip(head_row, widths, strict=True)))
    print("-+-".join("-" * width for width in widths))
    for row in body:
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    print(
        f"\nschemas: {rendered_bytes} bytes of TypeScript in total, {unknown} rendered as unknown; "
        "baselines: json.dumps of the same schemas, head+tail slicing of the same text"
    )


if __name__ == "__main__":
    main()
