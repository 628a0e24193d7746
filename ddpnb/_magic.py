"""`%%ddp`: parse flags, define the cell in the notebook, pick its function, hand it to `ddpnb.launch`."""

from __future__ import annotations

import ast

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ddpnb import _api, _pickling


@magics_class
class DDPMagics(Magics):
    @magic_arguments()
    @argument("--gpus", metavar="N|all",
              help="one rank per GPU over NCCL: a number or 'all'. Without it, ranks run on CPU over gloo.")
    @argument("-n", "--nprocs", type=int, metavar="N",
              help=f"number of CPU ranks over gloo when --gpus is not given (default {_api.DEFAULT_CPU_RANKS}).")
    @argument("--backend", choices=["nccl", "gloo"], help="override the process-group backend.")
    @argument("--timeout", type=float, metavar="SECONDS",
              help="stop every rank after this many seconds and show where each one was (default: none).")
    @argument("-o", "--out", metavar="NAME",
              help="also bind rank 0's return value to NAME in the notebook (with --background: the run handle).")
    @argument("--background", action="store_true",
              help="return the run handle at once and keep the dashboard live while other cells run; "
                   "the handle has wait(), result(), stop() and status.")
    @argument("--view", choices=list(_api.VIEWS),
              help="'widget' (the live dashboard), 'text' ([rank N] lines), 'none', or 'auto' (default: "
                   "$DDPNB_VIEW, else the dashboard in a Jupyter kernel and text elsewhere).")
    @argument("--engine", choices=list(_api.ENGINES), default="local",
              help="'local' (default): ranks are processes on this machine; 'ray': on a Ray cluster, through Ray "
                   "Train (pip install 'ddpnb[ray]').")
    @argument("--address", metavar="auto|HOST:PORT|ray://HOST:PORT|local",
              help="with --engine ray: the cluster to use (default: the one this kernel is connected to, else "
                   "$RAY_ADDRESS or a `ray start` cluster on this machine, else a local Ray instance sized for the "
                   "run, which 'local' asks for in any case).")
    @argument("--placement", choices=["pack", "spread"],
              help="with --engine ray: 'pack' ranks onto few nodes (default) or 'spread' them across nodes.")
    @argument("--env", action="append", default=[], metavar="KEY=VALUE",
              help="set an environment variable in every rank (repeatable).")
    @argument("--fn", metavar="NAME",
              help="the function to run (default: the last function the cell defines).")
    @line_cell_magic
    def ddp(self, line: str, cell: str | None = None) -> object:
        """Run the cell's function on every rank in fresh worker processes; show their output; return rank 0's
        result.

        The cell runs in the notebook first, like any cell, so what it defines stays available; its function
        (the last one it defines, or --fn NAME) is then called on every rank as fn(), fn(rank) or
        fn(rank, world_size), with the process group already initialised. Set DDPNB_CPU_FALLBACK=1 to run
        --gpus notebooks on CPU ranks where there are not enough GPUs. In Jupyter the run shows as a live
        dashboard (DDPNB_VIEW=text or --view text for plain `[rank N]` lines); --background returns its handle
        at once.
        """
        try:
            args = parse_argstring(self.ddp, line)
        except UsageError as exc:
            raise UsageError(f"{exc}. See %%ddp? for every flag, e.g. %%ddp -n 2 or %%ddp --gpus all.") from None
        env = dict(_parse_env(item) for item in args.env)
        if args.timeout is not None and args.timeout <= 0:
            raise UsageError(f"--timeout must be a positive number of seconds, not {args.timeout:g}.")
        if args.nprocs is not None and args.nprocs < 1:
            raise UsageError(f"--nprocs must be at least 1, not {args.nprocs}. Example: %%ddp -n 2")
        try:
            _api.plan(args.gpus, args.nprocs, args.backend, args.engine)  # fail before the cell defines anything
        except _api.LaunchError as exc:
            raise UsageError(str(exc)) from None
        name = args.fn or (_last_function(cell) if cell else None)
        if name is None:
            raise UsageError("this %%ddp cell defines no function. Define one, e.g.\n"
                             "    def train(rank, world_size): ...\nor name an existing one with --fn NAME.")
        if cell:
            self._define(cell)
        fn = self.shell.user_ns.get(name)
        if not callable(fn):
            raise UsageError(f"--fn {name}: no function of that name in the notebook.")
        try:
            run = _api.start(fn, gpus=args.gpus, nprocs=args.nprocs, backend=args.backend,
                             timeout=args.timeout, env=env, view=args.view, foreground=not args.background,
                             engine=args.engine, address=args.address, placement=args.placement)
        except (_api.LaunchError, _pickling.NotPicklableError) as exc:
            raise UsageError(str(exc)) from None
        if args.background:
            if args.out:
                self.shell.user_ns[args.out] = run
            return run
        result = run.result()
        if args.out:
            self.shell.user_ns[args.out] = result
        return result

    def _define(self, cell: str) -> None:
        """Run the cell's code in the notebook namespace, registered with IPython so tracebacks show its lines."""
        filename = self.shell.compile.cache(cell)
        code = compile(cell, filename, "exec")
        exec(code, self.shell.user_ns)  # noqa: S102 - this is the user's own cell, as a normal cell would run


def _last_function(cell: str) -> str | None:
    try:
        tree = ast.parse(cell)
    except SyntaxError as exc:
        raise UsageError(f"the cell has a syntax error: {exc}") from None
    names = [node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
    return names[-1] if names else None


def _parse_env(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise UsageError(f"--env takes KEY=VALUE, not {item!r}. Example: --env NCCL_DEBUG=INFO")
    return key, value
