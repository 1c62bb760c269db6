"""benchmarks/results/ is a record: every tracked file there has a row in its README's index,
every row names a file that exists, and benchmarks write there only with ``--record``.

Why: a number in the repository is only worth something with the command, device and date that
produced it (the index), and a benchmark run to try something must not rewrite the record
(benchmarks/record.py sends ordinary runs to the ignored benchmarks/out/).
"""
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
RESULTS = REPO / "benchmarks" / "results"
INDEX = RESULTS / "README.md"


def index_section() -> str:
    text = INDEX.read_text()
    assert "## Index" in text, f"{INDEX} has no '## Index' section"
    return text.split("## Index", 1)[1].split("\n## ", 1)[0]


def tracked_results() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "benchmarks/results"], cwd=REPO, capture_output=True,
                         check=True).stdout.decode()
    return [str(Path(p).relative_to("benchmarks/results")) for p in out.split("\0") if p and not p.endswith("README.md")]


def test_every_recorded_file_has_a_row_and_every_row_a_file():
    listed = set()
    for row in index_section().splitlines():
        if row.startswith("| `"):
            listed |= set(re.findall(r"`([^`\s]+\.(?:jsonl|json|png|log|tgz))`", row.split(" | ")[0]))
    files = tracked_results()
    assert len(files) > 30
    missing = sorted(set(files) - listed)
    assert not missing, f"recorded files without a row in {INDEX.relative_to(REPO)}'s index: {missing}"
    stale = sorted(p for p in listed if not (RESULTS / p).exists())
    assert not stale, f"index rows naming files that do not exist: {stale}"


def test_every_row_has_a_command_a_device_a_date_and_a_headline():
    for row in index_section().splitlines():
        if row.startswith("| `") and row.count(" | ") == 4:
            _, command, device, date, headline = (c.strip(" |") for c in row.split(" | "))
            assert command and device and headline, row
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), row


def test_benchmarks_write_to_the_scratch_folder_unless_recording():
    code = ("import sys; from benchmarks.record import results_dir, RECORDED, SCRATCH; "
            "print(results_dir() == ({} if '--rec' in sys.argv else SCRATCH), sys.argv[1:])")
    plain = subprocess.run([sys.executable, "-c", code.format("RECORDED")], cwd=REPO, capture_output=True, text=True)
    assert plain.stdout.split()[0] == "True", plain.stdout + plain.stderr
    rec = subprocess.run([sys.executable, "-c", code.format("RECORDED"), "--rec", "--record", "x"], cwd=REPO,
                         capture_output=True, text=True)
    assert rec.stdout.strip() == "True ['--rec', 'x']", rec.stdout + rec.stderr  # --record is taken off argv
    ignored = subprocess.run(["git", "check-ignore", "-q", "benchmarks/out/x.json"], cwd=REPO)
    assert ignored.returncode == 0, "benchmarks/out/ must be in .gitignore"


def test_one_record_switch():
    """``--record`` is benchmarks/record.py's alone: no benchmark parses its own, or defaults to the record
    (split_results.py is no benchmark: it files a lent GPU machine's results into the record)."""
    own = []
    for path in (REPO / "benchmarks").rglob("*.py"):
        text = path.read_text()
        if path.name not in ("record.py", "split_results.py") and ('"--record"' in text or re.search(r'default="benchmarks/results|/ "results"', text)):
            own.append(str(path.relative_to(REPO)))
    assert not own, f"benchmarks with their own way into benchmarks/results/ (use benchmarks.record.results_dir): {own}"
