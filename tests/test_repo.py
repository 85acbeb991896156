"""Repository contracts: CI runs exactly the README's test command."""

import re

from conftest import REPO


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- test-command.*?-->\s*```bash\n(.+?)\n```", readme, re.S)
    assert block, "README.md lost its test-command block"
    command = block.group(1).strip()
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines
