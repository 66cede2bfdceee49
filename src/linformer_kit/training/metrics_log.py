"""metrics.jsonl: the training loop's records, one JSON object a line (and TensorBoard)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ..files import atomic_write

logger = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics log. A line that is not a JSON object (one cut short by a
    kill or a full disk while it was appended) is skipped with a warning naming it: the
    records of a resumed run past its checkpoint are dropped anyway."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or "step" not in record:
            logger.warning("%s:%d is not a whole record: skipped (%.60r)", path, number, line)
            continue
        records.append(record)
    return records


class MetricsLog:
    """Appends records to metrics.jsonl (and TensorBoard when installed); rank 0 only."""

    def __init__(self, run_dir: Path, enabled: bool, keep_until: int | None) -> None:
        self.path = run_dir / METRICS_NAME
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        if self.path.is_file() and keep_until is not None:  # resuming: drop records past it
            self.records = [r for r in read_records(self.path) if r["step"] <= keep_until]
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            text = "".join(json.dumps(r) + "\n" for r in self.records)
            atomic_write(self.path, lambda tmp: Path(tmp).write_text(text))
        self.writer = self._tensorboard(run_dir, keep_until) if enabled else None

    @staticmethod
    def _tensorboard(run_dir: Path, keep_until: int | None) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
        # resuming: the events past the checkpoint are dropped there too (else shown twice)
        purge = None if keep_until is None else keep_until + 1
        return SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)

    def write(self, record: dict[str, Any]) -> None:
        """Keeps a record; rank 0 also appends it to the log."""
        self.records.append(record)
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for name, value in record.items():
                if name not in ("step", "split") and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{record['split']}/{name}", value, record["step"])

    def close(self) -> None:
        """Flushes TensorBoard."""
        if self.writer is not None:
            self.writer.close()
