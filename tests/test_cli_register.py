"""The ``cutopo register`` command-line program (CPU only)."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.ndimage import gaussian_filter

from cutopo import cli
from cutopo.cpab import Tessellation

skio = pytest.importorskip("skimage.io")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _smooth(rng, shape, sigma=2.0):
    """A smooth random image in [0, 1], never constant."""
    x = gaussian_filter(rng.random(shape), sigma)
    return (x - x.min()) / (x.max() - x.min())


def test_bundled_pair_writes_figure_and_arrays(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["register", "--device", "cpu", "--out", str(out), "--tess", "4",
                     "--steps", "3", "--n-steps", "10"]) == 0
    png = out / "register.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 20_000
    theta = np.load(out / "theta.npy")
    assert theta.shape == (Tessellation((4, 4)).n_params,) and np.isfinite(theta).all()
    warped = np.load(out / "warped.npy")
    assert warped.shape == (128, 128) and np.isfinite(warped).all()
    captured = capsys.readouterr()
    assert "camera 128x128" in captured.out and "recovery:" in captured.out
    assert "folding fraction" in captured.out and str(png) in captured.out
    assert "register |" in captured.err                                     # the progress bar


def test_two_images_2d(tmp_path, capsys):
    rng = np.random.default_rng()
    fixed = _smooth(rng, (20, 24))
    moving = np.roll(fixed, 1, axis=1)
    np.save(tmp_path / "f.npy", 200 * fixed + 10)
    skio.imsave(tmp_path / "m.png", (200 * moving + 10).astype(np.uint8), check_contrast=False)
    out = tmp_path / "o"
    assert cli.main(["register", str(tmp_path / "f.npy"), str(tmp_path / "m.png"),
                     "--device", "cpu", "--tess", "2x3", "--steps", "4", "--n-steps", "10",
                     "--loss", "ncc", "--out", str(out), "--no-plot", "--quiet"]) == 0
    assert capsys.readouterr().out == ""
    assert not (out / "register.png").exists()
    warped = np.load(out / "warped.npy")
    assert warped.shape == (20, 24)
    assert 5 < warped.min() and warped.max() < 215                        # input intensities
    assert np.load(out / "theta.npy").shape == (Tessellation((2, 3)).n_params,)


def test_two_stacks_3d(tmp_path):
    rng = np.random.default_rng()
    fixed = _smooth(rng, (8, 10, 9), 1.5).astype(np.float32)
    np.save(tmp_path / "f.npy", fixed)
    np.save(tmp_path / "m.npy", np.roll(fixed, 1, axis=0))
    out = tmp_path / "o3"
    assert cli.main(["register", str(tmp_path / "f.npy"), str(tmp_path / "m.npy"), "--device",
                     "cpu", "--tess", "2", "--steps", "2", "--n-steps", "10", "--levels", "2",
                     "--out", str(out), "--quiet"]) == 0
    assert np.load(out / "warped.npy").shape == (8, 10, 9)
    assert np.load(out / "theta.npy").shape == (Tessellation((2, 2, 2)).n_params,)
    assert (out / "register.png").read_bytes()[:8] == PNG_MAGIC


def test_errors(tmp_path, capsys):
    rng = np.random.default_rng()
    a = _smooth(rng, (12, 14))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", _smooth(rng, (12, 15)))
    np.save(tmp_path / "c.npy", _smooth(rng, (6, 7, 8)))
    np.save(tmp_path / "nan.npy", np.where(a > 0.5, np.nan, a))
    np.save(tmp_path / "flat.npy", np.full((12, 14), 3.0))
    base = ["register", "--device", "cpu", "--quiet", "--no-plot", "--out", str(tmp_path / "o")]
    cases = [
        ([str(tmp_path / "a.npy")], "expected two paths, FIXED and MOVING, got 1"),
        ([str(tmp_path / "a.npy"), str(tmp_path / "missing.npy")], "no such file"),
        ([str(tmp_path / "a.npy"), str(tmp_path / "b.npy")], "they must agree"),
        ([str(tmp_path / "a.npy"), str(tmp_path / "nan.npy")], "NaN or inf"),
        ([str(tmp_path / "flat.npy"), str(tmp_path / "flat.npy")], "both images are constant"),
        ([str(tmp_path / "c.npy"), str(tmp_path / "c.npy"), "--tess", "2x2"],
         "--tess 2x2 has 2 axes, the images 3"),
        ([str(tmp_path / "a.npy"), str(tmp_path / "a.npy"), "--tess", "3", "--levels", "2"],
         "levels=2: every entry of tess.shape"),
    ]
    for extra, message in cases:
        assert cli.main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert "cutopo register: error:" in err and message in err, (extra, err)
    assert cli.main(base + ["--tess", "2x"]) == 2                           # argparse's error
    assert "expected N or NxM[xL]" in capsys.readouterr().err


def test_help_lists_the_options(capsys):
    assert cli.main(["register", "--help"]) == 0
    text = capsys.readouterr().out
    for option in ("FIXED MOVING", "--tess", "--levels", "--loss", "--steps", "--lr",
                   "--smoothness", "--n-steps", "--out", "--device"):
        assert option in text
    assert cli.main(["--help"]) == 0
    assert "register" in capsys.readouterr().out
