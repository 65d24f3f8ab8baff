"""A real third-party package declaring the ``loom`` entry point: listed, selectable, used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "loom-example-plugin"


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install`` the fixture package (no network: no deps, no build isolation) into a folder."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(FIXTURE)],
        check=True,
    )
    return target


def run_with(site: Path, code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *sys.path]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_listed_by_loom_plugins(plugin_site: Path) -> None:
    out = run_with(plugin_site, """
        import sys
        from loom.cli import main
        sys.exit(main(["plugins", "--json"]))
    """)
    rows = {(r["kind"], r["name"]): r for r in json.loads(out)}
    row = rows[("attention", "counting")]
    assert row["distribution"] == "loom-example-plugin"
    assert row["version"] == "0.3.1"
    assert row["status"] == "available"
    assert rows[("attention", "torch")]["distribution"] == "loom-server"


def test_selectable_and_used_by_the_engine(plugin_site: Path, tiny_model_dir: Callable[[str], Path]) -> None:
    model = tiny_model_dir("llama")
    out = run_with(plugin_site, f"""
        from loom.config import EngineConfig
        from loom.engine.llm_engine import LLMEngine
        from loom.engine.types import EngineRequest, StoppingParams
        import loom_example_plugin
        engine = LLMEngine(EngineConfig(model_id={str(model)!r}, attention_backend="counting",
                                        max_batch_total_tokens=256))
        before = loom_example_plugin.CALLS["forward"]  # the engine's warm-up ran through it too
        engine.add_request(EngineRequest("a", (5, 6, 7), stopping=StoppingParams(max_new_tokens=3, ignore_eos=True)))
        n = 0
        while engine.has_unfinished():
            n += sum(len(o.token_ids) for o in engine.step())
        print(engine.info.attention_backend, n, loom_example_plugin.CALLS["forward"] - before)
    """)
    backend, tokens, calls = out.strip().splitlines()[-1].split()
    assert backend == "counting"
    assert int(tokens) == 3
    assert int(calls) == 3 * 2  # 3 forwards x 2 layers


def test_duplicate_across_distributions_is_an_error(plugin_site: Path, tmp_path: Path) -> None:
    # A second distribution that also claims the attention backend name "counting".
    dup = tmp_path / "dup"
    (dup / "src" / "dup_plugin").mkdir(parents=True)
    (dup / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "dup-plugin"
        version = "1.0"
        [project.entry-points.loom]
        dup-plugin = "dup_plugin"
        [tool.setuptools.packages.find]
        where = ["src"]
    """))
    (dup / "src" / "dup_plugin" / "__init__.py").write_text(textwrap.dedent("""
        from loom.plugin_api import AttentionBackendSpec, hookimpl
        @hookimpl
        def loom_attention_backends():
            return [AttentionBackendSpec(name="Counting", summary="dup", load=lambda: None)]
    """))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(plugin_site), str(dup)], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(plugin_site), *sys.path]))
    proc = subprocess.run([sys.executable, "-c", "from loom.cli import main; raise SystemExit(main(['plugins']))"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "'counting' is claimed twice" in proc.stderr
    assert "loom-example-plugin" in proc.stderr and "dup-plugin" in proc.stderr
