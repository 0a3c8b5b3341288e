"""Search with Optuna: NAS, mixed precision, pruning, LoRA rank and joint spaces; resumable studies.

    from fxforge.search import Search, MixedPrecisionSpace, TextClassificationTask
    result = Search(MixedPrecisionSpace({"integer": {"width": [4, 8], "frac_width": [2, 4]}}),
                    objectives=["accuracy", "avg_weight_bits"], base=mg, task=task, n_trials=20).run()
    print(result.table())

Objectives (search/objectives.py): accuracy, latency_ms (timed on the lowered model where a lowering
applies), checkpoint_bytes (measured size of the exported weights file), weight_bits / avg_weight_bits
(accounted), param_count, peak_train_mb (measured peak memory of one training step).
"""

from .compression import JointSpace, LoRARankSpace, PruningSpace
from .config import load_config, search_from_config
from .errors import SearchError
from .fidelity import Fidelity
from .local_postgres import LocalPostgres, postgres_available
from .nas import NASSpace
from .objectives import OBJECTIVES, Constraint, Measurement, Objective
from .precision import MixedPrecisionSpace
from .prefix_cache import PrefixCache
from .results import SearchResult, pareto_front
from .runner import PRUNERS, SAMPLERS, Search
from .space import SearchSpace, TrialPlan, space_from_spec
from .storage import StorageSpec
from .task import Task, TensorTask, TextClassificationTask
from .worker import worker

__all__ = [
    "OBJECTIVES", "PRUNERS", "SAMPLERS", "Constraint", "Fidelity", "JointSpace", "LoRARankSpace", "LocalPostgres",
    "Measurement", "MixedPrecisionSpace", "NASSpace", "Objective", "PrefixCache", "PruningSpace", "Search",
    "SearchError", "SearchResult", "SearchSpace", "StorageSpec", "Task", "TensorTask", "TextClassificationTask",
    "TrialPlan", "load_config", "pareto_front", "postgres_available", "search_from_config", "space_from_spec",
    "worker",
]
