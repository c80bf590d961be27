"""Running one real cell (the embedded runtime, as an agent loop would) over some tools."""

from __future__ import annotations

from dataclasses import dataclass

from codemode.model import CodeMode
from codemode.protocol.types import InputText


@dataclass
class CellRun:
    """What the model would see: the success flag and the texts after the status header."""

    success: bool
    texts: list[str]


async def run_cell(code_mode: CodeMode, source: str, call_id: str = "call-1") -> CellRun:
    rendered = await code_mode.handle_exec(call_id, source)
    texts = [item.text for item in rendered.items[1:] if isinstance(item, InputText)]
    return CellRun(rendered.success, texts)
