"""docs/race.md's "Your own code" example, run as written: the page's code block is the target, it
FAILS in opcode mode and HOLDS under the GIL model, as the page says, and holds in both once the
check and the act are under the lock."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from isolab.cli import main
from isolab.race.explorer.types import ExitCode

DOC = Path(__file__).resolve().parents[2] / "docs" / "race.md"


def _example() -> str:
    block = re.search(r"```python\n# bank\.py\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None, "docs/race.md lost its bank.py example"
    return block.group(1)


@pytest.mark.parametrize("fixed", [False, True])
def test_the_pages_example_runs_as_it_says(tmp_path: Path, capsys, fixed: bool) -> None:
    code = _example()
    if fixed:
        old = "    if acct.balance >= 80:        # check ...\n        acct.balance -= 80"
        assert old in code
        code = code.replace(old, "    with acct.lock:\n        if acct.balance < 80:\n            return False\n"
                                 "        acct.balance -= 80")
    (tmp_path / "bank.py").write_text(code)
    target = f"{tmp_path / 'bank.py'}:scenario"
    opcode = main(["race", "explore", target, "--quiet"])
    out = capsys.readouterr().out
    assert opcode == (ExitCode.HOLDS if fixed else ExitCode.BUG), out
    if not fixed:
        assert "failed: overdrawn: balance -60" in out and "a GIL-faithful search holds" in out
    assert main(["race", "explore", target, "--quiet", "--switch", "gil"]) == ExitCode.HOLDS
