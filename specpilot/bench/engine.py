"""Engine steps on a synthetic full-size model: the autoregressive and the verify step against their byte
floors, and the `transformers` peer on the same weights.

    python -m specpilot.bench.engine [--shapes hybrid-27b] [--prefix 4096] [--nodes 32] [--out DIR]

One request, a `prefix`-token context, every step one CUDA graph (`specpilot.engine.GraphedStep`),
timed by replaying the graph under CUDA events (`specpilot.bench.timing`). The byte floor of a step
(`autotune.byte_floor`: at the measured copy and matmul rates, no fraction): every weight of the step's
format, the KV prefix of the attention layers, and the recurrent and conv states read and written once; its
FLOPs are 2 x weights x rows. The JSON carries the paper's floor beside it (`*_paper_floor_ms`, 90% / 60% of
the datasheet). Writes JSON and Markdown to `out`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import autotune

from .timing import Timing, time_cuda

__all__ = ["run", "run_processes"]


def _model_bytes(model) -> tuple[int, int]:
    """(bytes the step reads for the weights, weights as parameters) of a HybridModel."""
    total = params = 0
    from ..engine import Linear

    lins = [v for L in model.layers for v in L.values() if isinstance(v, Linear)] + [model.head_linear]
    for lin in lins:
        N, K = lin.shape
        params += N * K
        w = lin.packed if lin.packed is not None else lin.tiled
        total += w.nbytes if w is not None else 2 * N * K
    small = [v for L in model.layers for v in L.values() if isinstance(v, torch.Tensor)] + [model.final_norm]
    total += sum(t.numel() * t.element_size() for t in small)
    return total, params


def _state_bytes(model, prefix: int) -> tuple[int, int]:
    """(KV prefix bytes read, recurrent + conv state bytes read and written) by one request's step."""
    c = model.cfg
    kv = 2 * len(c.attn_layers) * prefix * c.kv_heads * c.head_dim * 2
    st = model.state[:, 0].numel() * 4 + model.conv_state[:, 0].numel() * 2
    return kv, 2 * st


def _random_tree(vocab: int, positions: int, topk: int, nodes: int, seed: int):
    from ..engine.spec.tree import build_tree

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (positions, topk), generator=g)
    scores = torch.log_softmax(torch.randn(positions, topk, generator=g) * 2, -1)
    return build_tree(tokens, scores, budget=nodes - 1)


def _peer(cfg, syn, prompt: list[int], new_tokens: int, device) -> dict:
    """transformers' own greedy generation on the same weights: ms per decoded token."""
    import transformers
    from transformers import Qwen3_5ForCausalLM

    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf = Qwen3_5ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(syn[n[len("model."):] if n.startswith("model.") else n].reshape(p.shape))
    ids = torch.tensor([prompt], device=device)
    out = {"transformers": transformers.__version__}
    try:
        import fla  # noqa: F401

        out["fla"] = getattr(fla, "__version__", "present")
    except ImportError:
        out["fla"] = None

    def gen(n, **kw):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    # eager with the model's own dynamic cache: a static cache makes transformers compile the step, which
    # took 6.9 s per token over 16 tokens on this model (the compile never amortises in a benchmark)
    gen(2)
    t1, tn = gen(1), gen(1 + new_tokens)
    out.update(mode="eager", ms_per_token=1e3 * (tn - t1) / new_tokens, tokens=new_tokens)
    del hf
    torch.cuda.empty_cache()
    return out


_COPIES = "memcpy / memset"  # copy and fill records (a CUDA graph's memcpy and memset nodes)
_CATEGORIES = (  # kernel name -> what the step spends it on (first match)
    (_COPIES, r"^(Memcpy|Memset)"),
    ("w12 GEMM", r"w12"),
    ("cuBLAS GEMM", r"gemm|gemv|cutlass|xmma|sm90_|splitK|cublas"),
    ("gdn verify", r"gdn_tree|gdn_.*wy|gdn_.*recurrent|tree_verify"),
    ("gdn conv", r"gdn.*conv"),
    ("gdn commit", r"gdn.*commit"),
    ("tree attention", r"tree_attn"),
    ("lm head", r"lmhead"),
    ("other (norms, gates, copies)", r"."),
)


def _category(name: str) -> str:
    return next(c for c, rx in _CATEGORIES if re.search(rx, name, re.I))


def idle_gaps(kernels, reps: int, max_gap_us: float = 100.0, top_pairs: int = 10) -> dict:
    """Device idle time per call before each kernel category: `kernels` are (name, start µs, end µs) records of
    `reps` calls; the gap from the previous kernel's end to a kernel's start is charged to that kernel's category
    (what the device waits for before it can run: its launch, a cluster or shared-memory reconfiguration, a
    dependency). Gaps over `max_gap_us` are the spaces between calls and are left out. Overlapping kernels (a
    programmatic dependent launch) give no gap. `top_pairs`: the pairs (previous kernel -> kernel, names without
    template arguments) with the most idle time per call, each with its gaps per call."""
    ks = sorted(kernels, key=lambda k: k[1])
    gaps: dict[str, float] = {}
    counts: dict[str, int] = {}
    pairs: dict[str, list] = {}  # "previous kernel -> kernel": [ms per call, gaps per call]
    end = prev = None
    for name, t0, t1 in ks:
        if end is not None and 0.0 < t0 - end <= max_gap_us:
            cat, ms = _category(name), (t0 - end) / 1e3 / reps
            gaps[cat] = gaps.get(cat, 0.0) + ms
            counts[cat] = counts.get(cat, 0) + 1
            pair = pairs.setdefault(f"{_short(prev)} -> {_short(name)}", [0.0, 0.0])
            pair[0] += ms
            pair[1] += 1 / reps
        end = t1 if end is None else max(end, t1)
        prev = name
    top = sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top_pairs]
    return {"ms": dict(sorted(gaps.items(), key=lambda kv: -kv[1])),
            "us_per_gap": {c: 1e3 * reps * gaps[c] / counts[c] for c in gaps},
            "top_pairs": {k: {"ms": v[0], "gaps": v[1], "us_per_gap": 1e3 * v[0] / v[1]} for k, v in top}}


def exclusive_time(kernels, reps: int) -> dict:
    """Device time per call by kernel category, each moment of the timeline charged once: a kernel counts from its
    start or from the end of every earlier kernel, whichever is later. Under programmatic dependent launch a kernel
    starts before the one ahead of it ends and waits; the profiler's own durations then count that wait twice, so
    their sum exceeds the step. These add up to the device's busy time. `kernels`: (name, start µs, end µs) records
    of `reps` calls."""
    out: dict[str, float] = {}
    end = None
    for name, t0, t1 in sorted(kernels, key=lambda k: k[1]):
        s = t0 if end is None else max(t0, end)
        if t1 > s:
            cat = _category(name)
            out[cat] = out.get(cat, 0.0) + (t1 - s) / 1e3 / reps
        end = t1 if end is None else max(end, t1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _short(name: str | None, width: int = 70) -> str:
    """A kernel's name without its template arguments and parameter list, at most `width` characters."""
    if name is None:
        return "(start)"
    base = re.split(r"[<(]", name, maxsplit=1)[0].strip() or name
    return base if len(base) <= width else base[:width - 3] + "..."


def breakdown(fn, reps: int = 5, top_kernels: int = 16) -> dict:
    """Device time per call of `fn` by kernel category (`_CATEGORIES`), from the profiler's device records,
    the number of kernels per call and of copy and fill records (memcpy / memset: in a graph, its memcpy and memset
    nodes, which run on the device between kernels and so are not idle time), the `top_kernels` records
    (category: name) with the most time per call, the idle time before each category (`idle_gaps`), and the time
    per category with overlaps charged once (`exclusive_ms`, `exclusive_time`: what adds up to the step when kernels
    launch early)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    cats: dict[str, float] = {}
    names: dict[str, list] = {}  # kernel name (short) -> [ms per call, launches per call]
    kernels = copies = 0
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0.0)
        if not us or e.key.startswith("cudaGraph") or "Runtime" in e.key:
            continue
        cat = _category(e.key)
        cats[cat] = cats.get(cat, 0.0) + us / 1e3 / reps
        if cat == _COPIES:
            copies += e.count
        else:
            kernels += e.count
        n = names.setdefault(f"{cat}: {_short(e.key)}", [0.0, 0.0])
        n[0] += us / 1e3 / reps
        n[1] += e.count / reps
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:top_kernels]
    return {"ms": dict(sorted(cats.items(), key=lambda kv: -kv[1])), "kernels_per_call": kernels / reps,
            "copies_per_call": copies / reps, "top_kernels": {k: {"ms": v[0], "launches": v[1]} for k, v in top},
            "idle": idle_gaps(spans, reps), "exclusive_ms": exclusive_time(spans, reps)}


_SMI_FIELDS = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw")


def gpu_state(index: int = 0, run=None) -> dict | None:
    """The GPU's SM and memory clocks (MHz), temperature (C) and power draw (W) from nvidia-smi, or None where it is
    missing or fails: recorded around each format's timing, since a step timed after another format's can run at
    other clocks. `run`: stands in for subprocess.run (tests)."""
    import subprocess

    run = run or subprocess.run
    try:
        out = run(["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(_SMI_FIELDS)}", "--format=csv,noheader,nounits"],
                  capture_output=True, text=True, timeout=10)
        vals = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
        return {k: float(v) for k, v in zip(("sm_mhz", "mem_mhz", "temp_c", "power_w"), vals)}
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def interleaved_rounds(rounds: int, formats) -> list[list[str]]:
    """The order the formats are timed in, round by round: as given in even rounds, reversed in odd ones, so that
    drift in clocks or temperature reaches every format alike and none is always timed after another."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    return [list(formats) if r % 2 == 0 else list(reversed(formats)) for r in range(rounds)]


def _pooled(timings):
    """One Timing of the samples of `timings` (the rounds of one step)."""
    return Timing(tuple(x for t in timings for x in t.samples), timings[0].method, timings[0].calls)


def _step_fields(t_ar: Timing, t_v: Timing) -> dict:
    """A format's timing fields from its pooled AR and verify timings: medians, p10 / p90 and the samples (ms)."""
    return {"ar_ms": 1e3 * t_ar.median, "ar_p10_ms": 1e3 * t_ar.p10, "ar_p90_ms": 1e3 * t_ar.p90,
            "verify_ms": 1e3 * t_v.median, "verify_p10_ms": 1e3 * t_v.p10, "verify_p90_ms": 1e3 * t_v.p90,
            "ar_samples_ms": [1e3 * x for x in t_ar.samples], "verify_samples_ms": [1e3 * x for x in t_v.samples],
            "timing_method": t_ar.method, "timing_calls": t_ar.calls}


def _floor_rates(dev) -> dict:
    """The rates the row's floors divide by, and where they come from (`autotune.floor_rates`)."""
    bw, mm, source = autotune.floor_rates(dev)
    return {"copy_tbs": bw / 1e12, "matmul_tflops": mm / 1e12, "source": source}


def _derive(row: dict) -> None:
    """The fields a format's row derives from its medians and floors."""
    row["ar_over_floor"] = row["ar_ms"] / row["ar_floor_ms"]
    row["verify_over_ar"] = row["verify_ms"] / row["ar_ms"]
    row["implied"] = {str(tau): {"tokens_per_s": 1e3 * tau / row["verify_ms"],
                                 "speedup_vs_ar": tau * row["ar_ms"] / row["verify_ms"]} for tau in (4, 6, 8)}


def _spawn(args: list[str], env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "specpilot.bench.engine", *args], check=True, env={**os.environ, **env})


# run_processes' process formats beyond "bf16" and "w12": the W12 model under an environment setting, timed as its own
# format beside the others
PROCESS_FORMATS = {"w12-glue-swiglu": ("w12", {"SPECPILOT_W12_SWIGLU": "0"})}


def run_processes(child_args: list[str], formats=("bf16", "w12"), rounds: int = 1, out=None, log=print,
                  spawn=None) -> dict:
    """Each format in a process of its own, `rounds` times, the formats' order alternating (`interleaved_rounds`):
    `python -m specpilot.bench.engine --formats F --no-peer` with `child_args`, the first round's with the per-kernel
    profile, the others without. For a GPU that cannot hold both models (hybrid-27b's 51 + 38 GB of weights on an
    80 GB H100), and a W12 model built as a user loads it rather than converted from the BF16 one in place. A format's
    samples of all its processes are pooled (medians, p10 / p90); `ar_ms_by_round` / `verify_ms_by_round` hold each
    process's medians; floors, bytes, breakdowns and GPU state come from its first process. A format of
    `PROCESS_FORMATS` ("w12-glue-swiglu": the W12 model with SwiGLU by the glue kernel after the product) runs its
    model under its environment. `spawn(args, env)` runs one process (tests pass their own)."""
    spawn = spawn or _spawn
    unknown = [f for f in formats if f not in ("bf16", "w12", *PROCESS_FORMATS)]
    if unknown:
        raise ValueError(f"specpilot.bench.engine: unknown format(s) {unknown}; pass bf16, w12 or one of "
                         f"{sorted(PROCESS_FORMATS)}")
    runs: dict[str, list[dict]] = {f: [] for f in formats}
    with tempfile.TemporaryDirectory() as tmp:
        for r, fmts in enumerate(interleaved_rounds(rounds, formats)):
            for fmt in fmts:
                d = Path(tmp) / f"{r}-{fmt}"
                model_fmt, env = PROCESS_FORMATS.get(fmt, (fmt, {}))
                spawn([*child_args, "--formats", model_fmt, "--no-peer", "--out", str(d),
                       *([] if r == 0 else ["--no-profile"])], env)
                found = sorted(d.glob("*-engine.json"))
                if len(found) != 1:
                    raise RuntimeError(f"specpilot.bench.engine: the {fmt} process of round {r} wrote {len(found)} "
                                       f"result files into {d}, expected 1")
                got = json.loads(found[0].read_text())
                got["formats"] = {fmt: got["formats"][model_fmt]}
                runs[fmt].append(got)
                row = got["formats"][fmt]
                log(f"round {r}: {fmt} AR {row['ar_ms']:.2f} ms, verify {row['verify_ms']:.2f} ms (own process)")
    res = {k: v for k, v in runs[formats[0]][0].items() if k != "formats"}
    res.update(rounds=rounds, processes=True, fresh=True, formats={})
    for fmt in formats:
        rows = [got["formats"][fmt] for got in runs[fmt]]
        first = rows[0]
        t_ar, t_v = (Timing(tuple(x / 1e3 for row in rows for x in row[key]), first["timing_method"],
                            first["timing_calls"]) for key in ("ar_samples_ms", "verify_samples_ms"))
        row = {**first, **_step_fields(t_ar, t_v), "ar_ms_by_round": [row["ar_ms"] for row in rows],
               "verify_ms_by_round": [row["verify_ms"] for row in rows]}
        _derive(row)
        res["formats"][fmt] = row
    if out is not None:
        write_run(out, "engine", res, markdown(res))
    return res


def run(shapes: str = "hybrid-27b", prefix: int = 4096, nodes: int = 32, positions: int = 16, topk: int = 4,
        reps: int = 30, peer_tokens: int = 8, formats=("bf16", "w12"), out=None, peer: bool = True,
        profile: bool = True, fused_glue: bool = False, fresh: bool = False, rounds: int = 1, head_screen: str = "auto",
        log=print) -> dict:
    """`rounds` > 1: every format's model built anew and kept (BF16 and W12 side by side in memory), then each
    step timed in `rounds` rounds of `reps` replays, the formats' order alternating (`interleaved_rounds`); a
    step's median is over the samples of all its rounds, and each round's medians are kept in the JSON."""
    from ..engine import Engine, HybridConfig, HybridModel, Kernels
    from ..engine.synthetic import SyntheticTensors, hf_config

    if head_screen == "w12" and "bf16" in formats:
        raise ValueError("specpilot.bench.engine: head_screen='w12' screens with a W12 head's 8-bit view, which the "
                         "BF16 model has not; pass formats=('w12',) or another screen")
    order = interleaved_rounds(rounds, formats)
    fresh = fresh or rounds > 1
    dev = torch.device("cuda")
    cfg = hf_config(shapes)
    syn = SyntheticTensors(cfg, dev)
    hc = HybridConfig.from_hf(cfg)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, hc.vocab, (prefix + 1,), generator=g).tolist()
    res = {"shapes": shapes, "prefix": prefix, "nodes": nodes, "positions": positions, "fused_glue": fused_glue,
           "head_screen": head_screen, "fresh": fresh, "rounds": rounds,
           "gpu": torch.cuda.get_device_name(), **versions(), "formats": {}}
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    # the floors' rates measured before any model takes the memory (cached on disk for the later processes of
    # run_processes); a failed measurement leaves autotune.floor_rates to its fallbacks, and each row names its source
    try:
        autotune.measure_ceilings(dev)
    except RuntimeError as e:  # torch.OutOfMemoryError among them
        log(f"specpilot.bench.engine: measuring the copy and matmul rates failed ({type(e).__name__}: {e}); the "
            "floors take autotune.floor_rates' fallback")
    model = None

    def build(fmt):
        nonlocal model
        t0 = time.perf_counter()
        if model is None or fmt == "bf16" or fresh:
            if rounds == 1:
                model = None  # `fresh`: the previous format's model freed first, each built as a user loads it
                torch.cuda.empty_cache()
            model = HybridModel(hc, syn, device=dev, fmt=fmt, kernels=Kernels.choose(dev), max_len=prefix + 128,
                                fused_glue=fused_glue, head_screen=head_screen)
        else:
            model.to_w12(head_screen=head_screen)
        log(f"{fmt}: model ready in {time.perf_counter() - t0:.1f} s")
        eng = Engine(model, None, tree_nodes=nodes, positions=positions, topk=topk, graphs=True)
        ctx = eng._start(prompt)
        return {"model": model, "eng": eng, "ctx": ctx, "ar": eng._graphs[1], "ver": eng._graphs[nodes],
                "tree": _random_tree(hc.vocab, positions, topk, nodes, seed=2), "t_ar": [], "t_v": [],
                "state_before": None}

    def time_steps(st):
        ctx = st["ctx"]
        t0 = time.perf_counter()
        st["ar"].load(len(ctx) - 1, ctx[-1], None)
        st["host_ar"] = time.perf_counter() - t0
        if st["state_before"] is None:
            st["state_before"] = gpu_state(idx)
        st["t_ar"].append(time_cuda([st["ar"].graph.replay], reps=reps, warmup=3, graph=False))
        t0 = time.perf_counter()
        st["ver"].load(len(ctx) - 1, ctx[-1], st["tree"])
        st["host_v"] = time.perf_counter() - t0
        st["t_v"].append(time_cuda([st["ver"].graph.replay], reps=reps, warmup=3, graph=False))
        st["state_after"] = gpu_state(idx)

    def finish(fmt, st):
        t_ar, t_v = _pooled(st["t_ar"]), _pooled(st["t_v"])
        wbytes, params = _model_bytes(st["model"])
        kv, stb = _state_bytes(st["model"], prefix)
        floor_ar = autotune.byte_floor(2 * params, wbytes + kv + stb, dev)  # physical: measured rates, no fraction
        floor_v = autotune.byte_floor(2 * params * nodes, wbytes + kv + stb, dev)
        try:  # the paper's floor (90% / 60% of the datasheet), beside the physical one; none without a datasheet
            paper_ar = autotune.paper_floor(2 * params, wbytes + kv + stb, dev)
            paper_v = autotune.paper_floor(2 * params * nodes, wbytes + kv + stb, dev)
        except ValueError:
            paper_ar = paper_v = None
        row = {"weight_bytes": wbytes, "kv_bytes": kv, "state_bytes": stb, "params": params, **_step_fields(t_ar, t_v),
               "ar_floor_ms": 1e3 * floor_ar, "verify_floor_ms": 1e3 * floor_v,
               "floor_rates": _floor_rates(dev),
               "ar_paper_floor_ms": None if paper_ar is None else 1e3 * paper_ar,
               "verify_paper_floor_ms": None if paper_v is None else 1e3 * paper_v,
               "host_load_ar_ms": 1e3 * st["host_ar"], "host_load_verify_ms": 1e3 * st["host_v"],
               "tree_nodes": st["tree"].n + 1, "head_screen": st["model"].head.screen,
               "gpu_state_before": st["state_before"], "gpu_state_after": st["state_after"]}
        if rounds > 1:
            row["ar_ms_by_round"] = [1e3 * t.median for t in st["t_ar"]]
            row["verify_ms_by_round"] = [1e3 * t.median for t in st["t_v"]]
        _derive(row)
        res["formats"][fmt] = row
        log(f"{fmt}: AR {row['ar_ms']:.2f} ms ({row['ar_over_floor']:.2f}x floor {row['ar_floor_ms']:.2f}), "
            f"verify {row['verify_ms']:.2f} ms ({row['verify_over_ar']:.3f}x AR)")
        if profile:
            row["ar_breakdown"] = breakdown(st["ar"].graph.replay)
            row["verify_breakdown"] = breakdown(st["ver"].graph.replay)
            log(f"{fmt}: AR by kernel {row['ar_breakdown']}")
            log(f"{fmt}: verify by kernel {row['verify_breakdown']}")

    if rounds == 1:
        for fmt in formats:
            st = build(fmt)
            time_steps(st)
            finish(fmt, st)
            del st
    else:
        states = {fmt: build(fmt) for fmt in formats}
        for r, fmts in enumerate(order):
            for fmt in fmts:
                time_steps(states[fmt])
            log(f"round {r}: " + ", ".join(f"{f} AR {1e3 * states[f]['t_ar'][-1].median:.2f} ms" for f in fmts))
        for fmt in formats:
            finish(fmt, states[fmt])
        del states
    del model
    torch.cuda.empty_cache()
    if peer:
        log("peer: transformers generate")
        res["peer"] = _peer(cfg, syn, prompt, peer_tokens, dev)
        log(f"peer: {res['peer']}")
    if out is not None:
        write_run(out, "engine", res, markdown(res))
    return res


def versions() -> dict:
    """torch's version, its CUDA's, and Triton's where it imports: the version fields of a run's JSON."""
    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def write_run(out, name: str, res: dict, md: str) -> None:
    """`<stamp>-<name>.json` (res) and `<stamp>-<name>.md` (md) into the folder `out`, made where missing."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    (out / f"{stamp}-{name}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stamp}-{name}.md").write_text(md)


def markdown(res: dict) -> str:
    lines = [f"# Engine steps: {res['shapes']}, one request, prefix {res['prefix']}, {res['nodes']}-row verify",
             "", f"{res['gpu']}, torch {res['torch']} (CUDA {res['cuda']}), Triton {res.get('triton')}. Every step "
             "one CUDA graph; medians of graph replays under CUDA events.", "",
             "| weights | AR step ms | AR floor ms | AR / floor | verify ms | verify / AR | tok/s at τ=4 / 6 / 8 | "
             "speedup at τ=4 / 6 / 8 |", "|---|---|---|---|---|---|---|---|"]
    for fmt, r in res["formats"].items():
        imp = r["implied"]
        lines.append(f"| {fmt} | {r['ar_ms']:.2f} | {r['ar_floor_ms']:.2f} | {r['ar_over_floor']:.2f}x | "
                     f"{r['verify_ms']:.2f} | {r['verify_over_ar']:.3f}x | "
                     + " / ".join(f"{imp[t]['tokens_per_s']:.0f}" for t in ("4", "6", "8")) + " | "
                     + " / ".join(f"{imp[t]['speedup_vs_ar']:.2f}x" for t in ("4", "6", "8")) + " |")
    fr = next((r["floor_rates"] for r in res["formats"].values() if r.get("floor_rates")), None)
    if fr:
        lines.append(f"\nFloors: the step's bytes at {fr['copy_tbs']:.2f} TB/s and its FLOPs at "
                     f"{fr['matmul_tflops']:.0f} TFLOP/s ({fr['source']}).")
    screens = [f"{fmt} {r['head_screen']}" for fmt, r in res["formats"].items() if r.get("head_screen")]
    if screens:
        lines.append("\nThe certified head's screen (`none`: the plain exact head): " + ", ".join(screens) + ".")
    if res.get("rounds", 1) > 1 or res.get("processes"):
        how = ("each format in a process of its own per round" if res.get("processes") else "both models in memory")
        n = res["rounds"]
        lines.append(f"\nEach step timed in {n} round{'s' if n > 1 else ''}, the formats' order alternating, {how}; "
                     "medians over all rounds' replays. By round (ms): " + "; ".join(
                         f"{fmt} AR " + " / ".join(f"{v:.2f}" for v in r["ar_ms_by_round"]) + ", verify "
                         + " / ".join(f"{v:.2f}" for v in r["verify_ms_by_round"]) for fmt, r in res["formats"].items())
                     + ".")
    for fmt, r in res["formats"].items():
        for kind in ("ar", "verify"):
            b = r.get(f"{kind}_breakdown")
            if b:
                parts = ", ".join(f"{k} {v:.2f}" for k, v in b["ms"].items())
                lines.append(f"\n{fmt} {kind} step by kernel (ms): {parts}; {b['kernels_per_call']:.0f} kernels.")
                idle = b.get("idle")
                if idle and idle["ms"]:
                    gaps = ", ".join(f"{k} {v:.2f} ({idle['us_per_gap'][k]:.1f} µs each)" for k, v in idle["ms"].items())
                    lines.append(f"Idle before each kind (ms): {gaps}.")
                    pairs = list((idle.get("top_pairs") or {}).items())[:3]
                    if pairs:
                        lines.append("Largest gaps (ms per call): " + "; ".join(
                            f"{k} {v['ms']:.2f} ({v['gaps']:.0f} x {v['us_per_gap']:.1f} µs)" for k, v in pairs) + ".")
    p = res.get("peer")
    if p and "ms_per_token" in p:
        bf = res["formats"].get("bf16")
        vs = f", {p['ms_per_token'] / bf['ar_ms']:.1f}x our BF16 AR step" if bf else ""
        lines += ["", f"Peer: transformers {p['transformers']} (fla {p['fla']}), {p['mode']}: "
                  f"{p['ms_per_token']:.1f} ms per decoded token ({1e3 / p['ms_per_token']:.1f} tokens/s){vs}."]
    elif p:
        lines += ["", f"Peer: did not run: {p}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specpilot.bench.engine")
    ap.add_argument("--shapes", default="hybrid-27b")
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--formats", default="bf16,w12")
    ap.add_argument("--out", default=None)
    ap.add_argument("--fused-glue", action="store_true", help="the glue as fused Triton kernels (engine.fused)")
    ap.add_argument("--head-screen", default="auto", choices=("auto", "int8", "int4", "w12", "none"),
                    help="the certified head's screen (lmhead.CertifiedHead; 'auto': the GPU's measured choice, the "
                         "plain exact head where none was measured; 'w12', a W12 head's 8-bit view, with "
                         "--formats w12 only); each format's row records the screen it ran")
    ap.add_argument("--rounds", type=int, default=1,
                    help="above 1: both formats' models kept side by side and each step timed in this many rounds, "
                         "the formats' order alternating (drift reaches both alike); implies --fresh")
    ap.add_argument("--processes", action="store_true",
                    help="each format in a process of its own, --rounds times, the order alternating, the samples "
                         "pooled (run_processes): for a GPU that cannot hold both models; runs no peer; --formats "
                         "may name w12-glue-swiglu (the W12 model with SPECPILOT_W12_SWIGLU=0: SwiGLU by the glue "
                         "kernel after the product instead of with it)")
    ap.add_argument("--no-profile", action="store_true", help="no per-kernel breakdown of the steps")
    ap.add_argument("--fresh", action="store_true",
                    help="build each format's model anew (the previous one freed) instead of converting the BF16 model "
                         "to W12 in place")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("specpilot.bench.engine: needs a CUDA GPU")
        return 2
    formats = tuple(a.formats.split(","))
    if not a.processes and set(formats) & set(PROCESS_FORMATS):
        print(f"specpilot.bench.engine: {sorted(set(formats) & set(PROCESS_FORMATS))} run with --processes only")
        return 2
    if a.processes:
        if not a.no_peer:
            print("specpilot.bench.engine: --processes runs no peer; pass --no-peer (a one-process run times it)")
            return 2
        child = ["--shapes", a.shapes, "--prefix", str(a.prefix), "--nodes", str(a.nodes), "--reps", str(a.reps),
                 "--head-screen", a.head_screen, *(["--fused-glue"] if a.fused_glue else [])]
        run_processes(child, formats, a.rounds, out=a.out)
        return 0
    run(a.shapes, a.prefix, a.nodes, reps=a.reps, peer=not a.no_peer, formats=formats, out=a.out,
        fused_glue=a.fused_glue, fresh=a.fresh, rounds=a.rounds, head_screen=a.head_screen, profile=not a.no_profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
