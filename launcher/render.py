"""JobPlan -> sbatch script text: a pure function of the plan, rendered with Jinja2.

Like submitit, every flag is computed here (sorted, shell-quoted), so templates only lay
text out; they never compute host lists or ports (workers/common/topology.py does that at
run time from the variables exported by the prologue). Templates come from
``cluster.template_dir`` first (an admin's copy, possibly partial) and then from the
packaged ``sbatch_templates/``; a variable the template does not get is an error
(StrictUndefined), never an empty string. The variables are listed in
sbatch_templates/README.md and in :func:`render_context`.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

import jinja2

from launcher.plan import JobPlan, PlanError
from launcher.resources import RolePlan
from workers.common.topology import SERVER_ROLES, RoleLayout, format_layout

PACKAGED_TEMPLATES = Path(__file__).resolve().parent.parent / "sbatch_templates"
MAIN_TEMPLATE = "hetjob.sbatch.j2"
STEP_TEMPLATES = {"trainer": "steps/trainer.sh.j2", "orchestrator": "steps/orchestrator.sh.j2",
                  "router": "steps/router.sh.j2"}
SERVER_TEMPLATE = "steps/server.sh.j2"
BASE_ENV = {"PYTHONUNBUFFERED": "1"}
"""Exported to every role before cluster.env (which may override it)."""


def flag(key: str, value: object = "") -> str:
    """``--key=value`` with the value shell-quoted; ``--key`` for an empty value."""
    text = str(value)
    return f"--{key}" if text == "" else f"--{key}={shlex.quote(text)}"


def flags(opts: dict[str, object]) -> list[str]:
    """Sorted flags; None values are left out."""
    return [flag(k, v) for k, v in sorted(opts.items()) if v is not None]


def component_flags(plan: JobPlan, index: int, *, log_dir: str, workdir: str) -> list[str]:
    c, job = plan.components[index], plan.slurm
    opts: dict[str, object] = {
        "nodes": c.num_nodes, "ntasks-per-node": c.num_tasks_per_node, "cpus-per-task": c.num_cpus_per_task,
        "gpus-per-node": c.num_gpus_per_node or None, "mem": component_mem(c, job),
        "partition": c.partition, "time": job.time_limit, "account": job.account, "qos": job.qos,
    }
    if index == 0:  # job-wide options: the batch script runs in component 0
        opts.update({"job-name": job.job_name, "output": f"{log_dir}/slurm-%j.out", "open-mode": "append",
                     "signal": f"B:USR1@{job.signal_grace_s}", "chdir": workdir})
        opts["requeue" if job.requeue else "no-requeue"] = ""
    opts.update(dict(job.sbatch_flags))
    opts.update(dict(c.sbatch_flags))  # this group's own (cluster.groups.<name>.sbatch_flags)
    return flags(opts)


def component_mem(c, job) -> Optional[str]:
    """``--mem``: the roles' sum when given; a GPU group without one takes the whole node (``0``)."""
    if c.mem_gb:
        return f"{c.mem_gb}G"
    return "0" if c.num_gpus_per_node and job.gpu_mem_whole_node else None


def container_flags(job) -> dict[str, object]:
    """pyxis flags of every srun step (cluster.container.runtime=pyxis); apptainer wraps the command instead."""
    if job.container_runtime != "pyxis":
        return {}
    return {"container-image": job.container_image, "container-mounts": ",".join(job.container_mounts) or None,
            "container-workdir": job.container_workdir or None}


def step_flags(role: RolePlan, job=None) -> list[str]:
    return flags({**(container_flags(job) if job is not None else {}), "overlap": "" if role.overlap else None,
        "het-group": role.het_group, "kill-on-bad-exit": 1, "nodes": role.num_nodes, "ntasks": role.num_procs,
        "ntasks-per-node": role.num_tasks_per_node, "cpus-per-task": role.num_cpus_per_task,
        "gpus-per-node": role.num_gpus_per_node or None, "mem": f"{role.mem_gb}G" if role.mem_gb else None,
        "distribution": "block", "exact": "", "job-name": role.role,
        "export": f"ALL,SLURMRL_ROLE={role.role},OMP_NUM_THREADS={role.num_cpus_per_task}",
    })


def step_command(role: RolePlan, job=None) -> str:
    """What each task runs: the role's module, output into its own per-task log file.

    The path is built from the task's own SLURM_PROCID (srun's %t breaks in het groups > 0).
    Under apptainer the module runs inside ``apptainer exec`` (the image's or the mounted Python).
    """
    wrap = ""
    if job is not None and job.container_runtime == "apptainer":
        parts = ["apptainer", "exec", "--nv"]
        if job.container_mounts:
            parts += ["--bind", ",".join(job.container_mounts)]
        if job.container_workdir:
            parts += ["--pwd", job.container_workdir]
        wrap = shlex.join([*parts, job.container_image]) + " "
    return (f'exec {wrap}"$SLURMRL_PYTHON" -m {role.module} '
            f'>>"$SLURMRL_LOG_DIR/{role.role}_$SLURM_PROCID.log" 2>&1')


def command_lines(argv: tuple[str, ...]) -> list[str]:
    """An argv as shell lines: the program (up to the first flag), then one ``--flag value`` per line."""
    i = next((k for k, a in enumerate(argv) if k >= 3 and a.startswith("--")), len(argv))
    lines = [shlex.join(argv[:i])]
    while i < len(argv):
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        lines.append(shlex.join(argv[i:j]))
        i = j
    return lines


def backend_step_of(plan: JobPlan, role: str) -> dict:
    """Template variables of a backend's step (JobPlan.backend_steps): its command preview and own environment.

    The preview's variable keeps its name ``sglang`` (sbatch_templates/README.md): admins' templates use it."""
    step = next((s for s in plan.backend_steps if s.role == role), None)
    if step is None:
        return {"sglang": [], "env": []}
    return {"sglang": command_lines(step.argv), "env": list(step.env)}


def layout_of(plan: JobPlan) -> str:
    by_group = sorted(plan.roles, key=lambda r: (r.het_group, r.role != "orchestrator"))
    return format_layout([RoleLayout(role=r.role, het_group=r.het_group, num_tasks=r.num_procs,
                                     num_tasks_per_node=r.num_tasks_per_node,
                                     num_nodes_per_replica=r.num_nodes_per_replica) for r in by_group])


def render_context(plan: JobPlan, *, run_dir: str, python: str, workdir: str, script_path: str,
                   template_origin: str) -> dict:
    """Every variable the templates see (documented in sbatch_templates/README.md)."""
    log_dir = f"{run_dir}/logs"
    steps = []
    for r in sorted(plan.roles, key=lambda r: (r.het_group, r.role != "orchestrator")):
        steps.append({
            "role": r.role, "het_group": r.het_group, "main": int(r.main),
            "respawn": int(r.role in SERVER_ROLES and plan.slurm.server_respawns > 0), "num_tasks": r.num_procs,
            "num_nodes": r.num_nodes, "num_nodes_per_replica": r.num_nodes_per_replica, "module": r.module,
            "description": r.description, "srun": step_flags(r, plan.slurm), "command": step_command(r, plan.slurm),
            "template": STEP_TEMPLATES.get(r.role, SERVER_TEMPLATE), **backend_step_of(plan, r.role),
        })
    return {
        "experiment": plan.experiment,
        "template_origin": template_origin,
        "submit_command": shlex.join(sbatch_command(script_path)),
        "summary": plan.summary(),
        "components": [{"index": c.index, "name": c.name, "roles": list(c.roles),
                        "sbatch": component_flags(plan, c.index, log_dir=log_dir, workdir=workdir)}
                       for c in plan.components],
        "steps": steps,
        "dims": plan.trainer_dims.describe(),
        "job": plan.slurm,
        "run_dir": run_dir,
        "log_dir": log_dir,
        "python": python,
        "layout": layout_of(plan),
        "env": sorted({**BASE_ENV, **dict(plan.slurm.env)}.items()),
        "setup": list(plan.slurm.setup),
        "preflight": plan.preflight,
        # The batch step runs on the host even when the steps run in a container; the supervisor
        # needs only the standard library, so a containerised job runs it with the host's python3.
        "supervisor_python": "python3" if plan.slurm.container_runtime != "none" else '"$SLURMRL_PYTHON"',
    }


def sbatch_command(script_path: str) -> list[str]:
    return ["sbatch", "--parsable", script_path]


def template_env(template_dir: Optional[str]) -> tuple[jinja2.Environment, str]:
    """Admin templates first (cluster.template_dir), packaged ones as the fallback."""
    dirs = [PACKAGED_TEMPLATES]
    origin = "sbatch_templates/ (packaged)"
    if template_dir:
        admin = Path(template_dir).expanduser()
        if not admin.is_dir():
            raise PlanError(f"cluster.template_dir={template_dir!r} is not a directory")
        dirs.insert(0, admin)
        origin = f"{admin} (cluster.template_dir), packaged sbatch_templates/ as fallback"
    env = jinja2.Environment(loader=jinja2.FileSystemLoader([str(d) for d in dirs]), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = lambda v: shlex.quote(str(v))
    return env, origin


def render_script(plan: JobPlan, *, run_dir: str, python: str, workdir: str, script_path: str) -> str:
    """The sbatch script for ``plan``; raises PlanError when a template is broken or incomplete."""
    env, origin = template_env(plan.slurm.template_dir)
    ctx = render_context(plan, run_dir=run_dir, python=python, workdir=workdir, script_path=script_path,
                         template_origin=origin)
    try:
        return env.get_template(MAIN_TEMPLATE).render(**ctx)
    except jinja2.UndefinedError as e:
        raise PlanError(f"sbatch template ({origin}) uses an undefined variable: {e.message}; "
                        f"see sbatch_templates/README.md for the variables") from e
    except jinja2.TemplateError as e:
        raise PlanError(f"sbatch template ({origin}) is broken: {e}") from e
