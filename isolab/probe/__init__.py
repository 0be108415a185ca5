"""Owns the isolation probe: black-box checks of any OpenAI-compatible server (`isolab probe`).

    ProbeConfig -> runner.run_probe (client.py: HTTP; scenarios.py: request orders)
                -> ProbeResult (records + verdicts.py's Verdicts) -> report.py (terminal, JSON, markdown)
"""

from isolab.probe.client import ProbeUsageError
from isolab.probe.record import Completion
from isolab.probe.runner import ProbeConfig, ProbeResult, run_probe, run_probe_sync
from isolab.probe.scenarios import SCENARIOS, Sizes
from isolab.probe.verdicts import Status, Thresholds, Verdict

__all__ = ["SCENARIOS", "Completion", "ProbeConfig", "ProbeResult", "ProbeUsageError", "Sizes", "Status",
           "Thresholds", "Verdict", "run_probe", "run_probe_sync"]
