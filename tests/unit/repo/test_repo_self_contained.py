"""Nothing in the repository refers to a file outside it.

Why: whoever clones the project must be able to follow every reference. The design document is
docs/design.md (in the repository); the outside design file it replaced and the session's shared
folder are names a clone cannot open, so no tracked file may mention them.
"""
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# Built from pieces so this file does not match itself.
FORBIDDEN = ("DESIGN" + ".md", "../" + "shared")


def tracked_files():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / name for name in out.decode().split("\0") if name]


def test_no_tracked_file_refers_outside_the_repository():
    files = tracked_files()
    assert len(files) > 100, "git ls-files found too few files: not run from a checkout?"
    hits = []
    for path in files:
        if not path.is_file():
            continue
        try:
            text = path.read_text(errors="ignore")
        except OSError:
            continue
        for line_no, line in enumerate(text.splitlines(), 1):
            for word in FORBIDDEN:
                if word in line:
                    hits.append(f"{path.relative_to(REPO)}:{line_no}: {word}")
    assert not hits, "references to files outside the repository (use docs/design.md):\n" + "\n".join(hits)
