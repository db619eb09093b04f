"""The `specpilot` command line: info, bench, demo, check, ceiling, pack, tune.

    specpilot info                      device, versions, measured roofs, variants per op
    specpilot bench [--shapes S] [--ops OP ...] [--out DIR] [--reps N] [--interpret]
    specpilot demo [--tokens N]         the engine on the shipped tiny model: pack and verify it, decode
                                        autoregressively and speculatively (n-gram and self-drafter), τ,
                                        time per step, and the outputs checked token for token
    specpilot pack IN.safetensors OUT.safetensors [--device cpu] [--include PATTERN]
    specpilot tune --op OP [--shapes S] [--only PAT] [--trials N] [--time-budget S] [--storage URL]
                   [--out DIR] [--ship]     tune an operator's configs on this GPU (specpilot/tuning.py)
    specpilot tune --report [--out DIR]     the stored tuned configs, and a PNG of time over floor
    specpilot check [--candidate C] [--prompts N] [--tokens N] [--json OUT]
                                        token forcing: the stock path's greedy streams forced through a
                                        candidate configuration; exit 0 accept, 1 reject (specpilot/check.py)
    specpilot ceiling [--shapes S] [--gpu G] [--measured ENGINE_JSON] [--png OUT] [--json OUT]
                                        the cost model: byte floors per kernel class, the ceiling speedup,
                                        the three factors, the verify step predicted (specpilot/ceiling.py)

Without CUDA, the commands that run kernels run them under the interpreter: TRITON_INTERPRET=1 is set
before anything imports Triton, and the interpreter repairs of `autotune.interpreter` are applied.
`specpilot info` only reads the variable, so it shows the set-up of a Python session started the same way.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

OPERATOR_PACKAGES = ("w12", "gdn", "tree_attn", "lmhead")


class UsageError(Exception):
    """A bad argument: printed as `specpilot: error: ...`, exit status 2."""


def _prepare_backend():
    """Import torch; on a machine without CUDA switch Triton to its (repaired) interpreter."""
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
        from autotune import interpreter

        interpreter.apply()
    return torch


def _device(torch, name: str | None):
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise UsageError(f"bad --device {name!r}: {' '.join(str(e).split())}; pass cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: the commands run on cpu or cuda; pass cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine; pass --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); pass an "
                         "index below that")
    return dev


def _version(mod: str) -> str:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        try:
            return getattr(__import__(mod), "__version__", "?")
        except Exception:
            return "not installed"


# --------------------------------------------------------------------------------------
# info
# --------------------------------------------------------------------------------------


def _variants(shapes, device) -> tuple[dict[str, list[str]], dict[str, str]]:
    """op -> variants the registry would benchmark here; plus errors (module or provider)."""
    from specpilot.bench import registry

    errors = dict(registry.load_errors())
    variants: dict[str, list[str]] = {}
    for name, provider in registry.providers().items():
        try:
            cases = provider(shapes, device)
        except Exception as e:
            errors[f"provider {name}"] = f"{type(e).__name__}: {e}"
            continue
        for c in cases:
            vs = variants.setdefault(c.op, [])
            if c.variant not in vs:
                vs.append(c.variant)
        if not cases:
            variants.setdefault(f"({name})", []).append(f"no cases for shapes {shapes.name!r} on {device.type}")
    return variants, errors


def _picks(device) -> dict[str, str]:
    """op -> the variant a call on `device` runs in this process, as its own Python session would pick it
    (`autotune.which_variant`), or why the op is not available."""
    import importlib

    import autotune

    for pkg in OPERATOR_PACKAGES:
        try:
            importlib.import_module(f"{pkg}.ops")
        except Exception:  # reported by the package lines above
            pass
    out = {}
    for op in ("w12.matmul", "gdn.tree_verify", "gdn.tree_conv1d", "gdn.commit", "tree_attn.tree_attention",
               "lmhead.argmax"):
        try:
            out[op] = autotune.which_variant(op, device)
        except Exception as e:  # noqa: BLE001 - info reports, it does not fail
            out[op] = f"not available ({type(e).__name__}: {e})"
    return out


def cmd_info(args) -> int:
    """The user's own set-up: TRITON_INTERPRET is read, never set, so the variants shown are the ones a Python
    session started the same way picks."""
    import torch

    import autotune
    from specpilot.bench import get_shape_set

    dev = _device(torch, args.device)
    ver = autotune.versions()
    print(f"device      : {autotune.gpu_name(dev)} ({dev})")
    if dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        props = torch.cuda.get_device_properties(dev)
        print(f"capability  : sm_{cap[0]}{cap[1]}, {props.multi_processor_count} SMs, "
              f"{props.total_memory / 2**30:.1f} GiB")
    print(f"versions    : torch {ver['torch']}, triton {ver['triton']}, CUDA {ver['cuda']}, "
          f"numba {_version('numba')}, specpilot {ver['specpilot']}")
    interp = os.environ.get("TRITON_INTERPRET")
    print("interpreter : " + (f"TRITON_INTERPRET={interp}" if interp is not None else "TRITON_INTERPRET unset")
          + (": CPU tensors run the Triton kernels under the interpreter" if autotune.is_interpreter() else
             ": CPU tensors run the torch paths only (start Python with TRITON_INTERPRET=1 to run the Triton "
             "kernels on the CPU)"))
    t0 = time.perf_counter()
    cached = autotune.cached_ceilings(dev) is not None
    kw = {} if dev.type == "cuda" else {"copy_bytes": 16 << 20, "matmul_n": 512}
    c = autotune.measure_ceilings(dev, refresh=args.refresh, **({} if cached and not args.refresh else kw))
    how = "cached" if cached and not args.refresh else f"measured in {time.perf_counter() - t0:.1f} s"
    print(f"ceilings    : copy {c.copy_tbs * 1e3:.1f} GB/s (read+write), BF16 matmul {c.bf16_tflops:.3g} TFLOP/s "
          f"[{how}, {c.measured_at}]")
    spec = autotune.gpu_spec(dev)
    if spec is not None:
        print(f"datasheet   : {spec.name}: {spec.bandwidth_tbs} TB/s, {spec.bf16_tflops} BF16 TFLOP/s, "
              f"{spec.int8_tops} INT8 TOP/s, {spec.fp8_tflops} FP8 TFLOP/s, {spec.sm_count} SMs, "
              f"sm_{spec.capability[0]}{spec.capability[1]}")
        print(f"measured/ds : bandwidth {c.copy_tbs / spec.bandwidth_tbs:.0%}, "
              f"BF16 {c.bf16_tflops / spec.bf16_tflops:.0%}")
    else:
        print("datasheet   : no entry (known: " + ", ".join(sorted(autotune.GPUS)) + ")")
    print(f"has_wgmma   : {autotune.has_wgmma(dev)}")
    for pkg in OPERATOR_PACKAGES:
        try:
            __import__(pkg)
            state = "importable"
        except Exception as e:
            state = f"not available ({type(e).__name__}: {e})"
        print(f"package     : {pkg}: {state}")
    print(f"picks       : the variant each op runs on {dev} here (variant=None; autotune.which_variant)")
    for op, v in _picks(dev).items():
        print(f"  {op}: {v}")
    shapes = get_shape_set("hybrid-27b" if dev.type == "cuda" else "tiny")
    variants, errors = _variants(shapes, dev)
    print(f"bench cases : (shape set {shapes.name}, as listed in this set-up)")
    for op, vs in sorted(variants.items()):
        print(f"  {op}: {', '.join(vs)}")
    for where, err in errors.items():
        print(f"  unavailable: {where}: {err}")
    return 0


# --------------------------------------------------------------------------------------
# bench / demo
# --------------------------------------------------------------------------------------


def _collect(shapes, device, ops):
    from specpilot.bench import registry

    for mod, err in registry.load_errors().items():
        print(f"warning: case module {mod} failed to import: {err}", file=sys.stderr)

    def warn(name, e):
        print(f"warning: cases for {name} failed: {type(e).__name__}: {e}", file=sys.stderr)

    try:
        return registry.collect(shapes, device, ops, on_error=warn)
    except ValueError as e:
        raise UsageError(str(e)) from None


# On a CPU each case samples for at most this long (torch paths take microseconds a call; interpreted kernels seconds)
CPU_CASE_BUDGET_S = 1.0


def _bench(torch, shapes_name: str | None, ops, out, reps, warmup, device, quiet=False, interpret=False) -> int:
    """Run and report. Exit status 3 when a case was not reported. On a CPU the cases run the torch paths, or with
    `interpret` the Triton kernels under the interpreter (TRITON_INTERPRET=1: seconds a call)."""
    if device.type == "cuda":
        if interpret:
            raise UsageError("--interpret runs Triton kernels under the CPU interpreter; pass it with --device cpu")
        return _bench_run(torch, shapes_name, ops, out, reps, warmup, device, quiet, interpret)
    old, threads = os.environ.get("TRITON_INTERPRET"), torch.get_num_threads()
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    # One thread: the CPU cases are small, and a second OpenMP thread only adds waits of a scheduler tick (4 ms
    # and more) whenever another process holds a core, which turns medians into noise
    torch.set_num_threads(1)
    try:
        if interpret:
            from autotune import interpreter

            interpreter.apply()
        return _bench_run(torch, shapes_name, ops, out, reps, warmup, device, quiet, interpret)
    finally:
        torch.set_num_threads(threads)
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def _bench_run(torch, shapes_name, ops, out, reps, warmup, device, quiet, interpret) -> int:
    from specpilot.bench import get_shape_set, report, runner

    if shapes_name is None:
        shapes_name = "hybrid-27b" if device.type == "cuda" else "tiny"
    try:
        shapes = get_shape_set(shapes_name)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if reps is not None and reps < 1:
        raise UsageError(f"--reps must be >= 1, got {reps}")
    cases = _collect(shapes, device, ops)
    if not cases:
        print(f"no benchmark cases for shapes {shapes.name!r} on {device.type}"
              + (f" (ops {', '.join(ops)})" if ops else ""))
        return 1
    groups = len({c.group for c in cases})
    print(f"benchmarking {len(cases)} cases in {groups} groups, shapes {shapes.name}, on {device}"
          + ("" if quiet else "; a line per group as it starts, and per case when checked and when timed"), flush=True)
    if device.type != "cuda":
        print("on the CPU, one thread: "
              + ("Triton kernels under the interpreter (TRITON_INTERPRET=1), seconds a call; their rows are marked "
                 "(interpreted) and have no speedup" if interpret else
                 "the torch paths a CPU runs (F.linear is 'torch', not cuBLAS); --interpret checks the Triton kernels "
                 "under the interpreter instead (seconds a call)"), flush=True)
    res = runner.run(cases, device, out_dir=out, reps=reps, warmup=warmup, shapes=shapes.name,
                     tag="-".join(ops) if ops else "all",
                     case_budget_s=None if device.type == "cuda" else CPU_CASE_BUDGET_S,
                     log=(lambda s: None) if quiet else (lambda s: print(s, flush=True)))
    md, png = report.write(res, res.meta, res.path)
    print()
    print(md.read_text())
    print(f"results: {res.path}\ntable  : {md}\nplot   : {png}")
    failed = [r for r in res if r["status"] != "ok"]
    if failed:
        print(f"{len(failed)} of {len(res)} cases not reported (failed check or setup): see the list above")
    return 3 if failed else 0


def cmd_bench(args) -> int:
    torch = _prepare_backend()
    dev = _device(torch, args.device)
    return _bench(torch, args.shapes, args.ops, args.out, args.reps, args.warmup, dev, interpret=args.interpret)


def cmd_demo(args) -> int:
    """The engine on the shipped tiny model (specpilot/engine/demo.py): exit status 1 if a speculative output
    differs from the autoregressive one."""
    torch = _prepare_backend()
    from specpilot.engine import demo

    if args.tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {args.tokens}")
    return demo.run(_device(torch, args.device), new_tokens=args.tokens)


def cmd_check(args) -> int:
    """Token forcing (specpilot/check.py): the stock path's greedy streams forced through a candidate
    configuration; exit status 0 when the rule accepts it, 1 when it rejects it."""
    for name in ("prompts", "tokens", "prompt_bytes"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (0 <= args.large_margin < float("inf") and 0 <= args.points < float("inf")):
        raise UsageError(f"--large-margin and --points must be >= 0, got {args.large_margin} and {args.points}")
    model = Path(args.model) if args.model else None
    if model is not None and not (model / "config.json").is_file():
        raise UsageError(f"--model {model}: no config.json there; pass a checkpoint folder")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise UsageError(f"--json {args.json}: the folder {Path(args.json).resolve().parent} does not exist")
    torch = _prepare_backend()
    from specpilot import check

    dev = _device(torch, args.device)
    try:
        prompts, texts = check.heldout_prompts(args.prompts, args.prompt_bytes, args.tokens, args.text)
    except ValueError as e:
        raise UsageError(str(e)) from None
    t0 = time.perf_counter()
    stock = check.stock_path(model, device=dev)
    if max(max(p + x) for p, x in zip(prompts, texts)) >= stock.engine.model.cfg.vocab:
        raise UsageError(f"the prompts are bytes but the model's vocabulary has {stock.engine.model.cfg.vocab} ids; "
                         "check a byte-level model, or call specpilot.check.reference with token ids")
    cand = check.make_candidate(args.candidate, stock, model, device=dev)
    print(f"token forcing: {cand.name} against {stock.name} ({stock.describe}), {args.prompts} prompts x "
          f"{args.tokens} tokens, on {dev}", flush=True)
    ref = check.reference(stock, prompts, args.tokens, texts, progress=True)
    command = (f"specpilot check --candidate {args.candidate} --prompts {args.prompts} --tokens {args.tokens} "
               f"--prompt-bytes {args.prompt_bytes} --large-margin {args.large_margin:g} --points {args.points:g} "
               f"--device {dev}" + (f" --model {model}" if model else "") + (f" --text {args.text}" if args.text else ""))
    meta = {"model": str(model) if model else "the shipped tiny_stdlib model",
            "text": str(args.text) if args.text else "heldout.txt of the shipped tiny_stdlib model",
            "device": str(dev), "prompt_bytes": args.prompt_bytes, "torch": torch.__version__, "command": command}
    rep = check.run(cand, ref, large_margin=args.large_margin, points=args.points, progress=True, meta=meta)
    rep.meta["seconds"] = round(time.perf_counter() - t0, 1)
    s, c, a = rep.totals_stock, rep.totals_candidate, rep.accuracy
    print(f"{'path':>12} | positions | mismatches |   rate | large-margin (> {rep.large_margin_threshold:g})")
    for name, t in (("stock", s), ("candidate", c)):
        print(f"{name:>12} | {t.positions:9d} | {t.mismatches:10d} | {100 * t.rate:5.2f}% | {t.large_margin:d}")
    print(f"rule        : reject if the rate is > stock + {rep.points:g} points or large-margin events > stock's")
    print(f"decision    : {rep.decision.upper()}: " + "; ".join(rep.reasons))
    if a is not None:
        lo, hi = a.interval_prompts
        plo, phi = a.interval_positions
        print(f"accuracy    : next byte of the held-out text: stock {100 * a.stock:.1f}%, candidate "
              f"{100 * a.candidate:.1f}%, difference {100 * a.difference:+.2f} points; 95% interval "
              f"[{100 * lo:+.2f}, {100 * hi:+.2f}] over prompts ({'covers' if a.covers_zero_prompts else 'excludes'} 0), "
              f"[{100 * plo:+.2f}, {100 * phi:+.2f}] over positions "
              f"({'covers' if a.covers_zero_positions else 'excludes'} 0)")
    if args.json:
        Path(args.json).write_text(rep.to_json() + "\n")
        print(f"report      : {args.json}")
    return 0 if rep.accept else 1


def cmd_ceiling(args) -> int:
    """The cost model (specpilot/ceiling.py): print the tables; write the JSON, the Markdown and the PNG."""
    import json

    from specpilot import ceiling

    try:
        rep = ceiling.report(args.shapes, args.gpu, nodes=args.nodes, prefix=args.prefix, weights=args.weights,
                             taus=args.tau.split(","), tau_ideal=args.tau_ideal, measured=args.measured,
                             perop=args.perop or (), peak_source=None if args.peaks == "table" else args.peaks,
                             escapes=args.escapes)
    except ValueError as e:
        raise UsageError(str(e)) from None
    md = ceiling.markdown(rep)
    print(md)
    for path, write in ((args.json, lambda p: p.write_text(json.dumps(rep, indent=1) + "\n")),
                        (args.md, lambda p: p.write_text(md)), (args.png, lambda p: ceiling.plot(rep, p))):
        if path:
            p = Path(path)
            if not p.parent.is_dir():
                raise UsageError(f"output folder {p.parent} does not exist")
            write(p)
            print(f"wrote {p}")
    return 0


# --------------------------------------------------------------------------------------
# pack
# --------------------------------------------------------------------------------------


def cmd_pack(args) -> int:
    """Bad input (missing, truncated or malformed file, nothing to pack, unwritable output): one line
    on stderr and exit status 2, from `UsageError` in `main`."""
    src, dst = Path(args.input), Path(args.output)
    if not src.is_file():
        raise UsageError(f"input checkpoint {src} does not exist" if not src.exists() else f"input {src} is not a file")
    for p in (src, dst):
        if p.suffix != ".safetensors":
            raise UsageError(f"{p}: expected a .safetensors file")
    if src.resolve() == dst.resolve():
        raise UsageError("output must differ from input (packing never overwrites the source)")
    if not dst.parent.is_dir():
        raise UsageError(f"output folder {dst.parent} does not exist")
    if dst.is_dir():
        raise UsageError(f"output {dst} is a folder")
    torch = _prepare_backend()
    dev = _device(torch, args.device)
    try:
        from w12.checkpoint import pack_checkpoint
        from w12.errors import W12CheckpointError
    except ImportError as e:
        print(f"specpilot: error: the w12 packer is not available: {e}", file=sys.stderr)
        return 1
    try:
        result = pack_checkpoint(str(src), str(dst), device=str(dev), include=args.include, progress=True)
    except (W12CheckpointError, OSError) as e:
        raise UsageError(" ".join(str(e).split())) from None
    if isinstance(result, dict):
        for k, v in result.items():
            print(f"{k}: {v}")
    elif result is not None:
        print(result)
    for w in getattr(result, "warnings", ()):
        print(f"specpilot: warning: {w}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------


def cmd_tune(args) -> int:
    """Tune one operator on this GPU (`specpilot.tuning.run`): a progress bar, then the before/after table; or
    `--report`: the stored tuned configs (shipped folder, then the user's cache) with their metadata, and a PNG
    of time over floor when they carry it (docs/autotune.md)."""
    import json as _json
    from pathlib import Path as _Path

    from autotune import config as _cfg
    from specpilot import tuning

    if args.report:
        entries = {}
        for label, folder in (("shipped", _cfg._config_dir()), ("user", _cfg._user_dir())):
            files = sorted(_Path(folder).glob("*.json")) if _Path(folder).is_dir() else []
            print(f"{label}: {folder}" + ("" if files else " (no tuned configs)"))
            for path in files:
                data = _cfg._read_or_warn(path)
                if data is None:
                    print(f"  {path.name}: not a tuned-config file, ignored")
                    continue
                meta = ", ".join(f"{k} {v}" for k, v in sorted(data["meta"].items()))
                print(f"  {path.name}: {meta}")
                for name, entry in sorted(data["entries"].items()):
                    extra = entry.get("_") or {}
                    fields = ", ".join(f"{k}={v}" for k, v in sorted(entry.items()) if k != "_")
                    print(f"    {name}: {fields}")
                    if extra:
                        print(f"      meta: {_json.dumps(extra, sort_keys=True, default=str)}")
                    entries[f"{path.stem}:{name}"] = entry
        png = tuning.report_png(entries, _Path(args.out or ".") / "tuned-configs.png")
        print(f"figure: {png}" if png else "figure: none (no stored entry records its time over floor)")
        return 0
    if not args.op:
        raise UsageError("specpilot tune: name an operator with --op (e.g. --op w12.matmul), or pass --report")
    if args.op not in tuning.OPS:
        raise UsageError(f"specpilot tune: unknown --op {args.op!r}; tunable: {', '.join(tuning.OPS)}")
    if args.trials < 1:
        raise UsageError(f"specpilot tune: --trials {args.trials}; ask for at least one trial per shape")
    try:
        backend = tuning.make_backend(args.op, None, reps=args.reps, rounds=args.rounds, workers=args.workers)
    except RuntimeError as e:
        raise UsageError(str(e)) from None
    variants = args.variant.split(",") if args.variant else None
    try:
        records = tuning.run(args.op, shape_set=args.shapes, only=args.only, variants=variants, trials=args.trials,
                             time_budget=args.time_budget, storage=args.storage, out=args.out, ship=args.ship,
                             backend=backend, progress=not args.no_progress)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print()
    print(tuning.table_md(records), end="")
    if args.out:
        print(f"\ndecisions: {_Path(args.out) / tuning.DECISIONS}\ntable    : {_Path(args.out) / tuning.TABLE}")
    return 1 if any(r.get("error") for r in records) else 0


# --------------------------------------------------------------------------------------


def _list_ops_in_help(parser: argparse.ArgumentParser) -> None:
    """`--help` lists the names `--ops` takes. Read from the registry when the help is printed, not when the
    parser is built: the registry imports torch."""
    plain = parser.format_help

    def format_help():
        try:
            from specpilot.bench import registry

            names = registry.known_ops()
        except Exception as e:  # the help must print even when torch or a case module does not import
            names = [f"(the registry did not load: {type(e).__name__}: {e})"]
        parser.epilog = ("ops (--ops takes a provider, or one of the op names in brackets, which `specpilot info` "
                         "lists): " + "; ".join(names))
        return plain()

    parser.format_help = format_help


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specpilot", description="SpecPilot: kernels for lossless speculative decoding")
    sub = p.add_subparsers(dest="cmd", metavar="{info,bench,demo,check,ceiling,pack,tune}")
    sub.required = True

    s = sub.add_parser("info", help="device, versions, measured roofs, variants per op")
    s.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda if present)")
    s.add_argument("--refresh", action="store_true", help="re-measure the roofs instead of using the cache")
    s.set_defaults(fn=cmd_info)

    def bench_args(s, shapes_help):
        s.add_argument("--shapes", default=None, help=shapes_help)
        s.add_argument("--ops", nargs="+", default=None, metavar="OP",
                       help="ops to run (default: all): a provider, or an op name as `specpilot info` lists them; "
                            "the list is below")
        s.add_argument("--out", default=None, metavar="DIR", help="folder for the JSON, markdown and PNG")
        s.add_argument("--reps", type=int, default=None, metavar="N", help="timed samples per case")
        s.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda if present)")

    s = sub.add_parser("bench", help="run the benchmark registry, print the table, write JSON + PNG")
    bench_args(s, "shape set (hybrid-27b, llama-3.1-8b, tiny; default hybrid-27b on a GPU, tiny on CPU)")
    s.add_argument("--warmup", type=int, default=None, metavar="N", help="warm-up passes per case")
    s.add_argument("--interpret", action="store_true",
                   help="on a CPU: check and time the Triton kernels under the interpreter (seconds a call; rows "
                        "marked interpreted, no speedups) instead of the torch paths")
    s.set_defaults(fn=cmd_bench)
    _list_ops_in_help(s)

    s = sub.add_parser("demo", help="the engine on the shipped tiny model: pack and verify, decode "
                                    "autoregressively and speculatively, check the outputs agree")
    s.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda if present)")
    s.add_argument("--tokens", type=int, default=256, metavar="N", help="new tokens per decoding (default 256)")
    s.set_defaults(fn=cmd_demo)

    s = sub.add_parser("check", help="token forcing: force the stock path's greedy streams through a candidate "
                                     "configuration; exit 0 accept, 1 reject")
    s.add_argument("--model", default=None, metavar="PATH", help="checkpoint folder (default: the shipped tiny model)")
    s.add_argument("--candidate", default="w12", choices=("stock", "w12", "tree", "reference-kernels", "planted-fault"),
                   help="w12: W12 weights; tree: the 64-token (prefill / verify) pass; reference-kernels: the torch "
                        "references; planted-fault: +2 on the logits of ids 0, 7, 14, ...; stock: the stock path "
                        "itself (default w12)")
    s.add_argument("--prompts", type=int, default=8, metavar="N", help="prompts from the text (default 8)")
    s.add_argument("--tokens", type=int, default=128, metavar="N", help="reference tokens per prompt (default 128)")
    s.add_argument("--prompt-bytes", type=int, default=64, metavar="N", help="bytes per prompt (default 64)")
    s.add_argument("--text", default=None, metavar="FILE", help="text the prompts come from (default: the shipped "
                                                                "tiny model's held-out text)")
    s.add_argument("--large-margin", type=float, default=0.25, metavar="X",
                   help="logit margin above which a mismatch is a large-margin event (default 0.25, NEAR_TIE)")
    s.add_argument("--points", type=float, default=0.5, metavar="P",
                   help="allowed rise of the mismatch rate over stock's, in percentage points (default 0.5)")
    s.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda if present)")
    s.add_argument("--json", default=None, metavar="OUT", help="write the report as JSON here")
    s.set_defaults(fn=cmd_check)

    s = sub.add_parser("ceiling", help="the cost model: byte floors per kernel class, ceiling speedup, the three "
                                       "factors, the verify step predicted from per-kernel measurements")
    s.add_argument("--shapes", default="hybrid-27b", help="shape set (default hybrid-27b)")
    s.add_argument("--gpu", default="h200", help="GPU name or slug of autotune.GPUS (default h200)")
    s.add_argument("--peaks", default="table", metavar="table|datasheet|BENCH_JSON",
                   help="the floor's rates: those measured on the GPU model (autotune.GPUS; the datasheet's where "
                        "none were measured; default), the datasheet's peaks, or the roofs a `specpilot bench` JSON "
                        "measured")
    s.add_argument("--nodes", type=int, default=32, help="rows of the verify step, root included (default 32)")
    s.add_argument("--prefix", type=int, default=4096, help="cached context tokens (default 4096)")
    s.add_argument("--weights", default="bf16,w12", help="bf16, w12 or both (default bf16,w12)")
    s.add_argument("--escapes", type=float, default=0.0, help="W12 escapes per weight (default 0)")
    s.add_argument("--tau", default="4,6,8", help="tokens per verify step for the ceiling (default 4,6,8)")
    s.add_argument("--tau-ideal", type=float, default=None, help="acceptance-limited τ for the leftover-acceptance factor")
    s.add_argument("--measured", default=None, metavar="ENGINE_JSON", help="python -m specpilot.bench.engine's JSON")
    s.add_argument("--perop", nargs="+", default=None, metavar="BENCH_JSON",
                   help="specpilot bench JSONs that time kernel classes (for the verify-step prediction)")
    s.add_argument("--png", default=None, metavar="OUT", help="stacked bars: measured vs floor per class")
    s.add_argument("--json", default=None, metavar="OUT", help="the whole report as JSON")
    s.add_argument("--md", default=None, metavar="OUT", help="the printed tables as a Markdown file")
    s.set_defaults(fn=cmd_ceiling)

    s = sub.add_parser("pack", help="pack a BF16 checkpoint into W12 (w12.checkpoint.pack_checkpoint)")
    s.add_argument("input", metavar="IN.safetensors")
    s.add_argument("output", metavar="OUT.safetensors")
    s.add_argument("--device", default="cpu", help="device that does the packing (default cpu)")
    s.add_argument("--include", default=None, metavar="PATTERN",
                   help="only pack tensors whose names match PATTERN (passed to pack_checkpoint as is)")
    s.set_defaults(fn=cmd_pack)

    s = sub.add_parser("tune", help="tune an operator's launch configs (autotune.tune), or --report the stored ones")
    s.add_argument("--op", default=None, help="w12.matmul, gdn.tree_verify, tree_attn.tree_attention or lmhead.argmax")
    s.add_argument("--shapes", default="hybrid-27b", help="shape set (default hybrid-27b)")
    s.add_argument("--only", default=None, metavar="PATTERNS",
                   help="comma-separated name patterns of the op's shapes (e.g. '*-M64' or 'B1-N32')")
    s.add_argument("--variant", default=None, help="comma-separated variants (default: every declared space)")
    s.add_argument("--trials", type=int, default=32, help="trials per (variant, shape) (default 32)")
    s.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="seconds for all studies together, shared among those left (default: none)")
    s.add_argument("--storage", default=None, metavar="URL", help="Optuna storage, e.g. sqlite:///studies.db (resumes)")
    s.add_argument("--out", default=None, metavar="DIR",
                   help="folder of the decisions JSON and the before/after table (--report: of the PNG; default .)")
    s.add_argument("--ship", action="store_true",
                   help="store promoted winners in the shipped autotune/configs/<gpu>.json, not the user cache")
    s.add_argument("--reps", type=int, default=30, help="timed samples per trial (default 30)")
    s.add_argument("--rounds", type=int, default=60, help="interleaved A/B rounds of the promotion rule (default 60)")
    s.add_argument("--workers", type=int, default=None, help="compile threads (default: cores, at most 16)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument("--report", action="store_true",
                   help="print the stored tuned configs with their metadata; write tuned-configs.png to --out")
    s.set_defaults(fn=cmd_tune)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except UsageError as e:
        parser.exit(2, f"specpilot: error: {e}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
