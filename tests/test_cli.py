"""The ``cutopo ecc`` command-line program (CPU only)."""
from __future__ import annotations

import csv
import os
import subprocess
import sys

import numpy as np
import pytest

import cutopo
from cutopo import cli
from cutopo._io import read_image

skio = pytest.importorskip("skimage.io")


def _rng():
    return np.random.default_rng()


def _random_images(tmp_path):
    """Two small .npy images (2-D uint8, 3-D float32) and one 2-D grey .png, none all-zero."""
    rng = _rng()
    a = rng.integers(0, 256, size=(17, 23), dtype=np.uint8)
    a[0, 0] = 7  # never all-zero
    b = rng.normal(size=(6, 9, 11)).astype(np.float32)
    c = rng.integers(1, 256, size=(21, 16), dtype=np.uint8)
    paths = [tmp_path / "a.npy", tmp_path / "b.npy", tmp_path / "c.png"]
    np.save(paths[0], a)
    np.save(paths[1], b)
    skio.imsave(paths[2], c, check_contrast=False)
    return [str(p) for p in paths], [a, b, c]


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_default_samples_write_the_plot(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["ecc", "--device", "cpu", "--out", str(out)]) == 0
    png = out / "ecc_curves.png"
    assert png.is_file() and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "coins" in printed and "blobs3d" in printed and "303x384" in printed
    assert str(png) in printed


def test_paths_per_image_thresholds_match_ecc(tmp_path):
    paths, images = _random_images(tmp_path)
    csv_path = tmp_path / "res" / "curves.csv"
    assert cli.main(["ecc", *paths, "--device", "cpu", "--thresholds", "40",
                     "--csv", str(csv_path), "--out", str(tmp_path / "o"), "--quiet"]) == 0
    rows = _read_csv(csv_path)
    assert rows[0] == ["path", "shape", "dtype", "quantity"] + [str(k) for k in range(40)]
    body = rows[1:]
    assert len(body) == 2 * len(paths)
    assert (tmp_path / "o" / "ecc_curves.png").is_file()
    for i, (path, image) in enumerate(zip(paths, images)):
        t_row, chi_row = body[2 * i], body[2 * i + 1]
        assert t_row[:4] == [path, "x".join(map(str, image.shape)), image.dtype.name, "threshold"]
        assert chi_row[:4] == [path, "x".join(map(str, image.shape)), image.dtype.name, "chi"]
        expected_t = cutopo.linear_thresholds(image, 40)
        np.testing.assert_array_equal(np.array(t_row[4:], dtype=np.float64), expected_t)
        np.testing.assert_array_equal(np.array(chi_row[4:], dtype=np.int64), cutopo.ecc(image, 40))


@pytest.mark.parametrize("connectivity", ["1", "full"])
def test_paths_shared_range_csv_and_npy(tmp_path, connectivity):
    paths, images = _random_images(tmp_path)
    csv_path, npy_path = tmp_path / "r.csv", tmp_path / "r.npy"
    assert cli.main(["ecc", *paths, "--device", "cpu", "--thresholds", "33", "--range", "-1.5", "255",
                     "--connectivity", connectivity, "--csv", str(csv_path), "--npy", str(npy_path),
                     "--no-plot", "--quiet", "--out", str(tmp_path / "o")]) == 0
    assert not (tmp_path / "o").exists()  # nothing else written with --csv and --no-plot
    t = np.linspace(-1.5, 255, 33)
    rows = _read_csv(csv_path)
    assert rows[0][:3] == ["path", "shape", "dtype"]
    np.testing.assert_array_equal(np.array(rows[0][3:], dtype=np.float64), t)
    expected = np.stack([cutopo.ecc(im, t, connectivity=1 if connectivity == "1" else im.ndim)
                         for im in images])
    got = np.array([row[3:] for row in rows[1:]], dtype=np.int64)
    assert [row[0] for row in rows[1:]] == paths
    np.testing.assert_array_equal(got, expected)
    npy = np.load(npy_path)
    assert npy.dtype == np.int64 and npy.shape == (3, 33)
    np.testing.assert_array_equal(npy, expected)


def test_range_wider_than_float64(tmp_path):
    """--range -1e308 1e308: HI - LO overflows float64, the thresholds stay finite (numpy's
    linspace would give NaN there) and end at LO and HI."""
    paths, images = _random_images(tmp_path)
    csv_path = tmp_path / "r.csv"
    lo = "-1" + "0" * 308  # -1e308 written as digits: argparse takes "-1e308" for an option
    assert cli.main(["ecc", *paths, "--device", "cpu", "--thresholds", "5", "--range", lo,
                     "1e308", "--csv", str(csv_path), "--no-plot", "--quiet",
                     "--out", str(tmp_path / "o")]) == 0
    t = np.array(_read_csv(csv_path)[0][3:], dtype=np.float64)
    assert np.all(np.isfinite(t)) and t[0] == -1e308 and t[-1] == 1e308 and np.all(np.diff(t) > 0)


def test_thresholds_file_text_and_npy(tmp_path):
    paths, images = _random_images(tmp_path)
    t = np.sort(_rng().uniform(-2, 260, size=25))
    text = tmp_path / "t.txt"
    text.write_text("# thresholds\n" + "\n".join(repr(float(v)) for v in t) + "\n")
    tnpy = tmp_path / "t.npy"
    np.save(tnpy, t)
    expected = np.stack([cutopo.ecc(im, t) for im in images])
    for source in (text, tnpy):
        npy = tmp_path / f"{source.stem}_{source.suffix[1:]}_out.npy"
        assert cli.main(["ecc", *paths, "--device", "cpu", "--thresholds-file", str(source),
                         "--csv", str(tmp_path / "x.csv"), "--npy", str(npy), "--no-plot", "--quiet"]) == 0
        np.testing.assert_array_equal(np.load(npy), expected)
        rows = _read_csv(tmp_path / "x.csv")
        np.testing.assert_array_equal(np.array(rows[0][3:], dtype=np.float64), t)
        np.testing.assert_array_equal(np.array([r[3:] for r in rows[1:]], dtype=np.int64), expected)


def test_default_csv_location_and_rgb_note(tmp_path, capsys):
    rng = _rng()
    rgb = rng.integers(0, 256, size=(12, 14, 3), dtype=np.uint8)
    rgb[0, 0] = (10, 200, 30)
    rgba = np.concatenate([rgb, np.full((12, 14, 1), 255, np.uint8)], axis=-1)
    skio.imsave(tmp_path / "rgb.png", rgb, check_contrast=False)
    skio.imsave(tmp_path / "rgba.png", rgba, check_contrast=False)
    out = tmp_path / "out"
    assert cli.main(["ecc", str(tmp_path / "rgb.png"), str(tmp_path / "rgba.png"), "--device", "cpu",
                     "--range", "0", "1", "--thresholds", "16", "--out", str(out), "--npy",
                     str(out / "c.npy")]) == 0
    captured = capsys.readouterr()
    assert "RGB image converted to grey" in captured.err and "RGBA" in captured.err
    assert str(out / "ecc.csv") in captured.out
    from skimage.color import rgb2gray

    grey = rgb2gray(rgb)
    expected = cutopo.ecc(grey, np.linspace(0, 1, 16))
    np.testing.assert_array_equal(np.load(out / "c.npy"), np.stack([expected, expected]))
    rows = _read_csv(out / "ecc.csv")
    assert rows[1][1:3] == ["12x14", "float64"]


def test_read_image_tiff_stack_and_int64(tmp_path):
    tifffile = pytest.importorskip("tifffile")
    stack = _rng().integers(0, 4000, size=(4, 9, 10), dtype=np.uint16)
    tifffile.imwrite(tmp_path / "s.tif", stack, photometric="minisblack")
    np.testing.assert_array_equal(read_image(tmp_path / "s.tif"), stack)
    from skimage.color import rgb2gray

    rgb = _rng().integers(0, 256, size=(9, 10, 3), dtype=np.uint8)
    tifffile.imwrite(tmp_path / "c.tif", rgb, photometric="rgb")
    tifffile.imwrite(tmp_path / "p.tif", np.moveaxis(rgb, -1, 0), photometric="rgb", planarconfig="separate")
    for name in ("c.tif", "p.tif"):
        notes = []
        np.testing.assert_array_equal(read_image(tmp_path / name, note=notes.append), rgb2gray(rgb))
        assert "RGB" in notes[0]
    wide = _rng().integers(-5, 5, size=(8, 8))  # int64: converted to int32, same values
    np.save(tmp_path / "w.npy", wide)
    notes = []
    got = read_image(tmp_path / "w.npy", note=notes.append)
    assert got.dtype == np.int32 and notes
    np.testing.assert_array_equal(got, wide)
    # big-endian files (a Motorola-order TIFF, a .npy from such a machine): the same dtype in
    # native order, values above 32767 intact (uint16 was widened to int16 and wrapped)
    bright = _rng().integers(30000, 65536, size=(9, 11)).astype(">u2")
    tifffile.imwrite(tmp_path / "be.tif", bright, byteorder=">", photometric="minisblack")
    np.save(tmp_path / "be.npy", bright)
    np.save(tmp_path / "bef.npy", bright.astype(">f4") / 7)
    for name, want in (("be.tif", bright), ("be.npy", bright), ("bef.npy", bright.astype(np.float32) / 7)):
        notes = []
        got = read_image(tmp_path / name, note=notes.append)
        assert got.dtype == want.dtype.newbyteorder("=") and got.dtype.isnative and not notes, name
        np.testing.assert_array_equal(got, want)
    assert (cutopo.ecc(read_image(tmp_path / "be.tif"), [40000, 60000])
            == cutopo.ecc(bright.astype(np.uint16), [40000, 60000])).all()
    np.save(tmp_path / "v.npy", np.ones((2, 3, 4, 5), np.float32))
    with pytest.raises(ValueError, match="v.npy"):
        read_image(tmp_path / "v.npy")
    (tmp_path / "x.gif").write_bytes(b"GIF89a")
    with pytest.raises(ValueError, match="x.gif"):
        read_image(tmp_path / "x.gif")


def test_missing_file_exits_2(tmp_path, capsys):
    paths, _ = _random_images(tmp_path)
    missing = str(tmp_path / "nope.png")
    assert cli.main(["ecc", paths[0], missing, "--device", "cpu", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert missing in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_unsorted_thresholds_file_exits_2(tmp_path, capsys):
    paths, _ = _random_images(tmp_path)
    bad = tmp_path / "bad.txt"
    bad.write_text("0 1 3 2\n")
    assert cli.main(["ecc", *paths, "--device", "cpu", "--thresholds-file", str(bad),
                     "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "bad.txt" in err and "sorted" in err and "Traceback" not in err


@pytest.mark.parametrize("extra, message", [
    (["--thresholds-file", "MISSING"], "no such thresholds file"),
    (["--npy", "x.npy"], "--npy needs"),
    (["--range", "3", "1"], "LO <= HI"),
    (["--range", "0", "1", "--thresholds-file", "t.txt"], "cannot be combined"),
    (["--thresholds", "0"], "positive integer"),
    (["--connectivity", "2"], "invalid choice"),
    (["--thresholds-file", "text.txt"], "not a number"),
])
def test_bad_options_exit_2(tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text("0 1 two\n")
    (tmp_path / "t.txt").write_text("0 1\n")
    paths, _ = _random_images(tmp_path)
    assert cli.main(["ecc", *paths, "--device", "cpu", "--quiet", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_help_and_python_m(tmp_path):
    assert cli.main(["--version"]) == 0
    assert cli.main([]) == 2
    run = subprocess.run([sys.executable, "-m", "cutopo", "ecc", "--help"], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0 and "--thresholds-file" in run.stdout


@pytest.mark.parametrize("stream", [False, True])
def test_periodic_boundary(tmp_path, stream):
    """--boundary periodic: the torus's curves, in memory and read in slabs (on the CPU);
    an axis shorter than 3 exits 2 with the library's message."""
    rng = _rng()
    a = rng.integers(0, 6, size=(9, 12), dtype=np.uint8)
    a[0] = a[-1]                                      # ties across the wrap
    b = rng.normal(size=(5, 4, 7)).astype(np.float32)
    paths = [tmp_path / "a.npy", tmp_path / "b.npy"]
    np.save(paths[0], a)
    np.save(paths[1], b)
    out = tmp_path / "c.npy"
    extra = ["--stream"] if stream else []
    assert cli.main(["ecc", *map(str, paths), "--device", "cpu", "--boundary", "periodic",
                     "--range", "-2", "5", "--thresholds", "15", "--connectivity", "full",
                     "--npy", str(out), "--no-plot", "--quiet", *extra]) == 0
    t = np.linspace(-2, 5, 15)
    want = [cutopo.ecc(im, t, connectivity=im.ndim, boundary="periodic") for im in (a, b)]
    np.testing.assert_array_equal(np.load(out), np.stack(want))
    assert not np.array_equal(want[0], cutopo.ecc(a, t, connectivity=2))  # not the box's
    np.save(tmp_path / "thin.npy", a[:2])
    assert cli.main(["ecc", str(tmp_path / "thin.npy"), "--boundary", "periodic", "--device",
                     "cpu", "--no-plot", "--quiet", *extra]) == 2


def test_periodic_help_names_every_path(capsys):
    """--boundary periodic streams through the GPU too: the help no longer says the CPU."""
    assert cli.main(["ecc", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "counted on the CPU unless" not in text
    assert "on every --device, in memory, in slabs (--stream) and with --scheduler" in text


def test_lazy_file_closes_what_it_opens(tmp_path):
    """A compressed TIFF read slab by slab through LazyFile leaves no file descriptor open (each
    read used to leave one until the garbage collector ran); LazyFile still pickles small."""
    import gc
    import pickle

    from cutopo._io import LazyFile

    tifffile = pytest.importorskip("tifffile")
    pytest.importorskip("zarr")
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    img = _rng().integers(0, 9, size=(20, 30, 40)).astype(np.uint8)
    tifffile.imwrite(tmp_path / "b.tif", img, compression="zlib")
    np.save(tmp_path / "a.npy", img)
    t = [0, 3, 8]
    want = cutopo.ecc(img, t)
    LazyFile(tmp_path / "b.tif")[:1]  # first use: Zarr's event loop (its descriptors stay)
    for name in ("b.tif", "a.npy"):
        gc.collect()
        gc.disable()
        try:
            before = len(os.listdir("/proc/self/fd"))
            f = LazyFile(tmp_path / name)
            got = cutopo.ecc(f, t, max_slab_bytes=30 * 40 * 3 * 4)  # slabs of 2 planes
            block = f[3:5]  # a .npy read is a view of the memory map: released with it
            np.testing.assert_array_equal(block, img[3:5])
            del block
            after = len(os.listdir("/proc/self/fd"))
        finally:
            gc.enable()
        np.testing.assert_array_equal(got, want)
        assert after == before, name
        g = pickle.loads(pickle.dumps(f))
        assert len(pickle.dumps(f)) < 500 and g.shape == img.shape
        np.testing.assert_array_equal(g[7, 2:5], img[7, 2:5])
