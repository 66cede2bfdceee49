"""Long Range Arena (Tay et al. 2020) tasks, generated or read offline: ListOps, byte-level
text classification and Pathfinder-32."""

from .common import LRASplit, LRATask, cache_path, cached_task
from .listops import evaluate as evaluate_listops
from .listops import generate_listops, load_listops
from .pathfinder import connected, generate_pathfinder, load_pathfinder
from .text import load_text, read_documents

TASKS = ("listops", "text", "pathfinder")

__all__ = [
    "TASKS",
    "LRASplit",
    "LRATask",
    "cache_path",
    "cached_task",
    "connected",
    "evaluate_listops",
    "generate_listops",
    "generate_pathfinder",
    "load_listops",
    "load_pathfinder",
    "load_text",
    "read_documents",
]
