"""On-disk cache of solved schedules, so the same model and budget are not solved twice.

Entries are JSON files keyed by a hash of the schedule document's format
(:data:`~tfremat.plan.schedule.SCHEDULE_FORMAT`), the graph's fingerprint, the budget, the
strategy name and its options: a new format gives every entry a new key, so entries
written by another version are never read. An entry is trusted only after it parses as a
JSON object, names the same key, was made for this graph (its fingerprint and size,
checked before anything is allocated), validates against the graph
(:func:`tfremat.plan.schedule.validate_schedule`), simulates within the budget and states
facts that agree with the schedule (:func:`check_facts`); anything else is a miss, logged,
and overwritten by the next store. A reader never deletes an entry (another process may
have just written a good one under the same name).

The cache never stops planning: an entry is written to a unique temporary file in the same
directory and renamed over the entry (:func:`write_atomically`), so concurrent writers of
one key cannot collide, and a directory that cannot be read or written is logged once per
directory (:func:`warn_once`) and treated as empty. The profile cache of
:mod:`tfremat.extract.profile_cache` shares these helpers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import tempfile
import threading
from pathlib import Path

from tfremat.errors import ScheduleError
from tfremat.graph import DFGraph
from tfremat.plan.schedule import SCHEDULE_FORMAT, Schedule
from tfremat.plan.simulator import simulate

__all__ = ["ScheduleCache", "default_cache_dir", "check_facts", "read_entry", "write_atomically", "warn_once"]

logger = logging.getLogger(__name__)

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _umask() -> int:
    """The process's umask, read without changing it (os.umask would, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def default_cache_dir() -> Path:
    """``$TFREMAT_CACHE_DIR/schedules``, else ``~/.cache/tfremat/schedules``."""
    root = os.environ.get("TFREMAT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tfremat")
    return Path(root) / "schedules"


def warn_once(directory: str | os.PathLike, what: str, error: BaseException) -> None:
    """Logs a warning that the cache directory cannot be used (``what``: "read" or
    "written"), once per directory and kind in this process; later ones at DEBUG."""
    token = (os.path.abspath(os.fspath(directory)), what)
    with _warned_lock:
        first = token not in _warned
        _warned.add(token)
    level = logging.WARNING if first else logging.DEBUG
    logger.log(level, "cache directory %s cannot be %s (%s: %s); going on without caching there", token[0], what,
               type(error).__name__, error)


def read_entry(path: str | os.PathLike) -> str | None:
    """The text of a cache entry; None when there is none, or when it cannot be read
    (logged once per directory by :func:`warn_once`)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError) as error:
        if isinstance(error, UnicodeDecodeError):
            logger.warning("cache entry %s is not text (%s); a miss", path, error)
        else:
            warn_once(os.path.dirname(os.fspath(path)), "read", error)
        return None


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Writes ``path`` as a whole or not at all: to a temporary file with a unique name
    in the same directory (created when missing), then renamed over ``path``. Concurrent
    writers of one path never share a temporary file; readers see the old entry or the
    new one, never part of one.

    Raises:
        OSError: the directory cannot be created or written (the temporary file is removed).
    """
    path = os.fspath(path)
    directory, name = os.path.split(path)
    os.makedirs(directory or ".", exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=directory or ".", prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as f:
            # mkstemp's file is 0600; an entry gets the mode open() would give it.
            with contextlib.suppress(OSError, AttributeError):
                os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def check_facts(graph: DFGraph, schedule: Schedule, budget_bytes: int | None) -> None:
    """Checks that a cached schedule's facts agree with the schedule itself and with the
    budget it is filed under: ``peak_bytes`` is its simulated peak, ``objective`` its
    cost, ``peak_bound_bytes`` at most that peak, ``exact_stages`` at most its stages and
    ``budget_bytes`` the key's budget (each when stated). The facts' own types and
    consistency are checked by :meth:`Schedule.from_dict`.

    Raises:
        ScheduleError: rule ``"facts"``, naming the fact.
    """
    facts = schedule.facts
    if facts is None:
        return
    peak = simulate(graph, schedule).peak_bytes
    cost = schedule.cost(graph)
    problems = []
    if facts.peak_bytes is not None and facts.peak_bytes != peak:
        problems.append(f"peak_bytes {facts.peak_bytes} is not the schedule's simulated peak {peak}")
    if facts.objective is not None and not math.isclose(facts.objective, cost, rel_tol=1e-9, abs_tol=1e-9):
        problems.append(f"objective {facts.objective} is not the schedule's cost {cost}")
    if facts.peak_bound_bytes is not None and facts.peak_bound_bytes > peak:
        problems.append(f"peak_bound_bytes {facts.peak_bound_bytes} exceeds the schedule's peak {peak}")
    if facts.exact_stages is not None and facts.exact_stages > schedule.num_stages:
        problems.append(f"exact_stages {facts.exact_stages} exceeds the {schedule.num_stages} stages")
    if facts.budget_bytes is not None and facts.budget_bytes != budget_bytes:
        problems.append(f"budget_bytes {facts.budget_bytes} is not the entry's budget {budget_bytes}")
    if problems:
        raise ScheduleError("; ".join(problems), rule="facts")


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
        """The cached schedule, or None on a miss, an unreadable directory or an entry that
        cannot be trusted (logged; the entry is left for the next store to overwrite).
        Never raises for what the entry holds."""
        key = self.key(graph, budget_bytes, strategy, options)
        path = self.path(key)
        text = read_entry(path)
        if text is None:
            return None
        try:
            schedule = self._trusted(text, key, graph, budget_bytes)
        except Exception as exc:  # noqa: BLE001 - whatever an entry holds, it is a miss, never the user's error
            logger.warning("schedule cache entry %s is not trusted (%s: %s); solving again", path,
                           type(exc).__name__, str(exc)[:300])
            return None
        logger.info("schedule cache hit: %s", path)
        return schedule

    @staticmethod
    def _trusted(text: str, key: str, graph: DFGraph, budget_bytes: int | None) -> Schedule:
        document = json.loads(text)
        if not isinstance(document, dict):
            # Valid JSON that is no entry (null, a list, a string) is as corrupt as
            # text that does not parse, and is solved again the same way.
            raise ScheduleError(f"entry is {json.dumps(document)[:40]}, not a JSON object", rule="cache-format")
        if document.get("key") != key:
            raise ScheduleError(f"entry names key {document.get('key')!r}", rule="cache-key")
        data = document.get("schedule")
        if not isinstance(data, dict):
            raise ScheduleError("entry holds no schedule document", rule="cache-format")
        if data.get("graph_fingerprint") != graph.fingerprint:
            raise ScheduleError(f"entry was made for graph {data.get('graph_fingerprint')!r}, not "
                                f"{graph.fingerprint}", rule="fingerprint")
        # from_dict checks the size against the graph before allocating anything.
        schedule = Schedule.from_dict(data, graph)
        peak = simulate(graph, schedule).peak_bytes
        if budget_bytes is not None and peak > budget_bytes:
            raise ScheduleError(f"cached peak {peak} exceeds the budget {budget_bytes}", rule="budget")
        check_facts(graph, schedule, budget_bytes)
        return schedule

    def store(self, graph: DFGraph, budget_bytes: int | None, strategy: str, schedule: Schedule,
              options: dict | None = None) -> Path | None:
        """Writes an entry atomically (:func:`write_atomically`); returns its path, or None
        when the directory cannot be written (logged once per directory, not raised)."""
        key = self.key(graph, budget_bytes, strategy, options)
        path = self.path(key)
        text = json.dumps({"key": key, "schedule": schedule.to_dict(graph)})
        try:
            write_atomically(path, text)
        except OSError as error:
            warn_once(self.directory, "written", error)
            return None
        return path
