"""``slurmrl`` console script: compose the Hydra config, plan, write the run dir, launch.

    slurmrl                                   # experiment=tiny_local on this machine
    slurmrl trainer.lr=3e-4 orchestrator.max_off_policy_steps=0
    slurmrl launcher.dry_run=true             # write configs, print what would start
    slurmrl cluster=local_slurm               # one heterogeneous Slurm job, followed until it ends
    slurmrl cluster=local_slurm launcher.follow=false   # submit and return
    slurmrl -m trainer.lr=1e-4,3e-4 cluster=local_slurm # one hetjob per sweep point
    slurmrl launcher.resume=runs/latest       # continue a stopped run (launcher/resume.py)
    slurmrl resume runs/latest [OVERRIDES]    # the same
    slurmrl preflight ARGS                    # slurmrl-preflight ARGS
    slurmrl status [RUN_DIR|JOB_ID]           # state of a submitted run (default runs/latest)
    slurmrl status --all [RUNS_ROOT]          # every run: state, step, last reward, pending reason
    slurmrl cancel [RUN_DIR|JOB_ID]
    slurmrl plot RUN [RUN...]                 # reward/eval/timing curves (PNG)
    slurmrl name=NAME ...                     # the run directory runs/NAME, job slurmrl-NAME
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher import sweep
from launcher.config_store import register, reject_unknown_keys
from launcher.launch import launch
from launcher.model_path import explicit_model_keys, explicit_server_path, resolve_model_path
from launcher.override_keys import refuse_unknown_keys
from launcher.plan import PlanError
from launcher.resume import SAFE_KEYS, resume_config
from launcher.run_dir import RunDirError
from launcher.submit import SubmitError
from workers.common.config import ConfigError, conform_sections
from workers.common.registry import SECTIONS, UnknownEntry

PLUGINS = register()  # SLURMRL_PLUGINS and entry points, before Hydra composes
USER_ERRORS = (PlanError, RunDirError, OmegaConfBaseException, KeyError, ConfigError, UnknownEntry)
CONF_DIR = Path(__file__).resolve().parents[1] / "hydra_conf"
_COMPOSED: list[bool] = []  # non-empty once Hydra composed the config and called hydra_app


@hydra.main(version_base=None, config_path="../hydra_conf", config_name="config")
def hydra_app(cfg: DictConfig) -> None:
    _COMPOSED.append(True)
    hc = HydraConfig.get()
    try:
        reject_unknown_keys(cfg)
        run_cfg = conform_sections(OmegaConf.to_object(cfg))
        check_algorithm_label(run_cfg, hc.runtime.choices.get("algorithm"))
        run_cfg = resolve_model_path(run_cfg, explicit_model_keys(hc.overrides.task),  # model.path: config.json
                                     explicit_server_path(hc.overrides.task))
        run_cfg.plugins = list(dict.fromkeys([*PLUGINS, *run_cfg.plugins]))  # roles import the same ones
        if run_cfg.launcher.resume:
            if hc.mode == RunMode.MULTIRUN:
                raise RunDirError("launcher.resume resumes one run; it cannot be swept (-m)")
            run_cfg = resume_config(run_cfg, list(hc.overrides.task))
        if hc.mode == RunMode.MULTIRUN:  # prepare only; sweep.run_all submits once every point planned
            sweep.collect(run_cfg, num=hc.job.num, overrides=list(hc.overrides.task), sweep_dir=hc.sweep.dir)
            return
        code = launch(run_cfg)
    except USER_ERRORS as e:
        print(f"slurmrl: error: {e}", file=sys.stderr)
        sys.exit(2)
    except SubmitError as e:  # a Slurm command failed: its stderr, no traceback
        print(f"slurmrl: error: {e}", file=sys.stderr)
        sys.exit(1)
    sys.exit(code)


def refuse_unparsable(argv: list[str]) -> None:
    """An override Hydra's grammar cannot parse: Hydra says "no viable alternative at input '['" without
    naming the override; name it (exit 2, like every other config mistake)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            parser.parse_overrides([arg])
        except OverrideParseException as e:
            why = str(e).splitlines()[0].removeprefix(f"Error parsing override '{arg}'").strip() or str(e)
            print(f"slurmrl: error: cannot parse the override {arg!r}: {why} (quote a value holding [ ] {{ }} ( ) , "
                  f"= or spaces: key='value')", file=sys.stderr)
            sys.exit(2)


def check_algorithm_label(run_cfg, choice) -> None:
    """``algorithm.name`` only labels the run; the recipe comes with the ``algorithm=<name>`` preset. A label
    that differs from the preset chosen (``algorithm.name=dapo`` alone: a GRPO run called dapo) is refused."""
    if choice and run_cfg.algorithm.name != choice:
        raise PlanError(f"algorithm.name={run_cfg.algorithm.name} labels a run whose recipe is algorithm={choice}: "
                        f"algorithm.name only records the preset; choose the recipe with algorithm="
                        f"{run_cfg.algorithm.name} (it sets the trainer.* and orchestrator.* knobs of that recipe)")


def refuse_null_groups(argv: list[str]) -> None:
    """``trainer=null``: Hydra fails on a config group set to null with a bare ValueError and a
    traceback; say what to do instead (exit 2, like every other config mistake)."""
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith("_")} | set(SECTIONS)
    for arg in argv:
        m = re.fullmatch(r"\+{0,2}([\w/]+)=null", arg)
        if m and m.group(1) in groups:
            print(f"slurmrl: error: {arg}: config group {m.group(1)} needs one of its options "
                  f"(hydra_conf/{m.group(1)}/); ~{m.group(1)} drops it", file=sys.stderr)
            sys.exit(2)


HELP = """usage: slurmrl [OVERRIDES...]          compose the config (Hydra), plan, write the run dir, launch
       slurmrl -m KEY=A,B [OVERRIDES...]  a sweep: one job per point (launcher.dry_run=true renders only)

commands:
  status [RUN_DIR|JOB_ID]       state and progress of one run (default runs/latest; local and dry runs too)
  status --all [RUNS_ROOT]      every run under the runs root: state, step, last reward, pending reason
  cancel [RUN_DIR|JOB_ID]       scancel a submitted run
  plot RUN [RUN...] [--out F]   reward, eval and timing curves of runs as one PNG (matplotlib)
  resume RUN_DIR [OVERRIDES]    continue a stopped run (= slurmrl launcher.resume=RUN_DIR [OVERRIDES])
  preflight ARGS                slurmrl-preflight ARGS (GPU, NCCL, filesystem and port checks; --help)
  export [--merge] RUN_OR_STEP OUT   a published step as one HF directory; --merge: a LoRA adapter merged
                                into its base (launcher/export.py)
  submit preflight|export|eval [--nodes N --cluster NAME ...] -- ARGS
                                a standalone Slurm job through submitit: preflight on N nodes, a step
                                exported as one HF directory, or slurmrl-eval of a step (--help)

common overrides:
  experiment=NAME               hydra_conf/experiment/ (tiny_local, glm5_swe_28xh200, ...)
  cluster=local|local_slurm|h200_ib    model=NAME  env=NAME  inference=NAME  weights=NAME
  launcher.dry_run=true         write configs and the sbatch script, print them, start nothing
  name=NAME                     the run directory runs/NAME, the Slurm job slurmrl-NAME, the W&B run NAME

slurmrl --cfg job prints the composed config; slurmrl --hydra-help lists Hydra's own flags.
"""


RESUME_HELP = """usage: slurmrl resume RUN_DIR [OVERRIDES...]

Continue a stopped, killed or finished run in its own directory with its own config/run.yaml (the same as
slurmrl launcher.resume=RUN_DIR). The trainer resumes from its newest checkpoint, the orchestrator from its
ledger. Overrides that may change on a resume:
""" + "".join(f"  {k:24s}{why}\n" for k, why in sorted(SAFE_KEYS.items()) if k != "launcher.resume")

HELP_FLAGS = ("--help", "-h", "help")


def subcommand_argv(argv: list[str]) -> list[str]:
    """``resume RUN [OVERRIDES]`` -> ``launcher.resume=RUN [OVERRIDES]`` (Hydra reads the rest); exits with the
    help (0) or a usage error (2) for ``resume --help`` / a bare ``resume``; ``preflight ARGS`` runs
    slurmrl-preflight (its own process: the launcher never imports a role's code)."""
    if argv[:1] == ["resume"]:
        if len(argv) < 2 or argv[1] in HELP_FLAGS:
            print(RESUME_HELP, end="", file=sys.stdout if len(argv) >= 2 else sys.stderr)
            sys.exit(0 if len(argv) >= 2 else 2)
        if "=" in argv[1]:
            print(f"slurmrl resume: error: the first argument is the run directory, got {argv[1]!r}\n{RESUME_HELP}",
                  end="", file=sys.stderr)
            sys.exit(2)
        return [f"launcher.resume={argv[1]}", *argv[2:]]
    if argv[:1] == ["preflight"]:
        os.execv(sys.executable, [sys.executable, "-m", "workers.preflight", *argv[1:]])
    return argv


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in HELP_FLAGS:
        print(HELP, end="")
        sys.exit(0)
    sys.argv[1:] = subcommand_argv(sys.argv[1:])
    if sys.argv[1:3] == ["status", "--all"] and len(sys.argv) <= 4 and sys.argv[3:] not in (["--help"], ["-h"]):
        from launcher.runs_list import list_command

        sys.exit(list_command(sys.argv[3] if len(sys.argv) == 4 else None))
    if len(sys.argv) > 1 and sys.argv[1] == "plot":
        from launcher.plot import main as plot_main

        sys.exit(plot_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "export":
        from launcher.export import main as export_main

        sys.exit(export_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "submit":
        from launcher.standalone import main as submit_main

        sys.exit(submit_main())
    if len(sys.argv) > 1 and sys.argv[1] in ("status", "cancel"):
        from launcher.submit import command_line

        sys.exit(command_line(sys.argv[1], sys.argv[2:]))
    refuse_unparsable(sys.argv[1:])
    refuse_null_groups(sys.argv[1:])
    sys.argv[1:] = refuse_unknown_keys(sys.argv[1:])  # our message, not Hydra's "+key" advice
    try:
        hydra_app()
    except SystemExit as e:  # Hydra refused the command line (a key the schema lacks, a wrong type): exit 2 as
        if e.code == 1 and not _COMPOSED:  # for every other config mistake; its message is on stderr already
            sys.exit(2)
        raise
    try:
        sys.exit(sweep.run_all())
    except USER_ERRORS as e:
        print(f"slurmrl: error: {e}", file=sys.stderr)
        sys.exit(2)
    except SubmitError as e:
        print(f"slurmrl: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
