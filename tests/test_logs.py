"""Every log line of an lclm command has one format, whoever emits it."""

import re
import subprocess
import sys

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR) .+")


def _stderr(code: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stderr.splitlines()


def test_lclm_absl_and_python_warnings_share_the_format():
    lines = _stderr(
        "import logging, warnings\n"
        "from lclm import logs\n"
        "logs.configure()\n"
        "from absl import logging as absl_logging\n"
        "logging.getLogger('lclm.train').info('from lclm')\n"
        "absl_logging.warning('from absl, as Orbax logs')\n"
        "absl_logging.info('absl info is chatter')\n"
        "warnings.warn('from a library', DeprecationWarning)\n"
    )
    messages = [line for line in lines if line.strip()]
    assert messages and all(LINE.match(line) for line in messages), lines
    text = "\n".join(messages)
    assert "INFO from lclm" in text and "WARNING from absl" in text
    assert "from a library" in text and "chatter" not in text


def test_other_processes_log_warnings_only():
    lines = _stderr(
        "import logging\n"
        "from lclm import logs\n"
        "logs.configure(main_process=False)\n"
        "logging.getLogger('lclm').info('hidden')\n"
        "logging.getLogger('lclm').warning('shown')\n"
    )
    assert len(lines) == 1 and LINE.match(lines[0]) and lines[0].endswith("WARNING shown")


def test_the_format_holds_when_a_library_logged_through_absl_before_configure():
    # importing Orbax logs through absl, whose first call installs Python's default format
    lines = _stderr(
        "import logging\n"
        "from absl import logging as absl_logging\n"
        "absl_logging.vlog(1, 'what Orbax logs when imported')\n"
        "from lclm import logs\n"
        "logs.configure()\n"
        "logging.getLogger('lclm.train').info('from lclm')\n"
    )
    assert [line for line in lines if line.strip()] and all(
        LINE.match(line) for line in lines if line.strip()
    ), lines
