"""Hub ids in ``model.path`` (``Qwen/Qwen3-8B``, ``org/name@revision``): resolved on the login node.

Why here and only here: compute nodes often have no route to the Hub, and a download started by
every trainer rank and inference server at once would fetch the checkpoint dozens of times. So
the launcher (the login node) resolves the id ONCE, through huggingface_hub's own cache layout
(``models--org--name/snapshots/<commit>/``, ``refs/<revision>``), into a directory every node
mounts; the run's config then holds that local snapshot directory, exactly as if the user had
typed it, and every role runs with ``HF_HUB_OFFLINE=1`` and that ``HF_HOME``.

Which cache (:func:`hf_home`): ``cluster.hf_home``; else the profile's ``cluster.env.HF_HOME``;
else ``<cluster.shared_root>/hf``; else the launcher's own (``HF_HOME`` / ``HF_HUB_CACHE``, by
default ``~/.cache/huggingface``: fine on one machine, and on a cluster only if home is shared).

Offline (``HF_HUB_OFFLINE=1`` where the launcher runs, or no network): an id already in the cache
resolves; a missing one is a plan-time error naming the cache it looked in. Online, the files a
run reads (config, safetensors, tokenizer, chat template) are downloaded with huggingface_hub's
progress bars; pickled ``*.bin`` / ``*.pt`` weights and GGUF files are not.

Torch-free (huggingface_hub does not import it).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Optional

from launcher.resources import PlanError

REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,95})(?:@(?P<revision>[\w./-]+))?$")
"""``org/name`` or ``org/name@revision`` (huggingface_hub's repo-id characters)."""
DOWNLOAD = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
"""What a run reads: config.json, the safetensors (+ index), tokenizer files, chat template."""


def parse_repo_id(path: str) -> Optional[tuple[str, Optional[str]]]:
    """``(repo_id, revision or None)`` when ``path`` is a hub id rather than a local path: it looks
    like ``org/name[@revision]`` and nothing exists at that path; None otherwise."""
    m = REPO_ID.match(path or "")
    if m is None or path.startswith((".", "~")) or Path(path).expanduser().exists():
        return None
    return m.group("repo"), m.group("revision")


def hf_home(cluster) -> tuple[str, str]:
    """``(HF_HOME directory, which setting chose it)`` for this cluster profile (module docstring)."""
    if cluster.hf_home:
        return cluster.hf_home, "cluster.hf_home"
    if cluster.env.get("HF_HOME"):
        return str(cluster.env["HF_HOME"]), "cluster.env.HF_HOME"
    if cluster.shared_root:
        return str(Path(cluster.shared_root) / "hf"), "cluster.shared_root/hf"
    from huggingface_hub import constants

    return constants.HF_HOME, "the launcher's HF_HOME"


def hub_cache(home: str) -> Path:
    """The hub cache under an HF_HOME (huggingface_hub's layout: ``$HF_HOME/hub``), or ``HF_HUB_CACHE``
    when the launcher's environment sets it and the home is the launcher's own."""
    from huggingface_hub import constants

    if home == constants.HF_HOME and os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    return Path(home) / "hub"


def offline() -> bool:
    """``HF_HUB_OFFLINE`` set (1/true/yes/on) where the launcher runs."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_repo_id(repo_id: str, revision: Optional[str], cache: Path, *, where: str) -> Path:
    """The local snapshot directory of ``repo_id`` in ``cache``: found there, or downloaded once into
    it (not offline). PlanError naming the cache when it is neither."""
    from huggingface_hub import snapshot_download

    label = repo_id + (f"@{revision}" if revision else "")
    try:  # the same patterns as the download: huggingface_hub (2.x) checks a cached snapshot against the
        # repo's file listing it cached, and without them calls one that skipped *.bin incomplete
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True,
                                      allow_patterns=DOWNLOAD))
    except Exception as e:  # huggingface_hub raises its own types (not in the cache, bad revision, ...)
        missing = e
    if offline():
        raise PlanError(f"model.path={label}: no such directory, and as a Hugging Face hub id it is not in the cache "
                        f"{cache} ({where}), and HF_HUB_OFFLINE=1 "
                        f"forbids a download; fetch it once where the network is (`hf download {repo_id} "
                        f"--cache-dir {cache}`, or this command without HF_HUB_OFFLINE), or point cluster.hf_home "
                        f"at the HF_HOME that holds it ({type(missing).__name__})") from None
    print(f"[slurmrl] model.path={label}: downloading into {cache} ({where}), once: later runs and every node "
          f"read it there", file=sys.stderr, flush=True)
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=DOWNLOAD))
    except Exception as e:
        raise PlanError(f"model.path={label}: no such directory, and as a Hugging Face hub id it is not in the cache "
                        f"{cache} ({where}) and the download "
                        f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def resolve_hub_path(cfg):
    """``cfg`` with a hub id in ``model.path`` replaced by its local snapshot directory, and every role
    told where the cache is and not to go online (``cluster.env`` HF_HOME, HF_HUB_OFFLINE=1); the
    repo's name as the default ``model.name``. No-op for a local path. Returns (cfg, repo name or None)."""
    import dataclasses

    parsed = parse_repo_id(cfg.model.path)
    if parsed is None:
        return cfg, None
    repo_id, revision = parsed
    home, where = hf_home(cfg.cluster)
    directory = resolve_repo_id(repo_id, revision, hub_cache(home), where=where)
    env = {**cfg.cluster.env, "HF_HUB_OFFLINE": "1"}
    env.setdefault("HF_HOME", home)
    cluster = dataclasses.replace(cfg.cluster, env=env)
    model = dataclasses.replace(cfg.model, path=str(directory))
    inference = cfg.inference
    sglang = getattr(inference, "sglang", None)
    if sglang is not None and sglang.model_path == cfg.model.path:  # inference=sglang_node: ${model.path}
        inference = dataclasses.replace(inference, sglang=dataclasses.replace(sglang, model_path=str(directory)))
    return (dataclasses.replace(cfg, model=model, cluster=cluster, inference=inference), repo_id.split("/", 1)[1])
