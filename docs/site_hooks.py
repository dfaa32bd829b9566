"""mkdocs hooks for akv's documentation site (mkdocs.yml lists this file).

The pages link to files that are not part of the site: the examples (``../examples/...``),
the library's source, the scripts beside the pages (``mxnet-comparison/local.py``), which
read well on GitHub from the Markdown as it is. Here such a link is pointed at the file in
the repository (``repo_url`` of mkdocs.yml, branch ``main``); a link to a file that does
not exist is a warning, so ``mkdocs build --strict`` fails on it.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.plugins.akv_site")

#: The branch the repository links point at.
BRANCH = "main"
#: An inline Markdown link or image: ``[text](target)`` or ``[text](target "title")``.
LINK = re.compile(r"(\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
FENCE = re.compile(r"^(```|~~~)", re.M)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """The page's Markdown with links to files outside the site pointed at the repository."""
    root = Path(config["config_file_path"]).resolve().parent
    docs = Path(config["docs_dir"]).resolve()
    page_dir = posixpath.dirname(page.file.src_uri)
    # Excluded files (mkdocs.yml's exclude_docs: the scripts) are not in the built site.
    site_files = {file.src_uri for file in files if not file.inclusion.is_excluded()}

    def rewrite(match: re.Match[str]) -> str:
        target = match.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:|#|/", target):  # a URL, an anchor, an absolute path
            return match.group(0)
        path, _, anchor = target.partition("#")
        inside = posixpath.normpath(posixpath.join(page_dir, path))
        if inside in site_files:
            return match.group(0)
        on_disk = (docs / page_dir / path).resolve()
        if path.endswith(".md") and not on_disk.exists():
            return match.group(0)  # mkdocs itself warns of a missing page
        if not on_disk.exists() or not on_disk.is_relative_to(root):
            log.warning("%s links to %s, which does not exist", page.file.src_uri, target)
            return match.group(0)
        kind = "tree" if on_disk.is_dir() else "blob"
        url = f"{config['repo_url'].rstrip('/')}/{kind}/{BRANCH}/"
        url += on_disk.relative_to(root).as_posix() + (f"#{anchor}" if anchor else "")
        return match.group(1) + url + match.group(3)

    # Links inside code blocks are code, not links.
    parts = re.split(r"(^(?:```|~~~).*?^(?:```|~~~)[^\n]*$)", markdown, flags=re.M | re.S)
    return "".join(part if FENCE.match(part) else LINK.sub(rewrite, part) for part in parts)
