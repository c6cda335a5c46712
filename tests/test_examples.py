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


@pytest.mark.parametrize("name, figure, needs", [
    ("soft_ecc_match", "soft_ecc_match.png", None),
    ("periodic_grf", "periodic_grf.png", None),
    ("torch_topology_loss", "torch_topology_loss.png", "torch"),
    ("jax_topology_loss", "jax_topology_loss.png", "jax"),
    ("cpab_align_torch", "cpab_align_torch.png", "torch"),
    ("deformable_keypoints_torch", "deformable_keypoints_torch.png", "torch"),
])
def test_example_writes_its_figure(tmp_path, name, figure, needs, capsys):
    if needs:
        pytest.importorskip(needs, reason=f"{name} needs {needs} (pip install 'cutopo[{needs}]')")
    assert _load(name).main(str(tmp_path)) == 0
    assert (tmp_path / figure).stat().st_size > 10_000
    assert "wrote" in capsys.readouterr().out
