"""Phasewise engine: Qt-free inference core (loading, templates, sampling, decode loop,
prefix KV cache, metrics). Imports neither `ui` nor `app` nor Qt."""

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
from engine.worker import Engine

__all__ = [
    "ChatMessage",
    "ContextOverflowError",
    "DownloadNotAllowedError",
    "DraftModelChanged",
    "Engine",
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
