"""What a run's directory holds, for every program that reads or writes one: checkpoints
(`checkpoint.py`), the train state's layout and shardings (`state.py`), where a workdir keeps
what and which directory a tool reads (`layout.py`), what a resume may change (`resume.py`),
and the workdir's lock (`lock.py`; on object stores `object_lock.py`)."""
