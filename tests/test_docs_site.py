"""The docs site (mkdocs.yml): it builds with ``--strict``, a broken link or anchor fails
that build, and headless Chromium renders its pages, served over HTTP, with the theme,
the navigation and each page's own title; the render check fails on a missing page, the
site's 404 page, an unstyled page and one that paints nothing.

``make setup`` installs what this needs: mkdocs-material (the dev extra) and Debian's
``chromium``. Missing either fails the tests, it does not skip them: CI runs them."""

from __future__ import annotations

import html
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpush.services.local.ports import free_port

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0
# Pages whose render is checked: the front page, the longest hand-written page, the
# generated settings reference, and an included root file with figures.
SCREENSHOT_PAGES = ["index", "architecture", "configure", "benchmarks"]
WINDOW = (1280, 900)


def _mkdocs_build(config: Path, out: Path) -> subprocess.CompletedProcess[str]:
    try:
        import material  # noqa: F401 - the theme, from the dev extra
    except ImportError:
        pytest.fail("mkdocs-material is not installed: run `make setup` (the dev extra)")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(out)],
        cwd=config.parent, capture_output=True, text=True, timeout=120, env=ENV, check=False)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = _mkdocs_build(REPO / "mkdocs.yml", out)
    assert done.returncode == 0, f"`mkdocs build --strict` failed:\n{done.stdout}{done.stderr}"
    return out


@pytest.fixture(scope="module")
def server(site: Path) -> Iterator[str]:
    """The built site on ``python -m http.server`` at a free loopback port."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
         "--directory", str(site)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, "http.server exited"
                assert time.monotonic() < deadline, "http.server did not listen in 15 s"
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@dataclass
class Render:
    url: str
    png: Path
    dom: str


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not on PATH: `make setup` installs it (Debian's chromium "
                    "package), which the docs site's screenshot test needs")
    return path


def render(url: str, workdir: Path) -> Render:
    """Headless Chromium's screenshot and serialised DOM of ``url`` (one run, after load)."""
    name = re.sub(r"\W+", "_", url.rsplit("/", 1)[-1]) or "root"
    png = workdir / f"{name}.png"
    done = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--hide-scrollbars", f"--user-data-dir={workdir / f'profile-{name}'}",
         f"--screenshot={png}", f"--window-size={WINDOW[0]},{WINDOW[1]}", "--dump-dom", url],
        capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 0 and png.is_file(), (
        f"chromium failed on {url} (rc {done.returncode}):\n{done.stderr[-2000:]}")
    return Render(url, png, done.stdout)


def _text(fragment: str) -> str:
    text = html.unescape(re.sub(r"<[^>]+>", "", fragment)).replace("¶", "")
    return " ".join(text.split())


def source_title(page: Path) -> str:
    """The H1 of a docs page's Markdown as plain text, following a whole-file snippet
    include (``--8<-- "BENCHMARKS.md"``) that comes before any H1."""
    fence = None
    for line in page.read_text().splitlines():
        stripped = line.strip()
        m = re.match(r"(`{3,}|~{3,})", stripped)
        if m and (fence is None or stripped.startswith(fence)):
            fence = None if fence else m.group(1)
            continue
        if fence:
            continue
        include = re.match(r'--8<--\s+"([^"]+)"\s*$', stripped)
        if include:
            return source_title(REPO / include.group(1))
        if line.startswith("# "):
            title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line[2:])  # [text](url) -> text
            return " ".join(title.replace("`", "").replace("*", "").split())
    raise AssertionError(f"{page} has no H1")


def assert_rendered(shot: Render, title: str) -> None:
    """``shot`` is the themed site page titled ``title``: its DOM has that H1 and Material's
    navigation and no 404, and its screenshot is a page, with the header bar the
    theme's stylesheet paints, not a blank or unstyled one."""
    from PIL import Image, ImageStat

    dom = shot.dom
    assert "Error code: 404" not in dom, f"{shot.url}: the server answered 404"
    h1s = [_text(h) for h in re.findall(r"<h1[^>]*>(.*?)</h1>", dom, re.S)]
    assert not any(h.startswith("404") for h in h1s), f"{shot.url}: the site's 404 page"
    page_title = _text(m.group(1)) if (m := re.search(r"<title>(.*?)</title>", dom, re.S)) else ""
    assert "404" not in page_title, f"{shot.url}: a 404 page ({page_title!r})"
    assert title in h1s, f"{shot.url}: H1 {title!r} not in the DOM (H1s: {h1s})"
    assert 'class="md-nav md-nav--primary"' in dom, f"{shot.url}: no Material navigation"
    assert re.search(r"<html[^>]*class=\"[^\"]*\bjs\b", dom), f"{shot.url}: theme JS did not run"

    with Image.open(shot.png) as img:
        assert img.size == WINDOW, f"{shot.png}: {img.size}"
        gray = img.convert("L")
        spread = ImageStat.Stat(gray).stddev[0]
        assert spread > 8, f"{shot.png}: a blank screenshot (grey level spread {spread:.1f})"
        # Material's header bar: a dark band across the top, where an unstyled page is white.
        header = ImageStat.Stat(gray.crop((0, 0, WINDOW[0], 40))).mean[0]
        assert header < 170, f"{shot.png}: no themed header bar (mean grey {header:.0f})"


def test_site_builds_strict_with_every_nav_page(site: Path) -> None:
    # Strict: the build itself (the fixture) fails on a warning; here, every page of the
    # nav made it into the site.
    nav = re.findall(r":\s+([\w./-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M)
    assert len(nav) >= 13, nav
    missing = [p for p in nav if not (site / p.replace(".md", ".html")).is_file()]
    assert not missing, f"nav pages not built: {missing}"
    assert (site / "bench" / "ttft_cdf_tiny.png").is_file()


def test_strict_build_fails_on_a_broken_link_or_anchor(tmp_path: Path) -> None:
    """The mkdocs.yml validation settings make a dead link or anchor a build error."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "docs", repo / "docs")
    (repo / "scripts").mkdir()
    for rel in ("mkdocs.yml", "scripts/mkdocs_hooks.py", "BENCHMARKS.md", "RELIABILITY.md"):
        shutil.copy(REPO / rel, repo / rel)
    page = repo / "docs" / "index.md"
    page.write_text(page.read_text() + "\n\nSee [gone](no-such-page.md) and "
                    "[the tables](configure.md#no-such-anchor) and [the README](../README.md).\n")
    done = _mkdocs_build(repo / "mkdocs.yml", tmp_path / "out")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    for needle in ("no-such-page.md", "no-such-anchor", "../README.md"):
        assert needle in out, f"no warning names {needle}:\n{out}"


def test_pages_render_in_headless_chromium(server: str, tmp_path: Path) -> None:
    for page in SCREENSHOT_PAGES:
        shot = render(f"{server}/{page}.html", tmp_path)
        assert_rendered(shot, source_title(REPO / "docs" / f"{page}.md"))
    if os.environ.get("KVPUSH_DOCS_SHOTS"):  # keep the screenshots to look at
        shutil.copytree(tmp_path, os.environ["KVPUSH_DOCS_SHOTS"], dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("profile-*"))


def test_render_check_catches_missing_blank_and_unstyled_pages(
        site: Path, server: str, tmp_path: Path) -> None:
    title = source_title(REPO / "docs" / "index.md")
    index = (site / "index.html").read_text()
    # The index page with the theme's stylesheets gone: a broken template.
    unstyled = re.sub(r'<link rel="stylesheet"[^>]*>', "", index)
    assert unstyled != index
    (site / "unstyled.html").write_text(unstyled)
    # The whole page in its DOM, but nothing painted.
    (site / "blank.html").write_text(index.replace(
        "</head>", "<style>body { visibility: hidden !important; }</style></head>", 1))
    cases = {
        "no-such-page.html": "the server answered 404",
        "404.html": "the site's 404 page",
        "unstyled.html": "no themed header bar",
        "blank.html": "a blank screenshot",
    }
    for path, reason in cases.items():
        shot = render(f"{server}/{path}", tmp_path)
        with pytest.raises(AssertionError, match=re.escape(reason)):
            assert_rendered(shot, title)
