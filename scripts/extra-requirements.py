"""Writes the requirement list of every extra in pyproject.toml, one `<extra>.txt` each, for the images' dependency
layers: an image installs its extra's list before it copies the sources, so a source edit rebuilds only the layer
that installs the platform itself (seconds), not the dependencies (minutes).

    python scripts/extra-requirements.py pyproject.toml OUT_DIR

Each list holds the core `dependencies`, then the extra's own, with the project's references to itself
(`agentgym-platform[env-server]`) replaced by what those extras require, each requirement once, in first-seen order.
Only the standard library: it runs in a bare python image before anything is installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path
from typing import Any

SELF_REFERENCE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*\[([^\]]*)\]\s*$")


def canonical(name: str) -> str:
    """PEP 503's normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def extra_requirements(pyproject: dict[str, Any]) -> dict[str, list[str]]:
    """Extra -> its full requirement list (core dependencies first, self-references expanded)."""
    project = pyproject["project"]
    me = canonical(project["name"])
    core: list[str] = list(project.get("dependencies", []))
    extras: dict[str, list[str]] = project.get("optional-dependencies", {})

    def expand(extra: str, seen: tuple[str, ...]) -> list[str]:
        if extra not in extras:
            raise SystemExit(f"extra-requirements: {project['name']}[{extra}] names no extra of pyproject.toml")
        if extra in seen:
            raise SystemExit(
                f"extra-requirements: extras refer to each other in a cycle: {' -> '.join((*seen, extra))}"
            )
        result: list[str] = []
        for requirement in extras[extra]:
            match = SELF_REFERENCE.match(requirement)
            if match and canonical(match[1]) == me:
                for inner in (part.strip() for part in match[2].split(",")):
                    result += expand(inner, (*seen, extra))
            else:
                result.append(requirement.strip())
        return result

    return {extra: list(dict.fromkeys(core + expand(extra, ()))) for extra in extras}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    source, out = Path(argv[0]), Path(argv[1])
    lists = extra_requirements(tomllib.loads(source.read_text()))
    out.mkdir(parents=True, exist_ok=True)
    for extra, requirements in lists.items():
        (out / f"{extra}.txt").write_text("".join(f"{line}\n" for line in requirements))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
