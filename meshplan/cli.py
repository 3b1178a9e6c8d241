"""Command-line front door: ``meshplan plan MODEL --cluster SPEC [options]``.

``main(argv)`` parses, builds the workload on the meta device, calls :func:`meshplan.api.plan`
and prints the plan (``Plan.explain()``, or one JSON document with ``--json``). Bad user input —
an argument argparse rejects, or a ValueError/TypeError/InfeasiblePlanError raised while parsing,
building or planning — is printed as ``meshplan: error: <message>`` on stderr with exit code 2 and
no traceback; any other exception keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any, Callable, NoReturn

from meshplan.cost.cluster import parse_cluster_spec
from meshplan.cost.memory import OPTIMIZERS
from meshplan.cost.mesh import parse_mesh_shape
from meshplan.errors import InfeasiblePlanError, WorkerError
from meshplan.plan.plan import Plan

# The planner, the zoo and torch are imported by the commands that use them: `meshplan run`'s
# launcher starts its ranks without them (a 2-rank run of an empty script: 0.4 s instead of 5 s
# here), and each rank imports what its script needs.

PROG = "meshplan"
EXIT_USAGE = 2  # argparse's own exit code for bad arguments; every user error uses it


class UsageError(ValueError):
    """An argument argparse rejected; ``usage`` is the usage line of the (sub)command."""

    def __init__(self, message: str, usage: str) -> None:
        super().__init__(message)
        self.usage = usage


class _Parser(argparse.ArgumentParser):
    """ArgumentParser that raises UsageError instead of exiting, so ``main`` returns an int.
    ``lazy_epilog`` makes the epilog when help is asked for (the zoo's list imports torch)."""

    def __init__(self, *args: Any, lazy_epilog: Callable[[], str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lazy_epilog = lazy_epilog

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self.format_usage())

    def format_help(self) -> str:
        if self._lazy_epilog is not None:
            self.epilog, self._lazy_epilog = self._lazy_epilog(), None
        return super().format_help()


# ---------------------------------------------------------------- argument types


def _float_pair(text: str) -> tuple[float, float]:
    """``"a0,a1"`` -> (a0, a1): one value per mesh axis."""
    parts = text.split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(parts) != 2 or len(values) != 2:
        raise argparse.ArgumentTypeError(
            f"expected two comma-separated numbers (mesh axis 0, mesh axis 1), e.g. '1,1'; got {text!r}")
    return values  # type: ignore[return-value]  # length checked above


def _mesh_axis(text: str) -> int:
    if text.strip() not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"must be a mesh axis, 0 or 1; got {text!r}")
    return int(text)


def _mesh_shape(text: str) -> tuple[int, int]:
    try:
        return parse_mesh_shape(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return int(text)


def _method(text: str) -> str:
    from meshplan.api import check_method
    try:
        return check_method(text.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _ratios(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 0 or sum(values) <= 0:
        raise argparse.ArgumentTypeError(
            f"bad ratios {text!r}: expected comma-separated non-negative numbers with a "
            "positive sum, one per device, e.g. 0.4,0.3,0.2,0.1")
    return values


def _microbatches(text: str) -> int | str:
    return "auto" if text.strip() == "auto" else _positive_int(text)


def _recompute(text: str) -> str:
    from meshplan.planner.recompute import parse_recompute
    try:
        parse_recompute(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _budget_gb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(
            f"expected a finite number of GiB per device >= 0 (0 = no budget); got {text!r}")
    return value


# ---------------------------------------------------------------- parser


def _zoo_epilog() -> str:
    from meshplan.zoo import describe_zoo
    return "zoo models (kind:field=value,...; preset=NAME picks a paper size): " + describe_zoo()


def _add_plan_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="find the fastest parallel plan of one training step",
        description="Find the fastest plan of MODEL's training step on a cluster: pipeline "
                    "stages on submeshes (method auto without --mesh), each stage's "
                    "intra-operator plan, micro-batches, dtype and recomputation.",
        lazy_epilog=_zoo_epilog)
    p.add_argument("model", metavar="MODEL",
                   help="zoo spec (e.g. mlp:layers=6,hidden=256,batch=32,bias=1, "
                        "gpt:preset=1.3b,batch=1024, moe:preset=70b, wresnet:preset=13b), "
                        "path/to/file.py:fn, or a Hugging Face model by name or config: "
                        "hf:llama-3-70b,batch=512,seq=4096, hf:path/config.json")
    p.add_argument("--cluster", required=True, metavar="SPEC",
                   help="cluster YAML path or preset: local:N, PRESET:H, PRESET:HxK "
                        "(e.g. p3.16xlarge:8, p3.16xlarge:1x4, dgx-a100:128)")
    p.add_argument("--mesh", type=_mesh_shape, metavar="RxC",
                   help="logical mesh shape, e.g. 2x4 (default: the cluster's hosts x devices)")
    p.add_argument("--alpha", type=_float_pair, metavar="A0,A1",
                   help="abstract latency per mesh axis (with --beta; objective in α-β units)")
    p.add_argument("--beta", type=_float_pair, metavar="B0,B1",
                   help="abstract inverse bandwidth per mesh axis (with --alpha)")
    p.add_argument("--method", type=_method, default="auto", metavar="METHOD",
                   help="auto = both levels searched (pipeline stages without --mesh); "
                        "intra-only = one stage; inter-only / equal-layer / equal-operator = "
                        "Alpa's ablations; megatron:dp=D,tp=T,pp=P[,mb=M] = Megatron-LM's "
                        "3-D parallelism as configured (mb: micro-batch size per replica, "
                        "searched if absent); megatron-grid = the fastest such configuration; "
                        "data, zero2, zero3, megatron (one stage: dp on mesh axis 0, tp on "
                        "axis 1), heuristic, expert = hand-style plans on one mesh; "
                        "hetero = HAP's program synthesis with per-device shard ratios on a "
                        "cluster of mixed devices (what auto does on one), dp-even / "
                        "dp-proportional = data parallel with an even batch split or one by "
                        "device speed (default: auto)")
    p.add_argument("--gather", choices=("auto", "padded", "broadcast"), default="auto",
                   help="how uneven shards are gathered: padded all-gathers, one broadcast "
                        "per device, or auto = the cheaper per tensor (default: auto)")
    p.add_argument("--sfb", choices=("off", "auto", "force"), default=None,
                   help="sufficient-factor broadcasting of matmul weight gradients (factors "
                        "gathered instead of the gradient all-reduced): auto = weighed per "
                        "weight, force = wherever it applies, off (default: auto for method "
                        "hetero, off otherwise; single-stage plans only)")
    p.add_argument("--ratios", type=_ratios, metavar="R0,R1,...",
                   help="with --method hetero: fixed shard ratios, one per device, instead of "
                        "balancing them")
    p.add_argument("--segments", type=_positive_int, default=1, metavar="K",
                   help="with --method hetero: cut the program into K model segments of about "
                        "equal FLOPs, each with shard ratios of its own (HAP §5.2; values "
                        "re-cut by an all-to-all between them), kept when faster than one set "
                        "(default: 1)")
    p.add_argument("--segment-ratios", type=_ratios, action="append", metavar="R0,R1,...",
                   help="with --method hetero: one segment's fixed ratios, one per device; "
                        "repeat once per segment")
    p.add_argument("--force-batch-dim", type=_mesh_axis, metavar="AXIS",
                   help="split the batch dim of every op over this mesh axis (0 or 1)")
    p.add_argument("--prefer-reduce-scatter", action="store_true",
                   help="sharded (ZeRO-2) parameter updates where data parallel")
    p.add_argument("--memory-budget-gb", type=_budget_gb, metavar="X",
                   help="per-device memory budget in GiB (default: device memory; 0 = no budget)")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="compute dtype (default auto: bf16 where the device runs it faster, "
                        "else fp16 where that is faster, else fp32)")
    p.add_argument("--microbatches", type=_microbatches, default="auto", metavar="auto|N",
                   help="micro-batches per step, gradients accumulated (default: searched)")
    p.add_argument("--recompute", type=_recompute, default="auto",
                   metavar="auto|none|full|selective|layers:K",
                   help="recompute activations in backward: every layer, the attention cores "
                        "(selective) or each stage's first K layers (default auto: per stage, "
                        "the least that memory demands)")
    p.add_argument("--schedule", choices=("auto", "1f1b", "gpipe", "interleaved"),
                   default="auto", help="pipeline schedule planned for (default auto: 1F1B, "
                                        "or interleaved 1F1B when faster)")
    p.add_argument("--layers", type=_positive_int, metavar="L", dest="num_layers",
                   help="layers the program is clustered into for pipeline stages "
                        "(default: from the program and the cluster)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="optimizer whose state is planned for (default: adamw)")
    p.add_argument("--json", action="store_true",
                   help="print the plan as one JSON document on stdout (nothing else)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bars (they are shown only when stderr is a terminal)")
    p.add_argument("-o", "--output", metavar="PATH", help="save the plan as JSON to PATH")
    p.add_argument("--simulate", action="store_true",
                   help="also simulate the plan's step (step time, TFLOP/s, MFU, bubble, peak "
                        "memory); with --json as the object 'simulated'; --timeline writes "
                        "its timeline")
    _add_timeline_argument(p)
    p.set_defaults(run=_run_plan)


def _add_timeline_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeline", metavar="PREFIX",
                   help="write the simulated timeline to PREFIX.timeline.json and a Gantt "
                        "chart to PREFIX.gantt.png (the chart needs matplotlib; without it "
                        "the JSON alone is written); without --timeline no file is written")


def build_parser() -> argparse.ArgumentParser:
    """The ``meshplan`` argument parser; each subcommand sets ``run(args) -> exit code``."""
    parser = _Parser(prog=PROG, description="Automatic parallelization of PyTorch training.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_plan_parser(subparsers)
    _add_show_program_parser(subparsers)
    _add_run_parser(subparsers)
    _add_report_parser(subparsers)
    _add_calibrate_parser(subparsers)
    _add_diff_parser(subparsers)
    _add_simulate_parser(subparsers)
    return parser


def _add_simulate_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate", help="simulate one training step of a saved plan",
        description="Run the per-rank instruction lists of the plan in PLAN_JSON on a virtual "
                    "clock with the cost model's durations and print the step time, "
                    "samples/s, TFLOP/s per device, MFU, pipeline bubble and peak memory per "
                    "device; --timeline writes the timeline as JSON and as a PNG Gantt chart.")
    p.add_argument("plan_json", metavar="PLAN_JSON", help="a plan file")
    p.add_argument("--json", action="store_true",
                   help="print {\"simulated\": {...}} as one JSON document on stdout")
    _add_timeline_argument(p)
    p.set_defaults(run=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    from meshplan.plan.plan import load_plan
    try:
        loaded = load_plan(args.plan_json)
    except ValueError as err:
        return _fail(str(err))
    return _simulated(loaded, args.timeline, args.json, None)


def _simulated(result: Plan, prefix: str | None, as_json: bool, document: dict | None) -> int:
    """Simulate ``result``, write its timeline files when ``prefix`` is given (the chart
    where matplotlib is installed) and print the figures (or, with ``as_json``, ``document``
    with the object "simulated" added)."""
    from meshplan.report.gantt import write_gantt
    from meshplan.sim.simulate import format_simulation, simulate
    try:
        sim = simulate(result)
    except ValueError as err:
        return _fail(str(err))
    files: tuple[str, ...] = ()
    if prefix is not None:
        try:
            files = (f"{prefix}.timeline.json",)
            with open(files[0], "w") as f:
                json.dump(sim.timeline.to_json(), f)
            write_gantt(sim.timeline, f"{prefix}.gantt.png",
                        title=f"{result.model}: simulated step")
            files += (f"{prefix}.gantt.png",)
        except OSError as err:
            return _fail(f"cannot write the timeline to {prefix!r}: {err.strerror or err}")
        except RuntimeError as err:   # no matplotlib: the JSON timeline alone
            print(f"{PROG}: no Gantt chart: {err}", file=sys.stderr)
    if as_json:
        written = dict(zip(("timeline_json", "gantt_png"), files))
        out = (document or {}) | {"simulated": sim.summary() | written}
        return _emit(json.dumps(out, indent=1))
    return _emit(format_simulation(result, sim, files))


def _add_report_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "report", help="write a saved plan as one self-contained HTML page",
        description="Write PLAN_JSON as one HTML page (no network needed to view it): the "
                    "cluster drawn as hosts of devices coloured by stage, the stages, the "
                    "sharding of every layer, the simulated pipeline timeline, memory per "
                    "device against its limit, and the collectives by kind and link.")
    p.add_argument("plan_json", metavar="PLAN_JSON", help="a plan file")
    p.add_argument("-o", "--output", metavar="HTML", required=True, help="the page to write")
    p.set_defaults(run=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from meshplan.plan.plan import load_plan
    from meshplan.plan.report import render_report
    try:
        page = render_report(load_plan(args.plan_json))
    except ValueError as err:
        return _fail(str(err))
    try:
        with open(args.output, "w") as f:
            f.write(page)
    except OSError as err:
        return _fail(f"cannot write the report to {args.output!r}: {err.strerror or err}")
    print(f"{PROG}: report written to {args.output}", file=sys.stderr)
    return 0


def _add_diff_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "diff", help="compare two saved plans",
        description="Compare two plans side by side: summary and prediction, stages, the "
                    "parameters laid out or updated differently, bytes moved by kind.")
    p.add_argument("a", metavar="A_JSON", help="a plan file")
    p.add_argument("b", metavar="B_JSON", help="another plan file")
    p.set_defaults(run=_run_diff)


def _run_diff(args: argparse.Namespace) -> int:
    from meshplan.plan.diff import diff_plans
    from meshplan.plan.plan import load_plan
    try:
        text = diff_plans(load_plan(args.a), load_plan(args.b),
                          (os.path.basename(args.a), os.path.basename(args.b)))
    except ValueError as err:
        return _fail(str(err))
    return _emit(text)


def _add_calibrate_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "calibrate", help="measure this machine and write a cluster profile",
        description="Measure matmul throughput per dtype, memory bandwidth and all-reduce "
                    "times (1 KiB .. 64 MiB, per group size) over NPROC local processes on "
                    "the current backend, fit the cost model's alpha-beta form and write a "
                    "cluster YAML that --cluster accepts; prints each fit with its error.")
    p.add_argument("--nproc", type=_positive_int, default=4, metavar="N",
                   help="processes (devices) to measure over (default: 4)")
    p.add_argument("-o", "--output", metavar="YAML", required=True, help="the profile to write")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="measure the CPU (gloo, the default) or the GPUs (matmul TFLOP/s per "
                        "dtype and HBM bandwidth of GPU 0; all-reduce over NCCL, one process "
                        "per GPU)")
    p.set_defaults(run=_run_calibrate)


def _run_calibrate(args: argparse.Namespace) -> int:
    from meshplan.cost.calibrate import run_calibration
    if args.nproc < 2:
        return _fail(f"--nproc must be at least 2 to measure a collective, got {args.nproc}")
    try:
        text, report = run_calibration(args.nproc, args.output, args.device)
    except RuntimeError as err:   # --device cuda without a GPU
        return _fail(str(err))
    except OSError as err:
        return _fail(f"cannot write the profile to {args.output!r}: {err.strerror or err}")
    print(f"{PROG}: profile written to {args.output}", file=sys.stderr)
    return _emit(json.dumps(report, indent=1) if args.json else text)


def _add_run_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run", help="run a training script on N local processes (as torchrun would)",
        description="Run SCRIPT on NPROC local processes joined as one world (NCCL on GPUs, "
                    "gloo on the CPU), each with torchrun's environment (RANK, WORLD_SIZE, "
                    "LOCAL_RANK, MASTER_ADDR, ...), so the same script runs under torchrun "
                    "across machines; meshplan.parallelize joins that world, rank r on GPU r "
                    "when there are GPUs. A failing process stops the others and the run.")
    p.add_argument("script", metavar="SCRIPT", help="the training script (a Python file)")
    p.add_argument("--nproc", type=_positive_int, default=1, metavar="N",
                   help="processes to start (default: 1)")
    p.add_argument("--ray", action="store_true",
                   help="run each rank as an actor on a Ray cluster (a local one started for "
                        "the run unless --ray-address); needs the 'ray' extra")
    p.add_argument("--ray-address", metavar="ADDRESS",
                   help="the Ray cluster to run on ('auto': the running one); implies --ray")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                   help="where the ranks compute (default auto: a GPU each when there are "
                        "GPUs, on Ray one GPU per actor; else the CPU)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...",
                   help="arguments passed to SCRIPT")
    p.set_defaults(run=_run_script)


def _run_script(args: argparse.Namespace) -> int:
    from meshplan.runtime.run_script import run_script, run_script_on_ray
    try:
        if args.ray or args.ray_address:
            run_script_on_ray(args.script, args.nproc, args.script_args, args.ray_address,
                              device=args.device)
        else:
            run_script(args.script, args.nproc, args.script_args, device=args.device)
    except (ValueError, ImportError) as err:
        return _fail(str(err))
    except WorkerError as err:
        print(f"{PROG}: error: {err.message}", file=sys.stderr)
        return 1
    return 0


def _add_show_program_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "show-program", help="print one rank's static instruction list of a saved plan",
        description="Print the instructions RANK runs in one training step of the plan in "
                    "PLAN_JSON (saved with 'meshplan plan ... -o PLAN_JSON'): RUN forward / "
                    "backward of a micro-batch, SEND / RECV of activations and gradients "
                    "between stages (with the values and layouts moved), FREE, APPLY_GRAD, "
                    "clock by clock of the plan's pipeline schedule.")
    p.add_argument("plan_json", metavar="PLAN_JSON", help="a plan file")
    p.add_argument("--rank", type=int, required=True, help="global rank (0 .. devices - 1)")
    p.set_defaults(run=_run_show_program)


def _run_show_program(args: argparse.Namespace) -> int:
    from meshplan.lower.pipeline_program import format_rank_program, pipeline_program
    from meshplan.plan.plan import load_plan
    try:
        program = pipeline_program(load_plan(args.plan_json))
        text = format_rank_program(program, args.rank)
    except ValueError as err:
        return _fail(str(err))
    return _emit(text)


# ---------------------------------------------------------------- plan command


def _plan_from_args(args: argparse.Namespace) -> Plan:
    """Parse the cluster, build the workload on meta and plan it. Raises ValueError/TypeError."""
    from meshplan.api import plan
    from meshplan.zoo.spec import build_workload
    if (args.alpha is None) != (args.beta is None):
        raise ValueError("give both --alpha and --beta (two values each, one per mesh axis), "
                         "or neither")
    cluster = parse_cluster_spec(args.cluster)
    work = build_workload(args.model, device="meta")
    return plan(work.model, work.loss_fn, args.optimizer, work.example_batch, cluster,
                mesh_shape=args.mesh, alpha=args.alpha, beta=args.beta, method=args.method,
                force_batch_dim=args.force_batch_dim,
                prefer_reduce_scatter=args.prefer_reduce_scatter,
                memory_budget_gb=args.memory_budget_gb, dtype=args.dtype,
                microbatches=args.microbatches, recompute=args.recompute,
                num_layers=args.num_layers, schedule=args.schedule, name=work.name,
                progress=not args.quiet, gather=args.gather, sfb=args.sfb,
                axis_weights=((1.0,), args.ratios) if args.ratios else None,
                segments=args.segments, segment_ratios=args.segment_ratios)


def _run_plan(args: argparse.Namespace) -> int:
    # With --json, stdout carries the JSON document only: anything the pipeline prints goes to stderr.
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    try:
        with quiet:
            result = _plan_from_args(args)
    except (ValueError, TypeError, InfeasiblePlanError, NotImplementedError) as err:
        return _fail(str(err))
    if args.output is not None:
        try:
            result.save(args.output)
        except OSError as err:
            return _fail(f"cannot write plan to {args.output!r}: {err.strerror or err}")
        print(f"{PROG}: plan saved to {args.output}", file=sys.stderr)
    if args.simulate:
        if not args.json:
            _emit(result.explain())
        return _simulated(result, args.timeline, args.json,
                          result.to_json() if args.json else None)
    return _emit(json.dumps(result.to_json(), indent=1) if args.json else result.explain())


def _emit(text: str) -> int:
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # The reader closed the pipe early (``| head``): not worth a traceback. Point stdout at
        # devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


# ---------------------------------------------------------------- entry


def main(argv: list[str] | None = None) -> int:
    """Run the ``meshplan`` command line on ``argv`` (default: ``sys.argv[1:]``); return the exit
    code: 0 on success, 2 on bad user input (message on stderr, no traceback), 1 if stdout's
    reader closed the pipe early."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as err:
        print(err.usage, end="", file=sys.stderr)
        return _fail(str(err))
    except SystemExit as done:  # --help: argparse printed it and asked to exit
        return done.code if isinstance(done.code, int) else 0
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)
