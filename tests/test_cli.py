"""The `specpilot` command line, on the CPU: info and demo print real numbers; bad args fail clearly."""

import os
import re
import subprocess
import sys

import pytest
import torch

from specpilot import cli

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path of the CLI")

NUM = r"[0-9]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?"


def _run(args, tmp_path, timeout=240):
    env = {**os.environ, "SPECPILOT_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)  # the commands that run kernels (bench, demo) set it by themselves on a CPU
    return subprocess.run([sys.executable, "-m", "specpilot", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=tmp_path)


@pytest.mark.slow
@cpu_only
def test_info(tmp_path):
    r = _run(["info"], tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert re.search(r"^device\s+: cpu", out, re.M)
    assert re.search(r"versions\s+: torch \S+, triton \S+, CUDA \S+, numba \S+, specpilot \S+", out)
    m = re.search(rf"ceilings\s+: copy ({NUM}) GB/s .* BF16 matmul ({NUM}) TFLOP/s", out)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, out
    assert "has_wgmma   : False" in out
    # info shows the caller's own set-up: the variable is unset, so CPU tensors run the torch paths
    assert "interpreter : TRITON_INTERPRET unset: CPU tensors run the torch paths only" in out
    assert re.search(r"^  w12\.matmul: torch$", out, re.M) and re.search(r"^  gdn\.tree_verify: reference$", out, re.M)
    assert re.search(r"^\s+linear: torch", out, re.M) and re.search(r"^\s+lm_head: torch", out, re.M)  # CPU matmul
    # Measured once, then cached on disk.
    assert (tmp_path / "cache" / "ceilings.json").exists()
    assert "[cached" in _run(["info"], tmp_path).stdout


@pytest.mark.slow
@cpu_only
def test_demo(tmp_path):
    r = _run(["demo", "--tokens", "24"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = r.stdout
    assert re.search(r"pack\s+: \d+ tensors to W12 at 12\.\d+ bits per weight, verified bit for bit", text), text
    rows = re.findall(rf"^\s*(autoregressive|n-gram drafter|trained heads|self-drafter) \|\s+\d+ \|\s+({NUM}) \|.*"
                      r"\| identical$", text, re.M)
    assert [name for name, _ in rows] == ["autoregressive", "n-gram drafter", "trained heads", "self-drafter"], text
    assert float(rows[0][1]) == 1.0 and all(float(tau) > 1.0 for _, tau in rows[1:]), text
    assert "lossless : every speculative output equals the autoregressive one" in text
    for row in re.findall(r"^\s*(?:autoregressive|n-gram drafter|trained heads|self-drafter) \|.*$", text, re.M):
        _, steps, tau, ms, tps, _ = (c.strip() for c in row.split("|"))  # one source: tokens/s = τ / mean step time
        assert float(tps) == pytest.approx(float(tau) * 1e3 / float(ms), rel=0.01, abs=0.06), row


def _main(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    ([], "required"),
    (["frobnicate"], "invalid choice"),
    (["bench", "--reps", "many"], "invalid int"),
    (["bench", "--shapes", "gpt-5"], "unknown shape set 'gpt-5'"),
    (["bench", "--shapes", "tiny", "--ops", "nonsense"], "unknown op(s) nonsense"),
    (["bench", "--shapes", "tiny", "--reps", "0"], "--reps must be >= 1"),
    pytest.param(["bench", "--device", "cuda:0"], "CUDA is not available", marks=cpu_only),
    (["pack", "missing.safetensors", "out.safetensors"], "does not exist"),
    (["pack"], "required"),
], ids=["none", "unknown-cmd", "reps-not-int", "bad-shapes", "bad-ops", "reps-zero", "no-cuda", "pack-missing",
        "pack-no-args"])
def test_bad_args(argv, message, capsys):
    code, err = _main(argv, capsys)
    assert code == 2
    assert message in err


def test_pack_validates_paths(tmp_path, capsys):
    src = tmp_path / "in.safetensors"
    src.write_bytes(b"")
    code, err = _main(["pack", str(src), str(src)], capsys)
    assert code == 2 and "must differ" in err
    code, err = _main(["pack", str(src), str(tmp_path / "out.bin")], capsys)
    assert code == 2 and ".safetensors" in err
    code, err = _main(["pack", str(src), str(tmp_path / "nope" / "out.safetensors")], capsys)
    assert code == 2 and "does not exist" in err


def test_pack_calls_packer_and_prints_report(tmp_path, capsys, monkeypatch):
    import types

    seen = {}

    def pack_checkpoint(in_path, out_path, *, device, include, progress):
        seen.update(in_path=in_path, out_path=out_path, device=device, include=include, progress=progress)
        return {"tensors_packed": 3, "ratio": 0.75}

    monkeypatch.setitem(sys.modules, "w12.checkpoint", types.SimpleNamespace(pack_checkpoint=pack_checkpoint))
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    src.write_bytes(b"")
    assert cli.main(["pack", str(src), str(dst), "--include", "*.mlp.*"]) == 0
    assert seen == {"in_path": str(src), "out_path": str(dst), "device": "cpu", "include": "*.mlp.*",
                    "progress": True}
    out = capsys.readouterr().out
    assert "tensors_packed: 3" in out and "ratio: 0.75" in out
    monkeypatch.setitem(sys.modules, "w12.checkpoint", None)  # the packer is missing
    assert cli.main(["pack", str(src), str(dst)]) == 1
    assert "w12 packer is not available" in capsys.readouterr().err


# --- pack: every bad input is one line on stderr and exit status 2 ---------------------------------


def _bad_inputs(tmp_path):
    """name -> (input path, output path) of inputs `specpilot pack` must refuse."""
    from safetensors.torch import save_file

    good = tmp_path / "good.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({"a.weight": (torch.randn(16, 128, generator=g) * 0.02).bfloat16(),
               "b.weight": torch.randn(4, 4, generator=g)}, str(good))
    raw = good.read_bytes()
    cases = {}

    def write(name, data):
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(data)
        cases[name] = (p, tmp_path / f"{name}-out.safetensors")

    write("empty", b"")
    write("truncated-header", raw[:20])
    write("truncated-data", raw[:-7])
    write("garbage", b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    n = int.from_bytes(raw[:8], "little")
    write("bad-dtype", raw[:8] + raw[8:8 + n].replace(b'"BF16"', b'"XX16"') + raw[8 + n:])
    fp32 = tmp_path / "fp32.safetensors"
    save_file({"w": torch.randn(4, 128, generator=g)}, str(fp32))
    cases["only-fp32"] = (fp32, tmp_path / "fp32-out.safetensors")
    cases["missing"] = (tmp_path / "missing.safetensors", tmp_path / "x.safetensors")
    cases["input-is-folder"] = (tmp_path, tmp_path / "y.safetensors")
    (tmp_path / "outdir.safetensors").mkdir()
    cases["output-is-folder"] = (good, tmp_path / "outdir.safetensors")
    cases["output-unwritable"] = (good, "/proc/specpilot-test-out.safetensors")
    return cases


BAD_PACK = ["empty", "truncated-header", "truncated-data", "garbage", "bad-dtype", "only-fp32", "missing",
            "input-is-folder", "output-is-folder", "output-unwritable"]


@pytest.mark.parametrize("case", BAD_PACK, ids=BAD_PACK)
def test_pack_bad_input_one_line_exit_2(tmp_path, capsys, case):
    src, dst = _bad_inputs(tmp_path)[case]
    code, err = _main(["pack", str(src), str(dst)], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specpilot: error: "), err
    assert "Traceback" not in err


def test_pack_bad_input_subprocess_no_traceback(tmp_path):
    src, dst = _bad_inputs(tmp_path)["truncated-data"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "SPECPILOT_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "specpilot", "pack", str(src), str(dst)], capture_output=True,
                       text=True, timeout=240, env=env, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("specpilot: error: ") and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_pack_real_run_lists_worst_and_warns(tmp_path, capsys):
    from safetensors.torch import save_file

    import w12

    g = torch.Generator().manual_seed(1)
    t = {"wide.weight": (torch.randn(1000, 130, generator=g) * 0.02).bfloat16(),
         "k64.weight": (torch.randn(30, 64, generator=g) * 0.02).bfloat16(),
         "tiny.weight": (torch.randn(4, 8, generator=g) * 0.02).bfloat16()}
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(t, str(src))
    assert cli.main(["pack", str(src), str(dst)]) == 0
    cap = capsys.readouterr()
    assert re.search(r"worst tensors \(bits per weight\):\n\s+12\.6\d+\s+k64\.weight \[30 x 64\]", cap.out), cap.out
    assert "tiny.weight: kept in BF16" in cap.out
    # 1000 x 130 takes 12.31 bits per weight in the runtime layout load_file builds, packed; its version-1 planes
    # would take 18.03 in memory (rows padded to 192 columns), which the warnings say
    assert "wide.weight: kept" not in cap.out
    assert "specpilot: warning: k64.weight [30 x 64]: 12.6" in cap.err
    assert re.search(r"specpilot: warning: wide\.weight \[1000 x 130\]: 18\.03 bits per weight in memory as "
                     r"version-1 planes .* the default runtime layout takes 12\.3\d", cap.err), cap.err
    out = w12.load_file(dst)
    assert isinstance(out["wide.weight"], w12.TiledW12) and out["wide.weight"].bits_per_weight < 12.5
    assert torch.equal(w12.unpack(out["wide.weight"]).view(torch.int16), t["wide.weight"].view(torch.int16))
