"""What each step of a run does (lclm.train.cadence): the loop's decisions by step number,
tested without devices or a model."""

from lclm.config.run_config import run_config
from lclm.config.schema import base_config
from lclm.train.cadence import Cadence


def _where(cadence, what, terminated=()):
    """The steps of `cadence` whose plan has `what` set."""
    return [s for s in cadence.steps() if getattr(cadence.at(s, s in terminated), what)]


def test_logs_every_log_every_and_the_first_and_last_steps():
    assert _where(Cadence(first=1, last=10, total=10, log_every=4), "log") == [1, 4, 8, 10]
    # a resumed run logs its first step, one stopped early its last
    assert _where(Cadence(first=6, last=9, total=20, log_every=4), "log") == [6, 8, 9]


def test_validates_every_validation_every_and_at_the_last_step_each_one_logged():
    c = Cadence(first=1, last=7, total=10, log_every=5, validate_every=3)
    assert _where(c, "validate") == [3, 6, 7]
    assert _where(c, "log") == [1, 3, 5, 6, 7]
    assert _where(Cadence(first=1, last=7, total=10, log_every=5), "validate") == []


def test_saves_every_checkpoint_every_and_the_final_step_but_not_where_a_crash_stops_it():
    assert _where(Cadence(first=1, last=7, total=7, log_every=1, save_every=3), "save") == [3, 6, 7]
    assert _where(Cadence(first=1, last=5, total=7, log_every=1, save_every=3), "save") == [3]
    assert _where(Cadence(first=1, last=7, total=7, log_every=1), "save") == [7]
    assert _where(Cadence(first=1, last=7, total=7, log_every=1, save_every=3), "last_chance") == [
        7
    ]


def test_a_termination_logs_saves_and_stops_that_step():
    c = Cadence(first=1, last=10, total=10, log_every=4, save_every=5)
    plan = c.at(3, terminated=True)
    assert plan.log and plan.save and plan.last_chance and plan.stop
    assert not c.at(3).stop and not c.at(10).stop  # the loop ends after `last` anyway


def test_with_several_processes_retries_and_saves_by_time_wait_for_agreed_steps():
    one = Cadence(first=1, last=9, total=9, log_every=3)
    several = Cadence(first=1, last=9, total=9, log_every=3, multi=True)
    assert _where(one, "retry") == _where(one, "by_time") == list(range(1, 10))
    assert _where(several, "retry") == [1, 3, 6, 9]  # its logged steps
    assert _where(several, "by_time") == [3, 6, 9]  # multiples of log.every
    assert _where(several, "retry", terminated=(4,)) == [1, 3, 4, 6, 9]


def test_the_start_is_validated_only_for_a_fresh_run_with_held_out_data():
    assert Cadence(1, 5, 5, 1, validate_every=2, validate_at_start=True).validates_at_start
    assert not Cadence(3, 5, 5, 1, validate_every=2, validate_at_start=True).validates_at_start
    assert not Cadence(1, 5, 5, 1, validate_at_start=True).validates_at_start
    assert not Cadence(1, 5, 5, 1, validate_every=2).validates_at_start


def test_a_run_already_trained_has_no_steps():
    c = Cadence(first=11, last=10, total=10, log_every=1)
    assert c.trained and list(c.steps()) == []
    assert not Cadence(first=10, last=10, total=10, log_every=1).trained


def test_of_reads_the_train_log_validation_and_checkpoint_sections():
    config = base_config()
    config.train.steps, config.log.every, config.checkpoint.every = 50, 5, 20
    config.validation.update(path="", every=7, at_start=True)
    assert Cadence.of(run_config(config), first=11, stop_after=30, multi=True) == Cadence(
        first=11,
        last=30,
        total=50,
        log_every=5,
        validate_every=0,
        save_every=20,
        validate_at_start=True,
        multi=True,
    )
    config.validation.path = "held_out.jsonl"
    c = Cadence.of(run_config(config), first=1, stop_after=None, multi=False)
    assert (c.last, c.validate_every) == (50, 7)
