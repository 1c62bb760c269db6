"""Command-line keys checked by the project before Hydra sees them: an unknown key gets the valid
keys of its section and a "did you mean" (edit distance), never Hydra's "use +key=value" advice
(which would add the key and, before reject_unknown_keys existed, drop it silently).

How: the config is composed with the command line's group choices only (``env=dataset``,
``experiment=...``: they decide which schema each plugin section has), then every ``a.b.c=value``
key is walked down that config. A key under a free-form mapping (``cluster.sbatch_flags``,
``cluster.groups.trainer.sbatch_flags``: ``dict[str, str]`` fields) may be new: it is rewritten to
``++key=value`` (add or replace), so ``cluster.groups.trainer.sbatch_flags.constraint=h200`` works
as typed. Sweep values (``-m trainer.lr=1e-4,3e-4``) are checked by key only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parents[1] / "hydra_conf"


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def did_you_mean(key: str, candidates: list[str]) -> Optional[str]:
    """The closest candidate within a third of the key's length (at least 1, at most 3 edits)."""
    if not candidates:
        return None
    best = min(candidates, key=lambda c: (edit_distance(key, c), c))
    return best if edit_distance(key, best) <= max(1, min(3, len(key) // 3)) else None


def split_override(arg: str) -> Optional[tuple[str, str, str]]:
    """(prefix of + or ~, key, value) of a ``key=value`` override; None for flags and bare words."""
    if arg.startswith("-") or "=" not in arg:
        return None
    key, value = arg.split("=", 1)
    stripped = key.lstrip("+~")
    return key[: len(key) - len(stripped)], stripped, value


def is_sweep(value: str) -> bool:
    return "," in value or value.startswith(("range(", "choice(", "interval(", "glob("))


def search_paths(args: list[str]) -> list[str]:
    """The ``hydra.searchpath=[...]`` entries of the command line (a user's own config directories)."""
    out: list[str] = []
    for arg in args:
        parts = split_override(arg)
        if parts and parts[1] == "hydra.searchpath":
            out += [p.strip().strip("'\"") for p in parts[2].strip().strip("[]").split(",") if p.strip()]
    return out


def user_option_dirs(args: list[str], group: str) -> Optional[list[Path]]:
    """The ``group`` folders of the user's ``file://`` search paths; None when a search path is not a
    plain folder (``pkg://``): its options cannot be listed here, so Hydra checks the choice itself."""
    dirs = []
    for entry in search_paths(args):
        if not entry.startswith("file://"):
            return None
        dirs.append(Path(entry.removeprefix("file://")) / group)
    return dirs


def group_choices(args: list[str], groups: set[str]) -> list[str]:
    """The ``group=option`` overrides (a sweep's first option), which decide each section's schema,
    and the user's search paths, where more options live."""
    out = [arg for arg in args if (p := split_override(arg)) and p[1] == "hydra.searchpath"]
    for arg in args:
        parts = split_override(arg)
        if parts and not parts[0].startswith("~") and "." not in parts[1] and parts[1] in groups:
            value = parts[2].split(",")[0] if is_sweep(parts[2]) and "(" not in parts[2] else parts[2]
            out.append(f"{parts[0]}{parts[1]}={value}")
    return out


def composed(choices: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose("config", overrides=choices)
    finally:
        GlobalHydra.instance().clear()


def check_key(cfg: DictConfig, key: str) -> tuple[Optional[str], bool]:
    """(the error for ``key``, or None; whether the key sits under a free-form mapping)."""
    node, walked = cfg, []
    for part in key.split("."):
        if not OmegaConf.is_dict(node):
            return f"{'.'.join(walked)} is a value, not a section: {key} has no meaning", False
        typed = OmegaConf.get_type(node)
        if typed is dict or typed is None:  # a dict[str, ...] field: any key
            return None, True
        if part not in node:
            where = ".".join(walked) or "the root"
            if typed is not None and typed is not dict and walked:  # the schema that section uses, e.g. LlamaConfig
                where += f" ({typed.__name__})"
            valid = sorted(k for k in node.keys() if k != "hydra")
            guess = did_you_mean(part, valid)
            hint = f" Did you mean {'.'.join([*walked, guess])}?" if guess else ""
            return f"{key} is not a config key.{hint} Valid keys under {where}: {', '.join(valid)}", False
        walked.append(part)
        node = node[part]
    return None, False


def group_options(group: str, extra_dirs: tuple[Path, ...] = ()) -> list[str]:
    """The options of config group ``group``: its YAML files (here and in ``extra_dirs``, the user's
    search paths) and the entries stored in the ConfigStore."""
    from hydra.core.config_store import ConfigStore

    stored = ConfigStore.instance().repo.get(group, {})
    names = {p.stem for d in (CONF_DIR / group, *extra_dirs) for p in d.glob("*.yaml")}
    names |= {k.removesuffix(".yaml") for k in stored if isinstance(k, str) and k.endswith(".yaml")}
    return sorted(names)


def check_choices(args: list[str], groups: set[str]) -> list[str]:
    """``env=datasett``: the options of the group and the closest one (Hydra lists them without a guess)."""
    errors = []
    for arg in args:
        parts = split_override(arg)
        if not parts or parts[0].startswith("~") or "." in parts[1] or parts[1] not in groups:
            continue
        if is_sweep(parts[2]) or parts[2] in ("null", ""):
            continue
        extra = user_option_dirs(args, parts[1])
        if extra is None:
            continue
        options = group_options(parts[1], tuple(extra))
        if options and parts[2] not in options:
            guess = did_you_mean(parts[2], options)
            hint = f" Did you mean {parts[1]}={guess}?" if guess else ""
            errors.append(f"{parts[1]}={parts[2]} is not an option of {parts[1]}.{hint} Options: {', '.join(options)}")
    return errors


def checked_overrides(args: list[str]) -> tuple[list[str], list[str]]:
    """(the command line with free-form keys rewritten to ``++``, the errors: one per unknown key or option)."""
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    choice_errors = check_choices(args, groups)
    if choice_errors:
        return args, choice_errors
    keyed = [(i, p) for i, a in enumerate(args) if (p := split_override(a)) and "." in p[1]
             and not p[1].startswith("hydra.") and not p[0].startswith("~")]
    if not keyed:
        return args, []
    if any((p := split_override(a)) and p[1] == "model.path" for a in args):  # the family comes from config.json:
        keyed = [(i, p) for i, p in keyed if not p[1].startswith("model.")]  # launcher/model_path.py checks model.*
    try:
        cfg = composed(group_choices(args, groups))
    except Exception:  # noqa: BLE001  (a bad group option: Hydra's own message names it, next)
        return args, []
    out, errors = list(args), []
    for i, (prefix, key, value) in keyed:
        error, free_form = check_key(cfg, key)
        if error:
            if key.split(".")[0] in groups and key.split(".")[0] not in cfg:
                continue  # a group that is not a section (experiment/...): Hydra's own rules
            errors.append(error)
        elif free_form and not prefix:
            out[i] = f"++{key}={value}"
    return out, errors


def refuse_unknown_keys(args: list[str]) -> list[str]:
    """The command line to hand Hydra (free-form keys as ``++``); exits 2 with every unknown key."""
    import sys

    out, errors = checked_overrides(args)
    if errors:
        head = errors[0] if len(errors) == 1 else f"{len(errors)} unknown keys:\n" + "\n".join(f"  - {e}" for e in errors)
        print(f"slurmrl: error: {head}", file=sys.stderr)
        sys.exit(2)
    return out
