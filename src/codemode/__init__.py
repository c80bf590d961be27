"""codemode: the Code Mode protocol for Python.

Run model-written JavaScript cells that call your tools back, in process or on a remote host.
"""

import logging

from codemode.errors import (
    CodeModeError,
    ConnectionClosed,
    FrameError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    WireConversionError,
)
from codemode.model import CodeMode, Tool, ToolRegistry, tool
from codemode.protocol import (
    CellId,
    CodeModeNestedToolCall,
    CodeModeSessionCellExecutionLimits,
    CodeModeToolKind,
    ContentItem,
    ExecuteRequest,
    ImageDetail,
    InputAudio,
    InputImage,
    InputText,
    LiveCell,
    MissingCell,
    ParsedExecSource,
    Result,
    RuntimeResponse,
    Terminated,
    ToolDefinition,
    ToolName,
    WaitOutcome,
    WaitRequest,
    Yielded,
    parse_exec_source,
)
from codemode.session import (
    CancellationToken,
    CodeModeSession,
    CodeModeSessionDelegate,
    CodeModeSessionProvider,
    NoopCodeModeSessionDelegate,
    StartedCell,
)

__version__ = "0.1.0"

# A library logs only where its application configures logging: without this handler Python's
# last-resort handler would print codemode's warnings and tracebacks to stderr.
logging.getLogger("codemode").addHandler(logging.NullHandler())

__all__ = [
    "CancellationToken",
    "CellId",
    "CodeMode",
    "CodeModeError",
    "CodeModeNestedToolCall",
    "CodeModeSession",
    "CodeModeSessionCellExecutionLimits",
    "CodeModeSessionDelegate",
    "CodeModeSessionProvider",
    "CodeModeToolKind",
    "ConnectionClosed",
    "ContentItem",
    "ExecuteRequest",
    "FrameError",
    "ImageDetail",
    "InputAudio",
    "InputImage",
    "InputText",
    "LiveCell",
    "LocalProtocolError",
    "MissingCell",
    "NoopCodeModeSessionDelegate",
    "ParsedExecSource",
    "ProtocolError",
    "RemoteProtocolError",
    "Result",
    "RuntimeResponse",
    "StartedCell",
    "Terminated",
    "Tool",
    "ToolDefinition",
    "ToolName",
    "ToolRegistry",
    "WaitOutcome",
    "WaitRequest",
    "WireConversionError",
    "Yielded",
    "parse_exec_source",
    "tool",
]
