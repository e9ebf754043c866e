"""The kinds' table: one row per capture kind, command and agent extension, every module named
as a string.

The lists that used to be written by hand, one per place, are read from these rows:

- the CLI's commands (``dynprof.cli.COMMANDS``, in the order ``dynprof --help`` lists them), and
  from them the modules of the import contract "The CLI's commands import none of each other"
  in pyproject.toml (written by ``scripts/gen_cli_reference.py``, whose ``--check`` fails while
  it is stale);
- the agent's extensions (``dynprof.agent._agent.EXTENSIONS``, in the order it installs them);
- the renderers of an artifact of the row's kind (``dynprof.renderers.RENDERERS`` and
  ``HTML_RENDERERS``), for ``dynprof show`` and the web page;
- the options that features add to ``dynprof run`` (``dynprof.cli._run_options.load_run_options``,
  after the ones it lists itself);
- the sidecar's actions of a kind (``dynprof.sidecar.table.ACTIONS``, after the rows written
  there): each an :class:`dynprof.action_spec.ActionSpec` of the kind's own code.

A row names modules and never imports them: the agent reads this table at start without
loading any kind's module before its extension, and a renderer is imported only when an
artifact of its kind is shown. This module imports nothing of dynprof, and nothing the agent
does not import already.

The rows' order is both the order of the commands in ``dynprof --help`` and the order in which
the agent installs its extensions: a new row goes where its command is listed.
"""

from __future__ import annotations

from typing import NamedTuple


class Kind(NamedTuple):
    """One row: a capture kind (``name`` is the kind of its artifacts, which its renderers show),
    or a command or an agent extension that has no kind of its own. Each field it does not have
    is None.

    - ``command``: (subcommand name, module under ``dynprof.cli``, class name);
    - ``agent_extension``: the module the agent imports at start, which has ``install(agent)``;
    - ``renderer``: ``"module:function"`` taking an artifact of kind ``name`` and returning its
      summary (a dict, for ``--json``) and its text;
    - ``html_renderer``: ``"module:function"`` returning the HTML fragment (self-contained, no
      script) that the web page shows above the text;
    - ``run_option``: the module of its ``dynprof run`` option, which appends its
      ``(add_arguments, apply)`` pair to ``dynprof.cli._run_options.RUN_OPTIONS``;
    - ``action``: ``"module:ATTR"`` of its sidecar action, an
      :class:`dynprof.action_spec.ActionSpec` (the request, the collect, the job-wide answer,
      the limits), the action named after the row.

    A row is a named tuple (read-only) rather than a frozen dataclass: the agent reads the table
    when it starts in the training process, and making the dataclass would add a third of a
    millisecond to that start.
    """

    name: str
    command: tuple[str, str, str] | None = None
    agent_extension: str | None = None
    renderer: str | None = None
    html_renderer: str | None = None
    run_option: str | None = None
    action: str | None = None


KINDS: tuple[Kind, ...] = (
    Kind("run", command=("run", "run", "RunCommand")),
    Kind("ps", command=("ps", "ps", "PsCommand")),
    Kind("nodes", command=("nodes", "nodes", "NodesCommand")),
    Kind("attach", command=("attach", "attach", "AttachCommand")),
    Kind("start", command=("start", "start", "StartCommand")),
    Kind("stop", command=("stop", "stop", "StopCommand")),
    Kind("trace", agent_extension="dynprof.agent._ext_trace", renderer="collectors.torch_trace:render_artifact"),
    Kind(
        "stacks",
        command=("stacks", "stacks", "StacksCommand"),
        agent_extension="dynprof.agent._ext_stacks",
        renderer="collectors.stacks:render_artifact",
    ),
    Kind(
        "nccl",
        command=("nccl", "nccl", "NcclCommand"),
        renderer="collectors.flight_recorder:render_artifact",
        action="dynprof.job.nccl:ACTION",
    ),
    Kind(
        "gpu-coredump",
        command=("gpu-coredump", "gpu_coredump", "GpuCoredumpCommand"),
        run_option="dynprof.cli._run_gpu",
    ),
    Kind(
        "memory",
        command=("memory", "memory", "MemoryCommand"),
        agent_extension="dynprof.agent._ext_memory",
        renderer="collectors.memory.render:render_artifact",
    ),
    Kind("memory-plan", renderer="collectors.memory.plan.render:render_artifact"),
    Kind("host-memory", renderer="collectors.host_memory:render_artifact"),
    Kind("memory-report", command=("memory-report", "memory_report", "MemoryReportCommand")),
    Kind("hang", agent_extension="dynprof.agent._ext_hang", renderer="collectors.stacks:render_artifact"),
    Kind("flight", agent_extension="dynprof.agent._ext_flight"),  # its dumps are `nccl` artifacts
    Kind("job_store", agent_extension="dynprof.agent._ext_job_store"),
    # A healthcheck artifact has no renderer: its manifest's summary says the verdict.
    Kind(
        "healthcheck",
        command=("healthcheck", "healthcheck", "HealthcheckCommand"),
        action="healthcheck.collect:ACTION",
    ),
    Kind("link-test", command=("link-test", "link_test", "LinkTestCommand"), action="dynprof.job.links:ACTION"),
    Kind("ls", command=("ls", "ls", "LsCommand")),
    Kind("show", command=("show", "show", "ShowCommand")),
    Kind("analyze", command=("analyze", "analyze", "AnalyzeCommand")),
    Kind(
        "analysis",
        renderer="collectors.trace_analysis.render:render_artifact",
        html_renderer="collectors.trace_analysis.html:render_html",
    ),
    Kind("watch", command=("watch", "watch", "WatchCommand")),
    Kind("verdict", renderer="dynprof.watch.render:render_artifact", html_renderer="dynprof.watch.html:render_html"),
    Kind("serve", command=("serve", "serve", "ServeCommand")),
)


def commands() -> tuple[tuple[str, str, str], ...]:
    """Every row's command, in the table's order (``dynprof --help``'s)."""
    return tuple(kind.command for kind in KINDS if kind.command is not None)


def agent_extensions() -> tuple[str, ...]:
    """Every row's agent extension, in the table's order (the order the agent installs them)."""
    return tuple(kind.agent_extension for kind in KINDS if kind.agent_extension is not None)


def renderers() -> dict[str, str]:
    """Artifact kind -> ``"module:function"`` of its text renderer."""
    return {kind.name: kind.renderer for kind in KINDS if kind.renderer is not None}


def html_renderers() -> dict[str, str]:
    """Artifact kind -> ``"module:function"`` of its HTML renderer."""
    return {kind.name: kind.html_renderer for kind in KINDS if kind.html_renderer is not None}


def run_options() -> tuple[str, ...]:
    """Every row's ``dynprof run`` option module, in the table's order."""
    return tuple(kind.run_option for kind in KINDS if kind.run_option is not None)


def actions() -> dict[str, str]:
    """Action name (the row's) -> ``"module:ATTR"`` of its spec, in the table's order."""
    return {kind.name: kind.action for kind in KINDS if kind.action is not None}
