"""The docs site builds (``mkdocs build --strict``) and shows every machine as an SVG, also in a real browser."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from hicache_fsm.diagrams import IN_FLIGHT_FILL, JOB_COLOURS
from hicache_fsm.spec import load_all

ROOT = Path(__file__).resolve().parents[1]
SPECS = load_all()
SVG_NS = "{http://www.w3.org/2000/svg}"
CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the docs extra)")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def machine_page(site: Path, name: str) -> Path:
    return site / "machines" / name / "index.html"


def svg_images(page: Path) -> list[Path]:
    """Files the page's <img> tags name that end in .svg, resolved against the page."""
    html = page.read_text(encoding="utf-8")
    return [(page.parent / src).resolve() for src in re.findall(r'<img[^>]*\ssrc="([^"]+\.svg)"', html)]


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_every_machine_page_shows_an_svg_that_parses(site, spec):
    page = machine_page(site, spec.name)
    assert page.is_file(), f"no page for {spec.name}"
    images = svg_images(page)
    assert images, f"{page} embeds no SVG"
    for svg in images:
        assert svg.is_file(), f"{page} references {svg}, which the build did not produce"
        root = ET.parse(svg).getroot()
        assert root.tag == f"{SVG_NS}svg"
        texts = {t.text for t in root.iter(f"{SVG_NS}text")}
        assert set(spec.state_names) <= texts, "every state is drawn"
        assert "Legend" in texts
    assert 'class="language-mermaid"' in page.read_text(encoding="utf-8"), "the mermaid text stays for GitHub"


def _colour_pixels(png: Path, colours: dict[str, str], tolerance: int = 6) -> dict[str, int]:
    from PIL import Image

    want = {name: tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for name, c in colours.items()}
    found = dict.fromkeys(want, 0)
    with Image.open(png) as im:
        for count, pixel in im.convert("RGB").getcolors(maxcolors=1 << 24):
            for name, rgb in want.items():
                if all(abs(a - b) <= tolerance for a, b in zip(pixel, rgb)):
                    found[name] += count
    return found


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium)")
def test_a_machine_page_draws_its_svg_in_headless_chromium(site, tmp_path):
    """The residency page's picture shows in-flight states (amber) and job edges (their colours) on screen."""
    pytest.importorskip("PIL", reason="Pillow is needed to read the screenshot")
    shot = tmp_path / "residency.png"
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--window-size=1280,1600", f"--screenshot={shot}", machine_page(site, "residency").as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    found = _colour_pixels(shot, {"in_flight": IN_FLIGHT_FILL, **{k: JOB_COLOURS[k] for k in ("d2h", "h2d", "h2s")}})
    assert found["in_flight"] > 2000, f"no amber in-flight states on screen: {found}"
    for kind in ("d2h", "h2d", "h2s"):
        assert found[kind] > 10, f"no {kind} edges on screen: {found}"


@pytest.mark.parametrize("broken", ["[gone](missing-page.md)", "[spec](../hicache_fsm/specs/residency.yaml)",
                                    "[anchor](getting-started.md#no-such-section)"])
def test_strict_build_fails_on_a_broken_link(tmp_path, broken):
    """mkdocs.yml makes every unresolvable link (a page, a file outside docs/, an anchor) fail --strict.

    Not with --quiet: it hides the warnings that --strict counts.
    """
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the docs extra)")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text(encoding="utf-8") + f"\nSee {broken}.\n", encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0, "a broken link passed mkdocs build --strict"


def test_machine_pages_carry_their_spec_text(site):
    for spec in SPECS:
        html = machine_page(site, spec.name).read_text(encoding="utf-8")
        assert 'id="spec-source"' in html and f"name: {spec.name}" in html
