"""The documentation's promises that a reader relies on: the README's verdict table is REPRODUCTION.md's."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def table_under(path: Path, heading: str) -> list[str]:
    """The lines of the first Markdown table after `heading` (a line of its own)."""
    lines = path.read_text().splitlines()
    start = lines.index(heading)
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            rows.append(line.rstrip())
        elif rows:
            break
    return rows


def test_the_readme_verdict_is_reproductions():
    """REPRODUCTION.md holds the record; README.md shows it to a newcomer: a verdict changed in one must be changed
    in the other, or the first page a reader sees says something the record does not."""
    record = table_under(ROOT / "REPRODUCTION.md", "## The verdict")
    shown = table_under(ROOT / "README.md", "## The verdict")
    assert len(record) >= 3, "REPRODUCTION.md's verdict table was not found under '## The verdict'"
    assert shown == record, "README.md's verdict table differs from REPRODUCTION.md's: copy the record's rows"
