"""FIA benchmark suite: machine ceilings, a case table, peers (torch SDPA), timing and reports.

Run `python -m fia.bench` (or `fia-bench`); `--quick` for a < 2 minute run. `fia.bench.demo.demo()` (`fia-bench --demo`) is
the paged-KV decode loop shown in the README. Modules: machine (ceilings), cases (case table and inputs),
peers (SDPA equivalents), runner (checking, timing, memory), report (table, JSON, Markdown, PNG).
"""


def main(argv=None) -> int:
    from .__main__ import main as _main
    return _main(argv)


__all__ = ["main"]
