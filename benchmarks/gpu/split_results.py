"""Split run_all's gpu_results.json into one file per section under benchmarks/results/gpu/.

    python -m benchmarks.gpu.split_results RUN_DIR/gpu_results.json [--section-from NAME=OTHER.json ...]

Each output file carries the run's ``device_info`` (device name, date, torch) next to the
section, so a file copied elsewhere still says where and when it was measured.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "results" / "gpu"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="gpu_results.json of run_all")
    ap.add_argument("--section-from", action="append", default=[], metavar="NAME=FILE",
                    help="take section NAME from another run's gpu_results.json")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    runs = {"": json.loads(Path(args.results).read_text())}
    pick = {}
    for spec in args.section_from:
        name, path = spec.split("=", 1)
        runs[path] = json.loads(Path(path).read_text())
        pick[name] = path
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = set(runs[""]) | set(pick)
    for name in sorted(sections):
        run = runs[pick.get(name, "")]
        body = run.get(name)
        if not isinstance(body, dict) or name == "device_info":
            continue
        doc = {"device_info": run["device_info"], "section": name, name: body}
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
        print(f"wrote {out / f'{name}.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
