"""The docs say what the code has and point only inside the repository: every setting in the README's table,
every linked or backticked file and every cited section present, every metric the service defines in
docs/METRICS.md's tables with its type, nothing naming a path outside the clone, and no lab-notebook wording
("session" is only an HTTP or ONNX Runtime one)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from service.observability.metrics import ServiceMetrics
from service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ("README.md", "docs/*.md", "docs/history/*.md", "bench/README.md", "bench/*/README.md")
# a backticked path into one of the repository's folders (placeholders such as {2,4,8}, * or <variant> aside)
REPO_PATH = re.compile(r"`((?:bench|docs|tests|model|service|train|export|loadtest|docker|scripts)/[^`\s{*<\[]*)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a cited section: `docs/X.md, "Heading"`, `bench/README.md's "Heading"` or a link's `X.md#anchor`
CITED_SECTION = re.compile(
    r"((?:docs/[A-Z_]+|docs/history/[\w-]+|bench/(?:\w+/)?README|README)\.md)(?:, |'s )\"([^\"\s][^\"]*)\"")
# what no clone has: the design file and the folders beside the working copy it was written in
OUTSIDE = re.compile(r"DESIGN\.md|\.\./shared|/work/shared|shared/(notes|tools|data|corpus)\b")
# benchmark results record the commands exactly as they were run
RECORDED_AS_RUN = ("bench/results/",)


def _tracked(*patterns: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [f for f in out.stdout.split() if (ROOT / f).is_file()]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(doc: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in doc.read_text().splitlines() if re.match(r"#{1,6} ", line)]


def test_every_setting_is_in_the_readme_table() -> None:
    missing = [name for name in Settings.model_fields if f"`REFORMER_{name.upper()}`" not in README]
    assert not missing, f"settings missing from README.md's table: {missing}"


def test_the_readme_links_and_cited_files_exist() -> None:
    paths = re.findall(r"\]\(([^)#]+)\)", README) + re.findall(r"`((?:bench|docs|tests|model)/[^`* ]+)`", README)
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing


def test_no_session_numbers_in_the_repository() -> None:
    """Text that says "this session" or "session 9" loses its meaning once written; dates and commits keep it."""
    files = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.sh", "*.c", "*.h", "*.toml", "Makefile",
                            "Dockerfile"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile(r"\b(this|previous|next|earlier|later|that) session\b|\bsession \d|\bsessions? [0-9]",
                         re.IGNORECASE)
    hits = [f"{f}:{n}" for f in files if f != "tests/test_docs.py" and (ROOT / f).exists()
            for n, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert not hits, hits


def test_every_link_and_backticked_path_in_the_docs_exists() -> None:
    missing = []
    for doc in _tracked(*DOCS):
        text = (ROOT / doc).read_text()
        for path in REPO_PATH.findall(text):
            if "::" in path:  # a pytest node id, under tests/ as pytest prints it: the test must exist
                file, _, test = path.partition("::")
                found = next((f for f in (ROOT / file, ROOT / "tests" / file) if f.is_file()), None)
                if found is None or f"def {test.split('[')[0]}(" not in found.read_text():
                    missing.append(f"{doc}: `{path}`")
            elif not (ROOT / path.split(":")[0].rstrip(".,;")).exists():
                missing.append(f"{doc}: `{path}`")
        for link in LINK.findall(text):
            if re.match(r"[a-z]+://|mailto:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (ROOT / doc).parent / path if path else ROOT / doc
            if not target.exists():
                missing.append(f"{doc}: ({link})")
            elif anchor and target.suffix == ".md" and anchor not in map(_slug, _headings(target)):
                missing.append(f"{doc}: ({link}) has no such section")
    assert not missing, missing


def test_every_cited_section_exists() -> None:
    """`bench/README.md, "Soak"` in a docstring or a doc names a heading that starts with those words (a citation
    wrapped over two lines counts: the line break reads as a space, a comment's `#` dropped)."""
    missing = []
    for f in _tracked("*.py", "*.md", "*.sh", "*.yml", "*.yaml", "*.toml", "*.c", "*.h"):
        if f.startswith(RECORDED_AS_RUN) or f == "tests/test_docs.py":
            continue
        text = (ROOT / f).read_text(errors="replace")
        joined = re.sub(r"\s*\n\s*(?:#+ ?)?", " ", text)
        for m in CITED_SECTION.finditer(joined):
            doc, section = m.groups()
            headings = _headings(ROOT / doc) if (ROOT / doc).is_file() else None
            if headings is None or not any(h.lower().startswith(section.lower()) for h in headings):
                missing.append(f"{f}: {doc}, {section!r}")
    assert not missing, missing


def test_nothing_points_outside_the_repository() -> None:
    hits = [f"{f}:{n}" for f in _tracked() if f != "tests/test_docs.py" and not f.startswith(RECORDED_AS_RUN)
            for n, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, hits


def _documented_metrics() -> dict[str, str]:
    """name (without a counter's `_total`) -> type, from docs/METRICS.md's table rows."""
    rows = re.findall(r"^\| `(reformer_\w+)` \| (\w+)", (ROOT / "docs" / "METRICS.md").read_text(), re.MULTILINE)
    return {name.removesuffix("_total") if kind == "counter" else name: kind for name, kind in rows}


def test_metrics_doc_lists_every_metric_the_service_defines() -> None:
    sources = [*sorted((ROOT / "service" / "observability").glob("*.py")), ROOT / "service/prefix_cache/metrics.py"]
    code = "".join(f.read_text() for f in sources)
    defined = {f"reformer_{n}" for n in re.findall(r'(?:PREFIX \+ |counter\()"(\w+)"', code)}
    defined |= set(re.findall(r'^[A-Z_]+ = "(reformer_\w+)"', code, re.MULTILINE))
    documented = _documented_metrics()
    assert sorted(documented) == sorted(defined)
    rendered = text_string_to_metric_families(ServiceMetrics(debug_memory=True).render().decode())
    types = {f.name: f.type for f in rendered if f.name.startswith("reformer_")}
    assert types and all(documented[name] == kind for name, kind in types.items()), (types, documented)
