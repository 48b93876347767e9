"""Typed errors at the engine's edges.

The engine raises these; the CLI prints them as one line and the server maps
them to each API's status code and error shape. Nothing here knows HTTP.
"""

from __future__ import annotations


class StrataError(Exception):
    """Base class of every error Strata reports to a user."""


class ModelLoadError(StrataError):
    """A model file or folder cannot be used: names the path and the problem."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class BadRequest(StrataError):
    """A request is malformed; `param` names the offending field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class LaneBusy(BadRequest):
    """A lane action (erase) needs an idle lane and a request is using this one."""


class ContextTooLong(BadRequest):
    """A prompt (plus the tokens asked for) does not fit in --max-context."""

    def __init__(self, needed: int, max_context: int, what: str = "prompt") -> None:
        super().__init__(
            f"{what} needs {needed} tokens but --max-context is {max_context}",
            param="messages" if what == "prompt" else "max_tokens",
        )
        self.needed = needed
        self.max_context = max_context


class Overloaded(StrataError):
    """The engine cannot take the request now; try again after `retry_after` seconds."""

    code = "overloaded"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class KvPoolFull(Overloaded):
    """The shared KV pool has no free chunks for this request, even after evicting caches."""

    code = "kv_pool_full"


class QueueFull(Overloaded):
    """More requests are waiting than --max-queued allows."""

    code = "queue_full"


class StageUnavailable(Overloaded):
    """A remote stage cannot run now (its link is down or its worker gone); retry later."""

    code = "stage_unavailable"


class PartMissing(StrataError):
    """A remote stage no longer holds its part of a parked conversation (it restarted): the
    request reads its prompt from token 0 instead."""


class SessionFileError(StrataError):
    """A session file cannot be saved or restored: names the file and the problem."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem
