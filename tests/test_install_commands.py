"""The install commands in README.md, the docs and .ci/run take the torch build constraints.txt pins, from its index."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEX = re.compile(r"--extra-index-url (\S+)")


def _constraints() -> tuple[str, str]:
    """(the pinned torch version, the index URL constraints.txt tells installs to use)."""
    text = (ROOT / "constraints.txt").read_text(encoding="utf-8")
    [pin] = re.findall(r"^torch==(\S+)$", text, re.M)
    urls = set(INDEX.findall(text))
    assert len(urls) == 1, urls
    return pin, urls.pop()


def _first_block(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_constraints_pin_the_tested_hypothesis_release():
    """Seeded fuzz runs, which several tests assert on, draw other programs under another hypothesis release."""
    text = (ROOT / "constraints.txt").read_text(encoding="utf-8")
    assert re.search(r"^hypothesis==\d+\.\d+\.\d+$", text, re.M), text


def test_constraints_pin_a_cpu_build_index():
    pin, url = _constraints()
    assert re.fullmatch(r"\d+\.\d+\.\d+", pin)
    assert url == "https://download.pytorch.org/whl/cpu"


def test_readme_first_two_lines_install_from_the_cpu_index_and_run():
    _, url = _constraints()
    for page in (ROOT / "README.md", ROOT / "docs" / "index.md"):
        main_job, suite = _first_block(page)
        for line in (main_job, suite):
            install = line.split("&&")[0]
            assert install.startswith("pip install -c constraints.txt "), line
            assert INDEX.findall(install) == [url], line
        assert main_job.split("&&")[1].split("#")[0].strip() == "hicache-fsm simulate"
        assert suite.split("&&")[0].rstrip().endswith("-e '.[test]'")
        assert suite.split("&&")[1].split("#")[0].strip() == "python -m pytest -q"


def test_every_constrained_install_in_the_docs_names_the_index():
    _, url = _constraints()
    for page in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for line in page.read_text(encoding="utf-8").splitlines():
            if "pip install -c constraints.txt" in line:
                assert INDEX.findall(line) == [url], f"{page.name}: {line}"


def test_readme_says_how_to_keep_an_engines_torch():
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "engine's own torch" in text and "without the constraints and the index" in text


def test_ci_installs_the_same_way():
    _, url = _constraints()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert f'TORCH_INDEX_URL="${{TORCH_INDEX_URL-{url}}}"' in ci
    assert "sed -n 's/^torch==//p' constraints.txt" in ci  # the pin is read, not repeated
    assert re.search(r"pip install -q -c constraints\.txt .*--extra-index-url|index=\(--extra-index-url", ci)
