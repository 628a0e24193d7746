"""The magics: `%%ddp` (flags, the cell defined in the notebook, its function handed to `ddpnb.launch`) and the
session magics (`%ddp_start`, `%%ranks`, `%ddp_restart`, `%ddp_stop`), sugar over `ddpnb.session()`."""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import keyword
import shlex
import sys
import time
import types
import weakref
from collections.abc import Mapping
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class, needs_local_scope, no_var_expand
from IPython.core.magic_arguments import (
    MagicHelpFormatter,
    argument,
    kwds,
    magic_arguments,
    parse_argstring,
)
from IPython.utils.process import arg_split

from ddpnb import _api, _compat, _session, engines
from ddpnb._options import DEFAULT_KEEP, Launch, LaunchOptions
from ddpnb.core.pickling import NotPicklableError
from ddpnb.core.record import Outcome
from ddpnb.core.report import WorkerError
from ddpnb.core.run import Run
from ddpnb.core.spec import DEFAULT_CPU_RANKS, ViewKind
from ddpnb.core.words import format_duration, size_text

RANK_FLAGS = [  # where and how many ranks run: the flags %ddp_start shares with %%ddp
    argument(
        "--gpus",
        metavar="N|all",
        help="one rank per GPU over NCCL: a number or 'all'. Without it, ranks run on CPU over gloo.",
    ),
    argument(
        "-n",
        "--nprocs",
        type=int,
        metavar="N",
        help=f"number of CPU ranks over gloo when --gpus is not given (default {DEFAULT_CPU_RANKS}).",
    ),
    argument("--backend", choices=["nccl", "gloo"], help="override the process-group backend."),
    argument(
        "--engine",
        choices=engines.names(),
        default=engines.DEFAULT,
        help=f"where the ranks run: one of the registered engines ({', '.join(engines.names())}); "
        f"'{engines.DEFAULT}' (default) runs them on this machine. Each engine's own flags follow.",
    ),
    # each engine's own options, as the engine describes them (`EngineType.flags`)
    *(
        argument(flag.name, metavar=flag.metavar, choices=flag.choices, help=flag.help)
        for _, engine_flags in engines.flags()
        for flag in engine_flags
    ),
    argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set an environment variable in every rank (repeatable).",
    ),
    argument(
        "--no-fold",
        action="store_true",
        help="show every rank's copy of a line the ranks all print (by default it shows once, as "
        "[ranks 0-3] ...); the log files have every copy either way.",
    ),
    argument(
        "--stall",
        metavar="SECONDS",
        help="when no rank has made progress (output, a metric, a progress tick) for this long, mark the run "
        "stalled and say where each rank is; it goes on (default: adapted to the run, at least 60 s; 0: "
        "off).",
    ),
    argument(
        "--oversubscribe",
        action="store_true",
        help="start more CPU ranks on this machine than 8 for each CPU the kernel may use (at least 16), which "
        "is refused without it (local engine).",
    ),
]


def _rank_flags(fn: types.FunctionType) -> types.FunctionType:
    for decorator in reversed(RANK_FLAGS):
        fn = decorator(fn)
    return fn


class _Usage(MagicHelpFormatter):
    """`%%ddp?` starts with 'usage: %%ddp [...]' (IPython's own prefix, '::' and one %, is reStructuredText)."""

    def add_usage(self, usage: Any, actions: Any, groups: Any, prefix: str | None = "usage: ") -> None:
        argparse.HelpFormatter.add_usage(self, usage, actions, groups, "usage: ")


def _parse(magic: Any, line: str, see: str, elsewhere: Mapping[str, str] | None = None) -> argparse.Namespace:
    """The magic's flags; a bad one is a UsageError naming the close match (`--timout` -> `--timeout`) and `see`."""
    try:
        args = parse_argstring(magic, line)
    except UsageError as exc:
        raise UsageError(f"{exc}{did_you_mean(magic.parser, line, elsewhere)}. {see}") from None
    for name, value in vars(args).items():  # the split keeps a word's quotes: --srun-args '--mem=8G -c 4'
        if isinstance(value, str):
            setattr(args, name, _unquoted(value))
        elif isinstance(value, list):
            setattr(args, name, [_unquoted(item) if isinstance(item, str) else item for item in value])
    return args


def _unquoted(word: str) -> str:
    """A word as a shell would pass it: without the quotes around it."""
    return word[1:-1] if len(word) >= 2 and word[0] == word[-1] and word[0] in "'\"" else word


def did_you_mean(parser: argparse.ArgumentParser, line: str, elsewhere: Mapping[str, str] | None = None) -> str:
    """' (did you mean --timeout?)' for the first flag of `line` the parser does not know, when a common flag or
    one of the engine in use is close (never another engine's: `--time` is Slurm's); for a flag in `elsewhere`
    (another magic's), what it says instead."""
    known = _compat.parser_options(parser)
    offered = [option for option in known if option not in _other_engines_flags(_engine_in(parser, line))]
    for token in arg_split(line):
        flag = token.partition("=")[0]
        # argparse takes any unambiguous prefix of a flag (--time for --timeout): only the others are unknown
        if (
            flag.startswith("-")
            and not flag.lstrip("-").replace(".", "").isdigit()
            and not any(option.startswith(flag) for option in known)
        ):
            if elsewhere and flag in elsewhere:
                return f" ({elsewhere[flag]})"
            close = difflib.get_close_matches(flag, offered, n=1)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


def _engine_in(parser: argparse.ArgumentParser, line: str) -> str:
    """The --engine a line names, else the default (also where the line does not parse that far)."""
    try:
        found = parser.parse_known_args(arg_split(line))[0]
    except UsageError:
        return engines.DEFAULT
    return getattr(found, "engine", None) or engines.DEFAULT


def _other_engines_flags(engine: str) -> set[str]:
    """The flags of every engine but `engine` (a flag two engines share stays offered)."""
    flags = dict(engines.flags())
    mine = {flag.name for flag in flags.get(engine, [])}
    return {flag.name for name, engine_flags in flags.items() if name != engine for flag in engine_flags} - mine


def _run_only(flag: str) -> str:
    """What `%ddp_start` says of a flag that only `%%ddp` takes."""
    if flag == "--timeout":
        return "a session takes no --timeout, as it runs until %ddp_stop; %%ranks --timeout SECONDS bounds a cell"
    return f"{flag} is a flag of %%ddp runs, and a session takes none"


def _check_out_and_timeout(out: str | None, timeout: float | None, example: str) -> None:
    """-o takes a variable name, --timeout a positive number of seconds (nan too is refused)."""
    if out is not None and not (out.isidentifier() and not keyword.iskeyword(out)):
        raise UsageError(f"-o/--out takes a variable name, such as -o {example}, not {out!r}.")
    if timeout is not None and not timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, not {timeout:g}.")


def _rank_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options the rank flags give (`RANK_FLAGS`): ours, and the chosen engine's own that were given."""
    given = {name: getattr(args, name) for name in ("gpus", "nprocs", "backend", "engine")}
    given |= {
        "env": dict(_parse_env(item) for item in args.env),
        "fold": not args.no_fold,
        "stall": args.stall,
        "oversubscribe": args.oversubscribe,
    }
    for _, engine_flags in engines.flags():  # an engine's flag given with another engine: `options` says so
        given |= {
            flag.option: getattr(args, flag.option)
            for flag in engine_flags
            if getattr(args, flag.option, None) is not None
        }
    return given


def _checked(args: argparse.Namespace, **more: Any) -> Launch:
    """The cell's flags as checked launch options; a UsageError saying what to do, before the cell runs."""
    try:
        return LaunchOptions.of({**_rank_options(args), **more}).check()
    except _api.LaunchError as exc:
        raise UsageError(str(exc)) from None


@magics_class
class DDPMagics(Magics):
    def __init__(self, shell: Any = None, **kwargs: Any) -> None:
        super().__init__(shell, **kwargs)
        self._last_cell: tuple[str, Any, LaunchOptions] | None = None  # %ddp_export's: name, function, options
        # the run each cell started last, by cell (`_cell_key`): running the cell again stops it first
        self._cell_runs: weakref.WeakValueDictionary[tuple[str, ...], Run] = weakref.WeakValueDictionary()

    @magic_arguments("%%ddp")
    @kwds(formatter_class=_Usage)
    @_rank_flags
    @argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="stop every rank after this many seconds and show where each one was (default: none).",
    )
    @argument(
        "-o",
        "--out",
        metavar="NAME",
        help="also bind rank 0's return value to NAME in the notebook (with --background: the run handle).",
    )
    @argument(
        "--background",
        action="store_true",
        help="return the run handle at once and keep the dashboard live while other cells run; "
        "the handle has wait(), result(), stop() and status.",
    )
    @argument(
        "--detach",
        action="store_true",
        help="the run is owned by a supervisor process of its own, not this kernel: it goes on if the kernel "
        "dies or restarts; the cell returns its handle at once (as --background), and ddpnb.attach('last') "
        "or %%ddp_attach NAME from any later kernel shows it again (docs/detached.md). Local and Ray engines.",
    )
    @argument(
        "--view",
        choices=[kind.value for kind in ViewKind],
        help="'widget' (the live dashboard), 'text' ([rank N] lines), 'none', or 'auto' (default: "
        "$DDPNB_VIEW, else the dashboard in a Jupyter kernel and text elsewhere).",
    )
    @argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="when a rank fails (an error, a crash, --timeout), stop every rank and start them all again as "
        "fresh processes, up to N times (default 0); ddpnb.load_checkpoint then continues from the latest "
        "complete checkpoint, and ddpnb.attempt() says which attempt runs.",
    )
    @argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="where ddpnb.save_checkpoint writes, in DIR/<run name> (default: the run directory).",
    )
    @argument(
        "--keep-checkpoints",
        type=int,
        default=DEFAULT_KEEP,
        metavar="K",
        help=f"complete checkpoints kept per run; older ones are deleted (default {DEFAULT_KEEP}).",
    )
    @argument(
        "--resume",
        metavar="last|DIR",
        help="start from the latest complete checkpoint of an earlier run that stopped or failed: 'last' (the "
        "newest run with one), or its run directory (ddpnb.load_checkpoint loads it).",
    )
    @argument(
        "--tensorboard",
        metavar="DIR",
        help="write every rank's ddpnb.log metrics as TensorBoard event files in DIR/<run name>/rank<N> while "
        "the run goes (pip install tensorboard); tensorboard --logdir DIR shows them.",
    )
    @argument(
        "--debug",
        action="store_true",
        help="when a rank raises, open a post-mortem prompt (pdb) at the raising line first, in the cell's "
        "input box; leaving it (q or c) ends the run with the usual report.",
    )
    @argument(
        "--profile",
        nargs="?",
        const=True,
        default=None,
        metavar="STEPS",
        help="profile these steps (counted by ddpnb.log(step=...)) with torch.profiler on every rank, e.g. "
        "--profile 5-7 (alone: steps 3-5); the cell then says where each rank's step time went and which "
        "rank the others waited for, and the run directory holds one merged trace (profile/"
        "trace.json.gz, for Perfetto or chrome://tracing). See docs/profiling.md.",
    )
    @argument(
        "--fn",
        metavar="NAME",
        help="the function to run (default: the function the cell defines that nothing else in it uses).",
    )
    @argument(
        "--export",
        metavar="PATH",
        help="also write the function, with what it uses from the notebook, as a script torchrun or srun "
        "runs (see %%ddp_export? and docs/export.md); then run the cell as usual.",
    )
    @line_cell_magic
    def ddp(self, line: str, cell: str | None = None) -> object:
        """Run the cell's function on every rank in fresh worker processes; show their output; return rank 0's
        result. The line form, `%ddp --fn NAME [flags]`, runs a function defined earlier.

        The cell runs in the notebook first, like any cell, so what it defines stays available; its function
        (the one nothing else in the cell uses, or --fn NAME) is then called on every rank as fn(), fn(rank) or
        fn(rank, world_size), with the process group already initialised. Set DDPNB_CPU_FALLBACK=1 to run
        --gpus notebooks on CPU ranks where there are not enough GPUs. In Jupyter the run shows as a live
        dashboard (DDPNB_VIEW=text or --view text for plain `[rank N]` lines); --background returns its handle
        at once. Running a cell again first stops the run it started earlier, if that is still going; ddpnb.runs()
        lists every live run. With -o NAME the cell shows no value (NAME has it); a state dict shows as one line.
        """
        __tracebackhide__ = True  # an error in the cell's own code shows the user's lines, not these
        key = self._cell_key(line, cell)
        self._stop_earlier_run(key)  # first, as any cell run again replaces what it did, whatever it does now
        args = _parse(self.ddp, line, "See %%ddp? for every flag, e.g. %%ddp -n 2 or %%ddp --gpus all.")
        _check_out_and_timeout(args.out, args.timeout, "weights")
        if args.nprocs is not None and args.nprocs < 1:
            raise UsageError(f"--nprocs must be at least 1, not {args.nprocs}. Example: %%ddp -n 2")
        launch = _checked(
            args,
            timeout=args.timeout,
            view=args.view,
            max_restarts=args.max_restarts,
            checkpoint_dir=args.checkpoint_dir,
            keep_checkpoints=args.keep_checkpoints,
            resume=args.resume,
            tensorboard=args.tensorboard,
            debug=args.debug,
            profile=args.profile,
            detach=args.detach,
        )  # before the cell runs
        if not cell and not args.fn:
            raise UsageError("%ddp (one %) runs a function defined earlier: name it, e.g. %ddp -n 2 --fn train.")
        try:
            found = self._run_cell(cell, pick=not args.fn) if cell else None
        except _SyntaxShown:
            return None
        name = args.fn or found
        fn = self.shell.user_ns.get(name)
        if fn is None:
            raise UsageError(f"--fn {name}: no function of that name in the notebook.")
        if not callable(fn):
            raise UsageError(f"--fn {name}: {name} is not a function (its type is {type(fn).__name__}).")
        self._last_cell = (name, fn, launch.options)  # what %ddp_export writes
        if args.export:
            self.ddp_export(shlex.quote(args.export))
        background = args.background or args.detach  # a detached run's cell never waits: the kernel may go
        try:
            run = _api.start(fn, launch, foreground=not background)
        except (_api.LaunchError, NotPicklableError) as exc:
            raise UsageError(str(exc)) from None
        if args.detach:  # it outlives the kernel: running the cell again starts another, it stops nothing
            if args.out:
                self.shell.user_ns[args.out] = run
            else:
                print(
                    f"[ddpnb] detached as {run.name}: ddpnb.attach({run.name!r}) or %ddp_attach {run.name} from "
                    f"any kernel; its handle here is {self._keep_as_output(run)}"
                )
            return None
        self._cell_runs[key] = run
        if args.background:
            if args.out:
                self.shell.user_ns[args.out] = run
                return None
            where = self._keep_as_output(run)
            print(f"[ddpnb] its handle is {where} (add -o NAME to name it); ddpnb.runs() lists every live run")
            return None
        result = run.result()
        if args.out:  # like `weights = train()`: the value has a name, so the cell shows none
            self.shell.user_ns[args.out] = result
            return None
        summary = state_dict_summary(result)
        if summary is not None:  # not ~60 lines of tensors: one line, and the dict itself as the cell's value
            from IPython.display import display

            display({"text/plain": f"{summary} (the dict is {self._keep_as_output(result)})"}, raw=True)
            return None
        return result

    @magic_arguments("%ddp_export")
    @kwds(formatter_class=_Usage)
    @argument("path", help="the script to write, e.g. train.py")
    @argument(
        "--sbatch",
        action="store_true",
        help="also write PATH's .sbatch file: srun runs the script with one task per rank, the cell's nodes, "
        "GPUs and time as #SBATCH lines.",
    )
    @argument("--torchrun", action="store_true", help="print the torchrun command line that runs the script.")
    @argument(
        "--data",
        metavar="DIR",
        help="save the notebook's values that have no source (a tensor, a model) in DIR, which the script "
        "loads at start (without it, such a value is refused, with the line that uses it).",
    )
    @argument(
        "--fn",
        metavar="NAME",
        help="export this function, with %%%%ddp's defaults, instead of the last %%%%ddp cell's.",
    )
    @line_magic
    def ddp_export(self, line: str) -> None:
        """Write the last %%ddp cell's function, and what it uses from the notebook (imports, functions, classes,
        constants), as a standalone script that torchrun or srun runs with the cell's ranks: `%ddp_export
        train.py --sbatch`. See docs/export.md."""
        from ddpnb.script.sources import ExportError
        from ddpnb.script.writer import write

        args = _parse(self.ddp_export, line, "See %ddp_export? for every flag, e.g. %ddp_export train.py --sbatch.")
        if args.fn:
            fn = self.shell.user_ns.get(args.fn)
            if not callable(fn):
                raise UsageError(f"--fn {args.fn}: no function of that name in the notebook.")
            name, options = args.fn, LaunchOptions()
        elif getattr(self, "_last_cell", None) is not None:
            name, fn, options = self._last_cell
        else:
            raise UsageError(
                "%ddp_export writes the last %%ddp cell's function, and no %%ddp cell has run yet: run "
                "one first, or name a function with --fn NAME."
            )
        try:
            exported = write(
                fn, args.path, options, name=name, sbatch=args.sbatch, torchrun=args.torchrun, data=args.data
            )
        except (ExportError, _api.LaunchError) as exc:
            raise UsageError(str(exc)) from None
        print(exported)

    def _cell_key(self, line: str, cell: str | None) -> tuple[str, ...]:
        """Which cell this is, so that running it again stops its earlier run: the front end's cell ID where it
        sends one (JupyterLab, Notebook 7, VS Code: the cell stays the same cell when edited), else its text."""
        info = getattr(getattr(self.shell.displayhook, "exec_result", None), "info", None)
        cell_id = getattr(info, "cell_id", None)
        if cell_id:
            return ("id", cell_id) if cell is not None else ("id", cell_id, line)  # two %ddp lines: two runs
        return ("text", line, cell or "")

    def _stop_earlier_run(self, key: tuple[str, ...]) -> None:
        earlier = self._cell_runs.pop(key, None)
        if earlier is None or earlier.done:
            return
        started = earlier.record.started
        earlier.stop(Outcome.STOPPED, "stopped because its cell was run again")
        print(f"[ddpnb] stopped the earlier run of this cell (started {format_duration(time.time() - started)} ago)")

    def _keep_as_output(self, value: object) -> str:
        """Make `value` the cell's value (`_`, `Out[N]`) without displaying it; say where it is."""
        hook = self.shell.displayhook
        hook.update_user_ns(value)
        return f"Out[{hook.prompt_count}]" if hook.do_full_cache else "`_`"

    def _run_cell(self, cell: str, pick: bool) -> str | None:
        """Run the cell's code in the notebook, as a cell of its own would run (IPython's `!cmd` and `%magic`
        lines included, its lines in tracebacks under this cell's In[N]); with `pick`, return its function's name."""
        __tracebackhide__ = True
        cell = as_numbered_in_the_cell(self.shell, cell)
        filename = self.shell.compile.cache(cell, self._cell_number())
        try:
            tree = ast.parse(cell, filename)
        except SyntaxError as exc:
            show_syntax_error(self.shell, filename, exc)
            raise _SyntaxShown from None
        if pick and not any(
            isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Assign | ast.AnnAssign) for node in tree.body
        ):
            raise UsageError(NO_FUNCTION)  # before the cell runs: nothing it does happens twice
        exec(compile(tree, filename, "exec"), self.shell.user_ns)  # noqa: S102 - the user's own cell
        return _the_function(tree, self.shell.user_ns) if pick else None

    def _cell_number(self) -> int:
        return _cell_number(self.shell)


def _cell_number(shell: object) -> int:
    """This cell's N in In[N]. IPython 8 counts a cell after running it, IPython 9 before: the result IPython is
    building for the cell knows which."""
    building = getattr(shell.displayhook, "exec_result", None)  # type: ignore[attr-defined]
    count = getattr(building, "execution_count", None)
    return count if isinstance(count, int) else shell.execution_count  # type: ignore[attr-defined]


def as_numbered_in_the_cell(shell: Any, body: str) -> str:
    """A cell magic's body transformed as IPython transforms a cell (`!cmd`, `%magic`), with blank lines in place of
    the magic's line and of the leading blank lines IPython drops: line K of the code is line K of the cell as
    the notebook numbers it, in tracebacks, stacks and SyntaxErrors."""
    code = shell.transform_cell(body)
    dropped = _leading_blank_lines(body) - _leading_blank_lines(code)
    return "\n" * (1 + max(0, dropped)) + code


def _leading_blank_lines(text: str) -> int:
    lines = text.splitlines()
    return next((i for i, line in enumerate(lines) if line.strip()), len(lines))


class _SyntaxShown(Exception):
    """The cell's SyntaxError was shown already: `%%ddp` ends without another word."""


def show_syntax_error(shell: Any, filename: str, exc: SyntaxError) -> None:
    """A magic cell's SyntaxError, shown as a plain cell shows one: its line, no frames of IPython or ddpnb; and
    the cell still counts as failed (Run All stops here)."""
    shell.showsyntaxerror(filename)
    building = getattr(shell.displayhook, "exec_result", None)
    if building is not None:
        building.error_in_exec = exc


def state_dict_summary(value: object) -> str | None:
    """'state dict: 62 tensors, 11.2 M parameters (float32), 42.7 MiB' for a non-empty mapping whose values are
    all tensors (a model's state_dict()); None for any other value."""
    torch = sys.modules.get("torch")
    if (
        torch is None
        or not isinstance(value, Mapping)
        or not value
        or not all(isinstance(tensor, torch.Tensor) for tensor in value.values())
    ):
        return None
    tensors = list(value.values())
    count = sum(tensor.numel() for tensor in tensors)
    size = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    dtypes = ", ".join(sorted({str(tensor.dtype).removeprefix("torch.") for tensor in tensors}))
    return (
        f"state dict: {len(tensors)} tensor{'s' * (len(tensors) != 1)}, {_count(count)} parameters ({dtypes}), "
        f"{size_text(size)}"
    )


def _count(number: int) -> str:
    for limit, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if number >= limit:
            return f"{number / limit:.1f} {unit}"
    return str(number)


NO_FUNCTION = (
    "this %%ddp cell defines no function. Define one, e.g.\n    def train(rank, world_size): ...\n"
    "or name an existing one with --fn NAME."
)


def _the_function(tree: ast.Module, namespace: dict[str, object]) -> str:
    """The function a %%ddp cell defines for the ranks: among the functions it defines (`def`, or a name it binds
    to a function or partial), the one no other statement of the cell refers to, e.g. `train` and not the
    `helper` that `train` calls, nor the `make_train` that `train = make_train(0.1)` calls. More than one such
    function is ambiguous: `--fn NAME` says which."""
    defined: dict[str, int] = {}  # name -> the statement that binds it last
    for index, node in enumerate(tree.body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            defined[node.name] = index
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and _is_function(namespace.get(target.id)):
                    defined[target.id] = index
    if not defined:
        raise UsageError(NO_FUNCTION)
    used = {
        name: {
            i
            for i, node in enumerate(tree.body)
            for sub in ast.walk(node)
            if isinstance(sub, ast.Name) and sub.id == name and isinstance(sub.ctx, ast.Load)
        }
        for name in defined
    }
    unused = [name for name, index in sorted(defined.items(), key=lambda item: item[1]) if not used[name] - {index}]
    if len(unused) > 1:
        names = " and ".join(f"`{name}`" for name in unused)
        raise UsageError(
            f"this cell defines {names}, and none of them uses another: which one should every rank "
            f"run? Add it to the %%ddp line, e.g. --fn {unused[-1]}. The cell's definitions are in "
            "place, so `%ddp --fn NAME` with the same flags runs one now."
        )
    return unused[0] if unused else max(defined, key=defined.__getitem__)


def _is_function(value: object) -> bool:
    return isinstance(value, types.FunctionType | functools.partial)


def _parse_env(item: str) -> tuple[str, str]:
    try:  # the magic's split keeps a word's quotes: --env 'MSG=a b' arrives as "'MSG=a b'"
        words = shlex.split(item) if "'" in item or '"' in item else []
    except ValueError:  # an unbalanced quote: the value's own
        words = []
    key, sep, value = (words[0] if len(words) == 1 else item).partition("=")
    if not sep or not key:
        raise UsageError(f"--env takes KEY=VALUE, not {item!r}. Example: --env NCCL_DEBUG=INFO")
    return key, value


def parse_ranks(text: str) -> list[int]:
    """'0', '0,2', '1-3', '0,2-3' -> rank numbers."""
    ranks: set[int] = set()
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        low, dash, high = part.partition("-")
        try:
            ranks.update(range(int(low), int(high) + 1) if dash else [int(low)])
        except ValueError:
            raise UsageError(f"ranks are written 0, 0,2 or 1-3, not {text!r}.") from None
    if not ranks:
        raise UsageError(f"no rank selected by {text!r}: write 0, 0,2 or 1-3.")
    return sorted(ranks)


@magics_class
class SessionMagics(Magics):
    """%ddp_start, %%ranks / %ranks, %ddp_restart, %ddp_debug and %ddp_stop: sugar over `ddpnb.session()`."""

    @magic_arguments("%ddp_start")
    @kwds(formatter_class=_Usage)
    @_rank_flags
    @line_magic
    def ddp_start(self, line: str) -> None:
        """Start ranks that keep their state across cells: `%%ranks` cells then run on every rank, in each rank's
        own namespace (`rank`, `world_size` and `ddpnb` defined, the process group up). One session per kernel;
        `%%ddp` cells keep starting fresh ranks of their own."""
        ours = set(_compat.parser_options(self.ddp_start.parser))
        run_only = {flag: _run_only(flag) for flag in _compat.parser_options(DDPMagics.ddp.parser) if flag not in ours}
        args = _parse(self.ddp_start, line, "See %ddp_start? for every flag, e.g. %ddp_start -n 2.", run_only)
        try:
            _session.start_for_magics(**_rank_options(args))
        except (_api.LaunchError, NotPicklableError) as exc:
            raise UsageError(str(exc)) from None

    @magic_arguments("%%ranks")
    @kwds(formatter_class=_Usage)
    @argument("ranks", nargs="?", default=None, help="the ranks to run on: 0, 0,2 or 1-3 (default: every rank).")
    @argument("-o", "--out", metavar="NAME", help="also bind the per-rank values to NAME in the notebook.")
    @argument(
        "--timeout", type=float, metavar="SECONDS", help="interrupt the cell on every rank after this many seconds."
    )
    @line_cell_magic
    def ranks(self, line: str, cell: str | None = None) -> object:
        """Run the cell on the session's ranks; its last expression's value comes back, one per rank. The line
        form runs one expression on every rank: `%ranks loss.item()`."""
        __tracebackhide__ = True
        session = _session.current_session()
        if session is None:
            raise UsageError(
                "no session is running: start one with %ddp_start -n 2 (or --gpus N), then run %%ranks cells."
            )
        if cell is None:  # the line form: the whole line is the expression, on every rank (line 1, the magic's)
            code, selected, out, timeout = self.shell.transform_cell(line), None, None, None
        else:
            args = _parse(self.ranks, line, "Example: %%ranks 0,2 -o values")
            _check_out_and_timeout(args.out, args.timeout, "values")
            code, out, timeout = as_numbered_in_the_cell(self.shell, cell), args.out, args.timeout
            selected = None if args.ranks is None else parse_ranks(args.ranks)
        filename = self.shell.compile.cache(code, _cell_number(self.shell))
        try:
            values = session.execute(code, ranks=selected, timeout=timeout, filename=filename)
        except SyntaxError as exc:  # found here, before any rank was sent the cell
            show_syntax_error(self.shell, filename, exc)
            return None
        except ValueError as exc:  # ranks outside the session
            raise UsageError(str(exc)) from None
        if out:
            self.shell.user_ns[out] = values
        return values

    @line_magic
    def ddp_attach(self, line: str) -> object:
        """`%ddp_attach [NAME|PATH]`: the handle of a detached run (default: the newest), shown as its dashboard,
        its whole history first, then live. ddpnb.runs() lists them."""
        try:
            return _api.attach(line.strip() or "last")
        except (LookupError, PermissionError, _api.JournalError) as exc:
            raise UsageError(str(exc)) from None

    @line_magic
    def ddp_restart(self, line: str) -> None:
        """Fresh ranks for the session, with its flags: new processes and process group, empty namespaces."""
        session = _session.current_session()
        if session is None:
            raise UsageError("no session to restart: start one with %ddp_start -n 2.")
        session.restart()

    @line_magic
    def ddp_debug(self, line: str) -> None:
        """`%ddp_debug [RANK]`: post-mortem on that rank's last failed `%%ranks` cell (default rank 0), in this
        cell's input box; its namespace is intact, and the session goes on afterwards."""
        session = _session.current_session()
        if session is None:
            raise UsageError("no session is running: %ddp_debug opens a session rank's last error.")
        try:
            rank = int(line.strip() or 0)
        except ValueError:
            raise UsageError(f"%ddp_debug takes a rank number, e.g. %ddp_debug 1, not {line.strip()!r}.") from None
        try:
            session.debug(rank)
        except ValueError as exc:  # a rank outside the session
            raise UsageError(str(exc)) from None

    @line_magic
    def ddp_stop(self, line: str) -> None:
        """End the session's ranks (and their namespaces)."""
        session = _session.current_session()
        if session is None:
            raise UsageError("no session to stop: none was started in this kernel (%ddp_start -n 2 starts one).")
        if session.state is _session.SessionState.STOPPED:  # a second %ddp_stop, or the ranks ended on their own
            print(
                f"[ddpnb] no session to stop: this kernel's session had ended already "
                f"({session.stopped_by or 'stopped'}); %ddp_restart starts it again with its flags, %ddp_start "
                "with new ones"
            )
            return
        session.stop()


def point_debug_at_the_ranks(ipython: Any) -> None:
    """`%debug` right after a failed run or `%%ranks` cell would open pdb in ddpnb's own frames in the kernel, not
    the rank's (its process is gone, or elsewhere): it says how to reach the rank's frames instead. Anything else,
    and `%debug` with arguments, is IPython's own."""
    original = ipython.find_magic("debug")
    if original is None or getattr(original, "ddpnb_points", False):  # no such magic, or `%reload_ext`
        return

    @no_var_expand  # as IPython's own: the statement as typed ($x, {x} kept), and the caller's local namespace
    @needs_local_scope
    def debug(line: str = "", cell: str | None = None, local_ns: Any = None) -> Any:
        error = getattr(sys, "last_value", None)
        if line.strip() or cell is not None or not isinstance(error, (WorkerError, _session.SessionError)):
            return original(line, cell, local_ns)
        print(_debug_pointer(error))
        return None

    debug.ddpnb_points = True  # type: ignore[attr-defined]
    debug.__doc__ = original.__doc__
    ipython.register_magic_function(debug, "line_cell", "debug")


def _debug_pointer(error: BaseException) -> str:
    if isinstance(error, _session.SessionError):
        return (
            "[ddpnb] The error came from the session's ranks, whose namespaces are intact: `%ddp_debug RANK` "
            "opens pdb post-mortem where that rank's cell raised (`%ddp_debug 0`). %debug here would open "
            "ddpnb's own frames in the kernel."
        )
    first = error.record.first_failure if isinstance(error, WorkerError) else None
    who = f"rank {first.rank}'s process" if first is not None else "the ranks' processes"
    kept = (
        "; its locals where it raised are kept in `ddpnb.last_run().first_failure.frames`"
        if first is not None and first.frames
        else ""
    )
    return (
        f"[ddpnb] The error came from {who}, which has ended{kept}. To debug it on the rank, run the cell "
        "again with `%%ddp --debug`: the rank that raises opens pdb post-mortem at the raising line, in this "
        "cell's input box. %debug here would open ddpnb's own frames in the kernel."
    )
