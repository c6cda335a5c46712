"""The examples keep running and writing their figures (CPU)."""
import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, figure", [("soft_ecc_match", "soft_ecc_match.png")])
def test_example_writes_its_figure(tmp_path, name, figure, capsys):
    assert _load(name).main(str(tmp_path)) == 0
    assert (tmp_path / figure).stat().st_size > 10_000
    assert "wrote" in capsys.readouterr().out
