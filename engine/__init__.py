"""Phasewise engine: Qt-free inference. This front module holds what the window and the
commands import (errors, events, params, metrics, the request handle) and loads neither torch
nor a runtime; the local engine itself is engine.worker.Engine (docs/architecture.md)."""

from engine.errors import (
    ContextOverflowError,
    DownloadNotAllowedError,
    InvalidRequestError,
    ModelLoadError,
    PhasewiseError,
    SamplingError,
)
from engine.events import (
    DraftModelChanged,
    EngineEvent,
    GenerationResult,
    ModelInfo,
    ModelLoaded,
    ModelLoadFailed,
    ModelLoading,
    ModelLoadProgress,
    PrefillProgress,
    PrefillStarted,
    RequestFailed,
    RequestFinished,
    RequestQueued,
    SamplerSnapshot,
    TextFlushed,
    TokenEmitted,
)
from engine.metrics import RequestMetrics, percentile
from engine.params import ChatMessage, GenerationRequest, SamplingParams
from engine.protocol import RequestHandle

__all__ = [
    "ChatMessage",
    "ContextOverflowError",
    "DownloadNotAllowedError",
    "DraftModelChanged",
    "EngineEvent",
    "GenerationRequest",
    "GenerationResult",
    "InvalidRequestError",
    "ModelInfo",
    "ModelLoadError",
    "ModelLoadFailed",
    "ModelLoadProgress",
    "ModelLoaded",
    "ModelLoading",
    "PhasewiseError",
    "PrefillProgress",
    "PrefillStarted",
    "RequestFailed",
    "RequestFinished",
    "RequestHandle",
    "RequestMetrics",
    "RequestQueued",
    "SamplerSnapshot",
    "SamplingError",
    "SamplingParams",
    "TextFlushed",
    "TokenEmitted",
    "percentile",
]
