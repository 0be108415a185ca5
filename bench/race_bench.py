"""Race lab benchmark: QPS per passcode variant at 8 threads side by side, explorer executions/s,
and the loopback service. Prints a table and writes bench/results/race.json.

    .venv/bin/python bench/race_bench.py [--requests 100000] [--repeat 3]
    .venv/bin/python bench/race_bench.py --explorer-only   # bench/results/race_explorer.json:
        the explorer's cost before/after its reductions, and its GIL model beside real threads
    .venv/bin/python bench/race_bench.py --frontrun   # bench/results/race_frontrun.json (needs frontrun)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from isolab.cli import guarded
from isolab.commands.outputs import check_output_path
from isolab.race.bench import frontrun_comparison, run_bench, run_explorer_bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--explorer-only", action="store_true", help="only the explorer's cost and GIL-model figures")
    parser.add_argument("--frontrun", action="store_true",
                        help="the explorer beside frontrun (pip install frontrun into .venv; not a dependency)")
    args = parser.parse_args()
    results = Path(__file__).parent / "results"
    for name in ("requests", "repeat", "threads"):  # one sentence and exit 2, as `isolab race bench`
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    if args.frontrun and importlib.util.find_spec("frontrun") is None:
        parser.error("--frontrun needs frontrun: .venv/bin/pip install frontrun (it is not a dependency)")

    def run() -> int:
        check_output_path(args.json, "--json")  # before the run, not after it
        if args.frontrun:
            frontrun_comparison(args.json or results / "race_frontrun.json")
        elif args.explorer_only:
            run_explorer_bench(args.json or results / "race_explorer.json")
        else:
            run_bench(args.requests, args.repeat, args.threads, args.json or results / "race.json")
        return 0

    sys.exit(guarded(run))
