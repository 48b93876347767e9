"""What every handler of one app shares: the engine (once loaded), settings, metrics.

The engine may arrive after the app starts serving (it loads in the
background so /health can say "loading"), hence `engine` is optional and
handlers go through `ready_engine()`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from strata.engine.sampling_defaults import SamplingDefaults
from strata.serve.errors import ApiError
from strata.serve.metrics import ServeMetrics

ENGINE_STOPPED = "the engine loop has stopped and cannot serve requests; restart the server"


@dataclass
class ServeState:
    engine: Any | None
    model_name: str
    api_key: str | None = None
    session_dir: str | None = None  # the engine's --session-dir (the engine enforces it)
    load_error: str | None = None
    keepalive_s: float = 5.0  # a stream silent this long gets a keep-alive (a long prompt read)
    slots_listed: bool = True  # GET /slots answers (llama-server's --no-slots turns it off)
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)  # for unset sampling fields
    started: float = field(default_factory=time.time)
    metrics: ServeMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServeMetrics(self.engine_stats, lambda: self.model_name)

    def engine_stats(self) -> dict[str, Any] | None:
        return None if self.engine is None else self.engine.stats()

    def ready_engine(self) -> Any:
        """The loaded engine, or a 503 that tells the client to come back."""
        if self.engine is not None:
            if not self.engine.alive:  # a dead loop would never answer: say so instead of hanging
                raise ApiError(503, ENGINE_STOPPED, code="engine_stopped")
            return self.engine
        if self.load_error is not None:
            raise ApiError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")
        raise ApiError(503, "the model is still loading", code="loading", headers={"Retry-After": "1"})

    def max_context(self) -> int:
        return int(self.ready_engine().config.max_context)


def serve_state(request: Request) -> ServeState:
    return request.app.state.strata


def request_info(request: Request) -> dict[str, Any]:
    """The per-request record the access-log middleware prints when the answer ends."""
    info = request.scope.setdefault("strata.info", {})
    assert isinstance(info, dict)
    return info
