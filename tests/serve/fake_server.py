"""`python tests/serve/fake_server.py FLAGS`: the real `strata serve` entry point over the fake engine.

Lets a test run the whole process (flags, background load, signals, shutdown)
without a model. FAKE_LOAD_S delays the load; FAKE_LOAD_FAIL makes it fail.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import strata.engine  # noqa: E402
from fake_engine import FakeEngine  # noqa: E402
from strata.engine.config import EngineConfig  # noqa: E402
from strata.errors import ModelLoadError  # noqa: E402
from strata.serve.main import main  # noqa: E402


class LoadingFakeEngine(FakeEngine):
    def __init__(self, config: EngineConfig) -> None:
        time.sleep(float(os.environ.get("FAKE_LOAD_S", "0")))
        if os.environ.get("FAKE_LOAD_FAIL"):
            raise ModelLoadError(str(config.model), "not a GGUF file")
        super().__init__(max_context=config.max_context, lanes=config.parallel)

    def close(self) -> None:
        super().close()
        print("fake engine closed", flush=True)


strata.engine.Engine = LoadingFakeEngine  # type: ignore[attr-defined]
sys.exit(main())
