"""The files ``hgopt export`` writes: the runner plan, one ``torchrun`` script per node and, for
``--local``, a script that runs every rank on this machine. Pure Python: no torch."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from hgopt.export.netns import layout
from hgopt.export.runner_plan import NodeSpec, RunnerPlan

__all__ = ["ExportFiles", "node_command", "write_export"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportFiles:
    plan: Path
    node_scripts: tuple[Path, ...]
    commands: tuple[str, ...]
    """The torchrun command of each node, as written into its script."""
    local_script: Path | None


def node_command(rp: RunnerPlan, node: NodeSpec, plan_path: str) -> str:
    """The ``torchrun`` line that starts ``node``'s ranks. The runner maps (node, local rank) to its plan
    rank itself; torchrun's own numbering (node after node) is the same."""
    master = rp.master_addr or '"${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"'
    prefix = ""
    if rp.emulate_links == "netns" and len(rp.clusters) > 1:
        lay = layout(rp)
        master = lay.addr_of(rp, rp.nodes[0].cluster)
        prefix = (f"ip netns exec {lay.namespace_of(rp, node.cluster)} "
                  f"env GLOO_SOCKET_IFNAME={lay.ifname_of(rp, node.cluster)} ")
    return (f"{prefix}torchrun --nnodes {len(rp.nodes)} --node-rank {node.index} --nproc-per-node {len(node.ranks)} "
            f"--master-addr {master} --master-port {rp.master_port} "
            f"-m hgopt.runner --plan {plan_path} --node-index {node.index}")


def write_export(rp: RunnerPlan, out_dir: str | Path) -> ExportFiles:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.json"
    plan_path.write_text(rp.to_json() + "\n")
    scripts, commands = [], []
    for node in rp.nodes:
        cmd = node_command(rp, node, '"$HERE/plan.json"')
        commands.append(node_command(rp, node, shlex.quote(str(plan_path))))
        path = out / f"node{node.index}.sh"
        setup = ""
        if rp.emulate_links == "netns" and len(rp.clusters) > 1 and node.index == 0:
            setup = ("# link emulation: create the namespaces first (root), remove them afterwards:\n"
                     f"#   {sys.executable} -m hgopt.runner.netns up \"$HERE/plan.json\"   (and: down)\n")
        path.write_text(
            "#!/bin/sh\n"
            f"# node {node.index} of {len(rp.nodes)}: cluster {node.cluster}, node {node.cluster_node}, "
            f"ranks {node.ranks[0]}..{node.ranks[-1]}\n"
            f"{setup}"
            'HERE=$(cd "$(dirname "$0")" && pwd)\n'
            f"exec {cmd} \"$@\"\n"
        )
        path.chmod(0o755)
        scripts.append(path)
    local = None
    if rp.local:
        local = out / "run_local.sh"
        local.write_text(
            "#!/bin/sh\n"
            f"# every rank of this plan on this machine ({rp.world_size} processes)\n"
            'HERE=$(cd "$(dirname "$0")" && pwd)\n'
            f"exec \"${{PYTHON:-{sys.executable}}}\" -m hgopt.runner --plan \"$HERE/plan.json\" \"$@\"\n"
        )
        local.chmod(0o755)
    return ExportFiles(plan=plan_path, node_scripts=tuple(scripts), commands=tuple(commands), local_script=local)
