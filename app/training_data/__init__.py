"""Training data straight from PostgreSQL: Trainyard's trajectories and runs, filtered by
reward, project, run, learning key, run status, date and step; counted, paged by keyset,
exported to JSON Lines (and imported back), or turned into RL records and a Hugging Face
dataset. Usable without the API server: every function takes the database URL.

Names next to the reference's (``atlas.training_data``)::

    get_training_sessions(_async)     get_training_trajectories(_async)
    count_training_sessions(_async)   count_training_trajectories(_async)
    get_session_by_id(_async)         get_trajectory_by_id(_async)
    paginate_sessions                 paginate_trajectories (async), iter_trajectories (sync)
    status_filters=                   statuses=   (the run's status)
    include_trajectory_events=        include_messages=
    include_learning_data=            include_metadata=   (reward_breakdown and metadata)
    session.session_reward["score"]   trajectory.reward
    sessions_to_rl_records            to_rl_records
    (JSONL export intermediate)       export_jsonl / import_jsonl, to_hf_dataset

``min_reward``, ``max_reward``, ``learning_key``, ``start_date``, ``end_date`` and ``limit``
keep their names; ``projects``, ``run_ids``, ``steps`` and ``order`` are ours.
"""

from app.training_data.convert import to_hf_dataset, to_rl_records
from app.training_data.filters import TrainingDataError
from app.training_data.jsonl import (
    ImportResult,
    JsonlImportError,
    export_jsonl,
    export_jsonl_async,
    import_jsonl,
    import_jsonl_async,
)
from app.training_data.library import (
    connect,
    count_training_runs,
    count_training_runs_async,
    count_training_trajectories,
    count_training_trajectories_async,
    get_training_runs,
    get_training_runs_async,
    get_training_trajectories,
    get_training_trajectories_async,
    get_trajectory_by_id,
    get_trajectory_by_id_async,
    iter_trajectories,
    paginate_trajectories,
)
from app.training_data.records import TrainingRun, TrainingTrajectory

__all__ = [
    "ImportResult",
    "JsonlImportError",
    "TrainingDataError",
    "TrainingRun",
    "TrainingTrajectory",
    "connect",
    "count_training_runs",
    "count_training_runs_async",
    "count_training_trajectories",
    "count_training_trajectories_async",
    "export_jsonl",
    "export_jsonl_async",
    "get_training_runs",
    "get_training_runs_async",
    "get_training_trajectories",
    "get_training_trajectories_async",
    "get_trajectory_by_id",
    "get_trajectory_by_id_async",
    "import_jsonl",
    "import_jsonl_async",
    "iter_trajectories",
    "paginate_trajectories",
    "to_hf_dataset",
    "to_rl_records",
]
