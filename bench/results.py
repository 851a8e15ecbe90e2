"""``bench/RESULTS.md`` as data: one section per benchmark between stable markers, merged and
rendered without I/O (``run_all.py`` runs the benches and writes the file; ``plot_headlines.py``
reads the tables back).

A section looks like this, the markers being what a later run parses (the headings and the
fenced output inside may hold anything, ``demo_model``'s own ``###`` headings included)::

    <!-- bench: overhead -->
    ## overhead

    `python bench/overhead.py`: 16 s, exit 0; 2026-11-29 12:41 UTC, commit 7d32dfb, AMD EPYC (nproc 2)

    ~~~
    ...the table part of its output...
    ~~~
    <!-- /bench: overhead -->
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

_SECTION = re.compile(r"^<!-- bench: (?P<name>[\w.-]+) -->\n(?P<body>.*?)^<!-- /bench: (?P=name) -->$",
                      re.DOTALL | re.MULTILINE)
_TILDES = re.compile(r"^~{3,}", re.MULTILINE)
_FENCE = re.compile(r"^(?P<fence>~{3,})\n(?P<text>.*?)\n(?P=fence)$", re.DOTALL | re.MULTILINE)


def table_part(output: str, progress: re.Pattern[str] | None = None) -> str:
    """A bench's stdout without its progress lines (those ``progress`` matches from their start),
    and without the blank lines left at either end: the tables and the lines that explain them."""
    lines = output.splitlines()
    if progress is not None:
        lines = [line for line in lines if not progress.match(line)]
    return "\n".join(lines).strip("\n")


def fenced(text: str) -> str:
    """``text`` in a ``~~~`` fence longer than any run of tildes opening one of its lines
    (``~~~``, not backticks: ``demo_model``'s samples are ```` ``` ```` blocks of their own)."""
    longest = max((len(m.group()) for m in _TILDES.finditer(text)), default=0)
    fence = "~" * max(3, longest + 1)
    return f"{fence}\n{text}\n{fence}"


def render_section(name: str, command: str, note: str, table: str) -> str:
    """One bench's section, markers included: its command, ``note`` (wall time, exit status, the
    run's date, commit and machine) and its table part."""
    return (f"<!-- bench: {name} -->\n## {name}\n\n`{command}`: {note}\n\n{fenced(table)}\n"
            f"<!-- /bench: {name} -->")


def parse_sections(text: str) -> dict[str, str]:
    """The sections of a RESULTS.md by bench name, each the whole section, markers included."""
    return {m.group("name"): m.group() for m in _SECTION.finditer(text)}


def merge(old: Mapping[str, str], new: Mapping[str, str], order: Iterable[str]) -> list[str]:
    """The sections in ``order``: a bench's ``new`` section where this run ran it, else its
    ``old`` one (a bench neither ran nor had is left out, and so is a name not in ``order``)."""
    return [new.get(name) or old[name] for name in order if name in new or name in old]


def render_file(header: str, sections: Iterable[str]) -> str:
    return header.rstrip("\n") + "\n\n" + "\n\n".join(sections) + "\n"


def section_table(section: str) -> str:
    """The fenced output of a section (empty when it has none)."""
    m = _FENCE.search(section)
    return m.group("text") if m else ""


def section_note(section: str) -> str:
    """The line under a section's heading: its command and where its figures come from."""
    for line in section.splitlines():
        if line.startswith("`"):
            return line
    return ""
