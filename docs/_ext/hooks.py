"""mkdocs hooks (``hooks:`` in mkdocs.yml).

BENCHMARKS.md lives at the repository's root and shows its charts as ``docs/pictures/...``, right
where GitHub renders it; docs/performance.md includes it whole, where the same pictures are
``pictures/...``. Snippets would include it unchanged (and the build would warn of four missing
pictures), so this hook includes it itself, with those paths rewritten, and nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

INCLUDE = '--8<-- "BENCHMARKS.md"'


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != "performance.md" or INCLUDE not in markdown:
        return markdown
    # From the working directory, as snippets' base_path ["."] reads it.
    benchmarks = Path("BENCHMARKS.md").read_text(encoding="utf-8").replace("](docs/pictures/", "](pictures/")
    return markdown.replace(INCLUDE, benchmarks)
