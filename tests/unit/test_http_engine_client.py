"""The HTTP layer's boundary with the engine: AsyncEngine meets EngineClient, and vt.http loads
without the engine's step machinery."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_openai_api import FakeEngine
from vt.config import EngineConfig
from vt.engine.engine import AsyncEngine
from vt.http.engine_client import EngineClient, PromptTokenizer
from vt.model.make_model import make_model

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("compile_grammar", "add_request", "abort", "set_paused", "stats")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncEngine:
    model = make_model(tmp_path_factory.mktemp("client-model") / "tiny", preset="tiny")
    return AsyncEngine(EngineConfig(model=str(model), device="cpu", max_num_seqs=4))


def test_async_engine_meets_the_client_protocol(engine: AsyncEngine) -> None:
    assert isinstance(engine, EngineClient)
    assert isinstance(engine.tokenizer, PromptTokenizer)
    for name in METHODS:  # same parameters, so a call written against the protocol fits
        wanted = list(inspect.signature(getattr(EngineClient, name)).parameters)
        assert list(inspect.signature(getattr(AsyncEngine, name)).parameters) == wanted, name
    assert inspect.iscoroutinefunction(AsyncEngine.compile_grammar)


def test_the_route_tests_fake_engine_meets_it_too() -> None:
    assert isinstance(FakeEngine(), EngineClient)


def test_vt_http_loads_without_the_engine_module() -> None:
    modules = [f"vt.http.{p.stem}" for p in sorted((ROOT / "vt/http").glob("*.py")) if p.stem != "__init__"]
    code = (f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('vt.engine', 'vt.runner', "
            "'vt.kernels')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout
    assert json.loads(out) == ["vt.engine", "vt.engine.admission", "vt.engine.outputs", "vt.engine.stats"]
