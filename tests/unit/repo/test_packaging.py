"""The project's packaging installs quietly: every hydra_conf/<group>/ folder of YAML is package data
of a (namespace) package that setup.cfg lists, so setuptools has nothing to warn about.

Why: hydra_conf/<group>/ folders hold YAML only (no __init__.py). Shipped as data of the
``hydra_conf`` package (``*/*.yaml``), setuptools printed a page of "Package 'hydra_conf.env' is
absent from the `packages` configuration" per folder on every install; as namespace packages
(``find_namespace:``) with their own package data they are quiet. A new group folder must be
added to ``[options.package_data]`` or its YAML would be missing from a wheel. Checked by hand
with ``pip wheel -v --no-deps --no-build-isolation . | grep -i warn`` (only pip's byte-compile notes).
"""
import configparser
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_every_hydra_conf_group_is_namespace_package_data():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert cfg["options"]["packages"].strip() == "find_namespace:"
    data = {key: value.strip() for key, value in cfg["options.package_data"].items()}
    groups = sorted(d.name for d in (REPO / "hydra_conf").iterdir() if d.is_dir() and any(d.glob("*.yaml")))
    assert len(groups) >= 8, groups
    for group in ["", *groups]:
        key = "hydra_conf" + (f".{group}" if group else "")
        assert data.get(key) == "*.yaml", f"setup.cfg [options.package_data] needs `{key} = *.yaml`"
        if group:
            assert not list((REPO / "hydra_conf" / group).glob("*/*.yaml")), f"hydra_conf/{group}/ has nested folders"
    include = cfg["options.packages.find"]["include"].split()
    assert "hydra_conf*" in include and "launcher*" in include and "workers*" in include
