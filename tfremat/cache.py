"""On-disk cache of solved schedules, so the same model and budget are not solved twice.

Entries are JSON files keyed by a hash of the schedule document's format
(:data:`~tfremat.plan.schedule.SCHEDULE_FORMAT`), the graph's fingerprint, the budget, the
strategy name and its options: a new format gives every entry a new key, so entries
written by another version are never read. An entry is trusted only after it parses as a
JSON object, names the same key, validates against the graph
(:func:`tfremat.plan.schedule.validate_schedule`) and simulates within the budget;
anything else is logged, discarded and re-solved.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from tfremat.errors import ScheduleError
from tfremat.graph import DFGraph
from tfremat.plan.schedule import SCHEDULE_FORMAT, Schedule
from tfremat.plan.simulator import simulate

__all__ = ["ScheduleCache", "default_cache_dir"]

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$TFREMAT_CACHE_DIR/schedules``, else ``~/.cache/tfremat/schedules``."""
    root = os.environ.get("TFREMAT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tfremat")
    return Path(root) / "schedules"


class ScheduleCache:
    """A directory of solved schedules.

    Args:
        directory: where entries live (created on first store); default :func:`default_cache_dir`.
    """

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    @staticmethod
    def key(graph: DFGraph, budget_bytes: int | None, strategy: str, options: dict | None = None) -> str:
        """The cache key: schedule format, graph fingerprint, budget, strategy and its options."""
        payload = json.dumps(
            {"format": SCHEDULE_FORMAT, "graph": graph.fingerprint, "budget": budget_bytes, "strategy": strategy,
             "options": options or {}},
            sort_keys=True, default=str,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:24]

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def load(self, graph: DFGraph, budget_bytes: int | None, strategy: str, options: dict | None = None) -> Schedule | None:
        """The cached schedule, or None on a miss or an entry that cannot be trusted."""
        key = self.key(graph, budget_bytes, strategy, options)
        path = self.path(key)
        if not path.exists():
            return None
        try:
            document = json.loads(path.read_text())
            if not isinstance(document, dict):
                # Valid JSON that is no entry (null, a list, a string) is as corrupt as
                # text that does not parse, and is solved again the same way.
                raise ScheduleError(f"entry is {json.dumps(document)[:40]}, not a JSON object", rule="cache-format")
            if document.get("key") != key:
                raise ScheduleError(f"entry names key {document.get('key')!r}", rule="cache-key")
            schedule = Schedule.from_dict(document["schedule"], graph)
            peak = simulate(graph, schedule).peak_bytes
            if budget_bytes is not None and peak > budget_bytes:
                raise ScheduleError(f"cached peak {peak} exceeds the budget {budget_bytes}", rule="budget")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("discarding schedule cache entry %s (%s); solving again", path, exc)
            path.unlink(missing_ok=True)
            return None
        logger.info("schedule cache hit: %s", path)
        return schedule

    def store(self, graph: DFGraph, budget_bytes: int | None, strategy: str, schedule: Schedule, options: dict | None = None) -> Path:
        """Writes an entry atomically (write to a temporary file, then rename)."""
        key = self.key(graph, budget_bytes, strategy, options)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps({"key": key, "schedule": schedule.to_dict(graph)}))
        os.replace(temporary, path)
        return path
