"""MkDocs hooks of the docs site (``hooks:`` in mkdocs.yml).

BENCHMARKS.md and RELIABILITY.md live at the repo root and link their figures from there
(``docs/bench/x.png``). docs/benchmarks.md and docs/reliability.md include them whole
(``--8<-- "BENCHMARKS.md"``, pymdownx.snippets), and a page in docs/ reaches the same
figure as ``bench/x.png``: this hook drops the ``docs/`` prefix of such links once the
snippets are in, before MkDocs checks every link (a wrong one still fails the strict
build). Pages sit at the top of docs/, so the prefix is all there is to drop.
"""

from __future__ import annotations

import re
from typing import Any

from markdown import Extension, Markdown
from markdown.preprocessors import Preprocessor

# `](docs/...)` of a Markdown link or image, and `src="docs/..."` / `href="docs/..."`.
_ROOT_RELATIVE = re.compile(r"""(\]\(\s*<?|(?:src|href)=["'])docs/""")


class _RootRelativeLinks(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        return [_ROOT_RELATIVE.sub(r"\1", line) for line in lines]


class RootRelativeLinks(Extension):
    """Repo-root links to files under docs/ made relative to docs/ (after snippets)."""

    def extendMarkdown(self, md: Markdown) -> None:  # the name is Markdown's API
        # pymdownx.snippets runs at 32, fenced code at 25: the included text is in, and
        # no code block has been set aside yet.
        md.preprocessors.register(_RootRelativeLinks(md), "kvpush_root_relative_links", 31)


def on_config(config: Any) -> Any:
    """Add :class:`RootRelativeLinks` to every page's Markdown."""
    config.markdown_extensions.append(RootRelativeLinks())
    return config
