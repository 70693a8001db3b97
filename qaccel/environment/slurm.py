"""The tasks of a SLURM srun step, by SLURM's variables; SLURM's host lists, task counts, ports and job states."""

from __future__ import annotations

import itertools
import re
import subprocess
from collections.abc import Mapping

from qaccel.environment.layout import Environment, Kind
from qaccel.environment.variables import ceil_div, first, first_int, int_of, optional_int


class SlurmStep:
    """Only a multi-task srun step counts: a batch script or salloc shell also carries SLURM_PROCID."""

    kind = Kind.SLURM

    def find(self, env: Mapping[str, str]) -> Environment | None:
        return _slurm(env)


def _slurm(env: Mapping[str, str]) -> Environment | None:
    """Only a multi-task srun step counts: a batch script or salloc shell also carries SLURM_PROCID."""
    if "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
        return None
    count_key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    world_size = int_of(env, count_key, 1)
    if world_size <= 1:
        return None

    node_rank = int_of(env, "SLURM_NODEID", 0)
    num_nodes = first_int(env, ("SLURM_STEP_NUM_NODES", "SLURM_NNODES"))
    master_addr, address_from = env.get("MASTER_ADDR"), "MASTER_ADDR"
    if num_nodes is None or master_addr is None:
        hosts = _nodelist(env)
        num_nodes = num_nodes if num_nodes is not None else (len(hosts) or 1)
        if master_addr is None:
            master_addr = next(iter(hosts), None)
            address_from = f"the first node of {_nodelist_key(env)}"
    master_port = optional_int(env, "MASTER_PORT")
    job_id = first(env, ("SLURM_JOB_ID", "SLURM_JOBID"))
    if master_port is None and job_id is not None:
        master_port = slurm_port(job_id)

    return Environment(
        kind=Kind.SLURM,
        rank=int_of(env, "SLURM_PROCID", 0),
        local_rank=int_of(env, "SLURM_LOCALID", 0),
        node_rank=node_rank,
        world_size=world_size,
        local_world_size=_slurm_local_world_size(env, node_rank, world_size, num_nodes),
        num_nodes=num_nodes,
        master_addr=master_addr,
        master_port=master_port,
        address_from=address_from,
    )


def _slurm_local_world_size(env: Mapping[str, str], node_rank: int, world_size: int, num_nodes: int) -> int:
    """Tasks on this node from the per-node spec; an even split when the spec cannot say."""
    key = next((k for k in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if k in env), None)
    if key is not None:
        try:
            per_node = parse_tasks_per_node(env[key])
        except ValueError as err:
            raise ValueError(f"{key}={env[key]!r}: {err}") from None
        if 0 <= node_rank < len(per_node):
            return per_node[node_rank]
    return ceil_div(world_size, num_nodes)


def _nodelist(env: Mapping[str, str]) -> list[str]:
    """The step's hosts, widening to the job's when the step list is absent."""
    key = _nodelist_key(env)
    if key is None:
        return []
    try:
        return parse_nodelist(env[key])
    except ValueError as err:
        raise ValueError(f"{key}={env[key]!r}: {err}") from None


def _nodelist_key(env: Mapping[str, str]) -> str | None:
    return next((k for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if k in env), None)


def slurm_port(job_id: str) -> int:
    """15000 plus the job id's last four digits (Lightning's rule), identical on every task of the job."""
    digits = re.sub(r"\D", "", job_id)
    if not digits:
        raise ValueError(f"SLURM job id {job_id!r} has no digits to derive a port from")
    return 15000 + int(digits[-4:])


_TASKS_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def parse_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's compressed per-node task counts, e.g. "2(x3),1" -> [2, 2, 2, 1]."""
    text = spec.strip()
    if not text:
        return []
    counts: list[int] = []
    for item in text.split(","):
        match = _TASKS_ITEM.fullmatch(item.strip())
        if match is None or (match.group(2) is not None and int(match.group(2)) == 0):
            raise ValueError(f"malformed SLURM tasks-per-node spec {spec!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist expression without scontrol, which compute nodes may lack."""
    text = nodelist.strip()
    if not text:
        return []
    hosts: list[str] = []
    for expression in _split_top_level(text, nodelist):
        hosts.extend(_expand_host(expression.strip(), nodelist))
    return hosts


def _split_top_level(text: str, original: str) -> list[str]:
    """Split on commas that sit outside brackets; reject unbalanced brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"malformed SLURM nodelist {original!r}: nested '['")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"malformed SLURM nodelist {original!r}: unmatched ']'")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"malformed SLURM nodelist {original!r}: unclosed '['")
    parts.append(text[start:])
    if any(not part.strip() for part in parts):
        raise ValueError(f"malformed SLURM nodelist {original!r}: empty host name")
    return parts


def _expand_host(expression: str, original: str) -> list[str]:
    """One host pattern to its hosts; several bracket groups multiply out left to right."""
    parts = re.split(r"\[([^\[\]]*)\]", expression)
    pieces = [[part] if i % 2 == 0 else _expand_range(part, original) for i, part in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*pieces)]


def _expand_range(group: str, original: str) -> list[str]:
    """Bracket contents such as "01-04,07", keeping the zero padding of each range start."""
    values: list[str] = []
    for item in group.split(","):
        item = item.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if match is None:
            raise ValueError(f"malformed SLURM nodelist {original!r}: bad range {item!r}")
        low, high = match.group(1), match.group(2)
        if high is None:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"malformed SLURM nodelist {original!r}: descending range {item!r}")
        width = len(low)
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def slurm_job_state(job_id: str) -> tuple[str | None, int]:
    """A SLURM job's state from scontrol (None once SLURM forgot the job, or without scontrol), and its requeues
    so far."""
    try:
        shown = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None, 0
    state, restarts = re.search(r"\bJobState=(\S+)", shown.stdout), re.search(r"\bRestarts=(\d+)", shown.stdout)
    if shown.returncode or state is None:
        return None, 0
    return state.group(1), int(restarts.group(1)) if restarts else 0
