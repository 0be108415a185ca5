"""Owns the race lab: the seed's passcode checker and its fixes, the load harness that counts
their false accepts, the deterministic interleaving explorer, and the passcode HTTP service.

    checkers.py     the seed's PasscodeChecker verbatim, the fixes, and their mutants
    stress.py       real threads on a barrier, outcome counts, QPS  (report.py shows them)
    explorer/       controlled scheduling of unmodified code: search, shrink, save, replay
    scenarios.py    passcode:<variant> scenarios;  fixtures.py: the known-buggy fixtures
    service.py      `isolab passcode serve` and the loopback load test
    bench.py        QPS side by side, explorer executions/s
    explorer_cli.py what `isolab race explore` prints (the command itself: isolab/commands/race.py)
    gil_stress.py   real threads around the GIL model's switch points;  workloads.py: explorer cost
"""

from isolab.race.checkers import FIXES, MUTANT_OF, VARIANTS, Variant
from isolab.race.explorer import Scenario, SwitchMode, bounded_search, load, pct_search

__all__ = ["FIXES", "MUTANT_OF", "VARIANTS", "Scenario", "SwitchMode", "Variant", "bounded_search", "load",
           "pct_search"]
