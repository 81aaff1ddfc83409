"""Error codes, close codes and the exception tree.

Error tree::

    RttsError               base; has .code (wire string)
    +-- ProtocolError       the client sent something we cannot act on (error event)
    +-- Overloaded          no capacity now; retry later (error event, or 1013/503)
    +-- EngineError         one synthesis request failed (error event for that context)
    |   +-- EngineTimeout   one request exceeded its deadline
    +-- InternalError       a server bug ended one context (error event, incident id logged)
    +-- AuthError           key, token, origin or quota refused (rtts.api.auth)
    +-- ApiError            an HTTP answer: status + OpenAI-shaped body (rtts.api.http.common)
    +-- ElevenError         an ElevenLabs-shaped socket or HTTP error (rtts.api.elevenlabs)
    +-- WyomingError        a Wyoming ``error`` event (rtts.api.wyoming)
    +-- VoiceError          a refused voice operation, with its HTTP status (rtts.core.voices)
    +-- ConfigError         a setting that cannot work: one line, exit 2 (rtts.cli.main)
    +-- HubUnavailable      the model hub cannot be reached (rtts.engines.weights)

Each has ``message``; the ones with a status or close code carry it too.

Close codes used by the server (all documented in the README):

==== ======================================================================
1000 normal closure (the client asked)
1001 server going away (graceful shutdown)
1007 invalid UTF-8 in a text frame (raised by the websockets library)
1008 policy violation: too many protocol errors on one connection
1009 message too big (over ``max_message_bytes``; raised by websockets)
1011 internal server error
1013 try again later: server overloaded or not ready
4000 idle: no open context and no message for ``idle_timeout`` (reconnect when needed)
4008 client too slow: audio could not be delivered within ``slow_client_timeout``
==== ======================================================================
"""

from __future__ import annotations

__all__ = [
    "CLOSE_GOING_AWAY",
    "CLOSE_IDLE",
    "CLOSE_INTERNAL_ERROR",
    "CLOSE_INVALID_DATA",
    "CLOSE_MESSAGE_TOO_BIG",
    "CLOSE_NORMAL",
    "CLOSE_POLICY_VIOLATION",
    "CLOSE_SLOW_CLIENT",
    "CLOSE_TRY_AGAIN_LATER",
    "EngineError",
    "EngineTimeout",
    "ErrorCode",
    "InternalError",
    "Overloaded",
    "ProtocolError",
    "RttsError",
]

import logging
import secrets
from enum import StrEnum

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_INVALID_DATA = 1007
CLOSE_POLICY_VIOLATION = 1008
CLOSE_MESSAGE_TOO_BIG = 1009
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_IDLE = 4000
CLOSE_SLOW_CLIENT = 4008


class ErrorCode(StrEnum):
    """Machine-readable ``code`` field of an ``error`` event."""

    INVALID_JSON = "invalid_json"
    INVALID_MESSAGE = "invalid_message"
    UNKNOWN_TYPE = "unknown_type"
    INVALID_PARAMS = "invalid_params"
    UNKNOWN_CONTEXT = "unknown_context"
    CONTEXT_EXISTS = "context_exists"
    TOO_MANY_CONTEXTS = "too_many_contexts"
    TEXT_TOO_LONG = "text_too_long"
    INVALID_SSML = "invalid_ssml"  # a context started with ssml: true got bad SSML
    BINARY_NOT_ACCEPTED = "binary_not_accepted"
    OVERLOADED = "overloaded"
    ENGINE_ERROR = "engine_error"
    TIMEOUT = "timeout"
    SHUTTING_DOWN = "shutting_down"
    RATE_LIMITED = "rate_limited"  # a message kind sent faster than its documented rate
    INTERNAL_ERROR = "internal_error"  # a server bug ended one context; the log has the id


class RttsError(Exception):
    """Base class of every error rtts raises on purpose: ``message`` is what the client (or
    the operator) is told, ``code`` a machine-readable string (an :class:`ErrorCode` for
    the core's errors; a protocol's own code for a front-end's, None where it has none)."""

    code: str | None = ErrorCode.INVALID_MESSAGE

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class ProtocolError(RttsError):
    """The client sent a message that cannot be acted on; reported, connection stays open."""


class Overloaded(RttsError):
    """No capacity right now (queue full, governor rejecting); the client may retry."""

    code = ErrorCode.OVERLOADED


class EngineError(RttsError):
    """A synthesis request failed inside the engine; only that request is affected."""

    code = ErrorCode.ENGINE_ERROR


class EngineTimeout(EngineError):
    """A synthesis request ran past its deadline and was cancelled."""

    code = ErrorCode.TIMEOUT


class InternalError(RttsError):
    """A bug in rtts (an encoder, a pacer, a front-end) ended one context. The client gets
    this protocol's error with an incident id; the traceback is logged under that id."""

    code = ErrorCode.INTERNAL_ERROR

    @classmethod
    def incident(cls, logger: logging.Logger, what: str, exc: BaseException) -> InternalError:
        """Log ``exc`` with a fresh incident id and return the error clients are told."""
        incident = secrets.token_hex(4)
        logger.error("%s failed (incident %s)", what, incident, exc_info=exc)
        return cls(f"{what} failed (incident {incident})")
